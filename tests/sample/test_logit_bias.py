"""logit_bias and allowed_token_ids: validation, and the sampler on small fake logits."""
from __future__ import annotations

import pytest
import torch

from pagedllm.sample import SamplingMetadata
from pagedllm.sampling_params import SamplingParams

from sampler_impls import make_sampler, sampler_impl  # noqa: F401 (sampler_impl: every test on both)

V = 16


def meta_for(params, generators=None):
    n = len(params)
    return SamplingMetadata.from_params(params, [[] for _ in range(n)], [[] for _ in range(n)],
                                        generators or {}, V, [V - 1])


def sample(logits, params, generators=None):
    return make_sampler()(logits, meta_for(params, generators)).sampled_token_ids.tolist()


def peaked_logits(n=1):
    logits = torch.zeros(n, V)
    logits[:, 3] = 10.0  # id 3 is the clear favourite
    return logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plus_100_forces_an_id(temperature):
    params = SamplingParams(temperature=temperature, logit_bias={9: 100})
    gens = {i: torch.Generator().manual_seed(i) for i in range(32)}
    assert sample(peaked_logits(32), [params] * 32, gens) == [9] * 32


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_minus_100_bans_an_id(temperature):
    params = SamplingParams(temperature=temperature, logit_bias={3: -100})
    gens = {i: torch.Generator().manual_seed(i) for i in range(64)}
    drawn = sample(peaked_logits(64), [params] * 64, gens)
    assert 3 not in drawn
    if temperature == 0.0:
        assert drawn == [0] * 64  # the first of the tied zeros


def test_bias_adds_to_the_logit():
    logits = torch.tensor([[0.0, 1.0, 2.0] + [-50.0] * (V - 3)])
    # +1.5 on id 1 makes it the argmax (2.5 > 2.0); +0.5 would not (1.5 < 2.0)
    assert sample(logits, [SamplingParams(temperature=0, logit_bias={1: 1.5})]) == [1]
    assert sample(logits, [SamplingParams(temperature=0, logit_bias={1: 0.5})]) == [2]


def test_allowed_token_ids_restrict_seeded_draws():
    allowed = [1, 5, 11]
    params = SamplingParams(temperature=1.0, seed=0, allowed_token_ids=allowed)
    logits = torch.randn(200, V, generator=torch.Generator().manual_seed(0))
    gens = {i: torch.Generator().manual_seed(i) for i in range(200)}
    drawn = sample(logits, [params] * 200, gens)
    assert set(drawn) == set(allowed)  # only those, and every one of them over 200 draws


def test_allowed_token_ids_under_greedy_take_the_best_allowed():
    params = SamplingParams(temperature=0, allowed_token_ids=[7, 8])
    logits = peaked_logits()
    logits[0, 8] = 1.0
    assert sample(logits, [params]) == [8]


def test_rows_without_them_are_bit_identical():
    """Rows 0 and 2 sample as they do in a batch where no row sets either field."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    plain = SamplingParams(temperature=0.8, top_p=0.9, logprobs=3)
    special = SamplingParams(temperature=0.8, logit_bias={2: 5.0}, allowed_token_ids=[2, 4])

    def run(middle):
        gens = {i: torch.Generator().manual_seed(10 + i) for i in range(3)}
        return make_sampler()(logits, meta_for([plain, middle, plain], gens))

    base, mixed = run(plain), run(special)
    for row in (0, 2):
        assert mixed.sampled_token_ids[row] == base.sampled_token_ids[row]
        assert torch.equal(mixed.logprobs.logprobs[row], base.logprobs.logprobs[row])
        assert torch.equal(mixed.logprobs.token_ids[row], base.logprobs.token_ids[row])
    assert mixed.sampled_token_ids[1].item() in (2, 4)


def test_metadata_is_built_only_when_a_row_uses_them():
    meta = meta_for([SamplingParams(), SamplingParams()])
    assert meta.logit_bias is None and meta.disallowed_mask is None
    meta = meta_for([SamplingParams(), SamplingParams(logit_bias={4: 1.0, 6: -2.0})])
    assert meta.disallowed_mask is None
    assert meta.logit_bias.rows.tolist() == [1, 1]
    assert meta.logit_bias.token_ids.tolist() == [4, 6]
    assert meta.logit_bias.values.tolist() == [1.0, -2.0]
    meta = meta_for([SamplingParams(allowed_token_ids=[0, 2]), SamplingParams()])
    assert meta.logit_bias is None
    assert meta.disallowed_mask.shape == (2, V)
    assert (~meta.disallowed_mask[0]).nonzero().flatten().tolist() == [0, 2]
    assert not meta.disallowed_mask[1].any()


def test_callers_logits_are_not_modified():
    params = [SamplingParams(temperature=0, logit_bias={9: 100}),
              SamplingParams(temperature=1.0, allowed_token_ids=[1, 2])]
    for logits in (peaked_logits(2), peaked_logits(2).bfloat16()):
        before = logits.clone()
        sample(logits, params)
        assert torch.equal(logits, before)


def test_logprobs_come_from_the_raw_logits():
    logits = peaked_logits()
    params = SamplingParams(temperature=0, logprobs=1, logit_bias={9: 100})
    out = make_sampler()(logits, meta_for([params]))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.sampled_token_ids.tolist() == [9]
    assert out.logprobs.logprobs[0, 0].item() == pytest.approx(raw[0, 9].item())
    assert out.logprobs.token_ids[0, 1].item() == 3  # the model's top token, not the biased one


def test_bias_and_min_tokens_ban_combine():
    """A +100 bias on EOS does not override min_tokens' ban on it."""
    params = SamplingParams(temperature=0, min_tokens=2, logit_bias={V - 1: 100})
    assert sample(peaked_logits(), [params]) == [3]


@pytest.mark.parametrize("kwargs, msg", [
    ({"logit_bias": {5: 100.5}}, r"logit_bias values must be in \[-100, 100\], got 100.5"),
    ({"logit_bias": {5: -101}}, r"logit_bias values must be in \[-100, 100\]"),
    ({"logit_bias": {5: "x"}}, "logit_bias values must be a number"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias values must be a finite number"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {True: 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": [5]}, "logit_bias must be a dict"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must be a list of token ids"),
    ({"allowed_token_ids": ["1"]}, "allowed_token_ids must be a list of token ids"),
    ({"allowed_token_ids": 3}, "allowed_token_ids must be a list of token ids"),
])
def test_validation_names_the_field(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)


def test_valid_values_are_normalised():
    p = SamplingParams(logit_bias={5: 100, 6: -100}, allowed_token_ids=(1, 2))
    assert p.logit_bias == {5: 100.0, 6: -100.0} and p.allowed_token_ids == [1, 2]
