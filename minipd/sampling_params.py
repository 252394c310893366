"""How one request is decoded: :class:`SamplingParams`, in the shape vLLM users know."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from minipd.errors import ParameterError

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
        raise ParameterError(name, f"{name} must be None or an integer in [-2**63, 2**64 - 1] (a 64-bit seed), "
                                   f"got {seed!r}")
    return int(seed)


@dataclass
class SamplingParams:
    """Decoding settings for one request, checked when constructed.

    Every field is checked here, so a bad value is a :class:`~minipd.errors.ParameterError` (a
    ``ValueError``) naming the field in its ``param`` before any request is queued. Bools are
    refused wherever a number is expected (Python would read True as 1);
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
        n: completions per prompt; only 1 (send a prompt several times, with different seeds, for more).
        min_tokens: generate at least this many tokens before an end-of-sequence or stop token may end
            the request (those tokens are masked until then; stop strings still apply).
        presence_penalty: subtracted from the logit of every token that already appears in the output
            (OpenAI's and vLLM's meaning), in [-2, 2]; positive values favour new tokens.
        frequency_penalty: subtracted once per earlier occurrence in the output, in [-2, 2].
        repetition_penalty: HF's and vLLM's: a token seen in the prompt or the output has a positive
            logit divided by it and a negative one multiplied by it; 1 is off, > 1 discourages repeats.
        include_stop_str_in_output: keep the stop string that ended the request at the end of the text.
        skip_special_tokens: leave special tokens (end-of-sequence, ...) out of the text.

    Penalties change the distribution sampled from (and the greedy choice); ``logprobs`` stay those of
    the model's raw distribution.
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
    n: int = 1
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not is_real(self.temperature) or self.temperature < 0:
            raise ParameterError("temperature", "temperature must be a finite number >= 0 (0 means greedy), "
                                                f"got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if not is_integer(self.top_k) or self.top_k < -1 or self.top_k == 0 or self.top_k > TOP_K_MAX:
            raise ParameterError("top_k", "top_k must be -1 (all tokens) or a positive integer below 2**63, "
                                          f"got {self.top_k!r}")
        self.top_k = int(self.top_k)
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ParameterError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_p = float(self.top_p)
        if not is_integer(self.max_tokens) or self.max_tokens < 1:
            raise ParameterError("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        self.max_tokens = int(self.max_tokens)
        if not isinstance(self.ignore_eos, bool):
            raise ParameterError("ignore_eos", f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        self.seed = check_seed("seed", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_integer(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ParameterError(name, f"{name} must be None or an integer in [0, {MAX_LOGPROBS}] (how many top "
                                 f"tokens besides the chosen one), got {value!r}")
            setattr(self, name, None if value is None else int(value))
        self._stop_list = self._check_stop(self.stop)
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or not all(is_integer(t) and t >= 0 for t in ids):
                raise ParameterError("stop_token_ids", "stop_token_ids must be None or a list of non-negative "
                                                         f"integers, got {ids!r}")
            self.stop_token_ids = [int(t) for t in ids]
        if self.n != 1 or not is_integer(self.n):
            raise ParameterError("n", f"n must be 1 (one completion per request; send the prompt again, with "
                                      f"another seed, for more), got {self.n!r}")
        if not is_integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ParameterError("min_tokens", f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                                               f"got {self.min_tokens!r}")
        self.min_tokens = int(self.min_tokens)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not -2 <= value <= 2:
                raise ParameterError(name, f"{name} must be a number in [-2, 2], got {value!r}")
            setattr(self, name, float(value))
        if not is_real(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ParameterError("repetition_penalty", "repetition_penalty must be a finite number > 0 (1 is off), "
                                                       f"got {self.repetition_penalty!r}")
        self.repetition_penalty = float(self.repetition_penalty)
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterError(name, f"{name} must be True or False, got {getattr(self, name)!r}")

    @staticmethod
    def _check_stop(stop: object) -> list[str]:
        """``stop`` as a list of non-empty strings, or ``ValueError`` naming the field."""
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        # An empty stop string would match at once and end every request with no text.
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise ParameterError("stop", f"stop must be None, a non-empty string or a list of them, got {stop!r}")
        return list(stops)

    @property
    def has_penalties(self) -> bool:
        """Whether the logits need changing before sampling (a penalty, or ``min_tokens`` still to reach)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.min_tokens)

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list."""
        return self._stop_list
