"""``python -m minipd bench`` runs end to end (at a tiny scale; the figures themselves are not asserted)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from minipd.bench import file_workload, machine_label, make_workload, random_workload


def test_workloads_are_seeded_and_within_their_ranges():
    a = make_workload(16, (16, 32), (4, 8), vocab_size=100, seed=3, shared_prefix=5)
    b = make_workload(16, (16, 32), (4, 8), vocab_size=100, seed=3, shared_prefix=5)
    assert a == b
    assert all(21 <= len(p) <= 37 and p[:5] == a.prompts[0][:5] for p in a.prompts)
    assert all(4 <= n <= 8 for n in a.output_lens) and a.output_tokens == sum(a.output_lens)
    assert all(0 < t < 100 for p in a.prompts for t in p)


def test_the_random_mix_is_seeded_and_its_lengths_spread():
    a, b, c = (random_workload(48, vocab_size=100, seed=seed) for seed in (5, 5, 6))
    assert a == b and a != c
    lens = [len(p) for p in a.prompts]
    assert len(lens) == 48 and 1 <= min(lens) and max(lens) <= 640 and max(a.output_lens) <= 320
    assert max(lens) > 3 * min(lens)  # a mix, not one length
    small = random_workload(48, vocab_size=100, seed=5, scale=0.1)
    assert max(len(p) for p in small.prompts) <= 64


def test_a_workload_file_gives_its_lengths_and_refuses_what_the_model_cannot_take(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt_len": 7, "output_len": 3}\n\n{"prompt_len": 2, "output_len": 9, "arrival": 0.5}\n')
    w = file_workload(str(path), vocab_size=50, max_model_len=16)
    assert [len(p) for p in w.prompts] == [7, 2] and w.output_lens == [3, 9]
    with pytest.raises(ValueError, match="request 2 needs 2 \\+ 9 tokens; the model takes at most 10"):
        file_workload(str(path), vocab_size=50, max_model_len=10)
    path.write_text('{"prompt_len": 7}\n')
    with pytest.raises(ValueError, match=r"mine\.jsonl:1: a trace line needs"):
        file_workload(str(path), vocab_size=50, max_model_len=16)


def test_the_machine_label_names_the_cpu_and_threads():
    from minipd.kernels.measured import cpu_description

    label = machine_label()
    assert label.startswith(cpu_description()["cpu"]) and label.endswith(f"{torch.get_num_threads()} threads")


def test_bench_runs_a_workload_file_and_refuses_a_bad_one(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(f'{{"prompt_len": {p}, "output_len": {o}}}\n' for p, o in ((12, 4), (30, 6), (5, 8))))
    out = subprocess.run([sys.executable, "-m", "minipd", "bench", "--workload", str(path), "--rounds", "1",
                          "--no-hf-continuous"], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"[{path}] 3 requests, 47 prompt tokens, 18 output tokens" in out.stdout
    # (The bench's thread count is its own process's: this one's may have been changed by an earlier test.)
    cpu = machine_label().rsplit(", ", 1)[0]
    assert "throughput minipd / HF generate (padded)" in out.stdout and f"[{cpu}, " in out.stdout
    bad = subprocess.run([sys.executable, "-m", "minipd", "bench", "--workload", str(tmp_path / "none.jsonl")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "--workload must be one of mixed" in bad.stderr


def test_bench_prints_every_comparison():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "minipd", "bench", "--scale", "0.05", "--rounds", "1"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for needle in ("[mixed]", "throughput minipd / HF generate (padded)",
                   "throughput minipd / HF generate_batch (continuous)", "[single]", "TPOT minipd / HF generate",
                   "[shared-prefix]", "prefill tokens cut by prefix caching", "mean TTFT with / without caching",
                   "fp32 GEMM torch.mm", "copy bandwidth", "useful GFLOP/s", "of the fp32 GEMM peak",
                   "useful FLOP/s / fp32 GEMM peak (minipd)", "TPOT minipd int8 weights / HF generate",
                   "minipd, eager", "HF static cache + torch.compile", "TPOT minipd / HF static + compile",
                   "median", "[random, seed 0]", "TPOT minipd / one pass over the weights", "machine: ",
                   "engine: on (", "auto: a long-lived engine", "first decode program ready",
                   "warm start (a second process, same engine)", "minipd, bf16",
                   "TPOT minipd bf16 compile_decode / minipd (fp32)",
                   "(the higher of two measurements, before and after)", "roofline of minipd's",
                   "x HF padded `generate`"):
        assert needle in text, needle


def test_pd_bench_prints_interference_and_transfer_figures():
    """The disaggregation benchmark, at a tiny scale: every system and every transfer mode is reported,
    and the workers it starts are gone when it returns (subprocess timeout bounds it)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "minipd", "bench", "--workload", "pd", "--scale", "0.1",
                          "--rounds", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for needle in ("colocated, chunked prefill", "split (1 prefill + 1 decode worker)",
                   "P99 TPOT split / colocated (medians)", "[pd transfer]", "pull ", "push ", "layerwise ",
                   "layerwise, int8", "an int8 cache moves", "layerwise, int8 wire",
                   "sent as int8 (kv_transfer_dtype)"):
        assert needle in text, needle
    bad = subprocess.run([sys.executable, "-m", "minipd", "bench", "--workload", "pd", "--rounds", "0"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "--rounds must be at least 1" in bad.stderr


def test_the_moe_ladder_times_every_path_that_runs_here(capsys):
    from minipd.bench.moe import backends, main

    assert main("tiny-py-moe", scale=0.05) == 0
    out = capsys.readouterr().out
    paths = backends()
    assert "loop" in paths and ("triton" in paths) == torch.cuda.is_available()
    rows = [line for line in out.splitlines() if line.strip().endswith("x") and "tokens" not in line]
    assert len(rows) == 2 * 2 * len(paths)  # two layers, two batch sizes
    assert all(line.strip().endswith("1.00x") for line in rows if " loop " in line)
    if not torch.cuda.is_available():
        assert "triton (fused kernel): not run, it needs a CUDA GPU" in out


def test_the_ep_bench_reports_overlap_and_the_wire_bytes(capsys):
    from minipd.bench.expert_parallel import main

    assert main("tiny-py-moe", scale=0.25) == 0
    out = capsys.readouterr().out
    assert "communication hidden by two overlapped micro-batches" in out
    wire = {line.split()[0]: line.split() for line in out.splitlines() if line.strip().split()[:1]
            and line.split()[0] in ("float32", "int8", "fp8")}
    hidden = 256  # tiny-py-moe
    assert float(wire["float32"][1]) == 4 * hidden  # fp32 rows out, fp32 answers back
    assert float(wire["int8"][1]) == float(wire["fp8"][1]) == hidden + 2  # codes and a 2-byte scale
    assert float(wire["int8"][2]) == 4 * hidden
    assert wire["float32"][-1] == "100.0%"


def test_the_random_50m_model_has_the_size_it_says(tmp_path):
    from minipd.bench.random_models import random_model_config
    from minipd.config import ModelConfig
    from minipd.sim.costs import count_parameters

    total = count_parameters(ModelConfig.from_dict(random_model_config("random-50m"))).total
    assert 45e6 < total < 55e6
    import pytest

    with pytest.raises(ValueError, match="unknown random model"):
        random_model_config("random-7b")


def test_the_bench_says_why_a_model_gets_no_compiled_decode(capsys):
    from minipd import LLM
    from minipd.bench.hf import _compiled_or_why

    assert _compiled_or_why("minipd, compile_decode", LLM, "tiny-py-moe", compile_batch_sizes=(1,),
                            record_routing=True) is None
    assert "minipd, compile_decode: not run (compile_decode does not cover record_routing" in capsys.readouterr().out


def test_the_floor_keeps_the_higher_of_two_measurements():
    from minipd.bench.floor import Floor

    busy = Floor({"torch.mm": 90e9, "minipd": 100e9}, 1e9, 20e9, 2)
    quiet = Floor({"torch.mm": 180e9, "minipd": 170e9}, 2e9, 15e9, 2)
    best = busy.best_with(quiet)
    assert best.fp32_flops == {"torch.mm": 180e9, "minipd": 170e9} and best.fp32_peak == 180e9
    assert best.bf16_flops == 2e9 and best.bandwidth == 20e9 and best.threads == 2


def test_the_roofline_of_a_schedule_is_each_step_at_its_bound():
    """A prefill step is bound by its FLOPs at the GEMM peak, a one-row decode step by its bytes at the copy
    bandwidth; the schedule's roofline is their sum, from the steps' own records."""
    from minipd.bench.floor import Floor, schedule_roofline
    from minipd.config import ModelConfig
    from minipd.engine.stats import StepStats
    from minipd.models.registry import resolve_model
    from minipd.sim.costs import step_cost

    config = ModelConfig.from_pretrained(resolve_model("tiny-py"))
    floor = Floor({"torch.mm": 100e9}, 0.0, 20e9, 2)

    def stats(step: int, prefill: tuple[tuple[int, int], ...], decodes: int, context: int) -> StepStats:
        return StepStats(start_time=0.0, duration=0.0, num_prefill_tokens=sum(n for n, _ in prefill),
                         num_decode_tokens=decodes, num_running=0, num_waiting=0, kv_blocks_used=0,
                         kv_blocks_free=0, prefix_hit_rate=0.0, num_preemptions=0, step=step,
                         num_context_tokens=context, prefill_chunk_sizes=tuple(n for n, _ in prefill),
                         prefill_chunk_contexts=tuple(c for _, c in prefill))

    prefill = step_cost(config, [(0, 300), (100, 200)], dtype_bytes=4)  # a prompt, and a second chunk of one
    decode = step_cost(config, [(40, 1)], dtype_bytes=4)
    assert prefill.flops / 100e9 > (prefill.weight_bytes + prefill.kv_read_bytes + prefill.kv_write_bytes) / 20e9
    decode_bound = (decode.weight_bytes + decode.kv_read_bytes + decode.kv_write_bytes) / 20e9
    assert decode_bound > decode.flops / 100e9
    steps = [stats(1, ((300, 300), (200, 300)), 0, 600), stats(2, (), 1, 41), stats(3, (), 0, 0)]
    assert schedule_roofline(config, steps, floor) == pytest.approx(prefill.flops / 100e9 + decode_bound)
    # Decode rows beside a prefill chunk: their contexts are what the step attended beyond the chunk's.
    mixed = step_cost(config, [(0, 300), (40, 1), (40, 1)], dtype_bytes=4)
    assert schedule_roofline(config, [stats(4, ((300, 300),), 2, 382)], floor) == pytest.approx(
        max(mixed.flops / 100e9, (mixed.weight_bytes + mixed.kv_read_bytes + mixed.kv_write_bytes) / 20e9))
