"""What several ranks holding one model agree on about their KV, as the cache's own collectives.

    ranks = RankGroup(group)            # mx.distributed's group (engine/lockstep.py builds it)
    ranks.now = record_now              # rank 0's clock for this turn (set by the lockstep exchange)
    kv.join(ranks)                      # cache/manager.py: entry sizes summed, clock, disk agreement

Every rank keeps the same entries: an entry's size is the group's (each rank holds its own part:
equal parts under tensor parallelism, its layers' under pipeline), a disk write or read that failed
on one rank failed on every rank, the entries some rank's tier dropped are dropped everywhere, and
TTLs and last use read rank 0's clock. Each of these is a collective, so every rank calls it at the
same point of the same turn (the engine is the same code on the same inputs: LESSONS 60). The cache
calls these methods, never the engine's: imports and calls point down only.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any

import mlx.core as mx


class RankGroup:
    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.now = time.monotonic()     # rank 0's monotonic clock as of the current turn

    def clock(self) -> float:
        """Rank 0's monotonic time as of the current turn (every rank reads the same)."""
        return self.now

    def sum_bytes(self, value: int) -> int:
        """Every rank's ``value`` summed (an entry's bytes over the group)."""
        return int(mx.distributed.all_sum(mx.array([int(value)], dtype=mx.int64), group=self.group).item())

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. the cache budget: the tightest rank)."""
        got = mx.distributed.all_gather(mx.array([int(value)], dtype=mx.int64), group=self.group)
        return int(got.min().item())

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank's ``ok`` holds (a disk write, a disk read: one rank's failure is a
        failure everywhere)."""
        total = mx.distributed.all_sum(mx.array([int(bool(ok))], dtype=mx.int32), group=self.group)
        return int(total.item()) == self.size

    def union(self, ids: list[int]) -> list[int]:
        """Every rank's ``ids`` together, sorted (entries some rank's disk tier dropped)."""
        counts = mx.distributed.all_gather(mx.array([len(ids)], dtype=mx.int32), group=self.group)
        width = int(counts.max().item())
        if width == 0:
            return []
        mine = mx.array(list(ids) + [-1] * (width - len(ids)), dtype=mx.int64)
        got = mx.distributed.all_gather(mine, group=self.group).tolist()
        return sorted({int(i) for i in got if i >= 0})

    def digest_agrees(self, text: str) -> bool:
        """Whether every rank computed the same ``text`` (compared by a 63-bit hash of it)."""
        h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
        got = mx.distributed.all_gather(mx.array([h], dtype=mx.int64), group=self.group)
        return bool((got == h).all().item())
