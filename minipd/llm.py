"""The public entry point, in vLLM's shape: ``LLM(model).generate(prompts, SamplingParams(...))``.

In this first version each request runs through a plain prefill-then-decode loop over a contiguous
KV cache; the engine-core chapters put a paged cache and a continuous-batching scheduler behind
the same calls.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from minipd.config import ModelConfig
from minipd.engine.inputs import PromptInput, check_prompt_ids, normalize_params, normalize_prompts
from minipd.engine.request import Request
from minipd.kv.contiguous import ContiguousKVCache
from minipd.layers.sampler import sample_next_tokens
from minipd.models.loading import load_model
from minipd.outputs import RequestMetrics, RequestOutput, StreamDelta
from minipd.sampling_params import SamplingParams
from minipd.tokenizer import IncrementalDetokenizer, Tokenizer


class LLM:
    """A model ready to generate: a bundled name (``"tiny-py"``), a local HF folder, or a hub id.

    Args:
        model: what to load; an unknown name raises ``ValueError`` listing the bundled models.
        device: ``"cuda"``, ``"cpu"`` or a ``torch.device``; CUDA when present by default.
        dtype: parameter and activation dtype; bf16 on CUDA and fp32 on CPU by default.
        max_model_len: cap on prompt plus output tokens; the model's context length by default.
        seed: seeds the random source of requests that give no ``SamplingParams.seed``.
    """

    def __init__(self, model: str | os.PathLike = "tiny-py", *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, max_model_len: int | None = None,
                 seed: int | None = None) -> None:
        self.model, self.model_path = load_model(model, device=device, dtype=dtype)
        self.config: ModelConfig = self.model.config
        self.device = self.model.embed_tokens.weight.device
        self.dtype = self.model.embed_tokens.weight.dtype
        self.tokenizer = Tokenizer(self.model_path)
        context = self.config.max_position_embeddings
        if max_model_len is not None and not 1 < max_model_len <= context:
            raise ValueError(f"max_model_len must be in [2, {context}] for this model, got {max_model_len}")
        self.max_model_len = max_model_len or context
        eos = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._seed_source = torch.Generator().manual_seed(seed if seed is not None else time.time_ns())
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer requests are encoded and decoded with."""
        return self.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for each prompt; one :class:`RequestOutput` per prompt, in the order given.

        ``prompts`` is one string, one list of token ids, or a list of either. ``sampling_params``
        is one :class:`SamplingParams` for all, or one per prompt. Everything is checked before
        any request runs.
        """
        requests = self._make_requests(prompts, sampling_params)
        show = use_tqdm if use_tqdm is not None else len(requests) >= 8
        outputs = []
        for request in tqdm(requests, desc="generating", disable=not show):
            for _ in self._run(request):
                pass
            outputs.append(request.to_output())
        return outputs

    def stream(self, prompt: PromptInput, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield one :class:`StreamDelta` per generated token, as soon as it is produced."""
        (request,) = self._make_requests([prompt], sampling_params)
        yield from self._run(request)

    def _make_requests(self, prompts, sampling_params) -> list[Request]:
        prompt_list = normalize_prompts(prompts)
        params = normalize_params(sampling_params, len(prompt_list))
        encoded = []
        for i, p in enumerate(prompt_list):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            if isinstance(p, str) and not p:
                raise ValueError(f"prompts[{i}] is an empty string: a prompt needs at least one token")
            check_prompt_ids(i, ids, self.config.vocab_size, self.max_model_len)
            encoded.append((p if isinstance(p, str) else None, ids))
        now = time.perf_counter()
        requests = []
        for (text, ids), p in zip(encoded, params, strict=True):
            seed = p.seed if p.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_source))
            requests.append(Request(
                request_id=str(next(self._request_ids)), prompt=text, prompt_token_ids=ids, params=p,
                generator=torch.Generator(device=self.device).manual_seed(seed),
                detokenizer=IncrementalDetokenizer(self.tokenizer), eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len, metrics=RequestMetrics(arrival_time=now),
            ))
        return requests

    @torch.inference_mode()
    def _run(self, request: Request) -> Iterator[StreamDelta]:
        """Prefill the prompt, then decode one token at a time until the request finishes."""
        cfg = self.config
        cache = ContiguousKVCache(cfg.num_hidden_layers, request.max_total_len, cfg.num_key_value_heads,
                                  cfg.head_dim, dtype=self.dtype, device=self.device)
        request.metrics.first_scheduled_time = time.perf_counter()
        request.metrics.prefill_tokens = len(request.prompt_token_ids)
        tokens = torch.tensor(request.prompt_token_ids, device=self.device)
        positions = torch.arange(len(tokens), device=self.device)
        while True:
            hidden = self.model(tokens, positions, cache)
            logits = self.model.compute_logits(hidden[-1:])
            token_id = int(sample_next_tokens(logits, [request.params], [request.generator])[0])
            delta = request.append_token(token_id, time.perf_counter())
            yield StreamDelta(request.request_id, token_id, delta, request.finish_reason, request.to_output())
            if request.finish_reason is not None:
                return
            tokens = torch.tensor([token_id], device=self.device)
            positions = torch.tensor([cache.length], device=self.device)
