"""Speculation's cost model, measured (runner/spec/step_costs.py): decode-step wall times by rows and
width, and what a wider step costs in plain steps -- measured, scaled from a measured width, or
the prior. Pure: exact numbers."""
from __future__ import annotations

import pytest

from mlxstack.runner.spec.drafting import best_width
from mlxstack.runner.spec.step_costs import StepCosts


def test_nothing_measured_answers_the_prior():
    c = StepCosts(prior=0.03)
    assert c.cost(8, 1) == 1.0
    assert c.cost(8, 2) == pytest.approx(1.24)
    assert c.cost(1, 7) == pytest.approx(1.18)
    c.record(8, 1, 0.1)
    c.record(8, 2, 0.3)                       # measured: 3 plain steps; the prior still says 1.24
    assert c.cost(8, 2) == pytest.approx(3.0) and c.prior_cost(8, 2) == pytest.approx(1.24)
    assert c.prior_cost(8, 1) == 1.0
    c = StepCosts(prior=0.03)
    assert c.snapshot() == {"plain_step_ms": {}, "speculative_cost": {}, "calibrated_cost": {},
                            "prior_cost_per_position": 0.03}


def test_a_speculative_step_counts_only_against_plain_steps_of_the_same_rows():
    c = StepCosts(prior=0.03)
    c.record(8, 2, 0.2)                       # no plain step of 8 rows timed yet: ignored
    assert c.ratio == {} and c.seen == {}
    c.record(4, 1, 0.1)                       # another row count does not help
    c.record(8, 2, 0.2)
    assert c.ratio == {}
    c.record(8, 1, 0.15)
    c.record(8, 2, 0.2)
    assert c.cost(8, 2) == pytest.approx(0.2 / 0.15)
    assert c.seen == {(4, 1): 1, (8, 1): 1, (8, 2): 1}


def test_moving_averages_follow_the_machine():
    c = StepCosts(prior=0.03, alpha=0.5)
    c.record(8, 1, 0.1)
    c.record(8, 1, 0.2)                       # 0.1 + 0.5 * (0.2 - 0.1)
    assert c.plain[8] == pytest.approx(0.15)
    c.record(8, 3, 0.3)                       # 2.0 plain steps
    c.record(8, 3, 0.15)                      # 1.0 -> the average 1.5
    assert c.cost(8, 3) == pytest.approx(1.5)


def test_unmeasured_widths_from_one_measured_width_add_the_priors_price_per_position():
    c = StepCosts(prior=0.03)
    c.record(8, 1, 0.1)
    c.record(8, 2, 0.14)                      # the first extra position: +0.4 (the fixed part)
    assert c.cost(8, 6) == pytest.approx(1.4 + 0.03 * 8 * 4)
    assert c.cost(16, 2) == pytest.approx(1.48)       # nothing at 16 rows: the prior


def test_unmeasured_widths_on_the_line_through_the_two_nearest_measured_ones():
    c = StepCosts(prior=0.03)
    c.record(8, 1, 0.1)
    c.record(8, 2, 0.14)                      # +0.4
    c.record(8, 4, 0.18)                      # +0.8: 0.2 a position beyond the first
    c.record(8, 7, 0.27)                      # +1.7: 0.3 a position beyond the fourth
    assert c.cost(8, 3) == pytest.approx(1.6)         # between 2 and 4
    assert c.cost(8, 5) == pytest.approx(2.1)         # nearest are 4 and 7 (tie with 6 goes narrower)
    assert c.cost(8, 9) == pytest.approx(3.3)         # beyond 7: the line through 4 and 7


def test_a_wide_step_is_not_priced_in_proportion_to_a_narrow_ones_fixed_part():
    """Measured here: one draft per row for 8 rows cost 1.46 plain steps; a copying batch's 6-wide
    step must not be priced at 1 + 0.46 * 5 = 3.3 (it would never speculate) -- that was a bug."""
    c = StepCosts(prior=0.03)
    c.record(8, 1, 0.1555)
    c.record(8, 2, 0.1555 * 1.457)
    assert c.cost(8, 6) == pytest.approx(1.457 + 0.96)
    rows = [(6, 0.9)] * 8                     # every row copying
    assert best_width(rows, lambda w: c.cost(8, w)) == 6


def test_a_measured_step_never_costs_less_than_a_plain_one():
    c = StepCosts(prior=0.03)
    c.record(2, 1, 0.2)
    c.record(2, 2, 0.1)                       # a faster minute: 0.5 plain steps
    assert c.cost(2, 2) == 1.0
    assert c.cost(2, 3) == 1.0                # 0.5 + 0.03 * 2: still below a plain step


@pytest.mark.parametrize("rows, width, seconds", [(0, 1, 0.1), (8, 0, 0.1), (8, 1, 0.0), (8, 1, float("nan"))])
def test_nonsense_is_not_recorded(rows, width, seconds):
    c = StepCosts()
    c.record(rows, width, seconds)
    assert c.plain == {} and c.seen == {}


def test_snapshot_in_milliseconds_and_plain_steps():
    c = StepCosts(prior=0.05)
    c.record(8, 1, 0.1504)
    c.record(8, 2, 0.2)
    assert c.snapshot() == {"plain_step_ms": {"8": 150.4}, "speculative_cost": {"8x2": 1.33},
                            "calibrated_cost": {}, "prior_cost_per_position": 0.05}


def test_best_width_asks_the_measured_costs():
    """The same rows choose differently on a machine where positions are cheap and on one where the
    first extra position already costs a third of a step."""
    rows = [(6, 0.6)] * 5 + [(0, 0.0)] * 3          # five of eight rows could draft
    cheap, dear = StepCosts(prior=0.03), StepCosts(prior=0.03)
    for c, spec in ((cheap, 0.102), (dear, 0.14)):
        c.record(8, 1, 0.1)
        c.record(8, 2, spec)
    cheap.record(8, 7, 0.112)                         # +2 % a position, measured up to 7 wide
    assert best_width(rows, 0.03) == 2                                  # the prior alone
    assert best_width(rows, lambda w: cheap.cost(8, w)) == 5            # +2 % per position: longer drafts
    assert best_width(rows, lambda w: dear.cost(8, w)) == 1             # +40 %: a plain step


def test_a_row_count_that_only_speculates_takes_a_plain_step_now_and_then():
    c = StepCosts(refresh=3)
    assert c.wants_plain(8)                   # nothing to compare a wider step with yet
    c.record(8, 1, 0.1)
    assert not c.wants_plain(8) and c.wants_plain(4)
    for _ in range(2):
        c.record(8, 4, 0.2)
    assert not c.wants_plain(8)
    c.record(8, 4, 0.2)
    assert c.wants_plain(8)                   # three wider steps since: measure a plain one again
    c.record(8, 1, 0.12)
    assert not c.wants_plain(8) and c.since_plain[8] == 0


TABLE = {(1, 2): 1.1, (1, 4): 1.3, (1, 8): 1.5, (8, 2): 1.3, (8, 4): 1.9, (8, 8): 2.9}


def test_a_table_timed_at_load_is_the_prior():
    """runner/spec/calibration.py's table: along the widths linear (from 1 at width 1, past the
    widest its last slope), between row counts the extra cost linear in rows, past the largest in
    proportion, below the smallest its figures; measured steps still win over it."""
    from mlxstack.runner.spec.step_costs import table_cost

    assert table_cost(TABLE, 1, 1) == 1.0
    assert table_cost(TABLE, 1, 2) == pytest.approx(1.1)
    assert table_cost(TABLE, 1, 3) == pytest.approx(1.2)                  # between widths 2 and 4
    assert table_cost(TABLE, 1, 10) == pytest.approx(1.6)                 # past 8: slope 0.05 a position
    assert table_cost(TABLE, 8, 6) == pytest.approx(2.4)
    assert table_cost(TABLE, 4, 4) == pytest.approx(1 + 0.3 + (0.9 - 0.3) * 3 / 7)   # rows 1..8
    assert table_cost(TABLE, 16, 2) == pytest.approx(1.6)                 # 0.3 extra at 8 rows -> 0.6
    c = StepCosts(prior=0.03, table=dict(TABLE))
    assert c.cost(8, 4) == pytest.approx(1.9) and c.prior_cost(8, 4) == pytest.approx(1.9)
    c.record(8, 1, 0.1)
    c.record(8, 4, 0.25)
    assert c.cost(8, 4) == pytest.approx(2.5)                             # measured
    assert c.cost(8, 8) == pytest.approx(2.5 + 2.9 - 1.9)                 # one measured width + the table's step
    assert c.snapshot()["calibrated_cost"] == {"1x2": 1.1, "1x4": 1.3, "1x8": 1.5, "8x2": 1.3, "8x4": 1.9, "8x8": 2.9}
