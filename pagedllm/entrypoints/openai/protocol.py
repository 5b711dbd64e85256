"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields) and their SamplingParams."""
from __future__ import annotations

import json
import logging
import math
from typing import Annotated, Any, Callable, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_BACKENDS = (None, "auto", "guidance", "llguidance")  # pagedllm's one grammar backend

logger = logging.getLogger("pagedllm")

# Fields OpenAI's or vLLM's API defines that pagedllm does not implement: a request that sets
# one (to anything but its neutral value) gets a 400 naming it, never a silent answer without it.
_IS_SET: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": bool, "length_penalty": lambda v: v not in (None, 1, 1.0),
    "early_stopping": bool, "bad_words": bool, "logits_processors": bool,
    "truncate_prompt_tokens": lambda v: v is not None, "priority": lambda v: v not in (None, 0),
    "prompt_embeds": lambda v: v is not None, "mm_processor_kwargs": bool,
    "guided_whitespace_pattern": lambda v: v is not None, "lora_request": bool,
    "kv_transfer_params": bool, "vllm_xargs": bool, "cache_salt": lambda v: v is not None,
    "functions": bool, "function_call": lambda v: v not in (None, "none"),
    "audio": lambda v: v is not None,
    "web_search_options": lambda v: v is not None, "reasoning_effort": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]), "store": bool,
}
# Informational fields of OpenAI's API that change nothing in the answer: accepted quietly.
_INFORMATIONAL = {"user", "metadata", "service_tier"}
MAX_N = 16  # most samples per request (n and best_of)
ROLES = ("system", "user", "assistant", "tool", "developer")
_SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # a torch generator's seed (vLLM's bounds)
_IDS = {"items": {"minimum": 0}}
_TEXT, _TOKENS = {"type": "string", "minLength": 1}, {"type": "array", "minItems": 1,
                                                     "items": {"type": "integer", "minimum": 0}}
# a completion's prompt: a text, texts, token ids, or lists of token ids; none empty
_PROMPTS = [_TEXT, {"type": "array", "minItems": 1, "items": _TEXT}, _TOKENS,
            {"type": "array", "minItems": 1, "items": _TOKENS}]
_TOOLS = {"items": {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
        "parameters": {"type": "object"}}}}}}


def _not_bool(kind: str) -> Callable[[Any], Any]:
    """A before-validator refusing JSON's true and false, which pydantic's lax mode would read
    as 1 and 0."""
    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise PydanticCustomError("bool_number", "must be {kind}, not {value}",
                                      {"kind": kind, "value": json.dumps(value)})
        return value
    return check


# int and float fields that refuse booleans (otherwise lax: "16" and 16.0 are still 16)
Int = Annotated[int, BeforeValidator(_not_bool("an integer"))]
Float = Annotated[float, BeforeValidator(_not_bool("a number"))]


def token_ids_not_bools(value: Any, field: str) -> Any:
    """value, or a 400 naming the boolean a token-id input holds (pydantic would take it as 0/1)."""
    where = _first_bool(value, field)
    if where is not None:
        raise PydanticCustomError("bool_number", "token ids are integers; {where} is a "
                                  "boolean", {"where": where})
    return value


def _first_bool(value: Any, path: str) -> Optional[str]:
    """Where a token-id prompt (a list, or lists) holds a boolean, else None."""
    if isinstance(value, bool):
        return path
    if isinstance(value, list) and path.count("[") < 2:
        for i, item in enumerate(value):
            where = _first_bool(item, f"{path}[{i}]")
            if where is not None:
                return where
    return None


def _described(default: Any = None, **schema: Any) -> Any:
    """A field whose OpenAPI schema also states what the server accepts (ranges, enums), for
    clients and the API fuzz test. The checks themselves stay in SamplingParams and the handlers,
    whose messages name the field."""
    return Field(default, json_schema_extra=schema)


class OpenAIBaseModel(BaseModel):
    """Unknown fields are accepted and ignored with a warning, as vLLM does; fields of OpenAI's or
    vLLM's API that pagedllm does not implement are refused (check_unsupported)."""

    model_config = ConfigDict(extra="allow")

    def check_unsupported(self) -> None:
        """ValueError naming a defined-but-unimplemented field that is set; one warning line
        for fields outside both APIs."""
        extra = self.model_extra or {}
        for name, value in extra.items():
            if name in _IS_SET and _IS_SET[name](value):
                raise ValueError(f"{name} is not supported by pagedllm")
        unknown = sorted(n for n in extra if n not in _IS_SET and n not in _INFORMATIONAL)
        if unknown:
            logger.warning("ignoring request fields outside the OpenAI and vLLM APIs: %s",
                           ", ".join(unknown))


def check_json_values(body: Any) -> None:
    """PydanticCustomError naming the first string that is not valid Unicode (a lone surrogate,
    which JSON's \\ud800 escapes allow and no tokenizer or UTF-8 encoder takes) or number that
    is not finite (Python's JSON parser takes NaN and Infinity). Iterative: a deeply nested body
    cannot exhaust the stack here."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _check_unicode(path, value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise PydanticCustomError("json_number", "{value} is not a finite number",
                                      {"field": path, "value": str(value)})
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_unicode(path, key, " in a key")
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value)
                         if not isinstance(item, int))


def _check_unicode(path: str, text: str, where: str = "") -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise PydanticCustomError(
            "unicode", "a lone surrogate ({code}) at character {pos}{where} is not valid Unicode",
            {"field": path or "body", "code": f"U+{ord(text[err.start]):04X}",
             "pos": err.start, "where": where}) from None


class RequestBody(OpenAIBaseModel):
    """A request's whole body: its strings valid Unicode and its numbers finite, checked before
    the fields (check_json_values)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_json_values(cls, data: Any) -> Any:
        check_json_values(data)
        return data


class StreamOptions(OpenAIBaseModel):
    """stream_options of a streaming request."""

    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False  # usage in every chunk (vLLM)


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format: text, json_object, or json_schema {name, schema, strict}."""

    type: str = "text"
    json_schema: Optional[dict[str, Any]] = None


class SamplingFields(RequestBody):
    """Fields shared by completions and chat completions (OpenAI's and vLLM's extras)."""

    model: Optional[str] = None
    max_tokens: Optional[Int] = _described(minimum=0)
    n: Int = _described(1, minimum=1, maximum=MAX_N)
    best_of: Optional[Int] = _described(
        minimum=1, maximum=MAX_N,
        description="must equal n: returning the best n of more samples is not supported")
    temperature: Optional[float] = _described(minimum=0)
    top_p: Optional[float] = _described(exclusiveMinimum=0, maximum=1)
    # checked here: past a torch generator's range the engine itself would fail on it
    seed: Optional[Int] = Field(None, ge=_SEED_RANGE[0], le=_SEED_RANGE[1])
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = _described(0.0, minimum=-2, maximum=2)
    frequency_penalty: float = _described(0.0, minimum=-2, maximum=2)
    user: Optional[str] = None
    # JSON keys are strings: token ids as text
    logit_bias: Optional[dict[str, Float]] = _described(
        propertyNames={"pattern": "^[0-9]+$"},
        additionalProperties={"type": "number", "minimum": -100, "maximum": 100})
    # vLLM extras
    top_k: Optional[Int] = _described(minimum=-1)
    min_p: Optional[float] = _described(minimum=0, maximum=1)
    repetition_penalty: Optional[float] = _described(exclusiveMinimum=0)
    ignore_eos: bool = False
    min_tokens: Int = _described(0, minimum=0)
    stop_token_ids: Optional[list[Int]] = _described(**_IDS)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Optional[Int] = _described(minimum=0)
    allowed_token_ids: Optional[list[Int]] = _described(minItems=1, **_IDS)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = _described(minLength=1)
    guided_choice: Optional[list[str]] = _described(minItems=1, items={"minLength": 1})
    guided_grammar: Optional[str] = _described(minLength=1)
    guided_decoding_backend: Optional[str] = _described(enum=list(_BACKENDS))
    # OpenAI's predicted outputs: {"type": "content", "content": text or text parts}, the
    # n-gram source of speculative decoding (a server started with --speculative-config)
    prediction: Optional[Any] = None
    # vLLM's response extras
    return_token_ids: bool = False  # prompt_token_ids and each choice's token_ids
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:123"

    def constraint_fields(self) -> list[str]:
        """The output-constraint fields this request sets (response_format other than text,
        structured_outputs, guided_*), in that order."""
        fmt = self.response_format
        given = [name for name in ("structured_outputs", *_GUIDED) if getattr(self, name) is not None]
        return (["response_format"] if fmt is not None and fmt.type != "text" else []) + given

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The one output constraint the request sets, or None; ValueError naming the field."""
        if self.guided_decoding_backend not in _BACKENDS:
            raise ValueError(f"guided_decoding_backend must be one of 'auto', 'guidance' (pagedllm "
                             f"runs llguidance), got {self.guided_decoding_backend!r}")
        given = self.constraint_fields()
        if len(given) > 1:
            raise ValueError(f"{given[0]} cannot be combined with {', '.join(given[1:])}: set one "
                             "output constraint")
        if not given:
            return None
        name = given[0]
        if name == "response_format":
            return _response_format(self.response_format)
        if name == "structured_outputs":
            return _structured_outputs(self.structured_outputs)
        return StructuredOutputsParams(**{_GUIDED[name]: getattr(self, name)}, field_name=name)

    def sampling_params(self, max_tokens: Optional[int], defaults: SamplingParams,
                        logprobs: Optional[int],
                        constraint: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        """SamplingParams for this request; SamplingParams validates every value (400 on error).
        constraint (a tool_choice's) replaces the request's own output constraint."""
        self.check_unsupported()
        def pick(name: str) -> Any:
            value = getattr(self, name)
            return getattr(defaults, name) if value is None else value

        return SamplingParams(
            n=self.n, best_of=self.best_of, temperature=pick("temperature"), top_p=pick("top_p"),
            top_k=pick("top_k"), min_p=pick("min_p"), repetition_penalty=pick("repetition_penalty"),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            max_tokens=max_tokens,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=constraint or self.structured_outputs_params(),
            logit_bias=self.logit_bias_ids(), allowed_token_ids=self.allowed_token_ids,
            prediction=prediction_text(self.prediction),
            # a stream sends what is new at each step; a response needs the whole output
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.CUMULATIVE)

    def logit_bias_ids(self) -> Optional[dict[int, float]]:
        """logit_bias with its JSON string keys ("50256") as token ids; ValueError naming it."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            digits = key.strip().removeprefix("-")
            if not (digits.isascii() and digits.isdigit()):
                raise ValueError(f"logit_bias keys must be integer token ids, got {key!r}")
            bias[int(key)] = value
        return bias


def prediction_text(prediction: Any) -> Optional[str]:
    """OpenAI's `prediction` as its text (None when absent); ValueError naming the field."""
    if prediction is None:
        return None
    if not isinstance(prediction, dict):
        raise ValueError('prediction must be an object {"type": "content", "content": ...}')
    unknown = sorted(set(prediction) - {"type", "content"})
    if unknown:
        raise ValueError(f"prediction has unknown field(s) {', '.join(unknown)}; known: "
                         "content, type")
    if prediction.get("type") != "content":
        raise ValueError(f"prediction.type must be 'content', got {prediction.get('type')!r}")
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            and set(p) == {"type", "text"} for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError('prediction.content must be a string or a non-empty array of '
                     '{"type": "text", "text": ...} parts')


def _response_format(fmt: ResponseFormat) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, field_name="response_format")
    if fmt.type != "json_schema":
        raise ValueError("response_format.type must be 'text', 'json_object' or 'json_schema', "
                         f"got {fmt.type!r}")
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema must be a JSON schema object")
    return StructuredOutputsParams(json=schema, field_name="response_format.json_schema.schema")


def _structured_outputs(fields: Any) -> StructuredOutputsParams:
    if not isinstance(fields, dict):
        raise ValueError("structured_outputs must be an object")
    known = set(StructuredOutputsParams.__dataclass_fields__) - {"field_name"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"structured_outputs has unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    return StructuredOutputsParams(**fields)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        json_schema_extra=lambda schema: schema.update(anyOf=_PROMPTS))
    echo: bool = False
    suffix: Optional[str] = None
    logprobs: Optional[Int] = _described(minimum=0)

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids_not_bools(cls, value: Any) -> Any:
        return token_ids_not_bools(value, "prompt")


class ChatMessage(OpenAIBaseModel):
    """One message of a conversation."""

    role: str = _described(..., enum=list(ROLES))
    # text parts only (serving_chat.conversation)
    content: Optional[Union[str, list[dict[str, Any]]]] = _described(items={
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}})
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's calls
    tool_call_id: Optional[str] = None  # a tool message's answer to that call
    # an assistant's reasoning (vLLM's current name and its older alias), for templates that
    # render it
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = _described(..., minItems=1)
    max_completion_tokens: Optional[Int] = _described(minimum=1)
    logprobs: bool = False
    top_logprobs: Optional[Int] = _described(minimum=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    documents: Optional[list[dict[str, Any]]] = None  # for templates that render them (RAG)
    # OpenAI function tools; checked in chat_tools (400 naming tools / tool_choice)
    tools: Optional[Any] = _described(**_TOOLS)
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    include_reasoning: bool = True  # vLLM's: false drops the reasoning (a parser still splits)


class TokenizeRequest(RequestBody):
    """POST /tokenize: a prompt or chat messages."""

    model_config = ConfigDict(json_schema_extra={
        "anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # also each token's string (vLLM's token_strs)


class DetokenizeRequest(RequestBody):
    """POST /detokenize."""

    model: Optional[str] = None
    tokens: list[Int] = Field(default_factory=list, json_schema_extra=_IDS)
