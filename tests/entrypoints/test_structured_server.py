"""Structured outputs through the server with the official openai client: response_format (and
the client's parse()), vLLM's structured_outputs and guided_* fields, streamed and not, and a
400 naming the field for every invalid constraint."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from pydantic import BaseModel, ConfigDict, Field

from conftest import API_KEY, MODEL

DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
MESSAGES = [{"role": "user", "content": "Tell me about a city as JSON."}]


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false
    name: str = Field(max_length=24)
    population: int
    coastal: bool


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model=MODEL, messages=MESSAGES,
                                               response_format=City, temperature=0,
                                               max_tokens=120)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)


def test_json_schema_at_n3_streamed_and_not(client):
    schema = City.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    extra = {"seed": 5}
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, temperature=0.7,
                                           max_tokens=200, response_format=fmt, extra_body=extra)
    texts = [c.message.content for c in plain.choices]
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, temperature=0.7,
                                            max_tokens=200, response_format=fmt, stream=True,
                                            extra_body=extra)
    streamed = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts  # the same seeds, the same constrained samples
    assert [c.finish_reason for c in plain.choices] == ["stop"] * 3, texts
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_json_object_guided_fields_and_structured_outputs(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                         max_tokens=60, response_format={"type": "json_object"})
    text = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # any object: the model may go on past max_tokens; what came is an object's start
        assert out.choices[0].finish_reason == "length" and text.lstrip().startswith("{"), text
    regex = client.completions.create(model=MODEL, prompt="Today's date is", max_tokens=20,
                                      n=3, temperature=1.0, extra_body={"guided_regex": DATE})
    assert all(re.fullmatch(DATE, c.text) for c in regex.choices)
    choice = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5,
                                       extra_body={"guided_choice": ["blue", "grey"]})
    assert choice.choices[0].text in ("blue", "grey")
    grammar = client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= ("yes" | "no") "!"'}})
    assert grammar.choices[0].text in ("yes!", "no!")


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "("}, "guided_regex"),
    ({"structured_outputs": {"regex": "["}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
])
def test_invalid_constraints_are_400_naming_the_field(client, body, param):
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       extra_body=body)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body


# characters SmolLM2's vocabulary cannot write, written as escapes: each stopped its request
# mid-way (a 500) before the compile read the escapes
@pytest.mark.parametrize("body,param,char", [
    ({"guided_regex": r"a\x{4}b"}, "guided_regex", r"'\x04' (U+0004)"),
    ({"guided_grammar": r'start: "a" "\u0004"'}, "guided_grammar", r"'\x04' (U+0004)"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": r"^\U000b7105$"}}}},
     "response_format.json_schema.schema", r"'\U000b7105' (U+B7105)"),
])
def test_unwritable_characters_as_escapes_are_400_naming_the_field(client, body, param, char):
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       extra_body=body)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    assert f"{param} holds {char}, which this model's vocabulary cannot write" in \
        err.value.body["message"], err.value.body
