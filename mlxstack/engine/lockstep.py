"""Several ranks, one scheduler: every rank runs the same engine on the same work, step for step.

A model split over ranks (DISTRIBUTED=tensor | pipeline: models/sharding.py) runs collectives
inside every forward, so every rank must run the same forwards in the same order -- the same
admissions, prefill chunks, cache hits, rows joining and leaving, drafts. Rank 0 answers HTTP;
at every turn of the inference worker's loop (engine/worker.py) it sends every rank a ``Record``
over the control channel (TCP, authenticated and encrypted: system/control_channel.py; records as plain
data, engine/record_codec.py; a waiting follower sleeps there, where inside an
MLX collective it would spin):

- the work it took, in order: chat jobs (without their callbacks; a grammar travels as its spec
  and each rank compiles the same one; a request without a seed gets one drawn here, so sampled
  replies agree too) and calls that must run everywhere (warm prompts);
- the signals it saw since the last turn: clients that left (``job.is_cancelled`` is, on every
  rank, a flag these records set -- never a socket read mid-step);
- its clock, which every rank's engine, prompt cache and session stores read (watchdogs, TTLs and
  idle expiry fire at the same step everywhere);
- a digest of its scheduler (steps, requests in flight, tokens each has): a rank whose own digest
  differs has left the group's path -- it stops at once (the launcher restarts the group) instead
  of running collectives out of order, which hangs or silently mixes up results.

Every rank then takes the same items, admits, and steps: the scheduler, the prompt-cache index,
the session stores and every decision they make are the same code on the same inputs, and each
rank's caches hold its own shard of every entry's KV under the same entry. Rank 0 alone writes to
clients (a follower's ``emit`` is a no-op). An exception that escapes a step is fatal for the group
(one rank may have failed where the others did not): the worker dies, the rank exits, the launcher
restarts every rank.

    lock = Lockstep(group, channel, compile_grammar)   # after the model is loaded and sharded
    worker.lockstep = lock                       # the worker's loop calls lock.exchange(...)
"""
from __future__ import annotations

import logging
import os
import json
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import mlx.core as mx

from ..cache.ranks import RankGroup
from ..constraints.grammars import GrammarSpec
from ..models.memory import process_rss_bytes
from ..runner.sampling import SamplingParams
from . import record_codec
from .request import ChatJob

log = logging.getLogger("mlxstack.lockstep")

_CALLBACKS = ("emit", "is_cancelled", "on_prompt")
_DEBUG = bool(os.environ.get("MLXSTACK_LOCKSTEP_DEBUG"))


class LockstepBroken(SystemExit):
    """This rank's engine is no longer where rank 0's is: the rank must stop (not recoverable)."""


@dataclass
class Record:
    """One turn of the worker loop, as rank 0 saw it."""
    items: list = field(default_factory=list)     # ("chat", id, job fields, grammar spec) | ("call", replica) | ("stop",)
    cancelled: list = field(default_factory=list)  # ids of requests whose client left
    now: float = 0.0                                # rank 0's monotonic clock
    digest: tuple = ()                              # rank 0's scheduler before this turn


# request headers that carry credentials: followers never need them, so they never leave rank 0
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie",
                                "x-litellm-api-key", "x-goog-api-key", "ocp-apim-subscription-key"})


def portable_job(job: ChatJob) -> tuple[dict, Any]:
    """(the job's fields without its callbacks, grammar and credential headers, the grammar's spec
    or None) (pure)."""
    values = {f.name: getattr(job, f.name) for f in fields(job) if f.name not in _CALLBACKS}
    grammar = job.params.grammar
    values["params"] = replace(job.params, grammar=None)
    values["headers"] = {k: v for k, v in (job.headers or {}).items() if k.lower() not in CREDENTIAL_HEADERS}
    return values, (grammar.spec if grammar is not None else None)


_JOB_FIELDS = frozenset(f.name for f in fields(ChatJob)) - frozenset(_CALLBACKS)


def rebuilt_job(values: dict, params: SamplingParams | None = None) -> ChatJob:
    """The job a follower rank runs from rank 0's ``portable_job`` values (its callbacks do
    nothing; ``params``: with the grammar compiled on this rank). A job is built from a request
    in server/common/job_adapter.py and from a record here, nowhere else."""
    return ChatJob(**{**values, "params": params if params is not None else values["params"]},
                   emit=_noop, on_prompt=_noop)


def _check_job(values: Any, spec: Any, rank: int) -> None:
    """A chat item from a record: a job's fields (no callbacks), SamplingParams, a GrammarSpec or
    None -- else this rank cannot follow (LockstepBroken)."""
    ok = (isinstance(values, dict) and set(values) <= _JOB_FIELDS and isinstance(values.get("params"), SamplingParams)
          and (spec is None or isinstance(spec, GrammarSpec)))
    if not ok:
        raise LockstepBroken(f"rank {rank}: a chat item it cannot rebuild in rank 0's record")


def scheduler_digest(scheduler: Any) -> tuple:
    """What must be equal on every rank before a turn: steps taken, and each request in flight
    (its id, prompt position, tokens generated) in scheduling order (pure over the scheduler)."""
    if scheduler is None:
        return ()
    rows = [(getattr(s.job, "lockstep_id", -1), s.pos, len(s.generated))
            for s in list(scheduler.prefilling) + list(scheduler.group.seqs)]
    return (scheduler.steps, tuple(rows))


class _Flag:
    """A request's client-left flag, set only from records (so every rank reads the same)."""
    __slots__ = ("set",)

    def __init__(self) -> None:
        self.set = False

    def __call__(self) -> bool:
        return self.set


def _noop(*_a: Any) -> None:
    return None


class Lockstep:
    def __init__(self, group: Any, channel: Any, compile_grammar: Callable[[Any], Any] | None = None,
                 replicas: dict[str, Callable[..., Callable[[], Any]]] | None = None) -> None:
        self.group = group
        self.channel = channel      # rank 0 -> followers: send(bytes) / recv() -> bytes
        self.rank = group.rank()
        self.size = group.size()
        self.compile_grammar = compile_grammar
        self.replicas = replicas or {}
        self.ranks = RankGroup(group)   # the collectives the KV tiers agree over (cache/ranks.py)
        self._next_id = 0
        self._flags: dict[int, _Flag] = {}
        self._watch: dict[int, Callable[[], bool]] = {}     # rank 0: the real client checks
        self._lock = threading.Lock()
        self.turns = 0
        self.bytes_sent = 0
        self.share_seconds = 0.0
        self.mode = ""                                       # tensor | pipeline (for stats)
        self.rank_stats: dict[int, dict] = {}               # rank 0: what each rank last reported
        self._reported = 0.0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def stream(self) -> Any:
        """The context every turn runs in: MLX's generation stream, so the share's collectives and
        the forwards' all_sums (some issued with ``async_eval`` and still in flight) run in one
        order on every rank -- collectives on two streams interleave by timing, which differs."""
        from ..runner.mlx_stream import generation_stream

        return mx.stream(generation_stream())

    def clock(self) -> float:
        """Rank 0's monotonic time as of the current turn (every rank reads the same)."""
        return self.ranks.now

    def bind(self, engine: Any, local_ranks: int) -> int:
        """``engine`` on this rank joins the group: it reads rank 0's clock, and its cache budget
        counts every rank's part of an entry -- the tightest rank's share times the ranks -- so
        every rank evicts the same entries. Returns the per-rank share (bytes)."""
        state = engine.state
        engine.clock = self.clock
        per_rank = self.ranks.agree_min(state.cache_budget // max(1, local_ranks))
        state.cache_budget = per_rank * self.size
        state.kv.set_budget(state.cache_budget)
        state.join_ranks(self.ranks)
        engine.runner.replicated = True   # what the runner knows of it: data, read by its steps
        return per_rank

    # ------------------------------------------------------------------ transport
    def share(self, record: Record | None) -> Record:
        """Rank 0's ``record`` on every rank, over the control channel (system/control_channel.py:
        a follower waiting for rank 0 sleeps there; inside an MLX collective it would spin), as
        plain data (engine/record_codec.py: JSON, never pickle)."""
        t0 = time.perf_counter()
        if self.leader:
            assert record is not None
            data = record_codec.encode(record)
            self.channel.send(data)
            self.bytes_sent += len(data)
            out = record
        else:
            try:
                out = record_codec.decode(self.channel.recv(), Record)
            except (EOFError, OSError) as exc:
                raise LockstepBroken(f"rank {self.rank}: rank 0 is gone ({exc})") from None
            except record_codec.RecordError as exc:
                raise LockstepBroken(f"rank {self.rank}: a record it cannot read ({exc})") from None
        self.share_seconds += time.perf_counter() - t0
        return out

    # ------------------------------------------------------------------ one turn
    def exchange(self, items: list, scheduler: Any) -> list:
        """Rank 0: broadcast what it took (``items``: the worker's (work, future) pairs; None =
        stop) and return them wired for lockstep. Followers: ``items`` is ignored; return the
        same work rebuilt from rank 0's record. Raises LockstepBroken when this rank's scheduler
        is not where rank 0's is."""
        self.turns += 1
        mine = scheduler_digest(scheduler)
        if _DEBUG:
            log.warning("turn %d rank %d digest %r items %r", self.turns, self.rank, mine, items)
        if self.leader:
            record, items = self._record(items, mine)
            self.share(record)
        else:
            record = self.share(None)
            if record.digest != mine:
                raise LockstepBroken(f"rank {self.rank} left the group's path at turn {self.turns}: "
                                     f"rank 0 has {record.digest!r}, this rank {mine!r}")
            items = self._rebuild(record)
        self.ranks.now = record.now
        self._exchange_reports()
        for rid in record.cancelled:
            flag = self._flags.get(rid)
            if flag is not None:
                flag.set = True
        return items

    def _record(self, items: list, digest: tuple) -> tuple[Record, list]:
        from .worker import _Chat   # the worker's own wrapper (engine/worker.py imports us lazily)

        record = Record(now=time.monotonic(), digest=digest)
        with self._lock:
            record.cancelled = [rid for rid, gone in list(self._watch.items()) if _safe(gone)]
            for rid in record.cancelled:
                self._watch.pop(rid, None)
        for item in items:
            if item is None:
                record.items.append(("stop",))
                continue
            work, fut = item
            if isinstance(work, _Chat):
                rid = self._track(work.job, fut, real=work.job.is_cancelled)
                if work.job.params.seed is None:   # drawn once, here: every rank samples the same
                    work.job.params = replace(work.job.params, seed=int.from_bytes(os.urandom(8), "little"))
                values, spec = portable_job(work.job)
                record.items.append(("chat", rid, values, spec))
            elif getattr(work, "replica", None) is not None:
                record.items.append(("call", work.replica))
        return record, items

    def _track(self, job: ChatJob, fut: Future, real: Callable[[], bool] | None) -> int:
        rid = self._next_id
        self._next_id += 1
        flag = _Flag()
        job.lockstep_id = rid                     # type: ignore[attr-defined]
        job.is_cancelled = flag
        with self._lock:
            self._flags[rid] = flag
            if real is not None:
                self._watch[rid] = real

        def done(_f: Future) -> None:
            with self._lock:
                self._flags.pop(rid, None)
                self._watch.pop(rid, None)

        fut.add_done_callback(done)
        return rid

    def _rebuild(self, record: Record) -> list:
        from .worker import _Chat

        out: list = []
        for item in record.items:
            if item[0] == "stop":
                out.append(None)
            elif item[0] == "chat" and len(item) == 4:
                _, rid, values, spec = item
                _check_job(values, spec, self.rank)
                params = values["params"]
                if spec is not None:
                    if self.compile_grammar is None:
                        raise LockstepBroken(f"rank {self.rank} cannot compile the grammar rank 0 uses")
                    params = replace(params, grammar=self.compile_grammar(spec))
                job = rebuilt_job(values, params)
                fut: Future = Future()
                if rid != self._next_id:
                    raise LockstepBroken(f"rank {self.rank} expected request {self._next_id}, rank 0 sent {rid}")
                self._track(job, fut, real=None)
                out.append((_Chat(job), fut))
            elif item[0] == "call" and len(item) == 2 and isinstance(item[1], tuple) and item[1] \
                    and item[1][0] in self.replicas:
                out.append((self._replica(*item[1]), Future()))
            else:
                raise LockstepBroken(f"rank {self.rank}: an item it does not know in rank 0's record: {item!r:.200}")
        return out

    # ------------------------------------------------------------------ what the ranks hold
    def _exchange_reports(self, every: float = 1.0) -> None:
        """Followers: their memory to rank 0 about once a second (never waited for); rank 0: read
        what has arrived. Outside the lockstep path: nothing here decides anything."""
        if self.leader:
            for _, payload in self.channel.reports():
                try:       # plain data: a report is never unpickled (it only feeds /metrics)
                    report = json.loads(payload)
                    self.rank_stats[int(report["rank"])] = report
                except Exception:  # noqa: BLE001 - a report is only for /metrics
                    continue
            self.rank_stats[0] = self._own_report()
        elif time.monotonic() - self._reported >= every:
            self._reported = time.monotonic()
            try:
                self.channel.report(json.dumps(self._own_report()).encode())
            except OSError:
                pass

    def _own_report(self) -> dict:
        return {"rank": self.rank, "turns": self.turns, "active_memory": mx.get_active_memory(),
                "peak_memory": mx.get_peak_memory(), "rss": process_rss_bytes(), "high_water_rss": process_rss_bytes(field="VmHWM")}

    def _replica(self, name: str, *args: Any) -> Callable[[], Any]:
        """This rank's copy of a call rank 0 ran (its result is rank 0's to return; a failure here
        is logged, as rank 0's would be answered)."""
        fn = self.replicas[name](*args)

        def run() -> Any:
            try:
                out = fn()
            except Exception:
                log.exception("rank %d: the %s call rank 0 ran failed here", self.rank, name)
                raise
            if _DEBUG:
                log.warning("rank %d ran %s -> %r", self.rank, name, out)
            return out

        return run

    def stats(self) -> dict:
        """For /v1/cache/stats, /metrics and the dashboard (rank 0's view of the group)."""
        return {"ranks": self.size, "mode": self.mode, "turns": self.turns, "bytes_sent": self.bytes_sent,
                "share_seconds": round(self.share_seconds, 6),
                "share_us_per_turn": round(self.share_seconds / max(1, self.turns) * 1e6, 1),
                "per_rank": [v for _, v in sorted(list(self.rank_stats.items()))]}


def _safe(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:  # noqa: BLE001 - a broken check counts as a client that left
        return True
