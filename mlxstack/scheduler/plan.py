"""One step's plan: which rows leave or rejoin the batch, which waiting requests prefill and
how -- decided on plain data.

    sched = Scheduler(prefill_budget=512, prefills_together=True)
    sched.enter(req)                                   # started and admitted: waits to prefill
    plan = sched.schedule(InFlight(decoding=..., preempted=..., stopped=..., ...))   # -> StepPlan
    ... the engine core applies the plan's row moves, has the runner execute the rest, then:
    sched.drop(req)                                    # its prefill finished or failed

Rows first (with priorities, scheduler/priority.py): preempted rows whose client left end; while
a request more urgent than some decode rows is in flight, the less urgent ones beyond ``beside``
leave the batch (``preempt``); free rows take preempted ones back, the most urgent first
(``resume``). The plan names them; the engine core moves them (runner/batch.py preempt / resume).

A step prefills within ``prefill_budget`` tokens: when prefills may share a forward and two or
more waiting requests have short remainders (a warm agent turn's new tokens), all of them in one
batched forward -- they join the decode batch together; otherwise one chunk for ONE request: a
remainder one chunk finishes goes before a longer prompt's next chunk (never twice in a row while
the longer one waits), else round-robin. A long cold prompt never freezes the others, and a short
request that arrives during it waits at most one of its chunks. With priorities (``aging_s`` not
None: scheduler/priority.py) these rules apply among the most urgent waiting requests only --
their priority less one level per ``aging_s`` waited, so a less urgent prompt is not starved. Every step then decodes one token
for every row of the batch (the runner's decode group).

A request is the engine's (engine/request.py), read here only for plain facts: its prompt
tokens, checkout depth ``start``, prefill position ``pos``, whether it ``follows`` a leader's
shared prefill, whether its job is ``prefill_only``, its job's ``priority`` and when it was
queued (``queued_at``, perf_counter seconds). What needs the engine comes as data in ``InFlight``:
the ids of the requests that were abandoned (``stopped``: a hang-up or the watchdog, heard of the
requests ``hearing`` names) and of those whose cache holds a prefix by reference (``prefixed``: such
rows batch only on slab layers, which need every row to hold a token already). The scheduler calls
nothing: a plan is a function of its state and that data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .policy import choose_short, next_round_robin, remaining, shortest_fitting
from .priority import beside_rows, effective, movable, to_preempt, to_resume


@dataclass(frozen=True)
class InFlight:
    """What the engine core holds besides the waiting prompts: requests, read for plain facts
    (``job.priority``, ``tail``, ``shielded``, ``preempted_at``)."""
    decoding: tuple[Any, ...] = ()    # the decode batch's rows, in the order they joined
    preempted: tuple[Any, ...] = ()   # out of the batch for a more urgent request
    parked: tuple[Any, ...] = ()      # started, waiting for KV memory
    max_rows: int = 1                 # MAX_CONCURRENT_SEQUENCES
    prioritised: bool = False         # PRIORITY_SCHEDULING on (and one rank)
    beside: int = 0                   # PRIORITY_DECODE_ROWS: at least this many rows beside an urgent one
    share: float = 0.0                # PRIORITY_DECODE_SHARE: more while measured steps keep its speed (priority.py)
    step_s: tuple[float | None, ...] = ()   # [m - 1]: a decode step of m members, measured here (None: never)
    aging_s: float = 30.0             # PRIORITY_AGING_SECONDS
    now: float = 0.0                  # perf_counter seconds (preempted_at, queued_at are read against it)
    stopped: frozenset[int] = frozenset()    # ids of requests abandoned (of those ``hearing`` names)
    prefixed: frozenset[int] = frozenset()   # ids of waiting requests whose cache holds a prefix by reference


@dataclass(frozen=True)
class StepPlan:
    """One step: the rows that end, leave or rejoin the batch, then what it prefills; its decode
    covers every row of the batch after those moves and the prefills that finish."""
    step: int
    short: tuple[Any, ...] = ()     # requests whose whole remainders are fed together in one forward
    prefill: Any = None             # or the one request whose next chunk is fed
    budget: int = 0                 # tokens the prefill may feed
    end: tuple[Any, ...] = ()       # preempted rows whose client left: they end now
    preempt: tuple[Any, ...] = ()   # decode rows that leave the batch for a more urgent request
    resume: tuple[Any, ...] = ()    # preempted rows that rejoin it, most urgent first
    urgent: int | None = None       # the most urgent priority in flight (with priorities)


def left(req: Any) -> int:
    """Prompt tokens ``req`` still has to feed."""
    return remaining(len(req.prep.model_tokens), req.start, req.pos)


class Scheduler:
    def __init__(self, prefill_budget: int, prefills_together: bool, aging_s: float | None = None) -> None:
        self.prefill_budget = max(1, int(prefill_budget))
        self.prefills_together = prefills_together
        self.aging_s = aging_s        # None: no priorities (every waiting request alike)
        self.prefilling: list[Any] = []
        self.steps = 0
        self.short_batches = 0        # steps that prefilled several requests together
        self._rr = -1
        self._short_last = False      # the previous step served short work out of turn (a batch or one)
        self._urgent: int | None = None   # the most urgent priority in flight when ``_beside`` was chosen
        self._beside = 0

    def enter(self, req: Any) -> None:
        self.prefilling.append(req)

    def drop(self, req: Any) -> None:
        """``req`` no longer waits to prefill (finished, failed or abandoned)."""
        i = next(i for i, r in enumerate(self.prefilling) if r is req)
        del self.prefilling[i]
        if i <= self._rr:
            self._rr -= 1

    def reset(self) -> None:
        self.prefilling = []
        self._rr, self._short_last = -1, False
        self._urgent, self._beside = None, 0

    def hearing(self, preempted: tuple[Any, ...] | list[Any] = ()) -> list[Any]:
        """The requests whose hang-up (or watchdog) a plan reads (``InFlight.stopped``): those
        whose prompt has started feeding, and the preempted rows."""
        return [r for r in self.prefilling if r.pos >= 0] + list(preempted)

    def schedule(self, flight: InFlight = InFlight()) -> StepPlan:
        self.steps += 1
        rows = self._rows(flight)
        short = self._short_batch(flight)
        if len(short) >= 2:
            self._short_last = True
            self.short_batches += 1
            self.prefilling = [r for r in self.prefilling if not any(r is s for s in short)]
            self._rr = -1
            return StepPlan(self.steps, short=tuple(short), budget=self.prefill_budget, **rows)
        if self.prefilling:
            return StepPlan(self.steps, prefill=self.prefilling[self._next_prefill(flight.now)],
                            budget=self.prefill_budget, **rows)
        return StepPlan(self.steps, **rows)

    def _rows(self, f: InFlight) -> dict[str, Any]:
        """The plan's row moves (scheduler/priority.py): which preempted rows end, which decode
        rows leave, which preempted rows come back."""
        if not f.preempted and not f.prioritised:
            return {}
        end = tuple(s for s in f.preempted if id(s) in f.stopped)
        urgent = min((s.job.priority for s in (*self.prefilling, *f.decoding, *f.parked)), default=None) \
            if f.prioritised else None
        if urgent != self._urgent:   # rows beside it chosen once per urgent level: no flapping as costs drift
            self._urgent, self._beside = urgent, beside_rows(f.step_s, f.share, f.beside)
        beside = self._beside
        may_leave = [s for s in f.decoding if movable(s)]
        # rows that may not leave but are less urgent take their places beside the urgent one first
        fixed = sum(1 for s in f.decoding if urgent is not None and s.job.priority > urgent and not movable(s))
        preempt = tuple(may_leave[i] for i in to_preempt([s.job.priority for s in may_leave], urgent,
                                                       max(0, beside - fixed)))
        out = [s for s in f.preempted if not any(s is e for e in end)]
        waiting = [(s, f.now - s.preempted_at) for s in out] + [(s, 0.0) for s in preempt]
        if not waiting:
            return {"end": end, "preempt": preempt, "urgent": urgent}
        staying = [s for s in f.decoding if not any(s is p for p in preempt)]
        free = f.max_rows - len(self.prefilling) - len(staying) - len(f.parked)
        less = sum(1 for s in staying if urgent is not None and s.job.priority > urgent)
        back = to_resume([(s.job.priority, w) for s, w in waiting], urgent, less,
                         beside if f.prioritised else f.max_rows, free, f.aging_s)
        return {"end": end, "preempt": preempt, "resume": tuple(waiting[i][0] for i in back), "urgent": urgent}

    def _short_batch(self, f: InFlight) -> list[Any]:
        """Waiting requests whose whole remainders fit one padded batch within the budget (a long
        prompt still waiting gets the next step)."""
        if not self.prefills_together or len(self.prefilling) < 2:
            return []
        top = self._top(f.now)
        cands = [r for r in top if r.follows is None
                 and not r.job.prefill_only and not (r.pos >= 0 and id(r) in f.stopped)]
        if any(id(r) in f.prefixed for r in cands):        # slab rows: an empty one cannot be placed,
            cands = [r for r in cands if r.live.depth > 0]   # it prefills on its own
        chosen = [cands[i] for i in choose_short([left(r) for r in cands], self.prefill_budget)]
        if len(chosen) < 2 or (self._short_last and len(chosen) < len(self.prefilling)):
            return []
        return chosen

    def _level(self, req: Any, now: float) -> int:
        """``req``'s priority level now: its job's priority less one per ``aging_s`` waited."""
        return math.floor(effective(getattr(req.job, "priority", 0), now - getattr(req, "queued_at", now),
                                    self.aging_s or 0.0) + 1e-9)

    def _top(self, now: float) -> list[Any]:
        """The waiting requests the rules choose among: all of them, or with priorities the most
        urgent level's (aged as of ``now``)."""
        if self.aging_s is None or len(self.prefilling) < 2:
            return self.prefilling
        levels = [self._level(r, now) for r in self.prefilling]
        best = min(levels)
        return [r for r, lv in zip(self.prefilling, levels) if lv == best]

    def _next_prefill(self, now: float) -> int:
        """Which waiting request gets this step's prefill chunk: one whose whole remainder fits in
        the chunk goes before a longer one, but never twice in a row while a longer one waits;
        otherwise round-robin, skipping a request that waits for its leader (among the most urgent
        level's with priorities: the first of them not following a leader)."""
        top = self._top(now)
        if len(top) < len(self.prefilling):
            idx = [i for i, r in enumerate(self.prefilling) if any(r is t for t in top)]
            fits = shortest_fitting([0 if self.prefilling[i].follows else left(self.prefilling[i]) for i in idx],
                                    self.prefill_budget)
            own = [i for i in idx if self.prefilling[i].follows is None]
            return idx[fits] if fits is not None else (own or idx)[0]
        if not self._short_last:
            i = shortest_fitting([0 if r.follows else left(r) for r in self.prefilling], self.prefill_budget)
            if i is not None:
                self._short_last = True
                return i
        self._short_last = False
        for _ in range(len(self.prefilling)):
            self._rr = next_round_robin(len(self.prefilling), self._rr)
            if self.prefilling[self._rr].follows is None:
                break
        return self._rr
