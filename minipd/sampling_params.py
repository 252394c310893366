"""How one request is decoded: :class:`SamplingParams`, in the shape vLLM users know."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

#: Seeds go to ``torch.Generator.manual_seed``, which takes anything that fits a signed or an
#: unsigned 64-bit integer (a negative seed wraps: -1 and 2**64 - 1 give the same tokens).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
#: The most top tokens ``logprobs``/``prompt_logprobs`` may ask for (vLLM's default limit).
MAX_LOGPROBS = 20
#: top_k becomes an int64 tensor in the sampler, so it must fit a signed 64-bit integer.
TOP_K_MAX = 2**63 - 1


def is_integer(value: object) -> bool:
    """True for Python and NumPy integers; False for bools, which Python counts as integers."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """True for finite real numbers (Python or NumPy); False for bools, NaN and infinities."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_seed(name: str, seed: object) -> int | None:
    """``seed`` as a plain int (or None); ``ValueError`` naming ``name`` when it is not a 64-bit integer."""
    if seed is None:
        return None
    if not is_integer(seed) or not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"{name} must be None or an integer in [-2**63, 2**64 - 1] (a 64-bit seed), got {seed!r}")
    return int(seed)


@dataclass
class SamplingParams:
    """Decoding settings for one request, checked when constructed.

    Every field is checked here, so a bad value is a ``ValueError`` naming the field before any
    request is queued. Bools are refused wherever a number is expected (Python would read True as 1);
    NumPy numbers are accepted and stored as plain Python ones.

    Args:
        temperature: divides the logits before softmax; 0 means greedy (always the most likely token).
        top_k: sample only among the k most likely tokens; -1 means all of them. A k larger than the
            vocabulary is allowed and means all tokens; it must fit a signed 64-bit integer.
        top_p: sample from the smallest set of most likely tokens whose probability reaches top_p.
        max_tokens: the most new tokens to generate (at least 1).
        stop: strings that end generation when they appear in the text; they are not returned.
        stop_token_ids: token ids that end generation, besides the model's end-of-sequence tokens.
        ignore_eos: keep generating past end-of-sequence tokens (for benchmarks with fixed lengths).
        seed: with the same seed, sampling gives the same tokens; None draws a fresh seed. Any integer
            in [-2**63, 2**64 - 1]; negative seeds wrap modulo 2**64, as in ``torch.manual_seed``.
        logprobs: return, for every generated token, its log-probability and those of the ``logprobs``
            most likely tokens (0: the generated token's only), from the model's raw distribution
            (log-softmax of the logits, before temperature or top-k/top-p); None: none.
        prompt_logprobs: the same for every prompt token after the first (None for the first);
            a request that asks for them skips the prefix cache, since cached tokens are not computed.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if not is_integer(self.top_k) or self.top_k < -1 or self.top_k == 0 or self.top_k > TOP_K_MAX:
            raise ValueError(f"top_k must be -1 (all tokens) or a positive integer below 2**63, got {self.top_k!r}")
        self.top_k = int(self.top_k)
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_p = float(self.top_p)
        if not is_integer(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        self.max_tokens = int(self.max_tokens)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        self.seed = check_seed("seed", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_integer(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}] (how many top "
                                 f"tokens besides the chosen one), got {value!r}")
            setattr(self, name, None if value is None else int(value))
        self._stop_list = self._check_stop(self.stop)
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or not all(is_integer(t) and t >= 0 for t in ids):
                raise ValueError(f"stop_token_ids must be None or a list of non-negative integers, got {ids!r}")
            self.stop_token_ids = [int(t) for t in ids]

    @staticmethod
    def _check_stop(stop: object) -> list[str]:
        """``stop`` as a list of non-empty strings, or ``ValueError`` naming the field."""
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        # An empty stop string would match at once and end every request with no text.
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be None, a non-empty string or a list of them, got {stop!r}")
        return list(stops)

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list."""
        return self._stop_list
