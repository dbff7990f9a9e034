"""One KV manager: the verbs a request's KV goes through, from lookup to store.

    kv = KVManager(index, disk, sessions, counters, quant)
    found = kv.find(lookup)                           # both tiers; a disk hit loaded and verified
    live = kv.checkout(found.match, found.stored, by_reference)   # -> LiveCache at exactly match.depth
    live = kv.fork(leader_live, depth)                # a follower's first tokens, by reference
    state = kv.snapshot(live)                         # -> KVState (a depth a later turn extends)
    turn = kv.new_turn()                              # one per request: its entries share it
    entry = kv.store(key, tokens, state, pool=..., session_id=..., parent=..., ttl=..., turn=turn)
    kv.remove(entry_id, reason)

The engine asks these verbs and never reaches into an entry's payload, a tier or a layer's own
buffers: a fork takes the leader's first ``depth`` tokens from each layer's kind
(``LiveCache.share``: a prefixed layer's tail is not its whole sequence -- LESSONS 63), a hit on a
disk-only entry is loaded, verified and promoted here, and a store records the entry in the
session index and writes it through to disk in one place. The index (cache/prompt_cache.py), the
cache kinds (cache/layer_kinds.py) and the tiers stay what they were; this is the one door the
engine uses to them. Several ranks (engine/lockstep.py) count an entry's bytes over the group:
``group_bytes``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, NamedTuple

from ..config import faults
from .counters import CacheCounters
from .kv_ops import KVState, LiveCache, capture, checkout
from .layer_kinds import KVQuant, eval_state
from .prefixed_kv import PrefixedKVCache
from .prompt_cache import MISS, CacheEntry, MatchResult, PromptCache
from .sessions import SessionIndex
from .state_codes import StateCodes, acceptable

LOOKUP_RETRIES = 4   # disk entries that fail verification are dropped and the lookup runs again


class Found(NamedTuple):
    match: MatchResult
    from_disk: bool                  # the entry was loaded from the disk tier for this request
    stored: Any                      # the state to check out (None on a miss)
    gave_up: bool = False            # every try hit a disk file that failed verification


class KVManager:
    def __init__(self, index: PromptCache, disk: Any, sessions: SessionIndex, counters: CacheCounters,
                 quant: KVQuant | None, fresh: Callable[[], LiveCache] | None = None,
                 codes: StateCodes | None = None) -> None:
        self.index = index
        self.disk = disk               # cache/disk/backing.py DiskBacking, or None
        self.sessions = sessions
        self.counters = counters
        self.quant = quant
        self.codes = codes             # RECURRENT_STATE_BITS: stored recurrent states coded (lossy), or None
        self.fresh = fresh             # a new, empty LiveCache for the model (set by the engine)
        self.group_bytes: Callable[[int], int] = lambda n: n

    # ---------------------------------------------------------------- lookup and checkout
    def find(self, lookup: Callable[[], MatchResult]) -> Found:
        """``lookup()`` over both tiers. A hit on a disk-only entry is loaded (verified) and served
        from what was loaded, whether or not RAM can keep it (an entry over the byte budget stays
        disk-only); a file that fails verification is dropped and the lookup runs again, up to
        ``LOOKUP_RETRIES`` times (then a miss, ``gave_up``)."""
        if self.disk is not None:
            self.disk.sync(self.index)
        for _ in range(LOOKUP_RETRIES):
            match = lookup()
            stored = match.entry.payload if match.hit else None
            if not match.hit or stored is not None:
                return Found(match, False, stored)
            stored = self.disk.load(match.entry) if self.disk is not None else None
            if stored is not None and not acceptable(self.codes, stored.layers):
                stored = None          # recurrent codes another setting wrote: refused, a miss
            if stored is not None:
                self.index.promote(match.entry.entry_id, stored, self.group_bytes(stored.nbytes))
                return Found(match, True, stored)
            self.index.remove(match.entry.entry_id, "disk_corrupt")
            self.counters.bump("disk_load_failures")
        return Found(MISS, False, None, gave_up=True)

    def checkout(self, match: MatchResult, stored: Any, by_reference: int = 0) -> LiveCache:
        """The caches a request writes into: the entry's state at exactly ``match.depth`` (a
        prefix of at least ``by_reference`` tokens held by reference), or fresh ones on a miss."""
        if not match.hit:
            return self.new()
        live = checkout(stored, match.depth, self.quant, by_reference)
        if live.depth != match.depth:
            raise RuntimeError(f"bug: checkout depth {live.depth} != match depth {match.depth}")
        return live

    def restore(self, state: KVState) -> LiveCache:
        """Fresh caches holding ``state`` whole (a snapshot a request goes back to: its turn is
        closed again from there)."""
        return checkout(state, state.depth, self.quant)

    def new(self) -> LiveCache:
        if self.fresh is None:
            raise RuntimeError("KVManager.fresh is not set: the engine gives it the model's empty caches")
        return self.fresh()

    def fork(self, leader: LiveCache, depth: int) -> LiveCache:
        """A follower's caches holding ``leader``'s first ``depth`` tokens by reference -- the
        same arrays become both's root (the leader's next append copies its buffer once). Under KV
        quantisation a copy instead (its state at ``depth``, checked out): a layer below the start
        must become coded exactly where the follower's own run reaches it, which a prefix held by
        reference never does, and a coded layer's floats come with its codes. The copy still
        carries the leader's roots, so a decode slab holds the common floats once for all of them
        (cache/slab.py ``_share``; each row keeps its own codes)."""
        if leader.quant is not None:
            roots = leader.share(depth)
            live = checkout(capture(leader, depth), depth, self.quant)
            live.roots = list(roots)
            return live
        roots = leader.share(depth)
        return LiveCache([PrefixedKVCache(r) for r in roots], depth, self.quant, list(roots))

    def snapshot(self, live: LiveCache, depth: int | None = None) -> KVState:
        return capture(live, depth)

    # ---------------------------------------------------------------- store
    def new_turn(self) -> int:
        """The turn the entries one request stores share (the index's eviction order reads it)."""
        return self.index.new_turn()

    def store(self, key: list[int], tokens: list[int], state: KVState, *, pool: str, session_id: str,
              parent: str | None, ttl: float | None, inserted: list[int], fault: str | None = None,
              scope: str = "", turn: int | None = None) -> CacheEntry | None:
        """Insert ``state`` under ``key`` (the index may decline: None), record it in its session
        and write it through to disk; ``turn``: the request's (``new_turn()``), None: its own.
        The entry's id goes into ``inserted`` as soon as it exists,
        so a caller storing several can remove them all when a later step fails (all or nothing);
        ``fault`` names the request at the test fault point between insert and record. With
        RECURRENT_STATE_BITS the entry keeps its recurrent layers coded (cache/state_codes.py: lossy,
        what is stored only -- the request that took ``state`` computed with the exact one)."""
        if self.codes is not None:
            state = replace(state, layers=(layers := self.codes.code_layers(state.layers)),
                            nbytes=sum(s.nbytes for s in layers))
            eval_state(layers)         # the codes materialised: the float arrays' graph is not kept
        entry = self.index.insert(key, tokens, state, nbytes=self.group_bytes(state.nbytes), floor=state.floor,
                                  pool=pool, session_id=session_id, ttl=ttl, scope=scope, turn=turn)
        if entry is None:
            return None
        inserted.append(entry.entry_id)
        if fault is not None:
            faults.hit("store", fault)
        self.sessions.record(session_id, entry.entry_id, entry.depth, parent=parent)
        if self.disk is not None:
            self.disk.write_through(entry)
        return entry

    def fit(self, room: int, checked_out: set[int]) -> None:
        """Admission by memory: the RAM tier gives up what the budget no longer leaves it, in its
        eviction order, never an entry in ``checked_out`` (requests in flight hold its arrays)."""
        self.index.fit(room, checked_out)

    def remove(self, entry_id: int, reason: str) -> None:
        """Drop an entry (its session record and disk copy go with it: the index's eviction hook)."""
        self.index.remove(entry_id, reason)
