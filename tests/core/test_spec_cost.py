"""The speculator's cost model: the draft length that pays, and the fitted row cost."""
import pytest

from pagedllm.core.spec_cost import DEFAULT_ROW_COST, StepCost, best_draft_length


@pytest.mark.parametrize("acceptance, row_cost, limit, k", [
    (0.87, 0.35, 5, 3),  # the code-edit workload: 3 drafts, 1.6x (4 gives no 2 % more)
    (0.87, 0.35, 2, 2),  # capped by num_speculative_tokens
    (0.5, 0.35, 5, 1),
    (0.3, 0.35, 5, 0),  # nothing pays: decode plainly
    (0.95, 0.02, 8, 8),  # a GPU-like cheap row: as many as allowed
    (0.8, 1.0, 5, 0),  # a row as dear as a step: even 0.8 does not pay
])
def test_best_draft_length(acceptance, row_cost, limit, k):
    assert best_draft_length(acceptance, row_cost, limit) == k


def test_the_row_cost_is_fitted_from_steps_of_several_widths():
    cost = StepCost()
    assert cost.row_cost == DEFAULT_ROW_COST  # nothing seen yet
    for _ in range(5):
        cost.observe(1, 1, 0.024)
    assert cost.row_cost == DEFAULT_ROW_COST  # one width only: no slope
    for _ in range(40):  # plain steps 24 ms, 6-row verifies 48 ms: a row is 0.2 of a step
        cost.observe(1, 1, 0.024)
        cost.observe(6, 1, 0.048)
    assert cost.row_cost == pytest.approx(0.2, abs=0.03)
    dear = StepCost(prior=1.0)
    for _ in range(40):  # a 7B whose second row doubles the step
        dear.observe(1, 1, 0.17)
        dear.observe(2, 1, 0.34)
    assert dear.row_cost == pytest.approx(1.0, abs=0.05)


def test_a_draft_step_adds_its_share():
    cost = StepCost(draft_cost=0.85)  # a Q2_K of the same model drafting
    assert cost.row_cost == pytest.approx(DEFAULT_ROW_COST + 0.85)
    assert cost.prior_cost == cost.row_cost
    assert best_draft_length(0.89, cost.row_cost, 4) == 0  # it never pays
