"""Turns a scheduled batch into flat tensors once per step, runs the model, and samples.

Every token of the step goes into one flat batch (decodes first, then prefill chunks) with its
position and the pool slot its K/V go to; attention learns from the block tables which slots
each query may read. Python work here is per sequence, never per token.
"""

from __future__ import annotations

import torch

from minipd.engine.request import Request
from minipd.engine.scheduler import ScheduledBatch
from minipd.kernels.backend import KernelBackend
from minipd.kv.paged_cache import PagedAttentionMetadata, PagedKVCache
from minipd.kv.paged_pool import PagedKVPool
from minipd.layers.sampler import sample_next_tokens
from minipd.models.decoder import DecoderModel


def _padded(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    # Padding points at block 0: a valid index, never read because it lies past the context length.
    rows = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(tables), width)


class ModelRunner:
    """Runs one step of the model over the paged pool for a :class:`ScheduledBatch`."""

    def __init__(self, model: DecoderModel, pool: PagedKVPool, kernels: KernelBackend) -> None:
        self.model = model
        self.pool = pool
        self.kernels = kernels
        self.device = model.embed_tokens.weight.device
        model.set_kernels(kernels)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata,
                                                      list[Request], list[int]]:
        """Flat token ids, positions and attention metadata; the requests to sample and their rows."""
        bs = self.pool.block_size
        decodes = [(r, n) for r, n in batch.entries if n == 1]
        prefills = [(r, n) for r, n in batch.entries if n > 1]
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        to_sample: list[Request] = []
        rows: list[int] = []
        decode_positions: list[int] = []
        decode_slots: list[int] = []
        for i, (r, _) in enumerate(decodes):
            pos = r.num_computed_tokens
            ids.append(r.all_token_ids[pos])
            decode_positions.append(pos)
            decode_slots.append(r.blocks.block_table[pos // bs] * bs + pos % bs)
            if pos + 1 == r.num_tokens:
                to_sample.append(r)
                rows.append(i)
        positions.append(torch.tensor(decode_positions, dtype=torch.long))
        slots.append(torch.tensor(decode_slots, dtype=torch.long))
        query_start = [0]
        for r, n in prefills:
            start = r.num_computed_tokens
            ids.extend(r.all_token_ids[start:start + n])
            pos = torch.arange(start, start + n)
            table = torch.tensor(r.blocks.block_table, dtype=torch.long)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            query_start.append(query_start[-1] + n)
            if start + n == r.num_tokens:
                to_sample.append(r)
                rows.append(len(decodes) + query_start[-1] - 1)
        dev = self.device
        metadata = PagedAttentionMetadata(
            num_decode_tokens=len(decodes),
            slot_mapping=torch.cat(slots).to(dev),
            decode_block_tables=_padded([r.blocks.block_table for r, _ in decodes], dev),
            decode_context_lens=torch.tensor([p + 1 for p in decode_positions], dtype=torch.int32, device=dev),
            prefill_block_tables=_padded([r.blocks.block_table for r, _ in prefills], dev),
            prefill_query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor([r.num_computed_tokens + n for r, n in prefills], dtype=torch.int32,
                                              device=dev),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return input_ids, torch.cat(positions).to(dev), metadata, to_sample, rows

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Request], list[int]]:
        """Compute the batch's tokens into the cache; return the requests that got a new token, and the tokens."""
        input_ids, positions, metadata, to_sample, rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, PagedKVCache(self.pool, metadata, self.kernels))
        if not to_sample:
            return [], []
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        tokens = sample_next_tokens(logits, [r.params for r in to_sample], [r.generator for r in to_sample])
        return to_sample, tokens.tolist()
