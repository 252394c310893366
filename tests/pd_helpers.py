"""What the prefill/decode tests share: a reference engine, a mixed workload, and checks on workers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from minipd import LLM, DisaggregatedLLM, SamplingParams
from minipd.pd.transport import nixl_available

needs_nixl = pytest.mark.skipif(nixl_available() is not None, reason=f"needs NIXL: {nixl_available()}")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-py")


def mixed(llm: LLM, n: int = 32) -> tuple[list[list[int]], list[SamplingParams]]:
    text = ("import os\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser()\n"
            "    args = parser.parse_args(argv)\n    return run(args)\n") * 8
    ids = llm.tokenizer.encode(text)
    prompts = [ids[(i * 7) % 50:(i * 7) % 50 + 4 + (i * 13) % 90] for i in range(n)]
    params = []
    for i in range(n):
        if i % 4 == 1:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=8 + i % 24, ignore_eos=True))
        elif i % 4 == 2:
            params.append(SamplingParams(temperature=0, max_tokens=1 + i % 3))  # some end at the first token
        else:
            params.append(SamplingParams(temperature=0, max_tokens=8 + (i * 5) % 40, stop=["\n\n"]))
    return prompts, params


def tokens(outputs) -> list[tuple[list[int], str, str | None]]:
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs]


def wait_until_blocks_free(pd: DisaggregatedLLM, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = pd.worker_stats()
        if all(s["used_blocks"] == 0 and s["live_requests"] == 0 for s in stats.values()):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held: {stats}")
        time.sleep(0.2)


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().split(")")[-1].split()[0] == "Z", f"worker {pid} is still running"


def run_killing(pd: DisaggregatedLLM, prompts, params, role: str, after_tokens: int, sig: int = signal.SIGKILL):
    """Send every request, send ``sig`` (SIGKILL: kill) to the last worker of ``role`` once ``after_tokens``
    tokens came back (``0``: as soon as it holds a request), and finish every request."""
    victim = pd.worker_pids()[role][-1]
    ids = [pd.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    states = [pd.processor.states[i] for i in ids]
    received, deadline = 0, time.monotonic() + 120

    def holds_requests() -> bool:
        # (In push modes a prompt reaches its prefill worker only once a decode worker has reserved blocks.)
        return any(w.pid == victim and w.requests for w in pd.workers.workers.values())

    while not all(s.finished for s in states):
        if victim and after_tokens <= 0 and holds_requests():  # at once, with its prompts in flight
            os.kill(victim, sig)
            victim = 0
        assert time.monotonic() < deadline, "requests not finished in 120 s"
        received += len(pd.step())
        if victim and 0 < after_tokens <= received:
            os.kill(victim, sig)
            victim = 0
    assert victim == 0, "the run ended before the worker could be killed"
    return [s.to_output() for s in states]
