"""SamplingParams: vLLM defaults, normalisation, and ValueErrors that name the field."""

import pytest

from pagedllm.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": True}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"best_of": "3"}, "best_of"),
        ({"n": 1, "best_of": 3}, "best_of"),  # accepted and ignored before: now refused
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"seed": "42"}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"stop": [1]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", ""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"detokenize": "yes"}, "detokenize"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SamplingParams(**kwargs)


def test_message_shows_range_and_value():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1.0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"presence_penalty must be in \[-2, 2\], got 3.0"):
        SamplingParams(presence_penalty=3)


def test_normalisation():
    p = SamplingParams(stop="END", stop_token_ids=(7, 8), top_k=-1, temperature=1)
    assert p.stop == ["END"] and p.stop_token_ids == [7, 8] and p.top_k == 0
    assert isinstance(p.temperature, float)
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_edge_values_accepted():
    SamplingParams(n=3, best_of=3, presence_penalty=-2, frequency_penalty=2, top_p=1.0)
    SamplingParams(top_k=1, min_p=1.0, max_tokens=None, min_tokens=1000, logprobs=0)
    SamplingParams(min_tokens=4, max_tokens=4, prompt_logprobs=0, seed=-5)


def test_greedy_and_sampling_type():
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert greedy.is_greedy and greedy.sampling_type == SamplingType.GREEDY
    # Filters cannot change an argmax, so greedy turns them off.
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(temperature=0.5, seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], stop_token_ids=[1], seed=1)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(2)
    assert p.stop == ["x"] and p.stop_token_ids == [1]
