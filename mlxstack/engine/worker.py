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
(engine/scheduler.py), chat jobs are admitted while it has room and the worker alternates between
taking queued work and scheduler steps; callables run between steps.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The worker queue is at MAX_QUEUED_REQUESTS; the client should retry later."""


class _Chat:
    __slots__ = ("job", "submitted")

    def __init__(self, job: Any) -> None:
        self.job = job
        self.submitted = time.perf_counter()


class InferenceWorker:
    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self._queue: "queue.Queue[tuple[Any, Future] | None]" = queue.Queue()
        self._waiting = 0                         # submitted, not yet started or admitted
        self._waiting_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="mlx-inference", daemon=True)
        self._busy = threading.Event()
        self.scheduler: Any = None                # set once the model is loaded (App)
        self.run_chat: Callable[[Any], Any] | None = None   # engine.run, when no scheduler
        self._backlog: list[tuple[_Chat, Future]] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the worker to finish after the current job, and wait for it a little."""
        self._queue.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return self._waiting

    @property
    def busy(self) -> bool:
        return self._busy.is_set()

    @property
    def active_sequences(self) -> int:
        return self.scheduler.active if self.scheduler is not None else int(self.busy)

    def _reserve(self) -> None:
        with self._waiting_lock:
            if self._waiting >= self.max_queued:
                raise QueueFull("inference queue is full")
            self._waiting += 1

    def _release(self) -> None:
        with self._waiting_lock:
            self._waiting -= 1

    def submit(self, fn: Callable[[], Any]) -> Future:
        self._reserve()
        fut: Future = Future()
        self._queue.put((fn, fut))
        return fut

    def submit_chat(self, job: Any) -> Future:
        self._reserve()
        fut: Future = Future()
        self._queue.put((_Chat(job), fut))
        return fut

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while True:
            sched = self.scheduler
            busy = sched is not None and not sched.idle()
            try:
                items = [self._queue.get_nowait() if busy or self._backlog else self._queue.get()]
            except queue.Empty:
                items = []
            items += self._drain()      # everything that arrived meanwhile: admitted together, so
            for item in items:          # their short prefills share one forward (scheduler step 1)
                if item is None:
                    return
                self._take(*item)
            self._admit()
            if sched is not None and not sched.idle():
                self._busy.set()
                try:
                    sched.step()
                finally:
                    self._busy.clear()

    def _drain(self) -> list[Any]:
        out: list[Any] = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _take(self, work: Any, fut: Future) -> None:
        if isinstance(work, _Chat) and self.scheduler is not None:
            self._backlog.append((work, fut))       # admitted when the scheduler has room
            return
        self._release()
        if not fut.set_running_or_notify_cancel():
            return
        self._busy.set()
        try:
            fut.set_result(self.run_chat(work.job) if isinstance(work, _Chat) else work())
        except BaseException as exc:  # noqa: BLE001 - travels back to the handler
            fut.set_exception(exc)
        finally:
            self._busy.clear()

    def _admit(self) -> None:
        sched = self.scheduler
        while self._backlog and sched is not None and sched.has_room():
            work, fut = self._backlog.pop(0)
            self._release()
            if fut.set_running_or_notify_cancel():
                sched.admit(work.job, fut, queued_at=work.submitted)
