"""Which instruction set minipd's C++ CPU kernels are built for: ``MINIPD_CPU_ISA``.

By default (``native``) the kernels are compiled with ``-march=native``: everything this CPU has. The attention
kernels have variants by instruction set (AVX-512; AVX2 with FMA but no AVX-512; plain C++ loops), so a CPU with
AVX-512 never compiles the AVX2-only ones, nor any x86 CPU the plain loops. ``MINIPD_CPU_ISA=avx2`` builds the
kernels for x86-64-v3 (AVX2, FMA, F16C: what an AVX2-only CPU has, tuned for this one) and ``portable`` for the
architecture's baseline (x86-64: SSE2, no FMA), each a build of its own beside the native one. That is how the
tests check every variant against its reference on one machine, and how a bench can show what an older CPU's
instruction set gets (limit torch's and its libraries' code too: ``ATEN_CPU_CAPABILITY=avx2`` for torch's kernels
and the compiler's generated code, ``ONEDNN_MAX_CPU_ISA=AVX2`` for oneDNN's, ``MKL_ENABLE_INSTRUCTIONS=AVX2`` for
MKL's; each is read once, at its first use).

The features a limited build cannot use are left out of :func:`~minipd.kernels.measured.cpu_description`, and
torch's limits are part of the keys of measured choices and compiled programs, so what is measured or compiled
under a limit is kept and labelled apart from the native run's. The variable is read where it is needed: set it
before the process first loads the kernels (they are loaded once).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform

#: The environment variable that chooses, and what it may say (unset or "" means native).
ISA_ENV = "MINIPD_CPU_ISA"
ISAS = ("native", "avx2", "portable")


@functools.cache
def _cpuinfo() -> tuple[str | None, frozenset[str], dict[str, str]]:
    """The first CPU's model name, feature flags and x86 family and model numbers as Linux reports them
    (``/proc/cpuinfo``), read once."""
    name, flags, identity = None, None, {}
    wanted = {"cpu family": "family", "model": "model"}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                field, _, value = line.partition(":")
                field = field.strip()
                if name is None and field == "model name":
                    name = value.strip()
                elif flags is None and field in ("flags", "Features"):
                    flags = frozenset(value.split())
                elif field in wanted and wanted[field] not in identity:
                    identity[wanted[field]] = value.strip()
                elif not field:  # (the first processor's block ends here)
                    break
    except OSError:
        pass
    return name, flags or frozenset(), identity


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (``/proc/cpuinfo``); empty elsewhere."""
    return _cpuinfo()[1]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what the platform says of its processor."""
    return _cpuinfo()[0] or platform.processor() or platform.machine()


def cpu_identity() -> str:
    """Which CPU generation this is, beyond its name: x86's family and model numbers (``"family 26 model 2"``),
    or "" where Linux does not report them. A virtual machine may call two generations by one name ("AMD EPYC")
    with the same headline features, while their fastest paths differ (a Zen 5 core multiplies twice as wide as
    a Zen 4 core): what is measured or compiled on one must not be taken for the other's."""
    identity = _cpuinfo()[2]
    if "family" not in identity or "model" not in identity:
        return ""
    return f"family {identity['family']} model {identity['model']}"


def flags_digest() -> str:
    """A short hash of every feature flag the CPU reports: code built for "native" depends on all of them."""
    return hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def kernel_isa() -> str:
    """What ``MINIPD_CPU_ISA`` asks for: ``native``, ``avx2`` or ``portable``. A value that is none of these, or
    ``avx2`` where the CPU cannot run it, raises ``ValueError`` naming the variable and what is allowed."""
    isa = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if isa not in ISAS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISAS)} (unset means native), got {isa!r}")
    if isa == "avx2":
        if not _x86():
            raise ValueError(f"{ISA_ENV}=avx2 needs an x86 CPU with AVX2 and FMA, this one is {platform.machine()}: "
                             "use native or portable")
        if not cpu_flags():
            raise ValueError(f"{ISA_ENV}=avx2 needs an x86 CPU with AVX2 and FMA, and this system does not say which "
                             "features its CPU has (no /proc/cpuinfo): use native or portable")
        if not {"avx2", "fma"} <= cpu_flags():
            raise ValueError(f"{ISA_ENV}=avx2 needs an x86 CPU with AVX2 and FMA, and this one lacks "
                             f"{' and '.join(sorted({'avx2', 'fma'} - cpu_flags()))}: use native or portable")
    return isa


def kernel_cflags(isa: str | None = None) -> tuple[str, ...]:
    """The compiler flags of a build for ``isa`` (by default :func:`kernel_isa`)."""
    isa = kernel_isa() if isa is None else isa
    if isa == "native":
        return ("-O3", "-march=native", "-fopenmp")
    if isa == "avx2":
        # The x86-64-v3 level, not -march=native less AVX-512: that keeps whatever else the CPU has (AMX, VAES...),
        # and on AVX10 CPUs GCC cannot take AVX-512 away at all.
        return ("-O3", "-march=x86-64-v3", "-mtune=native", "-fopenmp")
    if isa == "portable":
        # Named on x86 (a compiler may be configured to default to a higher level); elsewhere the default.
        return ("-O3", "-march=x86-64", "-mtune=generic", "-fopenmp") if _x86() else ("-O3", "-fopenmp")
    raise ValueError(f"isa must be one of {', '.join(ISAS)}, got {isa!r}")


#: torch's and its libraries' own switches of instruction set (see the module's docstring).
TORCH_ISA_ENVS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def isa_limits() -> dict[str, str]:
    """Every instruction-set limit this process runs under, by variable: ``MINIPD_CPU_ISA`` unless native, and
    torch's switches (:data:`TORCH_ISA_ENVS`) that are set. Empty for a native run."""
    isa = kernel_isa()
    limits = {ISA_ENV: isa} if isa != "native" else {}
    limits.update({name: os.environ[name].strip() for name in TORCH_ISA_ENVS if os.environ.get(name, "").strip()})
    return limits


def usable_features(features: frozenset[str] | set[str], isa: str | None = None) -> set[str]:
    """``features`` less those a build for ``isa`` cannot use: AVX-512 and AMX under avx2, AVX2 and up under
    portable."""
    isa = kernel_isa() if isa is None else isa
    if isa == "avx2":
        return {f for f in features if not f.startswith(("avx512", "amx"))}
    if isa == "portable":
        return {f for f in features if not f.startswith(("avx", "fma", "f16c", "amx"))}
    return set(features)


__all__ = ["ISAS", "ISA_ENV", "TORCH_ISA_ENVS", "cpu_flags", "cpu_identity", "cpu_model", "flags_digest", "isa_limits",
           "kernel_cflags", "kernel_isa", "usable_features"]
