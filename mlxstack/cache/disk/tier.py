"""Disk tier of the prompt KV cache: opaque records (tokens + numpy tensors + JSON meta) stored as
checked safetensors files, an sqlite index, LRU by bytes, writes on a background thread.

    tier = DiskTier(root, disk_namespace(model=fp, template=th, layout=..., kv_quant=...), max_bytes)
    entry_id = tier.put(DiskRecord(key_tokens, model_tokens, {"0.keys": k, ...}, {"kind": "kv"}))
    infos = tier.entries()          # index only: at start-up no tensor file is read
    record = tier.load(entry_id)    # verified (size + CRC-32 + index checksum), or None
    tier.close()                    # flushes queued writes

Layout: ``root/<namespace>/index.sqlite``, ``root/<namespace>/lock`` and
``root/<namespace>/entries/<id>.safetensors``. The namespace is the caller's hash of everything
that makes KV state incompatible (model, template, cache-kind layout, KV quantisation), so a
different setting never opens another's directory.

Invariants (tests/test_disk_tier.py):
- A file is written to a temp name in the same directory, fsynced and renamed; only then is its
  index row inserted. A torn, corrupt or missing file is deleted, counted and never served.
- Start-up deletes temp files and files without a row, drops rows whose file is missing or has
  the wrong size, and reads no tensor bytes.
- ``put`` never blocks on I/O: it validates, plans the header, evicts (LRU by bytes) and queues.
  A queued entry is listed and loadable at once (served from the record it holds).
- One process per namespace directory (an flock); a second gets DiskTierBusy.
- Private whatever the umask (tests/test_disk_permissions.py): the root, namespace and entries
  folders 0700; entry, temp, lock and index files (and sqlite's -wal/-shm/-journal) 0600. Opening a
  tier tightens what an older version left 0755 / 0644 in every namespace under the root
  (cache/disk/folders.py).

Why one module of ~570 lines: the writer thread, LRU eviction, recovery and loads share one lock
and one in-memory table of entries; split apart, each piece would reach into the others' state.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...config import faults
from . import safetensors_io
from .folders import fsync_dir, open_private, private_dirs, prune_namespaces, tighten_tier  # noqa: F401 - prune_namespaces re-exported
from .index import DiskIndex, IndexRow
from .safetensors_io import CorruptFile, FilePlan

log = logging.getLogger(__name__)

FORMAT_VERSION = "1"
_KEY_TOKENS = "mlxstack.key_tokens"      # reserved tensor names: the tokens travel in the file
_MODEL_TOKENS = "mlxstack.model_tokens"  # too, so a file is self-describing and checksummed
_META = "mlxstack.meta"
_FORMAT = "mlxstack.format"
_SUFFIX = ".safetensors"
_TMP_MARK = ".tmp-"
_NAMESPACE_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class DiskTierBusy(RuntimeError):
    """Another process holds this namespace directory."""


@dataclass(frozen=True, slots=True)
class DiskRecord:
    key_tokens: np.ndarray            # int64 canonical cache key (negative ids: VLM image markers)
    model_tokens: np.ndarray          # int64 model tokens; the entry's depth is their length
    tensors: dict[str, np.ndarray]    # flat name -> array; ownership passes to the tier on put
    meta: dict                        # JSON-serialisable cache-kind state


@dataclass(frozen=True, slots=True)
class DiskEntryInfo:
    entry_id: int
    key_tokens: np.ndarray            # read-only
    model_tokens: np.ndarray          # read-only
    nbytes: int                       # file size (header + payload), what the budget counts
    created: float
    last_used: float
    meta: dict
    durable: bool                     # False while the write is still queued

    @property
    def depth(self) -> int:
        return len(self.model_tokens)


@dataclass(slots=True)
class _Entry:
    entry_id: int
    key_tokens: np.ndarray
    model_tokens: np.ndarray
    nbytes: int
    created: float
    last_used: float
    use_seq: int
    meta: dict
    checksum: str = ""
    plan: FilePlan | None = None       # set while queued / being written
    record: DiskRecord | None = None   # held until durable, then dropped

    def info(self) -> DiskEntryInfo:
        return DiskEntryInfo(self.entry_id, self.key_tokens, self.model_tokens, self.nbytes,
                             self.created, self.last_used, self.meta, self.record is None)

    def row(self) -> IndexRow:
        return IndexRow(self.entry_id, self.nbytes, self.checksum, self.created, self.last_used,
                        self.use_seq, self.key_tokens, self.model_tokens, self.meta)


@dataclass(slots=True)
class _Stats:
    writes: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    write_errors: int = 0
    loads: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    loads_from_queue: int = 0
    load_misses: int = 0
    evictions: int = 0
    corrupt_dropped: int = 0
    missing_dropped: int = 0
    dropped_writes: int = 0
    refused_too_big: int = 0
    stale_temp_removed: int = 0
    orphan_files_removed: int = 0


def disk_namespace(**parts: object) -> str:
    """A directory name from everything that makes stored KV incompatible (JSON-able values)."""
    blob = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, separators=(",", ":"))
    return "ns-" + hashlib.sha256(blob.encode()).hexdigest()[:32]


def _check_namespace(namespace: str) -> None:
    if not namespace or len(namespace) > 128 or namespace.startswith(".") or not set(namespace) <= _NAMESPACE_CHARS:
        raise ValueError(f"namespace {namespace!r} must be 1-128 characters of [A-Za-z0-9._-] not "
                         "starting with '.'; build it with disk_namespace(...)")


def _as_tokens(tokens, what: str) -> np.ndarray:
    if np.ndim(tokens) != 1:
        raise ValueError(f"{what} must be 1-D, got shape {np.shape(tokens)}")
    arr = np.array(tokens, dtype=np.int64, copy=True)
    arr.flags.writeable = False  # shared by every DiskEntryInfo snapshot
    return arr


class DiskTier:
    """Thread-safe: put/load/touch/remove from the inference thread, stats from any thread;
    file writes, deletions and index updates run on one writer thread (inline when
    ``background=False``)."""

    def __init__(
        self,
        root: Path,
        namespace: str,
        max_bytes: int,
        *,
        clock: Callable[[], float] = time.time,
        background: bool = True,
        max_queue: int = 8,
        max_queue_bytes: int = 1 << 30,
    ) -> None:
        _check_namespace(namespace)
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.namespace = namespace
        self.max_bytes = int(max_bytes)
        self.directory = Path(root).expanduser() / namespace
        self.entries_dir = self.directory / "entries"
        self.clock = clock
        self.background = background
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        private_dirs(Path(root).expanduser(), self.directory, self.entries_dir)
        tighten_tier(Path(root).expanduser(), self.directory)  # a tier an older version left 0755 / 0644
        self._lock_file = self._acquire_lock()

        self._lock = threading.Condition(threading.RLock())
        self._entries: OrderedDict[int, _Entry] = OrderedDict()   # least recently used first
        self._bytes = 0
        self._ops: deque[tuple[str, int]] = deque()               # ("write" | "delete", entry_id)
        self._queued_writes = 0
        self._queued_bytes = 0
        self._dirty_touch: dict[int, tuple[float, int]] = {}
        self._busy = False
        self._closed = False
        self._runner = threading.Lock()  # one _run_ops at a time (callers run it when not background)
        self._removed: list[int] = []                             # for drain_removed()
        self._stats = _Stats()
        self._use_seq = 0
        self._index = DiskIndex(self.directory / "index.sqlite")
        try:
            self._recover()
        except BaseException:
            self._index.close()
            self._lock_file.close()
            raise
        self._writer: threading.Thread | None = None
        if background:
            self._writer = threading.Thread(target=self._writer_loop, name="disk-tier-writer", daemon=True)
            self._writer.start()
        else:
            self._run_ops()

    # ------------------------------------------------------------------ public API
    def put(self, record: DiskRecord) -> int | None:
        """Queue ``record`` for writing and return its entry id, or None when it is refused
        (larger than the whole budget) or dropped (write queue full). Never waits for I/O.
        The tier keeps references to the arrays: the caller must not modify them afterwards."""
        key = _as_tokens(record.key_tokens, "key_tokens")
        model = _as_tokens(record.model_tokens, "model_tokens")
        for name in record.tensors:
            if isinstance(name, str) and name.startswith("mlxstack."):
                raise ValueError(f"tensor name {name!r}: the 'mlxstack.' prefix is reserved")
        meta_json = json.dumps(record.meta, sort_keys=True, allow_nan=False)  # TypeError/ValueError if not JSON
        meta = json.loads(meta_json)  # the tier's own copy, equal to what a reload returns
        stored = DiskRecord(key, model, dict(record.tensors), meta)
        plan = safetensors_io.plan_file(_file_tensors(stored), {_FORMAT: FORMAT_VERSION, _META: meta_json})
        with self._lock:
            if self._closed:
                raise RuntimeError("DiskTier.put after close()")
            if plan.size > self.max_bytes:
                self._stats.refused_too_big += 1
                return None
            if self.background and self._queued_writes and (
                self._queued_writes >= self.max_queue or self._queued_bytes + plan.size > self.max_queue_bytes
            ):
                self._stats.dropped_writes += 1
                return None
            entry_id = self._next_id
            self._next_id += 1
            self._evict_for(plan.size)
            now = self.clock()
            self._use_seq += 1
            self._entries[entry_id] = _Entry(entry_id, key, model, plan.size, now, now, self._use_seq,
                                             meta, plan=plan, record=stored)
            self._bytes += plan.size
            self._queued_writes += 1
            self._queued_bytes += plan.size
            self._ops.append(("write", entry_id))
            self._lock.notify_all()
        if not self.background:
            self._run_ops()
        return entry_id

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write, deletion and LRU bump is on disk. False on timeout."""
        if not self.background:
            self._run_ops()
            return True
        with self._lock:
            return self._lock.wait_for(lambda: not (self._ops or self._busy or self._dirty_touch), timeout)

    def entries(self) -> list[DiskEntryInfo]:
        """Every entry, least recently used first (index only: no tensor file is read)."""
        with self._lock:
            return [e.info() for e in self._entries.values()]

    def load(self, entry_id: int) -> DiskRecord | None:
        """The verified record, or None. A file that is missing, torn or fails its checksum is
        deleted with its row, counted and reported by drain_removed(). A hit bumps the LRU."""
        with self._lock:
            entry = self._entries.get(entry_id)
            if entry is None:
                self._stats.load_misses += 1
                return None
            if entry.record is not None:  # still queued: serve the record it holds
                self._stats.loads_from_queue += 1
                self._bump(entry)
                queued = entry.record
                return DiskRecord(queued.key_tokens, queued.model_tokens, dict(queued.tensors), queued.meta)
        read = self._checked(entry, safetensors_io.read_file)
        if read is None:
            return None
        tensors, metadata = read
        return DiskRecord(tensors.pop(_KEY_TOKENS), tensors.pop(_MODEL_TOKENS), tensors,
                          json.loads(metadata[_META]))

    def verified_path(self, entry_id: int) -> Path | None:
        """Verify a durable entry's file (size, CRC-32, index checksum) without keeping its
        payload, and return its path for a caller that reads the tensors with its own loader
        (``mx.load``: one copy instead of load()'s two). The meta is ``entries()``' (the
        checksum covers it). None when the entry is unknown, still queued (use load()), or was
        dropped as corrupt or missing. Files are never rewritten, only deleted after an
        eviction or removal, so read it before the next put()/remove(). A hit bumps the LRU."""
        with self._lock:
            entry = self._entries.get(entry_id)
            if entry is None or entry.record is not None:
                self._stats.load_misses += entry is None
                return None
        return None if self._checked(entry, safetensors_io.verify_file) is None else self._path(entry_id)

    def touch(self, entry_id: int) -> None:
        """Mark an entry most recently used (a hit served from the RAM copy of it)."""
        with self._lock:
            entry = self._entries.get(entry_id)
            if entry is not None:
                self._bump(entry)
        if not self.background:
            self._run_ops()

    def remove(self, entry_id: int) -> None:
        with self._lock:
            entry = self._entries.get(entry_id)
            if entry is not None:
                self._forget(entry)
        if not self.background:
            self._run_ops()

    def drain_removed(self) -> list[int]:
        """Ids that left the tier since the last call other than by remove(): evicted, dropped
        as corrupt or missing, or whose write failed. The caller's lookup index forgets them."""
        with self._lock:
            out, self._removed = self._removed, []
            return out

    def stats(self) -> dict:
        """Counters since start-up. ``entries``/``bytes`` include queued writes (the budget
        counts them at put); ``queue_depth``/``queue_bytes`` are writes queued or in progress;
        ``*_seconds`` are wall time on the writer thread (writes) or the caller (loads)."""
        with self._lock:
            s = self._stats
            return {
                "entries": len(self._entries), "bytes": self._bytes, "max_bytes": self.max_bytes,
                "writes": s.writes, "write_bytes": s.write_bytes, "write_seconds": s.write_seconds,
                "write_errors": s.write_errors,
                "loads": s.loads, "load_bytes": s.load_bytes, "load_seconds": s.load_seconds,
                "loads_from_queue": s.loads_from_queue, "load_misses": s.load_misses,
                "evictions": s.evictions, "corrupt_dropped": s.corrupt_dropped,
                "missing_dropped": s.missing_dropped, "dropped_writes": s.dropped_writes,
                "refused_too_big": s.refused_too_big, "stale_temp_removed": s.stale_temp_removed,
                "orphan_files_removed": s.orphan_files_removed,
                "queue_depth": self._queued_writes, "queue_bytes": self._queued_bytes,
            }

    def close(self, flush: bool = True) -> None:
        """Stop the writer (after finishing queued writes unless ``flush=False``), close the
        index and release the namespace lock. Idempotent."""
        with self._lock:
            if self._closed:
                return
            if not flush:
                for entry in [e for e in self._entries.values() if e.record is not None]:
                    self._forget(entry)
            self._closed = True
            self._lock.notify_all()
        if self._writer is not None:
            self._writer.join()
        else:
            self._run_ops()
        self._index.close()
        self._lock_file.close()

    # ------------------------------------------------------------------ start-up
    def _acquire_lock(self):
        f = open_private(self.directory / "lock")  # held open (locked) until close()
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise DiskTierBusy(f"{self.directory} is in use by another process; give each server "
                               "its own DISK_CACHE_DIR or turn the disk cache off") from None
        return f

    def _recover(self) -> None:
        """Reconcile files and rows: no tensor bytes are read (sizes come from stat)."""
        files = {}
        for path in self.entries_dir.iterdir():
            if _TMP_MARK in path.name:
                path.unlink(missing_ok=True)
                self._stats.stale_temp_removed += 1
            elif path.suffix == _SUFFIX and path.stem.isdigit():
                files[int(path.stem)] = path.stat().st_size
            else:
                log.warning("disk tier: ignoring unexpected file %s", path)
        rows = self._index.rows()
        if self._index.reset:  # index from another schema: its files cannot be trusted
            rows = []
        dead = []
        for row in rows:
            size = files.pop(row.entry_id, None)
            if size is None:
                self._stats.missing_dropped += 1
                dead.append(row.entry_id)
            elif size != row.nbytes:
                self._stats.corrupt_dropped += 1
                dead.append(row.entry_id)
                self._path(row.entry_id).unlink(missing_ok=True)
            else:
                self._entries[row.entry_id] = _Entry(row.entry_id, row.key_tokens, row.model_tokens, row.nbytes,
                                                     row.created, row.last_used, row.use_seq, row.meta,
                                                     checksum=row.checksum)
                self._bytes += row.nbytes
        if dead:
            self._index.delete(dead)
        for entry_id in files:  # durable file whose row never committed (crash) or was deleted
            self._path(entry_id).unlink(missing_ok=True)
            self._stats.orphan_files_removed += 1
        self._use_seq = max((e.use_seq for e in self._entries.values()), default=0)
        self._next_id = max([*self._entries, *(r.entry_id for r in rows), 0]) + 1
        with self._lock:
            self._evict_for(0)  # the budget may have shrunk since the last run

    # ------------------------------------------------------------------ internals (lock held)
    def _path(self, entry_id: int) -> Path:
        return self.entries_dir / f"{entry_id}{_SUFFIX}"

    def _bump(self, entry: _Entry) -> None:
        self._use_seq += 1
        entry.use_seq = self._use_seq
        entry.last_used = self.clock()
        self._entries.move_to_end(entry.entry_id)
        if entry.record is None:
            self._dirty_touch[entry.entry_id] = (entry.last_used, entry.use_seq)
            self._lock.notify_all()

    def _evict_for(self, nbytes: int) -> None:
        while self._entries and self._bytes + nbytes > self.max_bytes:
            victim = next(iter(self._entries.values()))
            self._forget(victim)
            self._stats.evictions += 1
            self._removed.append(victim.entry_id)

    def _forget(self, entry: _Entry) -> None:
        """Take an entry out of the in-memory index and queue the deletion of its file + row."""
        del self._entries[entry.entry_id]
        self._bytes -= entry.nbytes
        self._dirty_touch.pop(entry.entry_id, None)
        if entry.record is not None and entry.plan is not None:  # queued write: skip it
            self._queued_writes -= 1
            self._queued_bytes -= entry.nbytes
            entry.plan = None
        entry.record = None
        self._ops.append(("delete", entry.entry_id))
        self._lock.notify_all()

    # ------------------------------------------------------------------ internals (take the lock)
    def _checked(self, entry: _Entry, reader):
        """Run ``reader`` on a durable entry's file; on any defect drop the entry and return None."""
        with self._lock:
            expected = (entry.nbytes, entry.checksum)
        t0 = time.perf_counter()
        try:
            result = reader(self._path(entry.entry_id), expected_size=expected[0])
            metadata = result[1] if isinstance(result, tuple) else result
            if metadata.get(safetensors_io.CHECKSUM_KEY) != expected[1]:
                raise CorruptFile(f"file checksum {metadata.get('checksum')} != index checksum {expected[1]}")
            if metadata.get(_FORMAT) != FORMAT_VERSION or _META not in metadata:
                raise CorruptFile(f"not a format-{FORMAT_VERSION} entry file")
        except FileNotFoundError:
            self._drop(entry, "missing")
            return None
        except (CorruptFile, OSError) as exc:
            log.warning("disk tier: entry %d is unreadable (%s); deleted", entry.entry_id, exc)
            self._drop(entry, "corrupt")
            return None
        seconds = time.perf_counter() - t0
        with self._lock:
            self._stats.loads += 1
            self._stats.load_bytes += expected[0]
            self._stats.load_seconds += seconds
            if self._entries.get(entry.entry_id) is entry:
                self._bump(entry)
        return result

    def _drop(self, entry: _Entry, reason: str) -> None:
        with self._lock:
            if self._entries.get(entry.entry_id) is not entry:
                return  # evicted or removed meanwhile: not this load's finding
            if reason == "missing":
                self._stats.missing_dropped += 1
            else:
                self._stats.corrupt_dropped += 1
            self._forget(entry)
            self._removed.append(entry.entry_id)
        if not self.background:
            self._run_ops()

    def _writer_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._ops or self._dirty_touch or self._closed)
                if self._closed and not self._ops and not self._dirty_touch:
                    return
            try:
                self._run_ops()
            except Exception:
                log.exception("disk tier: writer error")

    def _run_ops(self) -> None:
        """Run queued work until none is left (writer thread, or the caller when not background)."""
        with self._runner:
            self._run_ops_locked()

    def _run_ops_locked(self) -> None:
        while True:
            with self._lock:
                touches, self._dirty_touch = self._dirty_touch, {}
                op = self._ops.popleft() if self._ops else None
                if op is None and not touches:
                    self._busy = False
                    self._lock.notify_all()
                    return
                self._busy = True
                entry = self._entries.get(op[1]) if op else None
                job = None
                if op and op[0] == "write" and entry is not None and entry.plan is not None:
                    job = (entry, entry.plan, entry.record)
                    entry.plan = None  # marks "in progress" (queue accounting below)
            try:
                if touches:
                    self._index.touch((eid, lu, seq) for eid, (lu, seq) in touches.items())
                if job is not None:
                    self._write(*job)
                elif op and op[0] == "delete":
                    self._index.delete([op[1]])
                    self._path(op[1]).unlink(missing_ok=True)
            except Exception:
                log.exception("disk tier: %s of entry %s failed", op[0] if op else "touch", op[1] if op else "-")

    def _write(self, entry: _Entry, plan: FilePlan, record: DiskRecord) -> None:
        final = self._path(entry.entry_id)
        tmp = final.with_name(f"{final.name}{_TMP_MARK}{os.getpid()}")
        t0 = time.perf_counter()
        try:
            checksum = safetensors_io.write_file(tmp, plan, _file_tensors(record))
            faults.hit("disk_write", str(entry.entry_id))  # tests: a write that fails before its rename
            with self._lock:
                alive = self._entries.get(entry.entry_id) is entry
                if alive:  # rename under the lock: an eviction now sees a durable entry
                    os.replace(tmp, final)
                    entry.checksum = checksum
                    entry.record = None
                    row = entry.row()
                    self._queued_writes -= 1
                    self._queued_bytes -= entry.nbytes
        except Exception as exc:  # noqa: BLE001 -- disk full, I/O error, ...: the entry is simply not kept
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._queued_writes -= 1
                self._queued_bytes -= entry.nbytes
                self._stats.write_errors += 1
                if self._entries.get(entry.entry_id) is entry:
                    entry.record = None
                    self._forget(entry)
                    self._removed.append(entry.entry_id)
            log.warning("disk tier: writing entry %d failed (%s); dropped", entry.entry_id, exc)
            return
        if not alive:  # evicted or removed while being written
            with self._lock:
                self._queued_writes -= 1
                self._queued_bytes -= entry.nbytes
            tmp.unlink(missing_ok=True)
            return
        fsync_dir(self.entries_dir)
        self._index.insert(row)
        seconds = time.perf_counter() - t0
        with self._lock:
            self._stats.writes += 1
            self._stats.write_bytes += entry.nbytes
            self._stats.write_seconds += seconds


def _file_tensors(record: DiskRecord) -> dict[str, np.ndarray]:
    return {**record.tensors, _KEY_TOKENS: record.key_tokens, _MODEL_TOKENS: record.model_tokens}
