"""How one request is decoded: :class:`SamplingParams`, in the shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Decoding settings for one request, checked when constructed.

    Args:
        temperature: divides the logits before softmax; 0 means greedy (always the most likely token).
        top_k: sample only among the k most likely tokens; -1 means all of them.
        top_p: sample from the smallest set of most likely tokens whose probability reaches top_p.
        max_tokens: the most new tokens to generate (at least 1).
        stop: strings that end generation when they appear in the text; they are not returned.
        stop_token_ids: token ids that end generation, besides the model's end-of-sequence tokens.
        ignore_eos: keep generating past end-of-sequence tokens (for benchmarks with fixed lengths).
        seed: with the same seed, sampling gives the same tokens; None draws a fresh seed.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (all tokens) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self._stop_list = stops
        ids = self.stop_token_ids or []
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding always takes the most likely token."""
        return self.temperature == 0

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list."""
        return self._stop_list
