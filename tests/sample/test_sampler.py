"""Sampler: greedy, filters, penalties, bans, logprobs, seeded reproducibility, distribution."""

import math

import pytest
import torch

from pagedllm.sample import SamplingMetadata, compute_prompt_logprobs, ops
from pagedllm.sampling_params import SamplingParams

from sampler_impls import make_sampler, sampler_impl  # noqa: F401 (sampler_impl: every test on both)

V = 8


def meta_for(params, prompts=None, outputs=None, generators=None, vocab=V, eos=(V - 1,)):
    n = len(params)
    return SamplingMetadata.from_params(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators or {},
        vocab,
        list(eos),
    )


def sample(logits, params, **kwargs):
    return make_sampler()(logits, meta_for(params, **kwargs))


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_and_input_untouched():
    logits = torch.randn(5, V, dtype=torch.bfloat16)
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_top_k_1_and_tiny_top_p_equal_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    want = logits.argmax(-1)
    as_greedy = (SamplingParams(top_k=1, temperature=5.0), SamplingParams(top_p=1e-6, temperature=5.0))
    for params in as_greedy:
        for _ in range(20):
            got = sample(logits, [params] * 6, vocab=50).sampled_token_ids
            assert torch.equal(got, want)


def test_mixed_batch_greedy_rows_stay_argmax():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    greedy, rand = SamplingParams(temperature=0.0), SamplingParams()
    params = [greedy, rand, greedy, rand]
    meta = meta_for(params)
    assert not meta.all_greedy and not meta.all_random
    for _ in range(10):
        got = make_sampler()(logits, meta).sampled_token_ids
        assert got[0] == logits[0].argmax() and got[2] == logits[2].argmax()


def test_top_k_keeps_only_k_best():
    torch.manual_seed(2)
    logits = torch.randn(3, 30)
    params = [SamplingParams(top_k=3), SamplingParams(top_k=0), SamplingParams(top_k=5)]
    meta = meta_for(params, vocab=30)
    assert meta.top_k.tolist() == [3, 30, 5]
    top3 = set(logits[0].topk(3).indices.tolist())
    top5 = set(logits[2].topk(5).indices.tolist())
    seen_row1 = set()
    for _ in range(300):
        got = make_sampler()(logits, meta).sampled_token_ids.tolist()
        assert got[0] in top3 and got[2] in top5
        seen_row1.add(got[1])
    assert len(seen_row1) > 5  # the disabled row is unaffected


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # 0.5 + 0.3 = 0.8 >= 0.7, so only tokens 0 and 1 survive.
    params = [SamplingParams(top_p=0.7)]
    seen = {sample(logits, params, vocab=4, eos=()).sampled_token_ids.item() for _ in range(300)}
    assert seen == {0, 1}


def test_min_p_filters_relative_to_top_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # threshold 0.4 * 0.5 = 0.2: tokens with p < 0.2 are dropped.
    params = [SamplingParams(min_p=0.4)]
    seen = {sample(logits, params, vocab=4, eos=()).sampled_token_ids.item() for _ in range(300)}
    assert seen == {0, 1}
    meta = meta_for([SamplingParams()], vocab=4)
    assert meta.min_p is None and meta.top_p is None and meta.top_k is None


def empirical(logits, params, n_draws=20000):
    """Sample the same row n_draws times in one batch; return frequencies."""
    batch = logits.expand(n_draws, -1)
    out = sample(batch, [params] * n_draws, vocab=logits.shape[-1], eos=())
    return torch.bincount(out.sampled_token_ids, minlength=logits.shape[-1]).float() / n_draws


def test_empirical_distribution_matches_softmax():
    torch.manual_seed(3)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    freq = empirical(probs.log(), SamplingParams())
    assert torch.allclose(freq, probs, atol=0.015)


def test_temperature_sharpens_and_flattens():
    torch.manual_seed(4)
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    for temp in (0.5, 2.0):
        want = torch.softmax(logits / temp, -1)
        assert torch.allclose(empirical(logits, SamplingParams(temperature=temp)), want, atol=0.015)


def test_top_p_distribution_is_renormalised():
    torch.manual_seed(5)
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    freq = empirical(logits, SamplingParams(top_p=0.7))
    assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015)


def test_repetition_penalty_math():
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 1.0]])
    # prompt holds 0 and 1, output holds 3: each seen logit is shrunk toward zero by 2.
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    meta = meta_for([p], prompts=[[0, 1]], outputs=[[3]], vocab=5, eos=())
    got = ops.apply_penalties(
        logits, meta.prompt_token_ids, meta.output_token_ids,
        meta.presence_penalties, meta.frequency_penalties, meta.repetition_penalties,
    )
    assert torch.allclose(got, torch.tensor([[1.0, -2.0, 3.0, -4.0, 1.0]]))


@pytest.mark.parametrize("temperature", [0.0, 1e-5, 0.5, 1.0])
def test_a_repetition_penalty_below_float32_draws_a_seen_token(temperature):
    """5e-324 is > 0 (valid, as in vLLM) but 0 in float32: seen positive logits divided by it
    were inf, the softmax NaN, and the draw an id one past the vocabulary, which stopped the
    engine (the API fuzz found it). In the limit they dominate, so a seen id is drawn."""
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 1.0]] * 16)
    p = SamplingParams(temperature=temperature, repetition_penalty=5e-324)
    gens = {i: seeded(i) for i in range(16)}
    out = sample(logits, [p] * 16, prompts=[[0, 4]] * 16, generators=gens, vocab=5, eos=())
    drawn = out.sampled_token_ids.tolist()
    assert set(drawn) <= {0, 4} and (temperature < 0.1 or set(drawn) == {0, 4})
    # a seen id already banned (-inf: a grammar, allowed_token_ids) stays banned, not NaN
    p = SamplingParams(temperature=temperature, repetition_penalty=5e-324, allowed_token_ids=[1, 2])
    out = sample(logits, [p] * 16, prompts=[[0, 4]] * 16, generators=gens, vocab=5, eos=())
    assert out.not_finite == [] and set(out.sampled_token_ids.tolist()) <= {1, 2}


def test_a_nan_row_fails_alone_and_draws_no_id_past_the_vocabulary():
    logits = torch.zeros(3, V)
    logits[:, 2] = 50.0  # the only id with any probability
    logits[1] = float("nan")
    out = sample(logits, [SamplingParams(temperature=1.0, logprobs=1)] * 3)
    assert out.not_finite == [1] and out.no_allowed_token == []
    drawn = out.sampled_token_ids.tolist()
    assert all(0 <= t < V for t in drawn) and drawn[0] == drawn[2] == 2


def test_presence_and_frequency_penalty_math():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # Prompt tokens do not count for presence/frequency; token 2 appears 3 times in the output.
    meta = meta_for([p], prompts=[[0, 0]], outputs=[[2, 2, 1, 2]], vocab=4, eos=())
    got = ops.apply_penalties(
        logits, meta.prompt_token_ids, meta.output_token_ids,
        meta.presence_penalties, meta.frequency_penalties, meta.repetition_penalties,
    )
    assert torch.allclose(got, torch.tensor([[1.0, 1.0 - 0.25 - 0.5, 1.0 - 0.75 - 0.5, 1.0]]))


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0),
    ]
    out = sample(logits, params, outputs=[[0], [0]], vocab=3, eos=())
    assert out.sampled_token_ids.tolist() == [1, 0]  # only the penalised row switches


def test_banned_ids_never_sampled():
    logits = torch.zeros(2, V)
    logits[:, V - 1] = 10.0  # EOS is by far the most likely
    logits[:, 3] = 9.0  # and so is the stop token
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[3]),
        SamplingParams(min_tokens=3, temperature=0.0),
    ]
    meta = meta_for(params, outputs=[[1], [1, 2, 4]])  # row 1 already reached min_tokens
    assert meta.banned_token_ids == {0: [3, V - 1]}
    for _ in range(200):
        got = make_sampler()(logits, meta).sampled_token_ids.tolist()
        assert got[0] not in (3, V - 1) and got[1] == V - 1


def test_ignore_eos_keeps_eos_allowed_under_min_tokens():
    meta = meta_for([SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[2])])
    assert meta.banned_token_ids == {0: [2]}


def test_logprobs_are_raw_and_well_formed():
    torch.manual_seed(6)
    logits = torch.randn(3, V)
    params = [
        SamplingParams(logprobs=3, temperature=0.7, presence_penalty=1.0),
        SamplingParams(logprobs=1),
        SamplingParams(),
    ]
    out = sample(logits, params, outputs=[[0, 1], [2], []])
    lp = out.logprobs
    ref = torch.log_softmax(logits, -1)
    assert lp.token_ids.shape == (3, 4) and lp.logprobs.shape == (3, 4) and lp.ranks.shape == (3,)
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(lp.logprobs, ref.gather(1, lp.token_ids))
    assert torch.equal(lp.token_ids[:, 1:], ref.topk(3, -1).indices)
    assert torch.all(lp.logprobs[:, 1:-1] >= lp.logprobs[:, 2:])  # top-K sorted descending
    order = ref.argsort(-1, descending=True)
    for row in range(3):
        want_rank = (order[row] == out.sampled_token_ids[row]).nonzero().item() + 1
        assert lp.ranks[row].item() == want_rank


def test_logprobs_zero_gives_only_sampled_column():
    logits = torch.randn(2, V)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 2)
    assert out.logprobs.token_ids.shape == (2, 1)
    assert torch.all(out.logprobs.ranks == 1)


def test_prompt_logprobs():
    torch.manual_seed(7)
    logits = torch.randn(5, V)
    targets = torch.tensor([1, 0, 7, 3, 3])
    lp = compute_prompt_logprobs(logits, targets, 2)
    ref = torch.log_softmax(logits, -1)
    assert torch.equal(lp.token_ids[:, 0], targets)
    assert torch.allclose(lp.logprobs[:, 0], ref[torch.arange(5), targets])
    assert torch.equal(lp.token_ids[:, 1:], ref.topk(2, -1).indices)
    assert torch.equal(lp.ranks, (ref >= ref[torch.arange(5), targets].unsqueeze(1)).sum(-1))
    with pytest.raises(ValueError, match="num_logprobs"):
        compute_prompt_logprobs(logits, targets, -1)


def test_seeded_rows_reproducible_and_batch_independent():
    torch.manual_seed(8)
    row = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.0, seed=123)

    def run_alone():
        out = sample(row, [p], generators={0: seeded(123)}, vocab=1000, eos=())
        return out.sampled_token_ids.item()

    alone = run_alone()
    assert run_alone() == alone
    # Same row at position 2 among unseeded, greedy and differently seeded neighbours.
    others = torch.randn(3, 1000)
    batch = torch.cat([others[:2], row, others[2:]])
    params = [SamplingParams(), SamplingParams(temperature=0.0), p, SamplingParams(seed=9)]
    for _ in range(3):
        gens = {2: seeded(123), 3: seeded(9)}
        out = sample(batch, params, generators=gens, vocab=1000, eos=())
        assert out.sampled_token_ids[2].item() == alone


def test_seeded_sequence_independent_of_neighbours():
    torch.manual_seed(9)
    steps = [torch.randn(1, 64) for _ in range(10)]
    p = SamplingParams(seed=5, top_k=20, top_p=0.9)

    def run(extra_rows):
        g = seeded(5)
        toks = []
        for logits in steps:
            batch = torch.cat([torch.randn(extra_rows, 64), logits])
            params = [SamplingParams()] * extra_rows + [p]
            out = sample(batch, params, generators={extra_rows: g}, vocab=64, eos=())
            toks.append(out.sampled_token_ids[-1].item())
        return toks

    assert run(0) == run(3) == run(1)


def test_greedy_rows_do_not_consume_their_generator():
    g = seeded(11)
    state = g.get_state()
    params = [SamplingParams(temperature=0.0), SamplingParams()]
    sample(torch.randn(2, V), params, generators={0: g})
    assert torch.equal(g.get_state(), state)


def test_empty_batch():
    out = sample(torch.randn(0, V), [])
    assert out.sampled_token_ids.shape == (0,)


def test_metadata_flags():
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(repetition_penalty=1.2, logprobs=2),
        SamplingParams(logprobs=5, top_k=100),
    ]
    meta = meta_for(params)
    assert meta.temperature.tolist() == [0.0, 1.0, 1.0]
    assert meta.max_num_logprobs == 5 and not meta.no_penalties
    assert meta.top_k is None  # top_k >= vocab is a no-op
    assert math.isclose(meta.repetition_penalties[1].item(), 1.2, rel_tol=1e-6)
    assert meta_for([SamplingParams(temperature=0.0)]).all_greedy
    assert meta_for([SamplingParams()]).no_penalties


def test_inverse_cdf_draws_never_pick_zero_probability_ids():
    """random_sample inverts each row's CDF: ids of probability 0 (masked, or after the last
    id with mass) are never drawn, and a seeded row repeats its draw whatever its neighbours."""
    from pagedllm.sample.ops import random_sample

    torch.manual_seed(6)
    probs = torch.zeros(4096, 1000)
    probs[:, [3, 500, 501]] = torch.tensor([0.2, 0.5, 0.3])  # the last 498 ids have no mass
    drawn = random_sample(probs, {}, [])
    assert set(drawn.tolist()) <= {3, 500, 501}
    freq = torch.bincount(drawn, minlength=1000)[[3, 500, 501]].float() / 4096
    assert torch.allclose(freq, torch.tensor([0.2, 0.5, 0.3]), atol=0.03)
    gens = {1: torch.Generator().manual_seed(7)}
    first = random_sample(probs[:3], gens, [1])[1]
    gens = {1: torch.Generator().manual_seed(7)}
    assert random_sample(probs[:3].flip(0), gens, [1])[1] == first
