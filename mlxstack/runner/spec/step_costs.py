"""What a speculative step costs here, measured: decode-step wall times by batch rows and width.

Pure (no MLX, no I/O). Speculation pays only when the tokens it adds outweigh what the wider
forward costs, and that cost is a property of the machine: on this 2-core CPU one more position
for 8 rows costs ~0.3 of a plain step (the first extra position more than the next ones: a
speculative step also loses the pipelining and reads its tokens back twice), on a GPU almost
nothing. A constant guessed on one machine is wrong on the next, so the scheduler times its
steps and asks this table:

    costs = StepCosts(prior=0.03)
    costs.record(rows=8, width=1, seconds=0.150)      # a plain step of 8 rows
    costs.record(rows=8, width=2, seconds=0.200)      # a speculative step, one draft per row
    costs.cost(8, 2)      # -> 1.333...: that step cost 1.33 plain steps (measured)
    costs.cost(8, 4)      # -> 1.813...: not seen yet: the measured width plus the prior's 0.03 * 8 a position
    costs.cost(16, 2)     # -> 1.48: nothing seen at 16 rows, the prior (1 + 0.03 * 16 * 1)

Before a row count and width were timed, the prior answers: the table of forwards timed at load
(``table``: runner/spec/calibration.py, on the path the step takes here), else the constant.

Each figure is an exponential moving average (``alpha``), so it follows the context growing and
the machine's speed drifting; a speculative step is compared with the plain steps of the same row
count, so a slower minute slows both. Only clean steps are recorded (no row joined, left or
failed in them: those steps also copy rows). A row count that only ever speculates (a batch
copying a file) takes a plain step now and then (``wants_plain``): the yardstick.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepCosts", "prior_step_cost", "table_cost"]


def prior_step_cost(prior: float, rows: int, width: int) -> float:
    """A step of ``width`` positions per row over ``rows`` rows, in plain steps, by the prior
    alone: ``1 + prior * rows * (width - 1)`` (each extra position one more token per row)."""
    return 1.0 if width <= 1 else 1.0 + prior * rows * (width - 1)


def table_cost(table: dict[tuple[int, int], float], rows: int, width: int) -> float:
    """A step of ``width`` positions over ``rows`` rows from a table measured at some row counts and
    widths (runner/spec/calibration.py): along the widths measured at a row count, linear (from 1 at
    width 1; past the widest, its last slope); between two measured row counts, the extra cost
    linear in rows; past the largest, in proportion to the rows; below the smallest, its figures."""
    if width <= 1:
        return 1.0

    def along(r: int) -> float:
        pts = [(1, 1.0)] + sorted((w, v) for (rr, w), v in table.items() if rr == r)
        for (w0, v0), (w1, v1) in zip(pts, pts[1:]):
            if width <= w1:
                return v0 + (v1 - v0) * (width - w0) / (w1 - w0)
        (w0, v0), (w1, v1) = pts[-2], pts[-1]
        return v1 + max(0.0, (v1 - v0) / (w1 - w0)) * (width - w1)

    counts = sorted({r for r, _ in table})
    if rows <= counts[0]:
        return along(counts[0])
    for r0, r1 in zip(counts, counts[1:]):
        if rows <= r1:
            e0, e1 = along(r0) - 1, along(r1) - 1
            return 1 + e0 + (e1 - e0) * (rows - r0) / (r1 - r0)
    return 1 + (along(counts[-1]) - 1) * rows / counts[-1]


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


@dataclass
class StepCosts:
    prior: float = 0.03            # cost of one more position per row, in plain steps, until measured
    alpha: float = 0.2
    plain: dict[int, float] = field(default_factory=dict)                 # rows -> seconds
    ratio: dict[tuple[int, int], float] = field(default_factory=dict)     # (rows, width) -> plain steps
    seen: dict[tuple[int, int], int] = field(default_factory=dict)        # (rows, width) -> steps recorded
    since_plain: dict[int, int] = field(default_factory=dict)             # rows -> wider steps since a plain one
    refresh: int = 64              # a plain step at least this often while rows keep speculating
    table: dict[tuple[int, int], float] = field(default_factory=dict)     # measured at load: the prior
    # rows -> the fastest plain step timed: what a step of that many rows costs when nothing else
    # competes for the machine (a busy minute slows single steps, never speeds one up)
    fastest: dict[int, float] = field(default_factory=dict)

    def wants_plain(self, rows: int) -> bool:
        """Whether the next step of ``rows`` rows should be plain to keep the measure honest: none of
        that row count timed yet (a wider step has nothing to be compared with), or ``refresh``
        wider steps since the last one (the context grew, the machine drifted). One plain step in
        ``refresh`` is what that costs a row that copies all the time."""
        return rows not in self.plain or self.since_plain.get(rows, 0) >= self.refresh

    def record(self, rows: int, width: int, seconds: float) -> None:
        """One clean decode step of ``rows`` rows (the forward's batch, free rows included) that
        fed ``width`` positions per row, and its wall time. A speculative step counts only once a
        plain step of the same row count has been timed (its cost is relative to that)."""
        if rows < 1 or width < 1 or not seconds > 0:
            return
        key = (rows, width)
        if width == 1:
            self.plain[rows] = _ema(self.plain.get(rows), seconds, self.alpha)
            self.fastest[rows] = min(self.fastest.get(rows, seconds), seconds)
            self.since_plain[rows] = 0
        elif rows in self.plain:
            self.ratio[key] = _ema(self.ratio.get(key), seconds / self.plain[rows], self.alpha)
            self.since_plain[rows] = self.since_plain.get(rows, 0) + 1
        else:
            return
        self.seen[key] = self.seen.get(key, 0) + 1

    def plain_step(self, rows: int, least: int = 8) -> float | None:
        """The fastest plain step of ``rows`` rows timed here, once at least ``least`` were (None
        before: a row count seen a few times says nothing yet)."""
        return self.fastest.get(rows) if self.seen.get((rows, 1), 0) >= least else None

    def cost(self, rows: int, width: int) -> float:
        """A step of ``width`` positions per row over ``rows`` rows, in plain steps (never below 1):
        measured at that width; else on the line through the two measured widths nearest to it at
        that row count; else from the one measured width, adding the prior's ``prior * rows`` per
        position; else the prior ``1 + prior * rows * (width - 1)``. (A wider step has a fixed part
        -- it is not pipelined, it reads its tokens back twice -- so one measured width scaled in
        proportion would price a wide step of a copying batch at several plain steps: measured,
        the first extra position for 8 rows here costs ~0.4 of a step, each further one ~0.2.)"""
        if width <= 1:
            return 1.0
        got = self.ratio.get((rows, width))
        if got is not None:
            return max(1.0, got)
        near = sorted((w for (r, w) in self.ratio if r == rows), key=lambda w: (abs(w - width), w))
        if len(near) >= 2:
            (w0, w1) = sorted(near[:2])
            r0, r1 = self.ratio[(rows, w0)], self.ratio[(rows, w1)]
            slope = max(0.0, (r1 - r0) / (w1 - w0))
            return max(1.0, r0 + slope * (width - w0))
        if near:
            w0 = near[0]
            return max(1.0, self.ratio[(rows, w0)] + self.prior_cost(rows, width) - self.prior_cost(rows, w0))
        return self.prior_cost(rows, width)

    def prior_cost(self, rows: int, width: int) -> float:
        """The prior alone: the table measured at load (``table_cost``), else
        ``1 + prior * rows * (width - 1)``; for decisions that must not depend on this run's step
        times (ranks in lockstep)."""
        if self.table:
            return max(1.0, table_cost(self.table, rows, width))
        return prior_step_cost(self.prior, rows, width)

    def snapshot(self) -> dict:
        """For /v1/cache/stats: plain step ms by rows, measured speculative costs by rows x width."""
        plain, ratio = dict(self.plain), dict(self.ratio)      # copies: the inference thread writes them
        return {"plain_step_ms": {str(r): round(s * 1000, 1) for r, s in sorted(plain.items())},
                "speculative_cost": {f"{r}x{w}": round(v, 3) for (r, w), v in sorted(ratio.items())},
                "calibrated_cost": {f"{r}x{w}": v for (r, w), v in sorted(self.table.items())},
                "prior_cost_per_position": self.prior}
