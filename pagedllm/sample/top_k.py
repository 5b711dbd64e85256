"""Top-k sampling on each row's k candidates instead of the whole vocabulary.

The full path sorts every row ([N, 152k]: ~20 ms a row on one thread), takes a softmax and
draws an exponential for every id. A row with a small top_k needs only its k largest logits:
torch.topk, top-p on those, and k draws. The kept set is the same as the full path's (every id
at least as large as the k-th largest), except where the k-th largest ties with the next one: the
full path keeps all the ties, so such a row goes the full way.

A seeded row draws exactly its own k values from its generator, so its tokens do not depend on
the other rows of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FAST_TOP_K = 1024  # rows with a top_k up to this take the candidates' path


@dataclass
class TopKCandidates:
    """The rows that take the candidates' path and their k largest logits."""

    rows: torch.Tensor   # [M] int64 rows of the batch
    logits: torch.Tensor  # [M, W] descending; -inf past each row's k
    ids: torch.Tensor    # [M, W] int64 token ids of those logits
    k: torch.Tensor      # [M] int64


def top_k_candidates(logits: torch.Tensor, top_k: torch.Tensor) -> Optional[TopKCandidates]:
    """The candidates of rows with 0 < top_k <= FAST_TOP_K whose k-th logit has no tie beyond
    it; None when no row qualifies. logits [N, V], top_k [N] (V where disabled)."""
    vocab = logits.shape[1]
    rows = ((top_k < vocab) & (top_k <= FAST_TOP_K)).nonzero().flatten()  # [M]
    if rows.numel() == 0:
        return None
    k = top_k[rows].clamp(min=1)  # [M]
    width = min(int(k.max()) + 1, vocab)  # one more, to see a tie at the k-th
    vals, ids = logits[rows].topk(width, dim=-1)  # [M, W] descending
    kth = vals.gather(1, (k - 1).unsqueeze(1))  # [M, 1]
    after = vals.gather(1, k.clamp(max=width - 1).unsqueeze(1))
    exact = ((after != kth) | (k >= width)).flatten()  # [M]
    if not bool(exact.all()):
        rows, vals, ids, k = rows[exact], vals[exact], ids[exact], k[exact]
        if rows.numel() == 0:
            return None
    past_k = torch.arange(width, device=logits.device).unsqueeze(0) >= k.unsqueeze(1)  # [M, W]
    return TopKCandidates(rows, vals.masked_fill(past_k, float("-inf")), ids, k)


def apply_top_p(cand: TopKCandidates, top_p: torch.Tensor) -> None:
    """Keep each row's smallest nucleus of mass >= p among its candidates, as the full path does
    on its ascending sort (in place). top_p [M]."""
    ascending = cand.logits.flip(-1)  # [M, W]
    cum = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
    drop = cum <= 1.0 - top_p.unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    cand.logits = ascending.masked_fill(drop, float("-inf")).flip(-1)


def sample_candidates(cand: TopKCandidates, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token id per candidate row: argmax(p / q), q ~ Exp(1), as the full path draws; a
    seeded row (generators: candidate row -> generator) draws its k values from its own."""
    probs = torch.softmax(cand.logits, dim=-1)  # [M, W]
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    else:  # past a seeded row's k the probability is 0: any finite q will do
        q.fill_(1.0)
    for row, gen in generators.items():
        q[row, :int(cand.k[row])].exponential_(generator=gen)
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    choice = probs.div(q).argmax(dim=-1, keepdim=True)  # [M, 1]
    return cand.ids.gather(1, choice).flatten()
