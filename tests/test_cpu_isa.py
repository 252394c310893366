"""MINIPD_CPU_ISA: the C++ kernels built for a lesser instruction set than the CPU's, and every path tested.

On a CPU with AVX-512 the native build never compiles the kernels' AVX2-only paths (an older EPYC's, say), nor
anywhere on x86 their plain C++ loops (an ARM laptop's): the kernel tests are run once more against each such
build, in a child process of its own."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import need_cpu_kernel

from minipd.kernels import isa
from minipd.kernels.cpu_paged_attention import NO_BUILD_ENV

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ("tests/test_cpu_kernels.py", "tests/test_cpu_panel_linear.py", "tests/test_cpu_fused_elementwise.py")


def _has_avx2() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma"} <= isa.cpu_flags()


def test_native_unless_asked_and_a_bad_value_names_the_variable_and_what_is_allowed(monkeypatch):
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    assert isa.kernel_isa() == "native" and "-march=native" in isa.kernel_cflags()
    monkeypatch.setenv(isa.ISA_ENV, "portable")
    assert isa.kernel_isa() == "portable" and "-march=native" not in isa.kernel_cflags()
    if platform.machine().lower() in ("x86_64", "amd64"):  # named: a compiler's default may be a higher level
        assert "-march=x86-64" in isa.kernel_cflags() and "-march=x86-64-v3" in isa.kernel_cflags("avx2")
    monkeypatch.setenv(isa.ISA_ENV, "sse4")
    with pytest.raises(ValueError, match=r"MINIPD_CPU_ISA must be one of native, avx2, portable.*'sse4'"):
        isa.kernel_isa()
    monkeypatch.setenv(isa.ISA_ENV, "avx2")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset({"sse2", "avx"}))  # a CPU without AVX2
    with pytest.raises(ValueError, match="MINIPD_CPU_ISA=avx2 needs an x86 CPU with AVX2 and FMA, and this one "
                                         "lacks avx2 and fma"):
        isa.kernel_isa()
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset())  # a system that does not say (no /proc/cpuinfo)
    with pytest.raises(ValueError, match="does not say which features its CPU has"):
        isa.kernel_isa()
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(ValueError, match="this one is aarch64"):
        isa.kernel_isa()


def test_the_engine_refuses_a_bad_value_rather_than_falling_back_quietly(monkeypatch):
    from minipd.kernels import cpu_paged_attention

    monkeypatch.setenv(isa.ISA_ENV, "avx1024")
    cpu_paged_attention.load_kernel.cache_clear()
    try:
        with pytest.raises(ValueError, match="MINIPD_CPU_ISA"):
            cpu_paged_attention.load_kernel()
        with pytest.raises(ValueError, match="MINIPD_CPU_ISA"):
            cpu_paged_attention.kernel_built()
    finally:
        cpu_paged_attention.load_kernel.cache_clear()


def test_each_isa_is_a_build_of_its_own_and_what_it_measures_is_labelled_apart(monkeypatch):
    from minipd.bench.hf import machine_label
    from minipd.engine.program_cache import program_key
    from minipd.kernels import cpu_paged_attention
    from minipd.kernels.backend import kernel_backends
    from minipd.kernels.measured import cpu_description, machine_key

    for name in (isa.ISA_ENV, *isa.TORCH_ISA_ENVS):
        monkeypatch.delenv(name, raising=False)
    native = (cpu_paged_attention.build_key(), cpu_description(), machine_key(), machine_label(), program_key({}))
    assert "isa" not in native[1] and "limited" not in native[3] and isa.isa_limits() == {}
    assert "MINIPD_CPU_ISA" not in kernel_backends()["cpu"]
    keys = {native[0], cpu_paged_attention.build_key(cflags=isa.kernel_cflags("portable"))}
    limited = ["portable"] + (["avx2"] if _has_avx2() else [])
    for name in limited:
        monkeypatch.setenv(isa.ISA_ENV, name)
        described = cpu_description()
        assert described["isa"] == name and described["cpu"] == native[1]["cpu"]
        assert set(described["features"]) <= set(native[1]["features"])
        assert not any(f.startswith(("avx512", "amx")) for f in described["features"])
        if name == "portable":
            assert described["features"] == []
        label = machine_label()
        assert f"limited: MINIPD_CPU_ISA={name} (torch's kernels: " in label
        assert f"for {name} (MINIPD_CPU_ISA)" in kernel_backends()["cpu"]  # (what `python -m minipd info` prints)
        # What is measured or compiled under a limit is kept apart from the native run's.
        assert machine_key() != native[2] and program_key({}) != native[4]
        keys.add(cpu_paged_attention.build_key())
    assert len(keys) == 1 + len(limited)  # native, portable (and avx2): never one another's build
    # torch's own limits too: the compiler's generated code follows ATEN_CPU_CAPABILITY.
    monkeypatch.delenv(isa.ISA_ENV)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert isa.isa_limits() == {"ATEN_CPU_CAPABILITY": "default"}
    assert machine_key() != native[2] and program_key({}) != native[4]
    assert "limited: ATEN_CPU_CAPABILITY=default (torch's kernels: " in machine_label()


def _native_isa() -> str:
    return "avx512" if _has_avx2() and "avx512f" in isa.cpu_flags() else "avx2" if _has_avx2() else "portable"


@pytest.mark.parametrize("limited", ["avx2", "portable"])
def test_every_path_of_the_kernels_passes_the_kernel_tests(limited):
    """The attention, linear, norm, RoPE and SwiGLU kernels built as for a lesser CPU (``MINIPD_CPU_ISA``: AVX2
    without AVX-512, or no AVX2 at all), then the kernel test files run against that build, in a child process
    (one process cannot hold two builds' ops). Where the native build already is that one, they ran it."""
    if limited == "avx2" and not _has_avx2():
        pytest.skip(f"this CPU ({platform.machine()}) has no AVX2 and FMA: no AVX2 paths to test here")
    if _native_isa() == limited:
        pytest.skip(f"the native build is the {limited} one on this CPU: the kernel test files ran it themselves")
    need_cpu_kernel()  # (where no compiler exists, MINIPD_NO_CPU_KERNEL=1 says so and this is skipped)
    env = {**os.environ, isa.ISA_ENV: limited, "HF_HUB_OFFLINE": "1"}
    env.pop(NO_BUILD_ENV, None)  # (this build is the test's own to make)
    built = subprocess.run([sys.executable, "-c", "from minipd.kernels.cpu_paged_attention import load_kernel\n"
                            "module, why = load_kernel()\nprint(module.compiled_isa() if module else why)"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert built.returncode == 0 and built.stdout.split()[-1:] == [limited], (built.stdout[-2000:],
                                                                              built.stderr[-3000:])
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = run.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in summary[0] and "skipped" not in summary[0], summary


def test_two_generations_under_one_name_keep_their_measurements_and_programs_apart(monkeypatch):
    """A virtual machine may call a Zen 4 and a Zen 5 EPYC both "AMD EPYC" with the same headline features,
    while oneDNN multiplies twice as fast on the second: what one measured or compiled is not the other's."""
    from minipd.bench.hf import machine_label
    from minipd.engine.program_cache import program_key
    from minipd.kernels.measured import cpu_description, machine_key

    flags = frozenset({"fpu", "sse2", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"})
    zen4 = {"family": "25", "model": "17"}
    zen5 = {"family": "26", "model": "2"}

    def as_if(identity: dict, extra: frozenset = frozenset()) -> tuple:
        monkeypatch.setattr(isa, "_cpuinfo", lambda: ("AMD EPYC", flags | extra, identity))
        return cpu_description(), machine_key(), program_key({}), machine_label()

    for name in (isa.ISA_ENV, *isa.TORCH_ISA_ENVS):
        monkeypatch.delenv(name, raising=False)
    four, five = as_if(zen4), as_if(zen5)
    assert four[0]["id"] == "family 25 model 17" and five[0]["id"] == "family 26 model 2"
    assert four[0]["features"] == five[0]["features"] == ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"]
    assert four[1] != five[1] and four[2] != five[2]
    assert four[3].startswith("AMD EPYC (family 25 model 17; avx2, avx512f,")
    # One flag more (a feature a hypervisor shows on one host and hides on another) changes what "native" builds.
    more = as_if(zen5, frozenset({"avx512_vp2intersect"}))
    assert more[1] != five[1] and more[2] != five[2] and more[0] == five[0]
    # Where Linux gives no family (another architecture), the name and flags still key it, and nothing breaks.
    bare = as_if({})
    assert "id" not in bare[0] and bare[3].startswith("AMD EPYC (avx2, ") and bare[1] != four[1]
