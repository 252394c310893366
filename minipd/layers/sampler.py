"""Turning logits into the next token: penalties, then greedy, temperature, top-k and top-p (nucleus) sampling."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from minipd.sampling_params import SamplingParams


def top_k_top_p_filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and outside its top-p nucleus.

    ``top_k`` (B,) uses -1 for "all tokens"; ``top_p`` (B,) keeps the smallest set of most likely
    tokens whose probabilities sum to at least ``top_p`` (the most likely token always stays).
    Rows with ``top_k == -1`` and ``top_p == 1`` come back unchanged.
    """
    vocab = logits.shape[-1]
    use_k, use_p = top_k > 0, top_p < 1
    if not bool((use_k | use_p).any()):
        return logits  # nothing to filter: skip the sort
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(use_k, top_k, vocab).to(logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    if bool(use_p.any()):
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p == 1 keep everything, whatever float rounding does to the cumulative sum.
        cut = (mass_before >= top_p.to(logits.device)[:, None]) & use_p.to(logits.device)[:, None]
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                    outputs: Sequence[Sequence[int]], eos_token_ids: Sequence[Collection[int]]) -> torch.Tensor:
    """The logits (B, V) each row samples from after its request's penalties (a copy; rows without any
    are unchanged), as vLLM applies them:

    - ``repetition_penalty`` (HF's ``RepetitionPenaltyLogitsProcessor``): every token of the prompt or
      the output has a positive logit divided by it, a negative one multiplied by it;
    - ``frequency_penalty`` / ``presence_penalty`` (OpenAI's): minus ``frequency * count + presence``
      for every token the output already holds ``count > 0`` times;
    - ``min_tokens`` (HF's ``MinNewTokensLengthLogitsProcessor``): while the output is shorter, the
      end-of-sequence tokens (unless ``ignore_eos``) and ``stop_token_ids`` cannot be chosen.
    """
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    logits = logits.float().clone()
    vocab, device = logits.shape[-1], logits.device
    for i in rows:
        p, row = params[i], logits[i]
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted({*prompts[i], *outputs[i]}), dtype=torch.long, device=device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and len(outputs[i]):
            counts = torch.bincount(torch.tensor(outputs[i], dtype=torch.long, device=device), minlength=vocab)
            counts = counts[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if len(outputs[i]) < p.min_tokens:
            banned = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_token_ids[i]))
            banned = {t for t in banned if t < vocab}
            if banned:
                row[torch.tensor(sorted(banned), dtype=torch.long, device=device)] = float("-inf")
    return logits


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """The distribution one request samples from, for a (V,) or (B, V) logits tensor (temperature > 0)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to define a distribution (0 is greedy), got {temperature}")
    rows = logits.reshape(-1, logits.shape[-1]).float() / temperature
    n = rows.shape[0]
    filtered = top_k_top_p_filter(rows, torch.full((n,), top_k), torch.full((n,), float(top_p)))
    return filtered.softmax(dim=-1).reshape(logits.shape)


#: Mixing constants (from PCG / splitmix64) that spread (seed, offset) pairs over 64-bit generator seeds.
_MULTIPLIER, _INCREMENT, _MASK64 = 6364136223846793005, 1442695040888963407, (1 << 64) - 1


def token_seed(seed: int, offset: int) -> int:
    """The generator seed for the ``offset``-th sampled token of a request seeded with ``seed``.

    Each token's randomness depends only on (seed, offset), not on a generator's history, so a
    request's sampling can resume anywhere: after a preemption, in another process, on another worker.
    """
    return ((seed & _MASK64) * _MULTIPLIER + (offset + 1) * _INCREMENT) & _MASK64


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    offsets: Sequence[int],
) -> torch.Tensor:
    """One next token per row of ``logits`` (B, V), each row under its own parameters.

    Row ``i`` draws its randomness from ``token_seed(seeds[i], offsets[i])``. Sampling uses the
    exponential-race form of a categorical draw (argmax of p / Exp(1)), which needs no CPU
    synchronisation and gives the same token for the same seed and offset.
    """
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not sampled_rows:
        return greedy
    idx = torch.tensor(sampled_rows, device=logits.device)
    rows = logits[idx] / torch.tensor([params[i].temperature for i in sampled_rows],
                                      device=logits.device)[:, None]
    top_k = torch.tensor([params[i].top_k for i in sampled_rows])
    top_p = torch.tensor([params[i].top_p for i in sampled_rows])
    probs = top_k_top_p_filter(rows, top_k, top_p).softmax(dim=-1)
    noise = torch.empty_like(probs)
    generator = torch.Generator(device=logits.device)
    for j, i in enumerate(sampled_rows):
        noise[j].exponential_(generator=generator.manual_seed(token_seed(seeds[i], offsets[i])))
    greedy[idx] = (probs / noise).argmax(dim=-1)
    return greedy
