"""Sampling parameters for one request, with vLLM's field names, defaults and checks."""

import copy
import enum
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

# Temperatures below this are treated as greedy decoding (same threshold as vLLM).
SAMPLING_EPS = 1e-5
# Seeds are signed 64-bit ints, as in vLLM's API (torch's generator takes any 64-bit pattern).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the last output (text, token ids, logprobs)
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingType(enum.IntEnum):
    """How the next token of a request is chosen."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _check_int(name: str, value: Any) -> int:
    # bool is a subclass of int, but n=True is a caller bug, not a count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _check_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise ValueError(f"stop must be a str or a list of str, got {value!r}")
    if any(s == "" for s in value):
        raise ValueError(f"stop must not contain an empty string, got {value!r}")
    return list(value)


def _check_stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ValueError(f"stop_token_ids must be a list of int, got {value!r}")
    if any(t < 0 for t in value):
        raise ValueError(f"stop_token_ids must be >= 0, got {value!r}")
    return list(value)


# OpenAI's range for a logit bias: -100 bans a token in practice, +100 forces it
MAX_LOGIT_BIAS = 100.0


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_logit_bias(value: Any) -> Optional[dict[int, float]]:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
    bias = {}
    for token, b in value.items():
        if not _is_id(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        b = _check_float("logit_bias values", b)
        if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {b} for token {token}")
        bias[token] = b
    return bias


def _check_allowed_token_ids(value: Any) -> Optional[list[int]]:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(_is_id(t) and t >= 0 for t in value):
        raise ValueError("allowed_token_ids must be a list of token ids (ints >= 0), "
                         f"got {value!r}")
    if not value:
        raise ValueError("allowed_token_ids must not be empty (None allows every token)")
    return list(value)


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's StructuredOutputsParams options that pagedllm's grammar backend does not implement:
# refused when set, never silently dropped
_UNSUPPORTED = {"structural_tag": None}
_JSON_ONLY = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a JSON schema, a regex, a choice of strings, a grammar
    (Lark or GBNF) or any JSON object: exactly one of them (vLLM's names)."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_fallback: bool = False  # one grammar backend: nothing to fall back to
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str] = None
    # the request field this came from, for error messages (e.g. "response_format")
    field_name: Optional[str] = None

    def __post_init__(self) -> None:
        given = [k for k in _CONSTRAINTS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{self.field_name or 'structured_outputs'} must set exactly one of "
                             f"{', '.join(_CONSTRAINTS)}; got {', '.join(given) or 'none'}")
        for name, default in _UNSUPPORTED.items():
            if getattr(self, name) != default:
                raise ValueError(f"structured_outputs.{name} is not supported by pagedllm")
        kind = given[0]
        label = self.label
        for name in _JSON_ONLY:
            if getattr(self, name) not in (None, False) and kind not in ("json", "json_object"):
                raise ValueError(f"structured_outputs.{name} applies to json and json_object "
                                 f"constraints, not {kind}")
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (str, dict)):
            raise ValueError(f"{label} must be a JSON schema (an object or its JSON text)")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"{label} must be a non-empty string")
        if kind == "choice" and (not isinstance(value, (list, tuple)) or not value
                                 or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"{label} must be a non-empty list of non-empty strings")
        if kind == "json_object" and value is not True:
            raise ValueError(f"{label} must be true")

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar or json_object."""
        return next(k for k in _CONSTRAINTS if getattr(self, k) not in (None, False))

    @property
    def label(self) -> str:
        """The request field to name in an error about this constraint."""
        return self.field_name or f"structured_outputs.{self.kind}"


@dataclass
class SamplingParams:
    """Decoding options of one request (OpenAI / vLLM semantics)."""

    n: int = 1
    best_of: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: Optional[list[int]] = None  # sample only among these ids
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # OpenAI's predicted output (its `prediction` content): text the answer is expected to
    # repeat, the n-gram source of speculative decoding for this request (pagedllm's; needs
    # an engine with speculative_config)
    prediction: Optional[str] = None

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_penalties()
        self._check_sampling()
        self._check_lengths()
        self._check_flags()
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError("output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or "
                             f"FINAL_ONLY), got {self.output_kind!r}") from None
        self.stop = _check_stop(self.stop)
        self.stop_token_ids = _check_stop_token_ids(self.stop_token_ids)
        self.logit_bias = _check_logit_bias(self.logit_bias)
        self.allowed_token_ids = _check_allowed_token_ids(self.allowed_token_ids)
        if self.prediction is not None and not isinstance(self.prediction, str):
            raise ValueError(f"prediction must be a str (the expected output text), got "
                             f"{type(self.prediction).__name__}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(so).__name__}")
        if self.temperature < SAMPLING_EPS:
            # Greedy: the filters cannot change the argmax, so turn them off.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_counts(self) -> None:
        self.n = _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.best_of is not None:
            self.best_of = _check_int("best_of", self.best_of)
            if self.best_of != self.n:
                # vLLM's V1 engine dropped best_of: generating extra samples to return the
                # best n is not done, so anything but best_of == n would be silently ignored
                raise ValueError(f"best_of must be None or equal to n={self.n} (returning the "
                                 f"best n of more samples is not supported), got {self.best_of}")
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (a signed 64-bit "
                                 f"int), got {self.seed}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )

    def _check_sampling(self) -> None:
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(
                f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}"
            )
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def _check_lengths(self) -> None:
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be None or >= 1, got {self.max_tokens}")
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and _check_int(name, value) < 0:
                raise ValueError(f"{name} must be None or >= 0, got {value}")

    def _check_flags(self) -> None:
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "detokenize",
        ):
            _check_bool(name, getattr(self, name))

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature below SAMPLING_EPS)."""
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        """Greedy, random, or random with a per-request seed."""
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def clone(self) -> "SamplingParams":
        """Deep copy, so per-request edits never leak into a shared params object."""
        return copy.deepcopy(self)
