"""The single inference thread: all MLX work runs here, requests FIFO.

MLX streams are per-thread and mlx-vlm issues bare ``mx.async_eval`` outside a stream context,
so one dedicated worker owns the model, the KV cache and every tensor. HTTP handler threads
only enqueue jobs and read results, which keeps /health and /v1/models answering while a
generation runs, and makes the model lock implicit (a job holds the model by running).

    worker = InferenceWorker(max_queued=16); worker.start()
    future = worker.submit(fn)   # raises QueueFull when the queue is at capacity
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The worker queue is at MAX_QUEUED_REQUESTS; the client should retry later."""


class InferenceWorker:
    def __init__(self, max_queued: int) -> None:
        self._queue: "queue.Queue[tuple[Callable[[], Any], Future] | None]" = queue.Queue(maxsize=max_queued)
        self._thread = threading.Thread(target=self._run, name="mlx-inference", daemon=True)
        self._busy = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the worker to finish after the current job, and wait for it a little."""
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._busy.is_set()

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        try:
            self._queue.put_nowait((fn, fut))
        except queue.Full:
            raise QueueFull("inference queue is full") from None
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            self._busy.set()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - travels back to the handler
                fut.set_exception(exc)
            finally:
                self._busy.clear()
