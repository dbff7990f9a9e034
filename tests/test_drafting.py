"""Prompt-lookup drafts and the per-row draft control (runner/spec/drafting.py): pure, exact."""
from __future__ import annotations

import pytest

from mlxstack.runner.spec.drafting import DraftControl, NgramDrafter, accepted_prefix


def test_accepted_prefix_counts_leading_agreement_only():
    assert accepted_prefix([5, 6, 7], [5, 6, 7]) == 3
    assert accepted_prefix([5, 6, 7, 9], [5, 6, 7]) == 3          # the bonus position is not a draft
    assert accepted_prefix([5, 9, 7], [5, 6, 7]) == 1             # 7 after a rejection does not count
    assert accepted_prefix([4], [5]) == 0
    assert accepted_prefix([4], []) == 0


def test_proposes_what_followed_the_most_recent_earlier_match():
    #          0  1  2  3  4  5  6  7  8  9
    d = NgramDrafter([1, 2, 3, 4, 5, 9, 2, 3, 7, 8], max_n=3, min_n=2)
    d.extend([1, 2, 3])
    # suffix (1,2,3) occurred at 0..2 -> continuation 4, 5, 9, 2 ...
    assert d.propose(4) == [4, 5, 9, 2]
    d2 = NgramDrafter([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3], max_n=3, min_n=2)
    # suffix (8,2,3) never seen; (2,3) seen last at 6..7 -> 7, 8, 2, 3
    assert d2.propose(3) == [7, 8, 2]


def test_the_current_suffix_never_matches_itself_and_a_repetition_continues_periodically():
    d = NgramDrafter([7, 8, 9], max_n=2, min_n=2)
    assert d.propose(4) == []                # (8, 9) only occurs at the end: no continuation known
    d.extend([7, 8])                         # (7, 8) occurred at 0 -> continuation 9, 7, 8 (the end)
    assert d.propose(5) == [9, 7, 8, 9, 7]   # ... then the period (3) again
    assert d.propose(2) == [9, 7]
    assert d.propose(0) == []


def test_a_reply_that_loops_on_itself_drafts_the_whole_budget():
    """"hello, hello, hello, ..." (period 2 in tokens): the most recent match is 2 tokens back,
    so without the periodic continuation a row drafted 2 tokens a step however long its budget."""
    d = NgramDrafter([1, 2, 3], max_n=4, min_n=2)       # the prompt
    d.extend([10, 11, 10, 11, 10])
    assert d.propose(8) == [11, 10, 11, 10, 11, 10, 11, 10]
    assert d.plan(6) == (6, 0.0)
    d.extend([12])                                       # the loop breaks: (10, 12) never seen
    assert d.propose(4) == []
    far = NgramDrafter([4, 5, 6, 7, 8, 9, 4, 5], max_n=2, min_n=2)
    assert far.propose(3) == [6, 7, 8]                   # a match far back: its own continuation


def test_longer_matches_win_over_more_recent_shorter_ones():
    d = NgramDrafter([5, 1, 2, 40, 41, 9, 2, 50, 51, 5, 1, 2], max_n=3, min_n=1)
    assert d.propose(2) == [40, 41]          # (5,1,2) -> 40, not (2,) -> 50 which is more recent
    d1 = NgramDrafter([9, 2, 50, 51, 8, 2], max_n=3, min_n=1)
    assert d1.propose(2) == [50, 51]          # only a 1-gram matches


def test_min_n_rejects_shorter_matches_and_bad_sizes_are_refused():
    assert NgramDrafter([9, 2, 50, 8, 2], max_n=3, min_n=2).propose(2) == []
    with pytest.raises(ValueError):
        NgramDrafter([], max_n=1, min_n=2)


def test_extend_one_token_at_a_time_equals_one_batch():
    toks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    whole = NgramDrafter(toks, max_n=4, min_n=1)
    step = NgramDrafter(toks[:5], max_n=4, min_n=1)
    for t in toks[5:]:
        step.extend([t])
    for k in (1, 3, 8):
        assert step.propose(k) == whole.propose(k)
    assert step._index == whole._index


def test_draft_control_grows_on_full_acceptance_keeps_on_partial_and_shrinks_on_none():
    c = DraftControl(8)
    assert c.budget() == 8
    c.record(8, 3)
    assert c.k == 8                          # some kept: the length stays (the next match is another)
    c.record(8, 0)
    assert c.k == 4                          # none kept: halved
    c.record(4, 4)
    assert c.k == 8                          # doubled, capped at max
    c.record(8, 8)
    assert (c.k, c.proposed, c.accepted, c.steps) == (8, 28, 15, 4)
    c.record(0, 0)                            # no drafts: nothing changes
    assert (c.k, c.steps) == (8, 4)


def test_draft_control_pauses_a_row_whose_drafts_keep_failing():
    c = DraftControl(6)
    c.record(6, 0)
    assert (c.k, c.pause, c.budget()) == (3, 0, 3)     # one miss: shorter drafts, no pause
    c.record(3, 0)
    assert (c.k, c.pause) == (1, 4)                    # two in a row: pause 2**2 steps
    assert [c.budget() for _ in range(5)] == [0, 0, 0, 0, 1]
    c.record(1, 0)
    assert c.pause == 8                                # the pause doubles
    assert [c.budget() for _ in range(9)] == [0] * 8 + [1]
    c.record(1, 1)                                     # an acceptance resets the streak
    assert (c.misses, c.k) == (0, 2)
    for _ in range(12):
        c.record(1, 0)
        while c.pause:
            c.budget()
    assert c.misses == 12
    c.record(1, 0)
    assert c.pause == 256                              # capped


def test_draft_control_zero_max_never_drafts():
    c = DraftControl(0)
    assert c.budget() == 0 and c.k == 0


def test_expected_accepted_is_the_geometric_sum():
    from mlxstack.runner.spec.drafting import expected_accepted

    assert expected_accepted(0.5, 3) == 0.5 + 0.25 + 0.125
    assert expected_accepted(1.0, 4) == 4.0
    assert expected_accepted(0.9, 0) == 0.0


def test_best_width_drafts_only_where_the_expected_tokens_pay_for_the_wider_forward():
    from mlxstack.runner.spec.drafting import best_width

    assert best_width([], 0.03) == 1
    assert best_width([(0, 0.0)] * 4, 0.03) == 1                  # nobody can draft
    assert best_width([(6, 0.95)], 0.03) == 7                     # one row copying: the longest drafts
    assert best_width([(6, 0.6)], 0.03) == 5                      # diminishing returns stop earlier
    assert best_width([(6, 0.6)] + [(0, 0.0)] * 7, 0.03) == 1     # 7 rows would ride along for nothing
    assert best_width([(6, 0.9)] * 8, 0.03) == 7                  # every row copying, a batch of 8
    assert best_width([(6, 0.6)] * 8, 0.03) == 3                  # a batch of weaker drafts: shorter
    assert best_width([(6, 0.9)] * 8, 0.0) == 7                   # positions for free (a GPU): all drafts
    assert best_width([(2, 0.05)], 0.03) == 1                     # drafts that fail cost more than they give
