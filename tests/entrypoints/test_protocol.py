"""Request bodies: lone surrogates and non-finite numbers refused naming the field, at any depth
without recursion; the OpenAPI schema's stated ranges are the ones the server enforces."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pagedllm.entrypoints.openai.protocol import (MAX_N, ChatCompletionRequest,
                                                  CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest, check_json_values)
from pagedllm.entrypoints.openai.serving_common import OpenAIError, check_n
from pagedllm.sampling_params import SamplingParams


@pytest.mark.parametrize("body,field,message", [
    ('{"prompt": "a\\ud800"}', "prompt", "lone surrogate (U+D800) at character 1"),
    ('{"prompt": ["ok", "ab\\udfff"]}', "prompt[1]", "(U+DFFF) at character 2"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages[0].content[0].text", "U+D83D"),
    ('{"prompt": "a", "stop": {"x": "\\udc00"}}', "stop.x", "U+DC00"),
    ('{"prompt": "a", "\\ud800": 1}', "body", "in a key"),
    ('{"prompt": "a", "temperature": NaN}', "temperature", "nan is not a finite number"),
    ('{"prompt": "a", "logit_bias": {"5": -Infinity}}', "logit_bias.5", "-inf is not a finite"),
])
def test_invalid_json_values_name_their_field(body, field, message):
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate(json.loads(body))
    error = err.value.errors()[0]
    assert error["ctx"]["field"] == field and message in error["msg"], error


def test_a_paired_surrogate_is_fine():
    assert CompletionRequest.model_validate(json.loads('{"prompt": "\\ud83d\\ude00"}')).prompt \
        == "\U0001F600"


def test_every_request_body_is_checked():
    for model, body in ((ChatCompletionRequest, {"messages": [], "user": "\ud800"}),
                        (TokenizeRequest, {"prompt": "\ud800"}),
                        (DetokenizeRequest, {"model": "\ud800"})):
        with pytest.raises(ValidationError, match="lone surrogate"):
            model.model_validate(body)


def test_deep_nesting_is_walked_without_recursion():
    deep: object = "\ud800"
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(Exception) as err:
        check_json_values({"x": deep})
    assert "lone surrogate" in str(err.value) and not isinstance(err.value, RecursionError)


def _stated_ranges():
    """(field, lowest accepted, highest accepted, below, above) from the served schema."""
    props = CompletionRequest.model_json_schema()["properties"]
    for name, spec in sorted(props.items()):
        low = spec.get("minimum", spec.get("exclusiveMinimum"))
        high = spec.get("maximum")
        if low is None and high is None or name in ("seed", "max_tokens", "logprobs",
                                                     "prompt_logprobs", "best_of"):
            continue  # pydantic's own check; 0 only with echo; the engine's max_logprobs;
            # best_of must equal n
        step = 1 if "integer" in json.dumps(spec) else 1e-6
        lowest = None if low is None else low + (step if "exclusiveMinimum" in spec else 0)
        yield name, lowest, high, None if low is None else lowest - step, \
            None if high is None else high + step


def _accepted(name, value) -> bool:
    req = CompletionRequest(prompt="x", **{name: value})
    try:
        check_n(req.n, req.best_of)
        req.sampling_params(max(16, req.min_tokens), SamplingParams(), req.logprobs)
    except (ValueError, OpenAIError):
        return False
    return True


@pytest.mark.parametrize("name,lowest,highest,below,above", list(_stated_ranges()))
def test_the_schema_states_the_ranges_the_server_enforces(name, lowest, highest, below, above):
    for inside in (lowest, highest):
        if inside is not None:
            assert _accepted(name, inside), (name, inside)
    for outside in (below, above):
        if outside is not None:
            assert not _accepted(name, outside), (name, outside)


def test_stated_n_limit_is_max_n():
    props = CompletionRequest.model_json_schema()["properties"]
    assert props["n"]["maximum"] == props["best_of"]["maximum"] == MAX_N
