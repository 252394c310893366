"""Chapter 03 exercises: paging the KV cache and finding a cached prefix, plugged into minipd's engine.

Each exercise has a reference solution (``reference_<name>``, written out plainly so a stuck
reader can read it) and a checker (``check_<name>(fn)``) that prints PASS, FAIL or TODO. A checker
first runs the reader's function on fixed inputs, edge cases included, and compares it with the
engine's own logic: the slot arithmetic of :mod:`minipd.engine.model_runner`,
:meth:`minipd.kv.block_manager.BlockManager.find_cached_prefix` and the block manager's eviction
order (the tests hold the references equal to them). The three paging checkers then **plug the
reader's function into the engine** and run the bundled ``tiny-py``:

- ``check_slot_mapping``: every step, the slots the model runner hands the kernels (where each new
  token's K/V are stored) are the reader's, computed from each request's block table and positions;
- ``check_longest_cached_prefix``: the block manager looks prompts up with the reader's function,
  on a workload with a shared header, repeats and a prompt made only of cached blocks;
- ``check_pick_block``: the block manager hands out the free block the reader picks, on a pool small
  enough that cached blocks must be evicted (chapter 03, section 7).

Each compares what the engine then does (the slots, the tokens reused from the cache, the
evictions, the generated tokens) with a run of the engine's own code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch

from minipd.exercises.ch01 import MODEL, ReaderError, compare_token_runs, engine_llm, greedy_tokens, run_plugged
from minipd.exercises.checking import (
    Case,
    CheckResult,
    call_reader,
    check_tensor_fn,
    compare_tensors,
    report,
    shadowed,
)
from minipd.kv.block_manager import BlockAllocation, BlockManager, chain_hash
from minipd.llm import LLM
from minipd.sampling_params import SamplingParams

__all__ = [
    "ENGINE_BLOCK_SIZE",
    "FreeBlock",
    "check_blocks_needed",
    "check_longest_cached_prefix",
    "check_pick_block",
    "check_slot_mapping",
    "reader_eviction",
    "reader_prefix_lookup",
    "reader_slot_mapping",
    "reference_blocks_needed",
    "reference_longest_cached_prefix",
    "reference_pick_block",
    "reference_slot_mapping",
]


# --- reference solutions ------------------------------------------------------------------------


def reference_blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` slots that ``num_tokens`` tokens occupy: the ceiling of the division."""
    return (num_tokens + block_size - 1) // block_size


def reference_slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The pool slot of each position: ``block_table[p // block_size] * block_size + p % block_size``.

    ``block_table`` (num_blocks,) lists the sequence's physical blocks in order; ``positions`` (N,)
    are token positions in the sequence. Returns (N,) int64.
    """
    physical_block = block_table.long()[positions // block_size]
    return physical_block * block_size + positions % block_size


def reference_longest_cached_prefix(token_ids: Sequence[int], cached: dict[int, int], block_size: int) -> list[int]:
    """Block ids of the longest run of leading full blocks whose chained hashes are in ``cached``.

    ``cached`` maps a block's chained hash (:func:`minipd.kv.block_manager.chain_hash`) to the
    physical block holding it. The search stops at the first miss, and never covers the last token:
    its logits are needed to sample the next token, so it must be computed.
    """
    found: list[int] = []
    parent = None
    usable = (len(token_ids) - 1) // block_size  # full blocks that leave at least one token over
    for index in range(usable):
        block_tokens = token_ids[index * block_size:(index + 1) * block_size]
        parent = chain_hash(parent, block_tokens)
        if parent not in cached:
            break
        found.append(cached[parent])
    return found


@dataclass(frozen=True)
class FreeBlock:
    """A block on the free list, as the eviction exercise sees it."""

    block_id: int
    #: It holds a registered full block that a later prompt could reuse (it is in the prefix cache).
    cached: bool
    #: When its last user let go of it: a counter, larger is more recent (0 for a block never used).
    freed_at: int


def reference_pick_block(free: list[FreeBlock]) -> int:
    """The free block to hand out next (its contents will be overwritten).

    A block with nothing cached, if there is one: its contents are of no use to anyone, and any such
    block will do. Otherwise every free block holds a cached prefix and one must be evicted: the one
    freed longest ago (least recently used), since a prefix used recently is the likeliest to be
    asked for again.
    """
    plain = [b for b in free if not b.cached]
    if plain:
        return plain[0].block_id
    return min(free, key=lambda b: b.freed_at).block_id


# --- comparing plain Python answers --------------------------------------------------------------


def _as_int(value: Any) -> int | None:
    """``value`` as an int if it is an integer (Python, numpy or 0-d torch), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())
    if isinstance(value, Integral):
        return int(value)
    return None


def _compare_ints(name: str, actual: Any, expected: int, where: str) -> CheckResult | None:
    got = _as_int(actual)
    if got is None:
        return CheckResult("FAIL", name, f"returned {type(actual).__name__}, expected an int {where}")
    if got != expected:
        diff = abs(got - expected)
        return CheckResult("FAIL", name, f"got {got}, expected {expected} (diff {diff}) {where}", max_diff=float(diff))
    return None


def _compare_int_lists(name: str, actual: Any, expected: list[int], where: str) -> CheckResult | None:
    if isinstance(actual, torch.Tensor):
        actual = actual.tolist()
    if not isinstance(actual, list | tuple) or any(_as_int(v) is None for v in actual):
        return CheckResult("FAIL", name, f"returned {type(actual).__name__}, expected a list of block ids {where}")
    got = [_as_int(v) for v in actual]
    if got == expected:
        return None
    first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got),
                                                                                                    len(expected)))
    message = f"got {got}, expected {expected}; first mismatch at position {first} {where}"
    return CheckResult("FAIL", name, message, first_mismatch=first)


def _check_values(name: str, fn: Callable[..., Any], reference: Callable[..., Any], cases: Sequence[Case]
                  ) -> CheckResult:
    """Run ``fn`` and ``reference`` on every case; exact comparison of ints or lists of ints."""
    for case in cases:
        expected = reference(*case.args, **case.kwargs)
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return failure
        where = f"[case: {case.label}]"
        compare = _compare_ints if isinstance(expected, int) else _compare_int_lists
        failure = compare(name, actual, expected, where)
        if failure is not None:
            return failure
    return CheckResult("PASS", name)


# --- inputs, including edge cases ---------------------------------------------------------------


def _blocks_cases() -> list[Case]:
    return [
        Case("0 tokens", (0, 16)),
        Case("1 token", (1, 16)),
        Case("exactly one full block (16 of 16)", (16, 16)),
        Case("one token into a second block (17 of 16)", (17, 16)),
        Case("1000 tokens in blocks of 256", (1000, 256)),
        Case("block size 1", (37, 1)),
    ]


def _slot_cases(g: torch.Generator) -> list[Case]:
    table = torch.randperm(12, generator=g)[:5].to(torch.int32)  # 5 shuffled physical blocks
    return [
        Case("prefill of 19 tokens, block size 4, shuffled table", (table, torch.arange(19), 4)),
        Case("one decode position in the middle of a block", (table, torch.tensor([13]), 4)),
        Case("a prefill chunk starting mid-block (positions 6..17)", (table, torch.arange(6, 18), 4)),
        Case("block size 1", (table, torch.tensor([4, 0, 2]), 1)),
        Case("block size 16, positions out of order", (table, torch.tensor([70, 3, 16, 47]), 16)),
    ]


def _prefix_cases() -> list[Case]:
    """Queries against the hash table of a real :class:`BlockManager` (block size 4)."""
    bs = 4
    bm = BlockManager(num_blocks=16, block_size=bs)
    first = list(range(100, 114))  # 14 tokens: three full blocks, then two tokens
    second = [*first[:4], 7, 7, 7, 7, 8]  # shares only the first block
    for tokens in (first, second):
        alloc = BlockAllocation()
        assert bm.allocate(alloc, len(tokens), bm.find_cached_prefix(tokens))
        bm.register_full_blocks(alloc, tokens, len(tokens))
    cached = dict(bm.cached)
    # The same table after the middle block of ``first`` was evicted: the chain is broken there.
    gap = dict(cached)
    gap.pop(chain_hash(chain_hash(None, first[:4]), first[4:8]))
    return [
        Case("a prompt extending the 14 cached tokens: three blocks hit", ([*first, 1, 2], cached, bs)),
        Case("exactly 12 cached tokens: the last token must be computed, two blocks", (first[:12], cached, bs)),
        Case("shares one block, then differs", ([*first[:4], 5, 5, 5, 5, 5], cached, bs)),
        Case("the other sequence's second block", ([*second, 9], cached, bs)),
        Case("same second block after a different first block (hashes are chained)",
             ([0, 0, 0, 0, *first[4:8], 1], cached, bs)),
        Case("middle block evicted: stop at the first miss", ([*first, 1], gap, bs)),
        Case("shorter than a block", (first[:3], cached, bs)),
        Case("a single token", ([100], cached, bs)),
    ]


# --- checkers -----------------------------------------------------------------------------------


def check_blocks_needed(fn: Callable[[int, int], int]) -> CheckResult:
    """Check ``fn(num_tokens, block_size) -> int``."""
    return report(_check_values("blocks_needed", fn, reference_blocks_needed, _blocks_cases()))


#: The engine checks: blocks of 4 tokens (so a 22-token prompt spans six blocks), few new tokens each.
ENGINE_BLOCK_SIZE = 4


def _as_slots(value: Any, n: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.shape != (n,) or value.is_floating_point():
        got = f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
            else type(value).__name__
        raise ReaderError(f"your function returned {got} for {n} positions; expected an integer tensor of shape "
                          f"({n},)")
    return value.long()


@contextmanager
def reader_slot_mapping(llm: LLM, fn: Callable[..., Any], log: dict[str, Any]) -> Iterator[None]:
    """Inside the block ``llm``'s model runner stores K/V at the slots ``fn(block_table, positions, block_size)``
    gives for each scheduled request; afterwards it computes them itself again.

    ``log`` receives ``steps`` (how many steps ran), ``worst`` (the largest |slot difference|) and
    ``first`` (a description of the first slot that differs from the engine's, or None).
    """
    runner = llm.engine.core.runner
    original = runner.prepare
    bs = runner.pool.block_size
    log.update(steps=0, worst=0.0, first=None, first_index=None)

    def prepare(batch: Any) -> Any:
        input_ids, positions, metadata, to_sample, rows = original(batch)
        # The runner lays a step out as decodes first (one token each), then prefill chunks.
        entries = [e for e in batch.entries if e[1] == 1] + [e for e in batch.entries if e[1] > 1]
        pieces, offset = [], 0
        for request, n in entries:
            table = torch.tensor(request.blocks.block_table, dtype=torch.int32)
            pieces.append(_as_slots(fn(table, positions[offset:offset + n].clone(), bs), n))
            offset += n
        slots = torch.cat(pieces).to(metadata.slot_mapping.device)
        ok, diff, first = compare_tensors(slots, metadata.slot_mapping, 0.0, 0.0)
        log["worst"] = max(log["worst"], diff)
        if not ok and log["first"] is None:
            row = first[0]
            starts = torch.tensor([n for _, n in entries]).cumsum(0)
            request = entries[int((starts <= row).sum())][0]  # the request whose rows hold ``row``
            log["first"] = (f"step {log['steps']}, request {request.request_id!r} (block table "
                            f"{request.blocks.block_table}), position {int(positions[row])}: slot "
                            f"{int(slots[row])}, the engine's {int(metadata.slot_mapping[row])}")
            log["first_index"] = row
        metadata.slot_mapping = slots
        log["steps"] += 1
        return input_ids, positions, metadata, to_sample, rows

    with shadowed(runner, prepare=prepare):
        yield


def _check_slots_in_engine(name: str, fn: Callable[..., Any]) -> CheckResult:
    # Blocks of 4 and at most 12 tokens a step: prompts arrive in chunks that start mid-block, and the three
    # requests' blocks interleave in the pool, so block tables are not 0, 1, 2, ...
    llm = engine_llm(block_size=ENGINE_BLOCK_SIZE, max_num_batched_tokens=12)
    expected = greedy_tokens(llm)
    log: dict[str, Any] = {}
    where = f"plugged into {MODEL}'s model runner (blocks of {ENGINE_BLOCK_SIZE}, your slots for every new token)"
    actual, failure = run_plugged(name, where, reader_slot_mapping(llm, fn, log), lambda: greedy_tokens(llm))
    if failure is not None:
        return failure
    if log["first"] is not None:
        return CheckResult("FAIL", name, f"{where}: first wrong slot at {log['first']}", max_diff=log["worst"],
                           first_mismatch=log["first_index"])
    return compare_token_runs(name, actual, expected, where) or CheckResult("PASS", name, max_diff=0.0)


def check_slot_mapping(fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> CheckResult:
    """Check ``fn(block_table, positions, block_size) -> (N,) int64`` slot by slot, then in the engine.

    First exactly against the reference on five fixed cases. Then a fresh ``tiny-py`` (blocks of 4, prompts
    in chunks of up to 12 tokens) stores every new token's K/V at the slots ``fn`` gives: each step's
    slots must be the engine's own, and the greedy tokens (three prompts, 16 each) too.
    """
    name = "slot_mapping"
    result = check_tensor_fn(name, fn, reference_slot_mapping, _slot_cases, atol=0.0, rtol=0.0)
    if result.status != "PASS":
        return report(result)
    return report(_check_slots_in_engine(name, fn))


#: The prefix-caching workload: a header shared by every prompt (five full blocks of 4 tokens and a bit).
PREFIX_HEADER = '"""Read and write small configuration files."""\nimport json\nimport os\n\n\n'
PREFIX_QUESTIONS = ["def load(path):\n", "def save(path, data):\n", "def exists(path):\n"]
#: New tokens per request in the prefix workload.
PREFIX_TOKENS = 6


def _prefix_rounds(llm: LLM) -> list[list[Any]]:
    """Two rounds of requests; the second finds the first's blocks cached. Returns the outputs per round.

    Round 2 repeats a round-1 prompt, adds two more with the same header, and a prompt that is exactly
    the first 16 tokens of a round-1 prompt: four cached full blocks, of which only three may be reused.
    """
    params = SamplingParams(temperature=0, max_tokens=PREFIX_TOKENS, ignore_eos=True)
    encode = llm.tokenizer.hf
    first = encode(PREFIX_HEADER + PREFIX_QUESTIONS[0])["input_ids"]
    round1 = [first]
    round2 = [first, *(encode(PREFIX_HEADER + q)["input_ids"] for q in PREFIX_QUESTIONS[1:]),
              first[:4 * ENGINE_BLOCK_SIZE]]
    return [llm.generate(prompts, params, use_tqdm=False) for prompts in (round1, round2)]


@contextmanager
def reader_prefix_lookup(llm: LLM, fn: Callable[..., Any]) -> Iterator[None]:
    """Inside the block ``llm``'s block manager finds cached prefixes with ``fn(token_ids, cached, block_size)``
    (``cached`` a copy of its hash table); afterwards with its own method.

    The answer is checked before the engine uses it: a list of block ids that hold a cached prefix, one
    token at least left to compute.
    """
    bm = llm.engine.block_manager

    def lookup(token_ids: Sequence[int], hashes: Sequence[bytes] | None = None) -> list[int]:
        if not bm.enable_prefix_caching:
            return []
        tokens = list(token_ids)
        found = fn(tokens, dict(bm.cached), bm.block_size)
        if isinstance(found, torch.Tensor):
            found = found.tolist()
        ids = [_as_int(b) for b in found] if isinstance(found, list | tuple) else None
        if ids is None or any(b is None for b in ids):
            raise ReaderError(f"your function returned {type(found).__name__} for a {len(tokens)}-token prompt; "
                              "expected a list of block ids")
        if len(ids) * bm.block_size > len(tokens) - 1:
            raise ReaderError(f"your function returned {len(ids)} blocks ({len(ids) * bm.block_size} tokens) for a "
                              f"{len(tokens)}-token prompt: at least its last token must be left to compute")
        stray = [b for b in ids if b not in set(bm.cached.values())]
        if stray:
            raise ReaderError(f"your function returned block {stray[0]}, which holds no cached block")
        return ids  # type: ignore[return-value]

    with shadowed(bm, find_cached_prefix=lookup):
        yield


def _check_prefix_in_engine(name: str, fn: Callable[..., Any]) -> CheckResult:
    options = {"block_size": ENGINE_BLOCK_SIZE, "enable_prefix_caching": True, "num_kv_blocks": 128}
    expected = _prefix_rounds(engine_llm(**options))
    llm = engine_llm(**options)
    where = f"plugged into {MODEL}'s block manager (blocks of {ENGINE_BLOCK_SIZE}, prefix caching on)"
    actual, failure = run_plugged(name, where, reader_prefix_lookup(llm, fn), lambda: _prefix_rounds(llm))
    if failure is not None:
        return failure
    for number, (got_round, want_round) in enumerate(zip(actual, expected, strict=True), start=1):
        for index, (got, want) in enumerate(zip(got_round, want_round, strict=True)):
            request = f"round {number}, request {index} ({len(want.prompt_token_ids)}-token prompt)"
            failure = _compare_request(name, where, request, got, want, "lookup")
            if failure is not None:
                return failure
    return CheckResult("PASS", name, max_diff=0.0)


def _compare_request(name: str, where: str, request: str, got: Any, want: Any, whose: str) -> CheckResult | None:
    """FAIL when a request's cached tokens or generated tokens differ from the engine's own run, else None."""
    if got.metrics.cached_tokens != want.metrics.cached_tokens:
        return CheckResult("FAIL", name, f"{where}: {request} reused {got.metrics.cached_tokens} cached tokens; "
                                         f"with the engine's own {whose}, {want.metrics.cached_tokens}",
                           max_diff=float(abs(got.metrics.cached_tokens - want.metrics.cached_tokens)))
    return compare_token_runs(name, [list(got.token_ids)], [list(want.token_ids)], where, labels=[request])


def check_longest_cached_prefix(fn: Callable[[list[int], dict[bytes, int], int], list[int]]) -> CheckResult:
    """Check ``fn(token_ids, cached, block_size) -> block ids``, then run the engine's block manager with it.

    First on eight queries against the hash table of a real :class:`BlockManager`. Then a fresh
    ``tiny-py`` with prefix caching looks every prompt up with ``fn``, over two rounds of requests
    sharing a header: each request must reuse as many cached tokens as with the engine's own lookup,
    and generate the same tokens.
    """
    name = "longest_cached_prefix"
    result = _check_values(name, fn, reference_longest_cached_prefix, _prefix_cases())
    if result.status != "PASS":
        return report(result)
    return report(_check_prefix_in_engine(name, fn))


# --- eviction ------------------------------------------------------------------------------------


def _free(*blocks: tuple[int, bool, int]) -> list[FreeBlock]:
    return [FreeBlock(*b) for b in blocks]


def _pick_cases() -> list[Case]:
    return [
        Case("nothing cached anywhere (a fresh pool)", (_free((0, False, 0), (1, False, 0), (2, False, 0)),)),
        Case("plain blocks and cached ones: a plain one, whenever it was freed",
             (_free((0, True, 9), (1, True, 2), (2, False, 12), (3, True, 5)),)),
        Case("a plain block freed long ago and a cached one freed long ago",
             (_free((4, True, 1), (7, False, 3), (9, True, 8)),)),
        Case("all cached: the least recently freed", (_free((0, True, 7), (3, True, 2), (5, True, 11), (6, True, 4)),)),
        Case("all cached, listed newest first", (_free((8, True, 30), (2, True, 20), (11, True, 10)),)),
        Case("a single free block", (_free((5, True, 3)),)),
    ]


def _check_picks(name: str, fn: Callable[..., Any]) -> CheckResult:
    for case in _pick_cases():
        (free,) = case.args
        actual, failure = call_reader(name, fn, case)
        if failure is not None:
            return failure
        where = f"[case: {case.label}]"
        got = _as_int(actual)
        if got is None:
            return CheckResult("FAIL", name, f"returned {type(actual).__name__}, expected a block id (an int) {where}")
        plain = [b.block_id for b in free if not b.cached]
        allowed = plain or [reference_pick_block(free)]  # any plain block is as good as another
        if got not in allowed:
            free_ids = [b.block_id for b in free]
            why = ("is not on the free list" if got not in free_ids else
                   "holds a cached prefix while a plain block is free" if plain else
                   "was freed more recently than another cached block")
            return CheckResult("FAIL", name, f"got block {got}, which {why}; expected "
                                             f"{'one of ' + str(allowed) if len(allowed) > 1 else allowed[0]} {where}")
    return CheckResult("PASS", name)


@contextmanager
def reader_eviction(llm: LLM, fn: Callable[[list[FreeBlock]], Any]) -> Iterator[None]:
    """Inside the block ``llm``'s block manager hands out the free block ``fn(free_blocks)`` picks; afterwards
    it picks by its own free-list order again.

    ``fn`` sees the free list sorted by block id, so the manager's own order gives nothing away, with each
    block's release time. The seam is two methods of the block manager instance, shadowed here and
    restored afterwards: ``_release`` (to time releases) and ``_take_free_block`` (to take the reader's
    block first; the manager's own bookkeeping, forgetting the hash and counting the eviction, still runs).
    """
    bm = llm.engine.block_manager
    take, release = bm._take_free_block, bm._release
    clock = [0]
    freed_at = dict.fromkeys(bm.free, 0)

    def timed_release(block_id: int) -> None:
        release(block_id)
        if block_id in bm.free:
            clock[0] += 1
            freed_at[block_id] = clock[0]

    def pick() -> int:
        view = [FreeBlock(b, bm.blocks[b].block_hash is not None, freed_at.get(b, 0)) for b in sorted(bm.free)]
        choice = fn(view)
        block_id = _as_int(choice)
        if block_id is None or block_id not in bm.free:
            raise ReaderError(f"your function returned {choice!r}, which is not the id of a free block "
                              f"(free: {[b.block_id for b in view]})")
        bm.free.move_to_end(block_id, last=False)  # the manager takes the first free block
        return take()

    with shadowed(bm, _take_free_block=pick, _release=timed_release):
        yield


#: The eviction workload's pool: 24 blocks of 4 tokens (96 tokens), with prefix caching.
EVICTION_POOL = {"block_size": ENGINE_BLOCK_SIZE, "enable_prefix_caching": True, "num_kv_blocks": 24}


def _eviction_phases(llm: LLM) -> list[tuple[list[Any], int]]:
    """Section 7's three phases on a small pool; each phase's outputs and the evictions so far.

    1: two requests with the shared header; 2: an unrelated prompt that needs most of the pool, so
    cached blocks must be evicted; 3: a third header request, which finds what survived.
    """
    params = SamplingParams(temperature=0, max_tokens=PREFIX_TOKENS, ignore_eos=True)
    encode = llm.tokenizer.hf
    headers = [encode(PREFIX_HEADER + q)["input_ids"] for q in PREFIX_QUESTIONS]
    text = "".join(f"value_{i} = compute({i}, scale={i * 3})\n" for i in range(20))
    unrelated = encode(text)["input_ids"][:17 * ENGINE_BLOCK_SIZE - PREFIX_TOKENS + 1]  # 17 of the 24 blocks
    phases = []
    for prompts in (headers[:2], [unrelated], headers[2:]):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        phases.append((outputs, llm.engine.block_manager.evictions))
    return phases


def _check_eviction_in_engine(name: str, fn: Callable[..., Any]) -> CheckResult:
    expected = _eviction_phases(engine_llm(**EVICTION_POOL))
    llm = engine_llm(**EVICTION_POOL)
    where = (f"plugged into {MODEL}'s block manager ({EVICTION_POOL['num_kv_blocks']} blocks of {ENGINE_BLOCK_SIZE}, "
             "prefix caching on)")
    actual, failure = run_plugged(name, where, reader_eviction(llm, fn), lambda: _eviction_phases(llm))
    if failure is not None:
        return failure
    for number, ((got_outs, got_evictions), (want_outs, want_evictions)) in enumerate(
            zip(actual, expected, strict=True), start=1):
        if got_evictions != want_evictions:
            return CheckResult("FAIL", name, f"{where}: after phase {number}, {got_evictions} cached blocks were "
                                             f"evicted; with the engine's own choice, {want_evictions}",
                               max_diff=float(abs(got_evictions - want_evictions)))
        for index, (got, want) in enumerate(zip(got_outs, want_outs, strict=True)):
            failure = _compare_request(name, where, f"phase {number}, request {index}", got, want, "choice")
            if failure is not None:
                return failure
    return CheckResult("PASS", name, max_diff=0.0)


def check_pick_block(fn: Callable[[list[FreeBlock]], int]) -> CheckResult:
    """Check ``fn(free_blocks) -> block_id``, then let it choose every block a small engine hands out.

    First on six free lists (any plain block is accepted where there is one). Then a fresh ``tiny-py``
    with a pool of 24 blocks of 4 and prefix caching takes every block ``fn`` picks, over three phases
    (two header requests; an unrelated prompt that forces evictions; a header request again): the
    evictions, the tokens each request finds cached and the generated tokens must be the engine's own.
    """
    name = "pick_block"
    result = _check_picks(name, fn)
    if result.status != "PASS":
        return report(result)
    return report(_check_eviction_in_engine(name, fn))
