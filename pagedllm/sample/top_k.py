"""Top-k sampling on each row's k candidates instead of the whole vocabulary.

The full path sorts every row ([N, 152k]: ~20 ms a row on one thread), takes a softmax and
draws an exponential for every id. A row with a small top_k needs only its k largest logits:
torch.topk, top-p on those, and k draws. A row with top_p alone needs only the ids of its
nucleus, which most often lie among the 1024 largest: when those hold more than p of the whole
vocabulary's probability, the ids past them are all dropped by top_p. The kept set is the same as the full path's (every id
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
NUCLEUS_WIDTH = 1024  # candidates of a top_p row without top_k, if they hold more than p


@dataclass
class TopKCandidates:
    """The rows that take the candidates' path and their k largest logits."""

    rows: torch.Tensor   # [M] int64 rows of the batch
    logits: torch.Tensor  # [M, W] descending; -inf past each row's k
    ids: torch.Tensor    # [M, W] int64 token ids of those logits
    k: torch.Tensor      # [M] int64
    # [M] a top_p-only row's probability outside its candidates and its full logsumexp
    # (top_p is taken over the whole vocabulary there); 0 and NaN for top-k rows
    tail: torch.Tensor
    lse: torch.Tensor


def top_k_candidates(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                     top_p: Optional[torch.Tensor] = None) -> Optional[TopKCandidates]:
    """The candidates of rows with 0 < top_k <= FAST_TOP_K whose k-th logit has no tie beyond
    it, and of rows with top_p alone whose NUCLEUS_WIDTH largest hold more than p; None when no
    row qualifies. logits [N, V], top_k [N] (V where disabled), top_p [N]."""
    n, vocab = logits.shape
    no = torch.zeros(n, dtype=torch.bool, device=logits.device)
    small_k = no if top_k is None else (top_k < vocab) & (top_k <= FAST_TOP_K)
    no_top_k = ~no if top_k is None else top_k >= vocab
    nucleus = no if top_p is None else (top_p < 1.0) & no_top_k
    rows = (small_k | nucleus).nonzero().flatten()  # [M]
    if rows.numel() == 0:
        return None
    nucleus = nucleus[rows]
    k = torch.where(nucleus, min(NUCLEUS_WIDTH, vocab),
                    top_k[rows] if top_k is not None else 0).clamp(min=1)  # [M]
    width = min(int(k.max()) + 1, vocab)  # one more, to see a tie at the k-th
    vals, ids = logits[rows].topk(width, dim=-1)  # [M, W] descending
    kth = vals.gather(1, (k - 1).unsqueeze(1))  # [M, 1]
    after = vals.gather(1, k.clamp(max=width - 1).unsqueeze(1))
    exact = (after != kth).flatten() | (k >= width)  # [M]
    past_k = torch.arange(width, device=logits.device).unsqueeze(0) >= k.unsqueeze(1)  # [M, W]
    vals = vals.masked_fill(past_k, float("-inf"))
    lse = torch.full_like(kth.flatten(), float("nan"))
    tail = torch.zeros_like(lse)
    if bool(nucleus.any()):
        lse[nucleus] = torch.logsumexp(logits[rows[nucleus]], dim=-1)
        mass = torch.exp(vals[nucleus] - lse[nucleus].unsqueeze(1)).sum(dim=-1)
        tail[nucleus] = (1.0 - mass).clamp(min=0.0)
        # the nucleus must lie among the candidates (a margin for the sums' rounding)
        exact[nucleus] = mass > top_p[rows[nucleus]] + 1e-4
    if not bool(exact.all()):
        rows, vals, ids, k, tail, lse = (t[exact] for t in (rows, vals, ids, k, tail, lse))
        if rows.numel() == 0:
            return None
    return TopKCandidates(rows, vals, ids, k, tail, lse)


def apply_top_p(cand: TopKCandidates, top_p: torch.Tensor) -> None:
    """Keep each row's smallest nucleus of mass >= p, as the full path does on its ascending
    sort (in place): over the candidates for top-k rows, over the whole vocabulary for top_p-only
    rows (their tail's mass comes first in the ascending sum). top_p [M]."""
    ascending = cand.logits.flip(-1)  # [M, W]
    probs = torch.softmax(ascending, dim=-1)
    whole = ~cand.lse.isnan()
    if bool(whole.any()):
        probs[whole] = torch.exp(ascending[whole] - cand.lse[whole].unsqueeze(1))
    cum = probs.cumsum(dim=-1) + cand.tail.unsqueeze(1)
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
