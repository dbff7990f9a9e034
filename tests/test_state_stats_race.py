"""Issue 23 #8: ``EngineState.stats()`` runs on HTTP handler threads (/metrics, /v1/cache/stats)
while the inference thread spills or evicts entries (``payload -> None``, under the cache lock). It
used to test ``e.payload is not None`` and then read ``e.payload.layers`` again outside the lock:
an eviction in between made /metrics answer 500. The rule now: a reader on another thread reads
an entry's payload only under the cache lock, once (``PromptCache.held``). The race itself is too
narrow to hit reliably from a test, so the test checks the rule: every payload read that stats()
makes is made while the cache lock is held."""
from __future__ import annotations

import dataclasses

from mlxstack.cache.prompt_cache import CacheEntry
from tests.conftest import build_engine, engine_settings
from tests.test_disk_cache import run_turns
from tests.test_model_families import TURNS

_SLOT = CacheEntry.payload           # the dataclass slot the guarded property wraps


class GuardedEntry(CacheEntry):
    """A cache entry whose payload may only be read while ``lock`` is held by the reader."""
    lock = None
    unlocked_reads = 0

    @property
    def payload(self):
        if GuardedEntry.lock is not None and not GuardedEntry.lock._is_owned():
            GuardedEntry.unlocked_reads += 1
        return _SLOT.__get__(self)

    @payload.setter
    def payload(self, value):
        _SLOT.__set__(self, value)


def test_stats_read_payloads_only_under_the_cache_lock(tiny_dense_hd64_path):
    # KV_BITS on: stats() inspects the payload's layers (quantized bytes), the read that raced
    eng = build_engine(engine_settings(tiny_dense_hd64_path, kv_bits="8", kv_group_size=64, quantized_kv_start=0))
    run_turns(eng, TURNS[:2], session="a")
    pc = eng.state.kv.index
    for eid, e in list(pc._entries.items()):
        pc._entries[eid] = GuardedEntry(**{f.name: getattr(e, f.name) for f in dataclasses.fields(CacheEntry)})
    GuardedEntry.lock, GuardedEntry.unlocked_reads = pc._lock, 0
    try:
        stats = eng.state.stats()
    finally:
        GuardedEntry.lock = None
    assert GuardedEntry.unlocked_reads == 0
    assert stats["entries"] == len(pc._entries) >= 2 and stats["quantized_bytes"] == stats["bytes"] > 0
