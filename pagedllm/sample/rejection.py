"""Verifying draft tokens against the target model's own draws (speculative decoding).

An n-gram draft is a point mass: the proposer puts probability 1 on its token x. Rejection
sampling (Leviathan et al. 2023) with draft q = point mass at x and target p accepts x with
probability min(1, p(x) / q(x)) = p(x), and on rejection draws from max(0, p - q) normalised,
which is p with x removed, renormalised. Drawing t ~ p and accepting x exactly when t == x is
the same law: P(accept) = p(x), and given t != x, t follows p restricted to the other ids. So
each position is sampled from the target's processed distribution (penalties, temperature,
top-k/top-p/min-p, with the drafts before it as history), and the drafts are kept up to the
first position whose draw differs; that draw takes its place. When every draft is kept, the
last position's draw is the bonus token. Greedy rows draw the argmax, so greedy output equals
decoding without speculation token for token.

    drafts   x1  x2  x3
    draws    t0  t1  t2  t3      (t_j from the target at the position after x_j)
    kept     x1 (t0 == x1), x2 (t1 == x2), then t2 != x3: output x1 x2 t2
"""
from __future__ import annotations


def verify_point_mass(draws: list[int], drafts: list[int]) -> list[int]:
    """The tokens a verify step yields: the drafts kept, then the target's draw after them.

    draws[j]: the target's draw at the position of drafts[j] (len(drafts) + 1 of them, the last
    one after every draft)."""
    if len(draws) != len(drafts) + 1:
        raise ValueError(f"{len(draws)} draws for {len(drafts)} drafts: need one more draw")
    for j, draft in enumerate(drafts):
        if draws[j] != draft:
            return draws[:j + 1]
    return list(draws)
