"""The disk tier behind the RAM prompt cache: write-through, spill, restore at start-up, load.

    backing = DiskBacking(tier, min_tokens=1024)
    backing.restore(prompt_cache)              # start-up: index every disk entry (no tensor read)
    backing.write_through(entry)               # a new long entry: copy it to disk now
    PromptCache(..., on_spill=backing.spill)   # a RAM eviction keeps the entry findable on disk
    state = backing.load(entry)                # a hit on a disk-only entry: verified, or None

A load is verified twice: the file's checksum (torn / corrupt files are deleted and counted by
the tier) and the model tokens the file itself carries against the index's; only then is the
state handed to the lookup, whose model-token LCP acceptance is the same as for RAM entries.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np

from ...config import faults
from .tier import DiskTier
from .records import arrays_to_state, entry_to_record, record_to_state
from ..kv_ops import KVState
from ..prompt_cache import CacheEntry, PromptCache

log = logging.getLogger("mlxstack.cache.disk")


class DiskBacking:
    def __init__(self, tier: DiskTier, min_tokens: int, min_spill_tokens: int = 16) -> None:
        self.tier = tier
        self.min_tokens = int(min_tokens)
        self.min_spill_tokens = int(min_spill_tokens)
        self._meta: dict[int, dict] = {}     # disk id -> the record's meta (the file's checksum covers it)
        self.hits = 0
        self.load_failures = 0
        self.spills = 0
        self.write_throughs = 0
        self.restored = 0
        self.load_seconds = 0.0
        # Several ranks (engine/lockstep.py): each rank's tier holds its own part of every entry.
        # What one rank's tier did -- a write refused, a file evicted, dropped or unreadable -- is
        # applied on every rank (these are collectives then, called at the same point of the same
        # turn everywhere), so every rank's index keeps the same entries. One process: as is.
        self.agree: Callable[[bool], bool] = lambda ok: ok                       # every rank's ok
        self.agree_union: Callable[[list[int]], list[int]] | None = None        # entry ids, all ranks

    # ------------------------------------------------------------------ writes
    def _put(self, entry: CacheEntry) -> int | None:
        if entry.payload is None:
            return None
        record = entry_to_record(entry)
        disk_id = self.tier.put(record)
        if disk_id is not None:
            self._meta[disk_id] = record.meta
        return disk_id

    def _put_everywhere(self, entry: CacheEntry) -> int | None:
        """``_put``, kept only where every rank's tier took its part."""
        disk_id = self._put(entry)
        if not self.agree(disk_id is not None) and disk_id is not None:
            self.tier.remove(disk_id)
            self._meta.pop(disk_id, None)
            disk_id = None
        return disk_id

    def write_through(self, entry: CacheEntry | None) -> None:
        """Copy a new entry of at least ``min_tokens`` to disk now (a crash cannot lose it)."""
        if entry is None or entry.disk_id is not None or entry.depth < self.min_tokens:
            return
        entry.disk_id = self._put_everywhere(entry)
        self.write_throughs += entry.disk_id is not None

    def spill(self, entry: CacheEntry, reason: str) -> int | None:
        """PromptCache.on_spill: the disk copy's id, or None (the entry is then dropped)."""
        if entry.depth < self.min_spill_tokens:
            return None
        disk_id = self._put_everywhere(entry)
        self.spills += disk_id is not None
        return disk_id

    def keep(self, cache: PromptCache) -> int:
        """Shutdown: every RAM entry not on disk yet (shorter than ``min_tokens`` too, down to the
        spill floor) written there, so the next start of the same model finds every session. Returns
        how many were queued (``close`` flushes them)."""
        kept = 0
        for entry in cache.entries():
            if entry.disk_id is None and entry.payload is not None and entry.depth >= self.min_spill_tokens:
                entry.disk_id = self._put_everywhere(entry)
                if entry.disk_id is None:         # the write queue was full: drain it and write this one
                    self.tier.flush()
                    entry.disk_id = self._put_everywhere(entry)
                kept += entry.disk_id is not None
        return kept

    def forget(self, entry: CacheEntry, reason: str) -> None:
        """The entry left the index: its disk copy goes too (unless the tier already dropped it)."""
        if entry.disk_id is not None and reason != "disk_evicted":
            self.tier.remove(entry.disk_id)
            self._meta.pop(entry.disk_id, None)

    # ------------------------------------------------------------------ reads
    def restore(self, cache: PromptCache) -> int:
        """Index every disk entry (start-up): the tensors stay on disk until a hit."""
        n = 0
        for info in self.tier.entries():
            meta = info.meta
            entry = cache.insert_disk_entry(info.key_tokens, info.model_tokens, disk_id=info.entry_id,
                                            nbytes=int(meta.get("ram_bytes", info.nbytes)),
                                            floor=int(meta.get("floor", info.depth)),
                                            pool=str(meta.get("pool", "kv")), session_id=str(meta.get("session", "")),
                                            last_used=time.monotonic(), scope=str(meta.get("scope", "")))
            if entry is not None:
                self._meta[info.entry_id] = meta
                n += 1
        self.restored = n
        return n

    def sync(self, cache: PromptCache) -> None:
        """Forget entries the tier evicted or dropped since the last call (several ranks: an entry
        any rank's tier dropped loses its disk copy on every rank)."""
        gone = list(self.tier.drain_removed())
        for disk_id in gone:
            self._meta.pop(disk_id, None)
        if self.agree_union is not None:
            lost = set(gone)
            mine = [e.entry_id for e in cache.entries(include_disk=True) if e.disk_id in lost]
            for entry_id in self.agree_union(mine):
                e = cache.get(entry_id)
                if e is not None and e.disk_id is not None and e.disk_id not in lost:
                    self.tier.remove(e.disk_id)
                    self._meta.pop(e.disk_id, None)
                    gone.append(e.disk_id)
        cache.forget_disk(gone)

    def load(self, entry: CacheEntry) -> KVState | None:
        """The verified state of a disk-only entry, or None (corrupt / missing / mismatched)."""
        t0 = time.perf_counter()
        disk_id = entry.disk_id
        state = None
        try:
            path = self.tier.verified_path(disk_id)
            faults.hit("disk_load", str(disk_id))  # tests: a load that fails (a miss, never a failed request)
            meta = self._meta.get(disk_id)
            if path is not None and meta is not None:
                import mlx.core as mx

                arrays = mx.load(str(path))
                stored = np.array(arrays.pop("mlxstack.model_tokens"), dtype=np.int64)
                if np.array_equal(stored, entry.model_tokens):
                    state = arrays_to_state(arrays, meta)
            elif path is None:
                record = self.tier.load(disk_id)   # still queued, or gone
                if record is not None and np.array_equal(record.model_tokens, entry.model_tokens):
                    state = record_to_state(record)
        except Exception:  # noqa: BLE001 - a bad file must never fail the request: treat as a miss
            log.exception("disk entry %s could not be loaded; dropping it", disk_id)
            state = None
        if not self.agree(state is not None):     # a rank that could not read its part: a miss everywhere
            state = None
        if state is None:
            self.load_failures += 1
            self.tier.remove(disk_id)
            self._meta.pop(disk_id, None)
        else:
            self.hits += 1
        self.load_seconds += time.perf_counter() - t0
        return state

    def stats(self) -> dict[str, Any]:
        s = self.tier.stats()
        return {**s, "hits": self.hits, "load_failures": self.load_failures, "spills": self.spills,
                "write_throughs": self.write_throughs, "restored_at_start": self.restored,
                "hit_load_seconds": round(self.load_seconds, 4), "directory": str(self.tier.directory)}

    def close(self) -> None:
        self.tier.close(flush=True)
