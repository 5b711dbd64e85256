"""How many drafts pay: what a verify row costs against a plain decode step, and the draft
length that gives the most tokens per second for a request's acceptance.

A verify of k drafts computes k more rows than a plain step (and, with a draft model, k draft
steps before it). On a CPU a row is not free: the block gemm's work grows with its rows, so a
6-row verify of the default model takes 65 ms against 24 for a plain step (2-vCPU Zen 4), and
a 2-row verify of a Qwen2-7B-shaped Q2_K 352 ms against 171. With c the cost of one more row
over a plain step, and each draft kept with probability a until the first rejection, k drafts
give 1 + a + ... + a^k tokens for 1 + k c steps' time; the best k maximises their ratio, and
0 (decode plainly) wins when no k beats 1:

    a = 0.87, c = 0.35: k = 3, 1.6x        a = 0.5: k = 1, 1.1x        a = 0.3: k = 0

c is fitted online, t = fixed + per_row * rows over the engine's recent decode-only steps
(StepCost, the target's time only), c = per_row * requests / t_plain; until steps of several
widths were seen (and blended with them after) it is DEFAULT_ROW_COST. With a draft model each
draft also costs a draft step: the draft's share of the target's parameters is added (a draft
step reads about that share of the bytes: a Q2_K of the same model ~0.85 of a step here, and
then no k pays). a is each request's own, decayed estimate
(SpecRequestState), from a prior of PRIOR_KEPT kept and PRIOR_MISSED refused drafts.
"""
from __future__ import annotations

DEFAULT_ROW_COST = 0.35  # the default model's 6-row verify on 2 Zen 4 vCPUs: (65 - 24) / 5 / 24
PRIOR_STEPS = 3.0  # weight of the prior against the fitted cost, in steps (the fit holds ~20)
FORGET = 0.95  # weight of the past per observed step
MIN_ROW_COST, MAX_ROW_COST = 0.01, 4.0
PRIOR_KEPT, PRIOR_MISSED = 1.0, 1.0  # a request's acceptance before its first verify: 0.5
DECAY = 0.8  # weight of a request's past verifies in its acceptance (per verify)


def best_draft_length(acceptance: float, row_cost: float, limit: int) -> int:
    """The k in 0..limit with the most expected tokens per unit of time (0: no drafts)."""
    best, best_gain = 0, 1.0
    tokens, power = 1.0, 1.0
    for k in range(1, limit + 1):
        power *= acceptance
        tokens += power
        gain = tokens / (1.0 + k * row_cost)
        if gain > best_gain * 1.02:  # a gain within noise is not worth a verify's risk
            best, best_gain = k, gain
    return best


class StepCost:
    """A running least-squares fit of a decode-only step's seconds (without a draft model's
    time) against its rows, recent steps weighted most, giving the relative cost of one more
    row; plus a draft model's step, as its share of the target's parameters (draft_cost)."""

    def __init__(self, prior: float = DEFAULT_ROW_COST, draft_cost: float = 0.0) -> None:
        """prior: the row cost before (and blended with) the fit; draft_cost: a draft step's
        time against a plain step's, added to each draft's cost."""
        self.prior = prior
        self.draft_cost = draft_cost
        self._w = self._r = self._rr = self._t = self._rt = 0.0
        self._requests = 1.0  # recent requests per step (decayed mean)

    def observe(self, rows: int, requests: int, seconds: float) -> None:
        """One decode-only step: its rows (drafts included), its requests, its seconds (the
        target's: a draft model's time is not in them)."""
        f = FORGET
        self._w = f * self._w + 1.0
        self._r = f * self._r + rows
        self._rr = f * self._rr + rows * rows
        self._t = f * self._t + seconds
        self._rt = f * self._rt + rows * seconds
        self._requests = f * self._requests + (1 - f) * requests

    @property
    def prior_cost(self) -> float:
        """A draft's cost before any step is timed (reproducible: no timing in it)."""
        return self.prior + self.draft_cost

    @property
    def row_cost(self) -> float:
        """A draft's cost against a plain step: one more verify row's time over a plain
        step's (per request of the step), blended with the prior (the prior alone until the
        rows have varied), plus draft_cost."""
        return self._fitted_row() + self.draft_cost

    def _fitted_row(self) -> float:
        w = self._w
        if w < 2.0:
            return self.prior
        mean_r, mean_t = self._r / w, self._t / w
        var = self._rr / w - mean_r * mean_r
        if var < 0.05:
            return self.prior
        slope = (self._rt / w - mean_r * mean_t) / var
        plain = mean_t - slope * (mean_r - self._requests)  # a step of one row per request
        if plain <= 0:
            return self.prior
        fitted = min(MAX_ROW_COST, max(MIN_ROW_COST, slope * self._requests / plain))
        return (PRIOR_STEPS * self.prior + w * fitted) / (PRIOR_STEPS + w)
