"""Who goes first when rows are short: how waiting raises a request's urgency, and which decode
rows make way for a more urgent request (plain numbers in, choices out; no MLX).

A priority is vLLM's integer: lower goes first. Where it comes from -- the request's ``priority``
field, the ``x-mlxstack-priority`` header, or what agent clients send -- is prompt/urgency.py's.
With one priority everywhere the order is first come, first served, as before.

Three choices follow from it (engine/core.py and engine/worker.py apply them each step):
- **admission**: the most urgent waiting request takes the next free row; waiting raises a
  request's urgency by one level every ``aging_s`` seconds (``effective``), so nothing starves;
- **preemption**: when a request more urgent than some decoding row is in flight, at most
  ``beside`` less urgent rows go on decoding next to it (``to_preempt``): the others leave the
  batch with their KV and their sampled, not yet fed, token, and resume exactly there once no
  more urgent request is in flight (``to_resume``) -- their replies token for token what they
  would have been (LESSONS 85). A decode step of fewer rows is what keeps the urgent reply's
  tokens near their speed alone;
- **prefill**: the most urgent waiting prompt gets the step's chunk first (scheduler/plan.py).

How many rows may stay beside it is the machine's: at least ``floor`` (PRIORITY_DECODE_ROWS), more
while a decode step of that many rows was measured here to keep the urgent row's tokens at
``share`` (PRIORITY_DECODE_SHARE) of their speed alone (``beside_rows``): on a GPU or Apple Silicon
a batch of 8 costs little more than one row and the background keeps decoding; on a CPU a step's
cost grows with its rows and the background pauses. Only measured steps count (no guess).
"""
from __future__ import annotations

from typing import Any


def movable(row: Any) -> bool:
    """Whether a decode row may leave for a more urgent request: not one whose last prompt token
    still rides in the next step (``tail``), not one that came back by waiting (``shielded``: no
    starvation)."""
    return not row.tail and not row.shielded


def effective(priority: int, waited_s: float, aging_s: float) -> float:
    """A waiting request's urgency: its priority less one level per ``aging_s`` waited."""
    return priority - (waited_s / aging_s if aging_s > 0 else 0.0)


def most_urgent(waiting: list[tuple[int, float]], aging_s: float) -> int:
    """Index of the waiting request to admit next, of (priority, seconds waited) pairs: the lowest
    effective priority; the one that waited longest among equals (first come, first served)."""
    return min(range(len(waiting)), key=lambda i: (effective(*waiting[i], aging_s), -waiting[i][1]))


def _least_first(rows: list[int], idx: list[int]) -> list[int]:
    """``idx`` (indices into ``rows``, priorities in the order they joined) least urgent first,
    the last to join first among equals."""
    return sorted(idx, key=lambda i: (-rows[i], -i))


def least_urgent(rows: list[int], urgent: int) -> int | None:
    """Index of the decode row that makes room for a request of priority ``urgent`` when the
    batch is full: the least urgent less urgent one (the last to join among equals), or None."""
    less = _least_first(rows, [i for i, p in enumerate(rows) if p > urgent])
    return less[0] if less else None


def to_preempt(rows: list[int], urgent: int | None, beside: int) -> list[int]:
    """Indices of the decode rows (their priorities, in the order they joined) that make way while
    a request of priority ``urgent`` is in flight: the less urgent rows beyond ``beside``, the
    least urgent first and, among equals, the last to join."""
    if urgent is None:
        return []
    less = [i for i, p in enumerate(rows) if p > urgent]
    if len(less) <= beside:
        return []
    return sorted(_least_first(rows, less)[: len(less) - beside])


def to_resume(preempted: list[tuple[int, float]], urgent: int | None, decoding_less: int,
              beside: int, free_rows: int, aging_s: float) -> list[int]:
    """Indices of the preempted rows (priority, seconds since they left) that come back now: with
    no more urgent request in flight, as many as there are free rows; beside one, up to ``beside``
    less urgent rows in all. The most urgent first; waiting raises a preempted row's urgency as
    it does a waiting request's, so one that waited long enough is no longer "less urgent" and
    comes back beside it (no starvation under a stream of urgent turns)."""
    eff = [effective(p, w, aging_s) for p, w in preempted]
    order = sorted(range(len(preempted)), key=lambda i: (eff[i], -preempted[i][1]))
    out: list[int] = []
    less = decoding_less
    for i in order:
        if len(out) >= free_rows:
            break
        if urgent is not None and eff[i] > urgent:
            if less >= beside:
                continue
            less += 1
        out.append(i)
    return out


def beside_rows(step_s: tuple[float | None, ...], share: float, floor: int) -> int:
    """Less urgent rows that may decode beside one urgent row: ``step_s[m - 1]`` is what a decode
    step of ``m`` members was measured to take here (the forward rows the batch would compute with
    that many; None: never timed), ``step_s[0]`` the urgent row alone. The most ``m - 1`` whose
    step keeps ``alone / step >= share``, at least ``floor``; ``floor`` when ``share`` is 0 or the
    step alone was never timed."""
    alone = step_s[0] if step_s else None
    if share <= 0 or not alone:
        return floor
    fits = [m - 1 for m, t in enumerate(step_s, start=1) if m > 1 and t and alone / t >= share]
    return max([floor, *fits])
