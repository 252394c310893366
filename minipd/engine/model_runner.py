"""Turns a scheduled batch into flat tensors once per step, runs the model, and samples.

Every token of the step goes into one flat batch (decodes first, then prefill chunks) with its
position and the pool slot its K/V go to; attention learns from the block tables which slots
each query may read. Python work here is per sequence, never per token.

The step's inputs are written into buffers allocated once (pinned on CUDA, so the copy to the GPU
is asynchronous) instead of ~9 tensors built from Python lists every step, and every length a
kernel needs is also kept as a Python list, so no layer waits for a device-to-host copy.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from minipd.engine.request import Request
from minipd.engine.scheduler import ScheduledBatch
from minipd.engine.step_core import StepResult
from minipd.kernels.backend import KernelBackend
from minipd.kv.paged_cache import PagedAttentionMetadata, PagedKVCache
from minipd.kv.paged_pool import PagedKVPool
from minipd.kv.residual import ResidualWindow
from minipd.layers.sampler import apply_penalties, sample_next_tokens
from minipd.models.decoder import DecoderModel
from minipd.models.forward_context import ForwardContext

if TYPE_CHECKING:
    from minipd.engine.compiled_decode import CompiledDecode

logger = logging.getLogger("minipd")


class InputBuffers:
    """Host buffers for one step's inputs, sized for the largest step the scheduler can make."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        pin = device.type == "cuda"

        def host(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self.device = device
        self.input_ids = host(max_tokens)
        self.positions = host(max_tokens)
        self.slot_mapping = host(max_tokens)
        # Flat, so each step's (rows, width) table is one contiguous slice: a pinned, asynchronous copy.
        self.block_tables = host(max_seqs * max_blocks_per_seq, dtype=torch.int32)
        self.context_lens = host(max_seqs, dtype=torch.int32)
        self.query_start = host(max_seqs + 1, dtype=torch.int32)
        # numpy views of the same memory: filling them from Python lists is much cheaper than torch indexing.
        self.np = {name: getattr(self, name).numpy() for name in
                   ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "query_start")}
        # Recorded after a step's copies are queued: the next step may refill the buffers only once the
        # GPU has read them (a step that samples nothing returns without any other synchronisation).
        self._copied = torch.cuda.Event() if pin else None

    def wait_until_free(self) -> None:
        """Block until the previous step's asynchronous copies out of these buffers are done."""
        if self._copied is not None:
            self._copied.synchronize()

    def mark_copied(self) -> None:
        """Note that this step's copies are queued (see :meth:`wait_until_free`)."""
        if self._copied is not None:
            self._copied.record()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A slice of a host buffer on the model's device (the slice itself on CPU: no copy)."""
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)


def top_logprobs(row: torch.Tensor, chosen: int, k: int) -> dict[int, float]:
    """The chosen token's log-probability and the ``k`` highest ones, from a (V,) log-softmax row."""
    found = {chosen: row[chosen].item()}
    if k:
        values, ids = row.topk(k)
        for value, token in zip(values.tolist(), ids.tolist(), strict=True):
            found.setdefault(token, value)
    return found


class ModelRunner:
    """Runs one step of the model over the paged pool for a :class:`ScheduledBatch`."""

    def __init__(self, model: DecoderModel, pool: PagedKVPool, kernels: KernelBackend, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, *,
                 attention_observer: Callable[..., None] | None = None) -> None:
        self.model = model
        self.pool = pool
        self.kernels = kernels
        self.device = model.embed_tokens.weight.device
        max_blocks = -(-max_model_len // pool.block_size)
        self.buffers = InputBuffers(max_num_batched_tokens, max_num_seqs, max_blocks, self.device)
        #: Called as ``layer_hook(batch, layer)`` once each layer's K/V of a step are stored (layer-wise KV transfer).
        self.layer_hook: Callable[[ScheduledBatch, int], None] | None = None
        #: Called as ``attention_observer(batch, layer, q, k_cache, scale)`` before each layer attends
        #: (token eviction by received attention). A hook given by whoever builds the runner.
        self.attention_observer = attention_observer
        #: A KIVI cache's filling blocks, kept in full precision (None for every other format).
        self.residual = ResidualWindow(pool) if pool.spec.has_residual_window else None
        #: The compiled static-shape decode step (``compile_decode=True``), used for the steps it covers.
        self.compiled: CompiledDecode | None = None

    def compiled_bucket(self, batch: ScheduledBatch) -> tuple[int, int] | None:
        """The bucket the compiled decode step runs ``batch`` in, or None when the step must run eagerly:
        a prefill chunk, a row that samples nothing, prompt log-probabilities, a layer hook, an attention observer
        the program keeps no queries for, or too big."""
        if self.compiled is None or self.layer_hook is not None:
            return None
        if self.attention_observer is not None and not self.compiled.keep_queries:
            return None
        width = 0
        for r, n in batch.entries:
            if n != 1 or r.num_computed_tokens + 1 != r.num_tokens or r.params.prompt_logprobs is not None:
                return None
            width = max(width, len(r.blocks.block_table))
        return self.compiled.buckets_for(len(batch.entries), width)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata,
                                                      list[Request], list[int]]:
        """Flat token ids, positions and attention metadata; the requests to sample and their rows."""
        bs = self.pool.block_size
        self.buffers.wait_until_free()
        buf = self.buffers.np
        ids, pos, slots = buf["input_ids"], buf["positions"], buf["slot_mapping"]
        tables, lens, starts = buf["block_tables"], buf["context_lens"], buf["query_start"]
        # A kernel choice, not the definition of a decode (that is Request.is_decode): any one-query row is
        # the last token of its context, which is exactly what the decode kernel computes.
        decodes = [(r, n) for r, n in batch.entries if n == 1]
        prefills = [(r, n) for r, n in batch.entries if n > 1]
        num_decode, num_prefill = len(decodes), len(prefills)
        decode_width = max((len(r.blocks.block_table) for r, _ in decodes), default=0)
        prefill_width = max((len(r.blocks.block_table) for r, _ in prefills), default=0)
        decode_end = num_decode * decode_width
        decode_tables = tables[:decode_end].reshape(num_decode, decode_width)
        prefill_tables = tables[decode_end:decode_end + num_prefill * prefill_width].reshape(num_prefill,
                                                                                           prefill_width)
        to_sample: list[Request] = []
        rows: list[int] = []
        decode_lens: list[int] = []
        window = self.residual
        if window is not None:
            window.begin_step()
        for i, (r, _) in enumerate(decodes):
            p = r.num_computed_tokens
            # A token's cache index is its position less the tokens evicted before it.
            c = p - r.blocks.num_dropped_tokens
            table = r.blocks.block_table
            ids[i] = r.all_token_ids[p]
            pos[i] = p
            decode_tables[i, :len(table)] = table
            decode_tables[i, len(table):] = 0  # padding must be a valid id for every view of the pool
            if window is None:
                slots[i] = table[c // bs] * bs + c % bs
            else:
                slots[i:i + 1], tail = window.place(r, table, c, 1, i)
                if tail is not None:
                    decode_tables[i, tail[0]] = tail[1]
            decode_lens.append(c + 1)
            if r.samples_after(1):
                to_sample.append(r)
                rows.append(i)
        lens[:num_decode] = decode_lens
        offset = num_decode
        query_start = [0]
        prefill_lens: list[int] = []
        for j, (r, n) in enumerate(prefills):
            p = r.num_computed_tokens
            c = p - r.blocks.num_dropped_tokens
            table = r.blocks.block_table
            ids[offset:offset + n] = r.all_token_ids[p:p + n]
            pos[offset:offset + n] = np.arange(p, p + n)
            prefill_tables[j, :len(table)] = table
            prefill_tables[j, len(table):] = 0
            if window is None:
                cache_index = np.arange(c, c + n)
                slots[offset:offset + n] = np.asarray(table)[cache_index // bs] * bs + cache_index % bs
            else:
                slots[offset:offset + n], tail = window.place(r, table, c, n, offset)
                if tail is not None:
                    prefill_tables[j, tail[0]] = tail[1]
            offset += n
            query_start.append(query_start[-1] + n)
            prefill_lens.append(c + n)
            if r.samples_after(n):
                to_sample.append(r)
                rows.append(offset - 1)
        lens[num_decode:num_decode + num_prefill] = prefill_lens
        starts[:num_prefill + 1] = query_start
        b = self.buffers
        dev = b.to_device
        metadata = PagedAttentionMetadata(
            num_decode_tokens=num_decode,
            slot_mapping=dev(b.slot_mapping[:offset]),
            decode_block_tables=dev(b.block_tables[:decode_end].view(num_decode, decode_width)),
            decode_context_lens=dev(b.context_lens[:num_decode]),
            prefill_block_tables=dev(b.block_tables[decode_end:decode_end + num_prefill * prefill_width]
                                     .view(num_prefill, prefill_width)),
            prefill_query_start_loc=dev(b.query_start[:num_prefill + 1]),
            prefill_context_lens=dev(b.context_lens[num_decode:num_decode + num_prefill]),
            decode_context_lens_host=decode_lens,
            prefill_query_start_host=query_start,
            prefill_context_lens_host=prefill_lens,
        )
        input_ids, positions = dev(b.input_ids[:offset]), dev(b.positions[:offset])
        if window is not None:
            window.plan()
        b.mark_copied()
        return input_ids, positions, metadata, to_sample, rows

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Compute the batch's tokens into the cache; return the requests that got a new token, the tokens,
        and the log-probabilities asked for."""
        adaptive = hasattr(self.pool, "compressed_layer")
        if adaptive:  # full-precision requests' rows first, then compressed ones (decodes, then prefills, each)
            batch.entries.sort(key=lambda entry: bool(entry[0].blocks.compressed))
        bucket = self.compiled_bucket(batch)
        try:
            input_ids, positions, metadata, to_sample, rows = self.prepare(batch)
            if bucket is not None and self.compiled is not None:
                try:
                    # Every row is a decode that samples: the logits come out in row order.
                    compressed = sum(1 for r, _ in batch.entries if r.blocks.compressed) if adaptive else 0
                    logits = self.compiled.run(input_ids, positions, metadata.decode_block_tables,
                                               metadata.decode_context_lens, metadata.slot_mapping, bucket,
                                               compressed_rows=compressed)
                    if self.attention_observer is not None:
                        self.compiled.observe(functools.partial(self.attention_observer, batch))
                    return self._sample(to_sample, logits, {})
                except torch._dynamo.exc.FailOnRecompileLimitHit as err:
                    # Nothing was written yet (the program stores K/V after it returns): go on eagerly.
                    logger.warning("compile_decode turned off: the compiler refused another program (%s)", err)
                    self.compiled = None
            hook = None if self.layer_hook is None else functools.partial(self.layer_hook, batch)
            observer = None if self.attention_observer is None else functools.partial(self.attention_observer, batch)
            parts = None
            if adaptive:
                full = [n for r, n in batch.entries if not r.blocks.compressed]
                parts = metadata.split(sum(1 for n in full if n == 1), sum(1 for n in full if n > 1))
            context = ForwardContext(PagedKVCache(self.pool, metadata, self.kernels, hook, observer, parts),
                                     self.kernels)
            hidden = self.model(input_ids, positions, context)
        finally:
            if self.residual is not None:
                self.residual.end_step()
        prompt_logprobs = self._prompt_logprobs(batch, hidden)
        if not to_sample:
            return StepResult([], [], [], prompt_logprobs)
        last = hidden[rows[0]:rows[0] + 1] if len(rows) == 1 else hidden[torch.tensor(rows, device=self.device)]
        return self._sample(to_sample, self.model.compute_logits(last), prompt_logprobs)

    def _sample(self, to_sample: list[Request], logits: torch.Tensor,
                prompt_logprobs: dict[str, list[dict[int, float]]]) -> StepResult:
        """Next tokens (and the log-probabilities asked for) from the sampled rows' logits.

        Penalties shape what is sampled; log-probabilities are those of the raw logits."""
        params = [r.params for r in to_sample]
        if any(p.has_penalties for p in params):
            chosen_from = apply_penalties(logits, params, [r.prompt_token_ids for r in to_sample],
                                          [r.output_token_ids for r in to_sample],
                                          [r.eos_token_ids for r in to_sample])
        else:
            chosen_from = logits
        tokens = sample_next_tokens(chosen_from, params, [r.seed for r in to_sample],
                                    [r.sampling_offset for r in to_sample]).tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(to_sample)
        wanted = [i for i, r in enumerate(to_sample) if r.params.logprobs is not None]
        if wanted:
            table = logits[torch.tensor(wanted, device=logits.device)].float().log_softmax(dim=-1)
            for row, i in enumerate(wanted):
                logprobs[i] = top_logprobs(table[row], tokens[i], to_sample[i].params.logprobs)
        return StepResult(to_sample, tokens, logprobs, prompt_logprobs)

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor) -> dict[str, list[dict[int, float]]]:
        """For requests asking for ``prompt_logprobs``: each prompt token computed this step, scored by the
        logits of the position before it. Rows follow :meth:`prepare`'s order: decodes, then prefills."""
        found: dict[str, list[dict[int, float]]] = {}
        decode_row, offset = 0, sum(1 for _, n in batch.entries if n == 1)
        for r, n in batch.entries:
            if n == 1:  # one-query rows come first (a one-token prompt chunk among them)
                start, decode_row = decode_row, decode_row + 1
            else:
                start, offset = offset, offset + n
            p = r.num_computed_tokens
            # Row p + i predicts token p + i + 1; keep the prompt tokens not reported before.
            first, end = max(p, r.num_prompt_logprobs_done - 1), min(p + n, r.num_prompt_tokens - 1)
            if r.params.prompt_logprobs is not None and first < end:
                table = self.model.compute_logits(hidden[start + first - p:start + end - p]).float().log_softmax(-1)
                targets = r.all_token_ids[first + 1:end + 1]
                found[r.request_id] = [top_logprobs(table[i], t, r.params.prompt_logprobs)
                                       for i, t in enumerate(targets)]
        return found
