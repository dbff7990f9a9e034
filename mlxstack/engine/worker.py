"""The single inference thread: all MLX work runs here.

MLX streams are per-thread and mlx-vlm issues bare ``mx.async_eval`` outside a stream context,
so one dedicated worker owns the model, the KV cache and every tensor. HTTP handler threads
only enqueue work and read results, which keeps /health and /v1/models answering while a
generation runs, and makes the model lock implicit (work holds the model by running).

    worker = InferenceWorker(max_queued=16); worker.start()
    future = worker.submit(fn)           # any callable, run alone (model load, token counting)
    future = worker.submit_chat(job)     # a chat request: run alone, or by the scheduler
                                         # (continuous batching) once one is attached

Both raise QueueFull when MAX_QUEUED_REQUESTS items already wait. With a scheduler attached
(engine/core.py), chat jobs are admitted while it has room and the worker alternates between
taking queued work and scheduler steps; callables run between steps.

The thread never dies of an Exception: one that escapes a scheduler step fails every request in
flight (``EngineCore.recover``) and serving goes on. Anything else (SystemExit, a fatal injected by
tests) ends the thread, but not silently: every future it held, every queued item and every later
submission is resolved with "inference thread died: ...", and ``health_problem()`` says so -- as it
says when the thread stops making progress (no step, no prefill chunk, no token) for longer than
INFERENCE_STALL_SECONDS while work waits. /health answers 503 with that reason (server/app.py) and
the launcher restarts such a server (launcher/stack.py).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The worker queue is at MAX_QUEUED_REQUESTS; the client should retry later."""


class WorkerDied(RuntimeError):
    """The inference thread is gone: the request was in flight, queued, or submitted after."""


def resolve(future: Future, result: object = None, exc: BaseException | None = None) -> bool:
    """Set a future's outcome unless it already has one (False then)."""
    if future.done():
        return False
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except Exception:  # noqa: BLE001 - InvalidStateError: resolved meanwhile
        return False
    return True


class _Chat:
    __slots__ = ("job", "submitted")

    def __init__(self, job: Any) -> None:
        self.job = job
        self.submitted = time.perf_counter()


class InferenceWorker:
    def __init__(self, max_queued: int, arrival_window_s: float = 0.0) -> None:
        self.max_queued = max_queued
        self.arrival_window_s = arrival_window_s   # ARRIVAL_WINDOW_MS (``_gather``)
        self.gathered = 0                         # requests that arrived within a window after the first
        self._queue: "queue.Queue[tuple[Any, Future] | None]" = queue.Queue()
        self._waiting = 0                         # submitted, not yet started or admitted
        self._waiting_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="mlx-inference", daemon=True)
        self._busy = threading.Event()
        self.core: Any = None                # set once the model is loaded (App)
        self.runner: Any = None              # its runner/rows.py RunnerContext: ``heard`` is progress too
        self.run_chat: Callable[[Any], Any] | None = None   # engine.run, when no scheduler
        self._backlog: list[tuple[_Chat, Future]] = []
        self.death: str | None = None             # why the thread died ("ExcType: message")
        self.recoveries = 0                       # exceptions that escaped a step (state reset)
        self._beat = time.monotonic()             # last progress: a step, a job, a chunk, a token
        self._idle = False                        # blocked waiting for work
        self._stopping = False
        self._taking: list[Any] = []               # drained from the queue, not yet taken
        self.lockstep: Any = None                  # engine/lockstep.py: several ranks, one scheduler
        self._deferred: list[Any] = []             # taken before lockstep began: exchanged next turn
        self.on_death: Callable[[BaseException], None] | None = None   # serve.py: a rank of a group exits

    def start(self) -> None:
        self._thread.start()

    def beat(self) -> None:
        """Progress: called after every step and job; the runner's checks between a prompt's
        forwards and decode steps count too (``runner.heard``), so a long request alone still
        shows it is alive."""
        self._beat = time.monotonic()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the worker to finish after the current job, and wait for it a little."""
        self._stopping = True
        self._queue.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return self._waiting

    def queued_by_priority(self) -> dict[int, int]:
        """Chat jobs taken from the queue and waiting for a row, per priority (lower first)."""
        return dict(sorted(Counter(getattr(work.job, "priority", 0) for work, _ in list(self._backlog)).items()))

    @property
    def busy(self) -> bool:
        return self._busy.is_set()

    @property
    def active_sequences(self) -> int:
        return self.core.active if self.core is not None else int(self.busy)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def health_problem(self, stall_seconds: float) -> str | None:
        """Why this worker cannot serve, or None: the thread died (or exited unasked), or it made
        no progress for more than ``stall_seconds`` (0 = never checked) while work waits."""
        if self.death is not None:
            return f"inference thread died: {self.death}"
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stopping:
            return "inference thread exited"
        if stall_seconds <= 0 or self._idle:
            return None
        sched = self.core
        pending = self._waiting + (sched.active if sched is not None else 0) + int(self.busy)   # backlog: in _waiting
        quiet = time.monotonic() - max(self._beat, self.runner.heard if self.runner is not None else 0.0)
        if pending and quiet > stall_seconds:
            return (f"inference thread stalled: no progress for {quiet:.0f}s with {pending} request(s) waiting "
                    f"or in flight (INFERENCE_STALL_SECONDS={stall_seconds:g})")
        return None

    def _reserve(self) -> None:
        if self._waiting >= self.max_queued:
            raise QueueFull("inference queue is full")
        self._waiting += 1

    def _release(self) -> None:
        with self._waiting_lock:
            self._waiting -= 1

    def _put(self, work: Any) -> Future:
        fut: Future = Future()
        with self._waiting_lock:     # one lock with _die: nothing is queued after it drained the queue
            if self.death is not None:
                fut.set_exception(WorkerDied(f"inference thread died: {self.death}"))
                return fut
            self._reserve()
            self._queue.put((work, fut))
        return fut

    def submit(self, fn: Callable[[], Any]) -> Future:
        return self._put(fn)

    def submit_chat(self, job: Any) -> Future:
        return self._put(_Chat(job))

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the thread ends: say why, leave nothing hanging
            self._die(exc)

    def _next_items(self) -> list[Any]:
        """What this turn takes: whatever waits (blocking when there is nothing else to do)."""
        sched = self.core
        busy = sched is not None and not sched.idle()
        if busy or self._backlog or self._deferred:
            try:
                items = [self._queue.get_nowait()]
            except queue.Empty:
                items = []
        else:
            self._idle = True
            try:
                items = [self._queue.get()]
            finally:
                self._idle = False
            items += self._gather(items[0])
        return items

    def _gather(self, first: Any) -> list[Any]:
        """After an idle spell: when ``first`` is a chat request and the last busy spell decoded
        several rows at once, what else arrives within ``arrival_window_s`` -- until as many chat
        requests as its largest batch held are here. Agents that fan out come back together, a
        few ms apart; taken one turn apart, the first one's prompt prefills alone and the rest in
        a second forward. A lone client's next request never waits (its spell held one row)."""
        sched = self.core
        expect = getattr(sched, "batch_peak", 1) if sched is not None else 1
        if sched is not None:
            sched.batch_peak = 0          # a new busy spell: its own peak decides the next wait
        if self.arrival_window_s <= 0 or expect < 2 or first is None or not isinstance(first[0], _Chat):
            return []
        out: list[Any] = []
        deadline = time.monotonic() + self.arrival_window_s
        chats = 1
        while chats < expect:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                item = self._queue.get(timeout=left)
            except queue.Empty:
                break
            out.append(item)
            if item is None:
                break
            chats += isinstance(item[0], _Chat)
        self.gathered += chats - 1
        return out

    def _loop(self) -> None:
        while True:
            lock = self.lockstep
            follower = lock is not None and not lock.leader
            items = [] if follower else self._next_items()   # a follower's work comes from rank 0
            self.beat()
            if not follower:
                items = self._deferred + items + self._drain()   # everything that arrived meanwhile:
                self._deferred = []     # admitted together, so their short prefills share one forward
            if lock is None:
                if not self._turn(items):
                    return
                continue
            with lock.stream():         # one stream: the collectives of every rank in one order
                self._idle = follower   # a follower waits for rank 0's next turn: not a stall
                try:
                    items = lock.exchange(items, self.core)
                finally:
                    self._idle = False
                self.beat()
                if not self._turn(items):
                    return

    def _turn(self, items: list[Any]) -> bool:
        """Take ``items``, admit, and run one scheduler step; False when told to stop."""
        lock = self.lockstep
        self._taking = items
        while items:
            item = items.pop(0)
            if item is None:
                return False
            self._take(*item)
            if lock is None and self.lockstep is not None:   # the load began lockstep: the rest
                self._deferred, items = items, []            # is exchanged with the other ranks
        self._admit()
        sched = self.core
        if sched is not None and not sched.idle():
            self._busy.set()
            try:
                sched.step()
            except Exception as exc:  # noqa: BLE001 - never the end of the thread
                if self.lockstep is not None:   # the other ranks may not have failed: the group
                    raise                       # is out of step -- this rank stops (lockstep.py)
                self.recoveries += 1
                log.error("a scheduler step failed; every request in flight fails, serving goes on",
                          exc_info=exc)
                n = sched.recover(exc)
                log.error("%d request(s) failed; scheduler state reset", n)
            finally:
                self._busy.clear()
            self.beat()
        return True

    def _die(self, exc: BaseException) -> None:
        """Resolve everything still waiting on this thread (no MLX call) and record why."""
        with self._waiting_lock:
            self.death = f"{type(exc).__name__}: {exc}"
            queued = self._drain()
        log.critical("the inference thread died (%s); /health reports it and the launcher restarts the "
                     "server", self.death, exc_info=exc)
        err = WorkerDied(f"inference thread died: {self.death}")
        pending = [fut for _, fut in self._backlog] + [item[1] for item in self._taking + queued if item is not None]
        self._backlog = []
        if self.core is not None:
            try:
                self.core.abandon(err)
            except Exception:  # noqa: BLE001
                log.exception("resolving the scheduler's requests failed")
        for fut in pending:
            resolve(fut, exc=err)
        if self.on_death is not None:
            self.on_death(exc)

    def _drain(self) -> list[Any]:
        out: list[Any] = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _take(self, work: Any, fut: Future) -> None:
        if isinstance(work, _Chat) and self.core is not None:
            self._backlog.append((work, fut))       # admitted when the scheduler has room
            return
        self._release()
        if not fut.set_running_or_notify_cancel():
            return
        self._busy.set()
        self.beat()
        try:
            fut.set_result(self.run_chat(work.job) if isinstance(work, _Chat) else work())
        except Exception as exc:  # noqa: BLE001 - travels back to the handler
            fut.set_exception(exc)
        except BaseException as exc:
            fut.set_exception(WorkerDied(f"inference thread died: {type(exc).__name__}: {exc}"))
            raise
        finally:
            self._busy.clear()
            self.beat()

    def _admit(self) -> None:
        """Queued chat jobs start while the scheduler has room: the one it picks first (the most
        urgent with priorities: engine/core.py ``pick_next``; else first come, first served), a
        more urgent one making room by preempting a less urgent row (``room_for``)."""
        sched = self.core
        while self._backlog and sched is not None:
            now = time.perf_counter()
            i = sched.pick_next([(getattr(w.job, "priority", 0), now - w.submitted) for w, _ in self._backlog])
            if not sched.room_for(getattr(self._backlog[i][0].job, "priority", 0)):
                break
            work, fut = self._backlog.pop(i)
            self._release()
            if fut.set_running_or_notify_cancel():
                try:
                    sched.admit(work.job, fut, queued_at=work.submitted)
                except Exception as exc:  # noqa: BLE001 - admit resolves its own failures; a bug here too
                    resolve(fut, exc=exc)
