"""Top-k rows sampled among their candidates: the same kept set and distribution as the full
sort, ties at the k-th logit kept, seeded rows independent of their neighbours' top_k."""
import torch

from pagedllm.sample import Sampler, SamplingMetadata, ops
from pagedllm.sample.top_k import top_k_candidates
from pagedllm.sampling_params import SamplingParams

V = 300


def draws(logits, params, n, generators=None):
    meta = SamplingMetadata.from_params(params, [[]] * len(params), [[]] * len(params),
                                        generators or {}, V, [])
    return torch.stack([Sampler()(logits, meta).sampled_token_ids for _ in range(n)])  # [n, N]


def test_candidates_keep_the_full_paths_set_and_distribution():
    torch.manual_seed(0)
    logits = torch.randn(2, V) * 2
    params = [SamplingParams(temperature=1.0, top_k=12), SamplingParams(temperature=1.0, top_k=40,
                                                                        top_p=0.6)]
    kept = ops.apply_top_k_top_p(logits, torch.tensor([12, 40]), torch.tensor([1.0, 0.6]))
    want = torch.softmax(kept, dim=-1)  # [2, V]
    got = draws(logits, params, 4000)
    for row in range(2):
        freq = torch.bincount(got[:, row], minlength=V).float() / got.shape[0]
        assert bool((freq[want[row] == 0] == 0).all())  # nothing outside the full path's set
        assert (freq - want[row]).abs().max() < 0.04


def test_a_tie_at_the_kth_logit_takes_the_full_path_and_keeps_the_ties():
    logits = torch.full((1, V), -5.0)
    logits[0, [3, 7, 11]] = 1.0  # top_k=2: the full path keeps all three
    assert top_k_candidates(logits, torch.tensor([2])) is None
    got = draws(logits, [SamplingParams(temperature=1.0, top_k=2)], 600)
    assert set(got.flatten().tolist()) == {3, 7, 11}


def test_seeded_row_ignores_its_neighbours_top_k():
    torch.manual_seed(1)
    row = torch.randn(1, V)
    p = SamplingParams(temperature=0.8, top_k=30, seed=7)

    def run(neighbours):
        batch = torch.cat([torch.randn(len(neighbours), V), row])
        gens = {len(neighbours): torch.Generator().manual_seed(7)}
        return draws(batch, neighbours + [p], 5, gens)[:, -1].tolist()  # 5 steps

    alone = run([])
    assert run([SamplingParams(temperature=1.0, top_k=200)]) == alone
    assert run([SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]) == alone


def test_top_p_alone_keeps_the_full_paths_nucleus():
    torch.manual_seed(2)
    logits = torch.randn(1, V) * 3
    kept = ops.apply_top_k_top_p(logits, None, torch.tensor([0.7]))
    want = torch.softmax(kept, dim=-1)[0]
    got = draws(logits, [SamplingParams(temperature=1.0, top_p=0.7)], 4000)[:, 0]
    freq = torch.bincount(got, minlength=V).float() / got.numel()
    assert bool((freq[want == 0] == 0).all())
    assert (freq - want).abs().max() < 0.04


def test_top_p_whose_nucleus_is_wider_than_the_candidates_takes_the_full_path():
    flat = torch.zeros(1, 3000)  # the 1024 largest hold a third of the mass
    assert top_k_candidates(flat, None, torch.tensor([0.9])) is None
    assert top_k_candidates(flat, None, torch.tensor([0.3])) is not None


def test_only_the_tied_row_leaves_the_candidates():
    logits = torch.randn(3, V)
    logits[1, [3, 7, 11]] = 50.0  # row 1: the 2nd largest ties with the 3rd
    cand = top_k_candidates(logits, torch.tensor([2, 2, 5]))
    assert cand.rows.tolist() == [0, 2]
    assert cand.ids[1, :5].tolist() == logits[2].topk(5).indices.tolist()
