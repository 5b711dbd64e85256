"""Verifying point-mass drafts: the kept tokens, and the output law equal to the target's."""
import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.rejection import verify_point_mass
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams


def test_kept_tokens():
    assert verify_point_mass([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all kept + bonus
    assert verify_point_mass([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # the target's draw replaces
    assert verify_point_mass([8, 5, 6, 7], [4, 5, 6]) == [8]
    with pytest.raises(ValueError, match="one more draw"):
        verify_point_mass([1, 2], [1, 2])


LOGITS = torch.tensor([1.0, 0.2, 1.6, -0.5, 0.9, 0.0])  # a 6-token vocabulary
DRAFT = 2
N = 6000  # requests, each a seed


def _target(params: SamplingParams) -> torch.Tensor:
    """The target's sampling law for these params, computed by hand."""
    logits = LOGITS / params.temperature
    if params.top_k > 0:
        keep = logits.topk(params.top_k).indices
        masked = torch.full_like(logits, float("-inf"))
        masked[keep] = logits[keep]
        logits = masked
    return torch.softmax(logits, dim=-1)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    used = expected > 0
    assert counts[~used].sum() == 0, "a token outside the target's support was drawn"
    return float(((counts[used] - expected[used]) ** 2 / expected[used]).sum())


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=3)])
def test_output_law_is_the_targets(params):
    """N seeded requests each verify the draft [DRAFT] with the real sampler: two rows (the
    draft's position and the one after) drawn with the request's generator. The first output
    token follows the target's law p (accept DRAFT w.p. p(DRAFT), else p without DRAFT), the
    acceptance rate is p(DRAFT), and the token after a kept draft follows p again."""
    p = _target(params)
    rows = 2 * N
    meta = SamplingMetadata.from_params(
        [params] * rows, [[1]] * rows, [[] if r % 2 == 0 else [DRAFT] for r in range(rows)],
        {r: g for i in range(N) for g in [torch.Generator().manual_seed(i)]
         for r in (2 * i, 2 * i + 1)}, LOGITS.numel(), [], "cpu")
    draws = Sampler()(LOGITS.expand(rows, -1).clone(), meta).sampled_token_ids.tolist()
    outs = [verify_point_mass(draws[2 * i:2 * i + 2], [DRAFT]) for i in range(N)]
    first = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=6).double()
    second = torch.bincount(torch.tensor([o[1] for o in outs if len(o) == 2]),
                            minlength=6).double()
    # chi-square, 5 degrees of freedom at most: 20.5 is its 0.1% tail (the seeds are fixed,
    # so the test is deterministic; a wrong law gives hundreds)
    assert _chi2(first, p) < 20.5
    assert _chi2(second, p) < 20.5
    accepted = sum(len(o) == 2 for o in outs) / N
    assert abs(accepted - float(p[DRAFT])) < 4 * (float(p[DRAFT]) * (1 - float(p[DRAFT])) / N) ** 0.5
