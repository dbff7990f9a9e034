"""The engine core: continuous batching on the one inference thread. Many requests in flight,
every one with its full cache pipeline (lookup -> checkout at its own depth -> prefill -> decode
-> close the turn -> store), advanced a step at a time.

    core = EngineCore(engine, max_sequences=8, prefill_budget=512, batching=True)
    core.admit(job, future)        # starts the request (render, lookup, checkout)
    core.step()                    # schedule -> execute -> update (below); resolves finished futures

One step:
1. **schedule** (scheduler/plan.py, no MLX): the step's row moves (preempted rows whose client
   left end, less urgent rows leave the batch for a more urgent request, preempted ones rejoin)
   and its prefill -- several waiting requests' short remainders in one forward, or one
   request's next chunk (the rules are there), as a ``StepPlan``;
2. **execute** on the runner (runner/: the only place a model runs): the row moves, that prefill,
   then one decode token for EVERY decoding sequence in one batched forward (runner/batch.py
   DecodeGroup ``step`` -> per-row ``RowOutput``: data);
3. **update**: prefilled requests join the batch, followers take their leader's KV, finished
   replies resolve; a reply that ends while other rows still decode goes out at once, its turn
   closed and stored with the others' once the batch empties or a request is admitted (``_end``).

Admission is FIFO up to ``max_sequences`` in flight and within the KV byte budget
(PROMPT_CACHE_MAX_BYTES). A request is started (rendered, looked up, checked out); when the KV
held in flight (measured: ``live_kv_bytes``), what the requests in flight will still add and what
it will add (uncached prompts, up to ``GROWTH`` generated tokens each, at the model's bytes per
token) would pass the budget while others are in flight, it is parked -- no row,
nothing admitted behind it -- until enough of them finish; alone, a request always runs. The RAM
cache tier makes room for what a starting request will hold (spilled / evicted in its usual
order: a hot session's entries last). The worker's bounded queue (503 when full) holds the rest.
A sequence that finished prefill joins the decode batch; one that finished or was abandoned
(hang-up, watchdog) leaves it, and only it. Everything runs on the caller's thread: no MLX call
ever leaves the inference thread.

A failure fails the requests it touched, and every future is resolved: a request whose prefill,
start, sampler or detokenizer failed gets its exception (the others go on, token for token); a
decode batch that had to be dropped (runner/batch.py GroupReset) fails its members. Only an
Exception is handled here: anything else (SystemExit, an injected fatal) is a dying thread, and
the worker resolves what is left (engine/worker.py). Should an exception still escape ``step()``,
the worker calls ``recover()``: every request in flight fails, the state is emptied, serving goes on.
A failed request stores nothing: no cache entry, no session record, no healing entry.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass

from ..cache.manager import KVManager
from ..runner.batch import DecodeGroup, GroupReset
from ..runner.rows import Verdict, halted
from ..runner.batch_prefill import feed_together, holds_prefixed, prefill_together
from ..runner.prefill import feed_deferred, prefill_chunk
from .chat import ChatEngine, ChatJob, ChatOutcome, Request
from ..runner.kv_bytes import live_bytes, measured_token_bytes, resident_arrays
from ..scheduler.admission import applies, committed_bytes, need_bytes, room
from ..scheduler.plan import InFlight, Scheduler, StepPlan, left
from ..scheduler.policy import growth
from ..scheduler import priority
from ..scheduler.shared_prefill import plan_follow, ready
from ..scheduler.status import RequestStatus
from .worker import resolve

log = logging.getLogger("mlxstack.scheduler")


class SchedulerReset(RuntimeError):
    """A request that was in flight when the scheduler's state had to be thrown away."""


def _growth(seq: Request) -> int:
    return growth(seq.params.max_tokens, seq.produced)


def fork(follower: Request, kv: KVManager) -> None:
    """Give ``follower`` its leader's first ``depth`` tokens by reference (cache/manager.py
    ``fork``; scheduler/shared_prefill.py decided whom it follows and when)."""
    leader, depth = follower.follows
    follower.live = kv.fork(leader.live, depth)
    follower.shared_prefill = depth - follower.start
    follower.start = depth
    follower.pos = depth
    follower.follows = None


@dataclass(frozen=True)
class PriorityPolicy:
    """PRIORITY_SCHEDULING, PRIORITY_DECODE_ROWS, PRIORITY_AGING_SECONDS, PRIORITY_DECODE_SHARE
    (scheduler/priority.py)."""
    enabled: bool = False
    beside: int = 0
    aging_s: float = 30.0
    share: float = 0.0


class EngineCore:
    def __init__(self, engine: ChatEngine, max_sequences: int, prefill_budget: int, batching: bool,
                 policy: PriorityPolicy = PriorityPolicy()) -> None:
        self.engine = engine
        self.max_sequences = max(1, int(max_sequences))
        self.group = DecodeGroup(engine.runner, batching)
        self.scheduler = Scheduler(prefill_budget, self.group.prefills_together)
        self.policy = policy
        self.preempted: list[Request] = []   # left the batch for a more urgent request (the plan's ``preempt``)
        self.preemptions = 0          # rows that did
        self.resumed = 0              # rows that came back
        self.futures: dict[int, Future] = {}
        self.last_batch = 0
        self.batch_peak = 0           # most rows in one decode forward since the worker last took work when idle
        self.closed_together = 0      # turns closed in a shared forward with others
        self.closing: list[Request] = []   # replied while others decode; turn closed and stored later
        self.replied_early = 0        # replies sent before their turn's closing forward
        self.failed = 0               # requests failed by the scheduler (not by their own finish)
        self.recoveries = 0           # times the whole state was thrown away (recover)
        self.shared_prefills = 0      # requests that took a common prompt prefix from another's prefill
        # started, waiting for KV memory (admission by bytes): one, or with priorities one per
        # request more urgent than every one parked before it (``has_room``)
        self.waiting_memory: list[Request] = []
        self.parked_total = 0         # requests that had to wait for memory
        self._token_bytes: tuple[int, int] | None = None
        self._tier_key: tuple = ()
        self._tier_ids: dict[int, int] = {}

    @property
    def prefilling(self) -> list[Request]:
        return self.scheduler.prefilling

    @property
    def prefill_budget(self) -> int:
        return self.scheduler.prefill_budget

    @property
    def steps(self) -> int:
        return self.scheduler.steps

    @property
    def short_batches(self) -> int:
        return self.scheduler.short_batches

    @property
    def active(self) -> int:
        return len(self.prefilling) + len(self.group) + len(self.waiting_memory) + len(self.preempted)

    @property
    def parked(self) -> Request | None:
        """The request that starts first once memory allows (the most urgent parked), or None."""
        return self.waiting_memory[0] if self.waiting_memory else None

    @property
    def prioritised(self) -> bool:
        """Whether priorities decide (PRIORITY_SCHEDULING, one rank: ranks decide alike only on
        what rank 0 sends, and waiting times differ between them)."""
        return self.policy.enabled and not self.engine.state.replicated

    def has_room(self, urgency: int | None = None) -> bool:
        """Whether a request (of priority ``urgency``) may start now: a row free and no request
        parked that it may not overtake -- with priorities a request more urgent than every parked
        one starts (and parks ahead of them if memory is short: LESSONS 91). A preempted row keeps
        its row against a request no more urgent than it (it resumes first), not against a more
        urgent one."""
        if self.waiting_memory and not self._overtakes(urgency):
            return False
        held = sum(1 for s in self.preempted if urgency is None or s.job.priority <= urgency)
        rows = len(self.prefilling) + len(self.group) + len(self.waiting_memory) + held
        return rows < self.max_sequences

    def _overtakes(self, urgency: int | None) -> bool:
        """Whether a request of priority ``urgency`` goes before every parked one."""
        return (self.prioritised and urgency is not None
                and all(urgency < s.job.priority for s in self.waiting_memory))

    def room_for(self, urgency: int) -> bool:
        """``has_room`` for a request of priority ``urgency``; with priorities, a full batch makes
        room by preempting its least urgent row when that one is less urgent."""
        if not self.has_room(urgency) and self.prioritised and (not self.waiting_memory or self._overtakes(urgency)):
            rows = self._preemptible()
            i = priority.least_urgent([s.job.priority for s in rows], urgency)
            if i is not None:
                self._preempt([rows[i]])
        return self.has_room(urgency)

    def _preemptible(self) -> list[Request]:
        """Decode rows that may leave for a more urgent request (scheduler/priority.py ``movable``)."""
        return [s for s in self.group.seqs if priority.movable(s)]

    def in_flight(self) -> list[Request]:
        """Every request in flight, whatever its status."""
        return [*self.prefilling, *self.group.seqs, *self.preempted, *self.closing, *self.waiting_memory]

    def in_flight_counts(self) -> Counter[tuple[int, str]]:
        """Requests in flight per (priority, status): what the stats and /metrics show."""
        return Counter((seq.job.priority, seq.status.value) for seq in self.in_flight())

    def by_status(self) -> dict[str, int]:
        """Requests in flight per status (engine/request.py ``status``)."""
        out: Counter[str] = Counter()
        for (_, status), n in self.in_flight_counts().items():
            out[status] += n
        return dict(out)

    def by_priority(self) -> dict[int, int]:
        """Requests in flight per priority (replied ones waiting to be closed left out)."""
        out: Counter[int] = Counter()
        for (prio, status), n in self.in_flight_counts().items():
            if status != RequestStatus.CLOSING.value:
                out[prio] += n
        return dict(sorted(out.items()))

    def pick_next(self, waiting: list[tuple[int, float]]) -> int:
        """Which of the waiting jobs (priority, seconds waited) the worker admits next: the most
        urgent (waiting raises it) with priorities, else the first."""
        return priority.most_urgent(waiting, self.policy.aging_s) if self.prioritised and waiting else 0

    # ------------------------------------------------------------------ admission by memory
    def need_bytes(self, seq: Request) -> int:
        """KV bytes ``seq`` will add while in flight: its uncached prompt and up to ``GROWTH``
        generated tokens, at the model's bytes per token (measured once, on a fresh cache fed one
        token); the reused prefix is held by reference (a rooted checkout, the slab's prefix)."""
        per_token, per_seq = self._per_token()
        return need_bytes(per_token, per_seq, len(seq.prep.model_tokens) - seq.start, _growth(seq))

    def _per_token(self) -> tuple[int, int]:
        if self._token_bytes is None:
            try:
                self._token_bytes = measured_token_bytes(self.engine.runner)
            except Exception:  # noqa: BLE001 - admission then reads the measured bytes alone
                log.warning("could not measure the KV bytes per token; admission by memory counts "
                            "only what is held", exc_info=True)
                self._token_bytes = (0, 0)
        return self._token_bytes

    def committed_bytes(self) -> int:
        """KV held in flight (measured at the last step) plus what the requests in flight will still
        add: the prompt they have not fed and up to ``GROWTH`` more generated tokens each."""
        per_token, _ = self._per_token()
        ahead = sum(left(s) + _growth(s) for s in [*self.prefilling, *self.group.seqs, *self.preempted])
        return committed_bytes(self.engine.state.live_kv_bytes, per_token, ahead)

    def _room(self, seq: Request) -> int | None:
        """KV bytes the budget leaves once ``seq`` is in flight beside the others (negative: it
        would pass the budget); None when admission by memory does not apply -- no budget, several
        ranks, or nothing else in flight (alone, a request always runs)."""
        state = self.engine.state
        if not applies(state.cache_budget, bool(self.prefilling or len(self.group)), state.replicated):
            return None          # measured only when it decides: need_bytes measures bytes per token once
        return room(state.cache_budget, self.committed_bytes(), self.need_bytes(seq))

    def _admit_or_park(self, seq: Request) -> bool:
        """``seq`` starts prefilling (the RAM cache tier first gives up what the budget no longer
        leaves it), or waits for memory (False)."""
        room = self._room(seq)
        if room is not None and room < 0:
            return False
        if room is not None:
            self.engine.state.kv.fit(room, self._checked_out(seq))
        self._enter(seq)
        return True

    def _checked_out(self, seq: Request) -> set[int]:
        """The cache entries ``seq`` and the requests in flight were checked out of: they hold
        those arrays (by reference, or until their first append), so spilling the entries frees
        no memory and loses a hot entry."""
        seqs = [seq, *self.prefilling, *self.group.seqs, *self.closing, *self.preempted, *self.waiting_memory]
        return {s.match.entry.entry_id for s in seqs if s.match.hit and s.match.entry is not None}

    def _unpark(self) -> None:
        """Parked requests start, the most urgent first, while memory allows; one that still does
        not fit stops the rest (none overtakes it). A client that left is let in at once: its
        prefill stops after one chunk."""
        while self.waiting_memory:
            seq = self.waiting_memory.pop(0)    # not counted beside itself while its room is computed
            if seq.job.is_cancelled():
                self._enter(seq)
            elif not self._admit_or_park(seq):
                self.waiting_memory.insert(0, seq)
                return

    def idle(self) -> bool:
        return self.active == 0

    # ------------------------------------------------------------------ admission
    def admit(self, job: ChatJob, future: Future, queued_at: float = 0.0) -> None:
        """Start ``job`` now (render, lookup, checkout); a failure resolves its future at once.
        Turns still waiting to be closed are stored first: the lookup sees every reply sent."""
        self._flush_closing()
        try:
            seq = self.engine.start(job)
        except Exception as exc:  # noqa: BLE001 - travels back to the handler (4xx / 5xx)
            resolve(future, exc=exc)
            return
        seq.queued_at = queued_at
        self.futures[id(seq)] = future
        if not self._admit_or_park(seq):
            seq.status = RequestStatus.PARKED
            # ahead of every parked one less urgent than it (``has_room`` let it overtake them)
            at = next((i for i, s in enumerate(self.waiting_memory) if seq.job.priority < s.job.priority),
                      len(self.waiting_memory))
            self.waiting_memory.insert(at, seq)
            self.parked_total += 1

    def _enter(self, seq: Request) -> None:
        """``seq`` starts prefilling."""
        if self.group.prefills_together and self.group.follow_min is not None:
            plan = plan_follow(seq, self.prefilling, self.group.follow_min)
            if plan is not None:
                seq.follows = plan
                if seq.live.quant is None:
                    # the leader stops at the shared depth (its root exactly there: LESSONS 42);
                    # under KV quantisation never -- a cut its run alone would not have changes
                    # the last bits of the K / V after it and so, rarely, a code (LESSONS 78): the
                    # follower waits for the chunk that passes the depth and takes its first tokens
                    plan[0].stops.append(plan[1])
        seq.status = RequestStatus.FOLLOWING if seq.follows is not None else RequestStatus.PREFILLING
        self.scheduler.enter(seq)
        self._forks()

    def _forks(self) -> None:
        """Waiting requests whose leader's prefill reached the shared depth take its KV; those
        whose leader left (failed, abandoned) prefill on their own."""
        for seq in self.prefilling:
            if seq.follows is None:
                continue
            leader = seq.follows[0]
            if all(leader is not s for s in self.prefilling):
                seq.follows = None
                seq.status = RequestStatus.PREFILLING
            elif ready(seq):
                try:
                    fork(seq, self.engine.state.kv)
                    self.shared_prefills += 1
                    self.engine.state.counters.bump("shared_prefill_tokens", seq.shared_prefill)
                except Exception:  # noqa: BLE001 - it prefills on its own
                    log.exception("request %s could not take its shared prefix", seq.job.request_id)
                    seq.follows = None
                seq.status = RequestStatus.PREFILLING

    def run(self, job: ChatJob) -> ChatOutcome:
        """``job`` alone, start to finish, on the calling (inference) thread: admitted, then
        stepped until its future resolves -- the path every request takes (ChatEngine.run). An
        exception escaping a step empties this core first (``recover``), as the worker does."""
        future: Future = Future()
        future.set_running_or_notify_cancel()
        self.admit(job, future)
        while not future.done():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - every request in flight fails with it
                self.recover(exc)
                if not future.done():
                    resolve(future, exc=exc)
            if self.idle() and not future.done():   # nothing left to step: never spin
                resolve(future, exc=RuntimeError(f"bug: request {job.request_id} left the core unresolved"))
        return future.result()

    # ------------------------------------------------------------------ one step
    def step(self) -> None:
        self._unpark()
        self.scheduler.aging_s = self.policy.aging_s if self.prioritised else None
        plan = self.scheduler.schedule(self._flight())
        self._move_rows(plan)
        if plan.short:
            self._prefill_short(list(plan.short))
        elif plan.prefill is not None:
            self._prefill_chunk(plan)
        if len(self.group):
            self.last_batch = len(self.group) if self.group.batching else 1   # sequences per forward pass
            self.batch_peak = max(self.batch_peak, self.last_batch)
            try:
                out = self.group.step()                       # execute: the forward(s), tokens read back
                verdicts, failed = self._judge(out)           # update: streamed, the stop rules applied
                finished = self.group.settle(verdicts, failed)   # rows keep what was used; ended ones leave
            except GroupReset as exc:   # the shared forward failed: the batch was dropped
                self._lost(exc)
                finished = []
            for seq, exc in self.group.take_failed():    # rows whose own work failed
                self._fail(seq, exc)
            self._ended(finished)
        if not len(self.group):
            self._flush_closing()         # the batch emptied (rows failed, or the last ones ended)
        self.account()
        self._unpark()                    # room freed by this step: the parked request starts next

    # ------------------------------------------------------------------ priorities
    def _flight(self) -> InFlight:
        """What the scheduler reads of the requests in flight (plain lists, scheduler/plan.py)."""
        prioritised = self.prioritised
        heard = self.scheduler.hearing(self.preempted)
        return InFlight(stopped=frozenset(id(s) for s in heard if self._stopped(s)),
                        prefixed=frozenset(id(s) for s in self.scheduler.prefilling if self._prefixed(s)),
                        decoding=tuple(self.group.seqs), preempted=tuple(self.preempted),
                        parked=tuple(self.waiting_memory), max_rows=self.max_sequences,
                        prioritised=prioritised, beside=self.policy.beside, aging_s=self.policy.aging_s,
                        share=self.policy.share,
                        step_s=self.group.step_times(self.max_sequences) if prioritised and self.policy.share else (),
                        now=time.perf_counter())

    def _move_rows(self, plan: StepPlan) -> None:
        """The plan's row moves, before its prefill: preempted rows whose client left end, less
        urgent decode rows leave the batch, preempted rows rejoin it (one that came back by
        waiting past its priority is not preempted again: no starvation)."""
        if plan.end:
            self.preempted = [s for s in self.preempted if not any(s is g for g in plan.end)]
            self.group.own_caches(list(plan.end))
            self._ended(list(plan.end))
        if plan.preempt:
            self._preempt(list(plan.preempt))
        whole = self.group.unpause(list(plan.resume))    # a batch set aside whole comes back as it was
        for seq in plan.resume:
            seq.shielded = plan.urgent is not None and seq.job.priority > plan.urgent
            if any(seq is w for w in whole):
                seq.status = RequestStatus.DECODING
                self.resumed += 1
            else:
                self._resume(seq)
        if plan.resume:
            self.preempted = [s for s in self.preempted if not any(s is r for r in plan.resume)]

    def _preempt(self, seqs: list[Request]) -> None:
        """Rows leave the batch with their whole KV and pending token (runner/batch.py
        ``preempt``); a failure to leave fails them (rolled back: the others go on)."""
        try:
            self.group.preempt(seqs)
        except GroupReset as exc:
            self._lost(exc)
            return
        except Exception as exc:  # noqa: BLE001 - rolled back: only these fail
            for seq in seqs:
                self.group.drop(seq)
                self._fail(seq, exc)
            return
        now = time.perf_counter()
        for seq in seqs:
            seq.status = RequestStatus.PREEMPTED
            seq.preempted_at = now
            seq.preemptions += 1
            self.preempted.append(seq)
        self.preemptions += len(seqs)
        log.info("preempted %d row(s) for a more urgent request", len(seqs))

    def _resume(self, seq: Request) -> None:
        try:
            self.group.resume(seq)
        except GroupReset as exc:   # it is among the lost
            self._lost(exc)
            return
        except Exception as exc:  # noqa: BLE001 - the join was rolled back: only this one fails
            self._fail(seq, exc)
            return
        seq.status = RequestStatus.DECODING
        self.resumed += 1

    def _ended(self, finished: list[Request]) -> None:
        """Rows whose decoding ended: their held-back text flushed, then closed and resolved."""
        ended = []
        for seq in finished:
            try:
                self.engine.end_decode(seq)
            except Exception as exc:  # noqa: BLE001 - the held-back text could not be flushed
                self._fail(seq, exc)
                continue
            ended.append(seq)
        self._end(ended)

    def _judge(self, out: dict) -> tuple[dict[int, Verdict], dict[int, BaseException]]:
        """What the decode step read back, judged: each row's tokens consumed in order (streamed,
        stop rules) until its reply ends; a hang-up or the watchdog ends it too. A row whose text
        could not be handled (the detokenizer, the call gate) fails alone."""
        verdicts: dict[int, Verdict] = {}
        failed: dict[int, BaseException] = {}
        for seq in self.group.seqs:
            row = out.get(id(seq))
            if row is None:
                continue
            try:
                seq.batch_sizes.append(row.size)
                used, done = 0, False
                for tok in row.tokens:
                    used += 1
                    if self.engine.consume(seq, tok):
                        done = True
                        break
                verdicts[id(seq)] = Verdict(used, done or self._stopped(seq))
            except Exception as exc:  # noqa: BLE001 - this row only
                failed[id(seq)] = exc
        return verdicts, failed

    def _stopped(self, seq: Request) -> bool:
        return halted(self.engine.runner, seq)

    @staticmethod
    def _prefixed(seq: Request) -> bool:
        return holds_prefixed([seq.live])

    def _prefill_chunk(self, plan: StepPlan) -> None:
        """One chunk of one request's prompt; it joins the batch once its prompt is fed."""
        seq = plan.prefill
        try:
            done = prefill_chunk(self.engine.runner, seq, plan.budget, self.group.batching and not seq.job.prefill_only)
        except Exception as exc:  # noqa: BLE001 - this request only
            self.scheduler.drop(seq)
            self._fail(seq, exc)
            done = False
        self._forks()                 # before it joins the batch (its own layers go to a row)
        if done:
            self.scheduler.drop(seq)
            self._prefilled(seq)

    def account(self) -> None:
        """What the requests in flight hold in RAM (engine state's ``live_kv_bytes``: the
        ``mlxstack_kv_bytes`` gauge adds the RAM cache tier), each array once and none the tier
        holds (a prefix checked out by reference is counted there); the draft model's stored
        caches count too."""
        draft = self.engine.speculation.draft
        others = [*self.scheduler.prefilling, *self.closing, *self.preempted]
        self.engine.state.live_kv_bytes = live_bytes(self.group, others, self._tier_arrays()) \
            + (draft.store.nbytes if draft is not None else 0)

    def _tier_arrays(self) -> dict[int, int]:
        """The RAM tier's arrays (id -> bytes), walked again only when its entries changed."""
        held = self.engine.state.kv.held()
        key = tuple((e.entry_id, id(p)) for e, p in held)
        if key != self._tier_key:
            self._tier_key, self._tier_ids = key, resident_arrays([p for _, p in held])
        return self._tier_ids

    def recover(self, exc: BaseException) -> int:
        """After an exception escaped ``step()``: the state cannot be trusted. Every request in
        flight fails (its stream ends with an error), the state is emptied (no MLX call: nothing
        here can fail after an MLX error) and the next request starts from scratch. Returns how
        many requests were failed."""
        err = SchedulerReset(f"the inference step failed ({type(exc).__name__}: {exc}); "
                             "this request was in flight and was abandoned")
        err.__cause__ = exc
        futures, self.futures = self.futures, {}
        self.scheduler.reset()
        self.closing = []                 # replied already; their turns are simply not stored
        self.waiting_memory = []
        self.preempted = []
        self.group.reset()
        self.group.take_failed()
        self.recoveries += 1
        self.engine.state.live_kv_bytes = 0
        n = sum(resolve(f, exc=err) for f in futures.values())
        self.failed += n
        return n

    def abandon(self, exc: BaseException) -> int:
        """The inference thread is dying: resolve every future still held (no MLX call)."""
        futures, self.futures = self.futures, {}
        return sum(resolve(f, exc=exc) for f in futures.values())

    def _end(self, ended: list[Request]) -> None:
        """Sequences that finished decoding this step. While other rows still decode, a completed
        reply goes out now and its turn is closed (last token + the template's closer fed) and
        stored later, together with every other that ends before the batch empties or a new
        request is admitted: one closing forward for all of them instead of one in every step
        where some row ended, and no reply waits for one. Once the batch is empty, the pending
        ones and these close now, together, and these replies go out after their store."""
        if len(self.group) and self.group.prefills_together and self.engine.state.kv.enabled:
            now, later = time.perf_counter(), [s for s in ended if self.engine.completed(s)]
            for seq in later:
                seq.t_end = now
                if self._finish(seq, store=False):
                    seq.status = RequestStatus.CLOSING
                    self.closing.append(seq)
                    self.replied_early += 1
            ended = [s for s in ended if not any(s is d for d in later)]
        pending, self.closing = ([], self.closing) if len(self.group) else (self.closing, [])
        self._close_together(pending + ended)
        for seq in pending:
            self.engine.store_turn(seq)
            seq.status = RequestStatus.FINISHED
        for seq in ended:
            seq.t_end = time.perf_counter()
            self._finish(seq)

    def _flush_closing(self) -> None:
        """Close and store the turns whose replies already went out (``_end``)."""
        if not self.closing:
            return
        pending, self.closing = self.closing, []
        self._close_together(pending)
        for seq in pending:
            self.engine.store_turn(seq)
            seq.status = RequestStatus.FINISHED

    def _close_together(self, finished: list[Request]) -> None:
        """Sequences that finished in the same step close their turns (last sampled token + the
        template's closer) in one batched forward instead of one forward each; finish() then only
        stores. Anything unusual (an abort, a failure here) is left to finish()'s own path."""
        eng = self.engine
        if not self.group.prefills_together or len(finished) < 2 or not eng.state.kv.enabled:
            return
        plans: list[tuple[Request, list[int], list[int]]] = []
        for seq in finished:
            if not eng.completed(seq):
                continue
            try:
                target, to_feed = eng.plan_close(seq, eng.content_ids(seq))
            except Exception:  # noqa: BLE001 - finish() closes (and logs) it on its own
                continue
            if to_feed:
                plans.append((seq, target, to_feed))
            else:
                seq.closed = target
        if len(plans) < 2:
            return   # finish() feeds a lone closer itself (plan_close only cut what it had to)
        try:
            if not feed_together(eng.decode_model, [s.live for s, _, _ in plans], [f for _, _, f in plans],
                                 self.group.min_shared):
                return   # not taken (nothing fed): finish() closes each alone
        except Exception:  # noqa: BLE001 - nothing was advanced: finish() closes each alone
            log.exception("closing %d turns together failed; closing them one by one", len(plans))
            return
        for seq, target, _ in plans:
            seq.closed = target
        self.closed_together += len(plans)

    def _prefill_short(self, seqs: list[Request]) -> None:
        """Requests whose whole remainders the plan feeds together: one forward, then each joins
        the batch (or finishes: nothing to generate)."""
        try:
            layers = prefill_together(self.engine.loaded.model, seqs, self.group.min_shared)
        except Exception as exc:  # noqa: BLE001 - the forward failed: fail its members
            for s in seqs:
                self._fail(s, exc)
            return
        def own(i: int) -> None:   # sequence i takes its row back as its own layers (coded ones too)
            seqs[i].live.layers = [layer.extract(i) for layer in layers]
            seqs[i].live.recount()

        now = time.perf_counter()
        joining: list[int] = []
        for i, s in enumerate(seqs):
            s.t_first = now
            try:
                if self.engine.begin_decode(s, None):
                    joining.append(i)
                    continue
                own(i)                                    # nothing to generate
                feed_deferred(self.engine.runner, s)
            except Exception as exc:  # noqa: BLE001 - this request only
                self._fail(s, exc)
                continue
            s.t_end = time.perf_counter()
            self._finish(s)
        if not joining:
            return
        try:
            if len(joining) == 1 and not len(self.group):   # alone: it decodes on its own cache
                own(joining[0])
                self.group.add(seqs[joining[0]], None)
            else:
                self.group.adopt([seqs[i] for i in joining], layers, joining)
            for i in joining:
                seqs[i].status = RequestStatus.DECODING
        except GroupReset as exc:
            self._lost(exc)
        except Exception as exc:  # noqa: BLE001 - the join was rolled back: only the joiners fail
            for i in joining:
                self._fail(seqs[i], exc)

    def _prefilled(self, seq: Request) -> None:
        seq.t_first = time.perf_counter()
        deferred = seq.logits is None and seq.pos == len(seq.prep.model_tokens) - 1
        if seq.prefill_aborted or (seq.logits is None and not deferred) or seq.job.prefill_only:
            seq.t_end = seq.t_first
            self._finish(seq)
            return
        try:
            if not self.engine.begin_decode(seq, seq.logits):
                feed_deferred(self.engine.runner, seq)
                seq.t_end = time.perf_counter()
                self._finish(seq)
                return
            self.group.add(seq, seq.logits)
            seq.status = RequestStatus.DECODING
        except GroupReset as exc:
            self._lost(exc)
        except Exception as exc:  # noqa: BLE001 - the join was rolled back: only this one fails
            self._fail(seq, exc)

    def _finish(self, seq: Request, store: bool = True) -> bool:
        """Resolve ``seq``'s future with its outcome (``store``: its turn closed and stored
        first); False when it failed instead (nothing is to be stored then)."""
        future = self.futures.pop(id(seq), None)
        if store or future is None:
            seq.status = RequestStatus.FINISHED
        if future is None:   # failed already: its KV must not be stored as if it had finished
            log.error("request %s finished after it had failed; nothing stored", seq.job.request_id)
            return False
        try:
            outcome = self.engine.finish(seq, store=store)
        except Exception as exc:  # noqa: BLE001
            resolve(future, exc=exc)
            return False
        resolve(future, outcome)
        return True

    def _fail(self, seq: Request, exc: BaseException) -> None:
        seq.status = RequestStatus.FINISHED
        future = self.futures.pop(id(seq), None)
        if future is not None and resolve(future, exc=exc):
            self.failed += 1
            log.error("request %s failed in the scheduler", seq.job.request_id, exc_info=exc)

    def _lost(self, reset: GroupReset) -> None:
        """The decode batch was dropped: every member fails (with the reason)."""
        log.error("decode batch of %d dropped", len(reset.lost), exc_info=reset.cause)
        for seq in reset.lost:
            self._fail(seq, reset)
