"""One KV manager: the verbs a request's KV goes through, from lookup to store.

    kv = KVManager(config, seed, disk, sessions, counters, quant)   # builds the index (cache/prompt_cache.py)
    found = kv.find(Lookup(key, model, scope=..., session_id=..., stable_tokens=...))   # both tiers
    live = kv.checkout(found.match, found.stored, by_reference)   # -> LiveCache at exactly match.depth
    live = kv.fork(leader_live, depth)                # a follower's first tokens, by reference
    state = kv.snapshot(live)                         # -> KVState (a depth a later turn extends)
    turn = kv.new_turn()                              # one per request: its entries share it
    entry = kv.store(key, tokens, state, pool=..., session_id=..., parent=..., ttl=..., turn=turn)
    kv.remove(entry_id, reason)

The engine asks these verbs and never reaches into the index, an entry's payload, a tier or a
layer's own buffers: a lookup is data (``Lookup``: the request's tokens, scope, session, stable
prefix and image spans), the match rules -- by key, then broad over the session's lineage, never
cut inside an image -- are here, and so is what an eviction does to the session index and the disk
tier; a fork takes the leader's first ``depth`` tokens from each layer's kind
(``LiveCache.share``: a prefixed layer's tail is not its whole sequence -- LESSONS 63), a hit on a
disk-only entry is loaded, verified and promoted here, and a store records the entry in the
session index and writes it through to disk in one place. The index (cache/prompt_cache.py), the
cache kinds (cache/layer_kinds.py) and the tiers stay what they were; this is the one door the
engine uses to them. Several ranks (engine/lockstep.py) join with the cache's own collectives
(``join``, cache/ranks.py): an entry's bytes counted over the group, rank 0's clock, every disk
read and write agreed -- the cache never calls the engine.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..config import faults
from .counters import CacheCounters
from .kv_ops import KVState, LiveCache, capture, checkout
from .layer_kinds import KVQuant, eval_state
from .prefixed_kv import PrefixedKVCache
from .ranks import RankGroup
from .prompt_cache import (  # noqa: F401 - re-exported: the engine's names for an entry and a match
    MISS,
    POOL_KV,
    POOL_SNAPSHOT,
    CacheEntry,
    MatchResult,
    PromptCache,
    PromptCacheConfig,
)
from .sessions import SessionIndex
from .state_codes import StateCodes, acceptable

LOOKUP_RETRIES = 4   # disk entries that fail verification are dropped and the lookup runs again

log = logging.getLogger("mlxstack.cache")


@dataclass(frozen=True)
class Lookup:
    """What one request looks up (plain data: the engine builds it, ``KVManager.find`` answers)."""
    key: np.ndarray                        # the cache key's tokens (a VLM key carries image markers)
    model: np.ndarray                      # the model tokens (reuse is accepted where these agree)
    scope: str = ""                        # the tenant's cache scope: nothing crosses it
    session_id: str = ""
    prefer_session: bool = False           # CACHE_SESSION_PARTITIONING: the session's own entry wins ties
    stable_tokens: int = 0                 # the session's stable prefix: a match short of it looks broader
    images: tuple[tuple[int, int], ...] = ()          # [start, end) of each image's pads in ``model``
    markers: tuple[tuple[int, int], ...] | None = None  # each image's identity marker; None: not identified


class Found(NamedTuple):
    match: MatchResult
    from_disk: bool                  # the entry was loaded from the disk tier for this request
    stored: Any                      # the state to check out (None on a miss)
    gave_up: bool = False            # every try hit a disk file that failed verification


class KVManager:
    def __init__(self, config: PromptCacheConfig, seed: int, disk: Any, sessions: SessionIndex,
                 counters: CacheCounters, quant: KVQuant | None, codes: StateCodes | None = None) -> None:
        self.disk = disk               # cache/disk/backing.py DiskBacking, or None
        # the index (RAM tier + disk-only entries); nothing outside cache/ touches it
        self.index = PromptCache(config, seed, counters, on_evict=self._on_evict,
                                 on_spill=disk.spill if disk is not None else None)
        self.sessions = sessions
        self.counters = counters
        self.quant = quant
        self.codes = codes             # RECURRENT_STATE_BITS: stored recurrent states coded (lossy), or None
        # the module whose empty caches a miss checks out (the engine names it: a VLM's language
        # model); data, not a callback into the engine
        self.cache_model: Any = None
        self.group_bytes: Callable[[int], int] = lambda n: n

    # ---------------------------------------------------------------- lookup and checkout
    @property
    def enabled(self) -> bool:
        """Whether anything is stored and looked up (off: PROMPT_CACHE_MAX_ENTRIES_GLOBAL=0 or a
        cache layout this build does not understand)."""
        return self.index.enabled

    @property
    def config(self) -> PromptCacheConfig:
        return self.index.config

    def find(self, q: Lookup) -> Found:
        """``q`` over both tiers. A hit on a disk-only entry is loaded (verified) and served
        from what was loaded, whether or not RAM can keep it (an entry over the byte budget stays
        disk-only); a file that fails verification is dropped and the lookup runs again, up to
        ``LOOKUP_RETRIES`` times (then a miss, ``gave_up``). Off: a miss."""
        if not self.index.enabled:
            return Found(MISS, False, None)
        if self.disk is not None:
            self.disk.sync(self.index)
        for _ in range(LOOKUP_RETRIES):
            match = self.match(q)
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

    def match(self, q: Lookup) -> MatchResult:
        """The index's match in the request's scope: by key, then -- when it stops short of the
        session's stable prefix, or misses -- the broad lookup over entries sharing a block and the
        session's lineage; then cut where an image would be reused from an entry that did not see
        it (``within_images``). The payload may be disk-only (``find`` loads it)."""
        index = self.index
        hashes = index.hashes(q.key, q.scope)
        prefer = q.session_id if q.prefer_session else ""
        match = index.lookup(q.key, q.model, key_hashes=hashes, prefer_session=prefer, scope=q.scope)
        if match.depth < min(q.stable_tokens, len(q.model) - 1) or (not match.hit and len(index)):
            second = index.lookup(q.key, q.model, broad=True, key_hashes=hashes,
                                  extra_candidates=self.sessions.candidates(q.session_id), prefer_session=prefer,
                                  scope=q.scope)
            if second.depth > match.depth:
                match = second._replace(match_type="session" if second.entry.pool == POOL_KV else "snapshot")
        if match.hit and match.entry.pool == POOL_SNAPSHOT:
            match = match._replace(match_type="snapshot")
        return self.within_images(q, match)

    def within_images(self, q: Lookup, match: MatchResult) -> MatchResult:
        """Never reuse KV for an image unless the entry saw the same image, never cut inside one.
        Two images of the same size expand to identical pad tokens, so the model-token LCP cannot
        tell them apart: a hit covers an image only where the entry's key carries the same marker
        (CACHE_VLM_IMAGE_IDENTITY), else it is cut back to that image's first pad. A reuse that
        would end inside a run of the *same* image (never on clean traffic) evicts the entry and
        misses (``vlm_retreat``)."""
        if not match.hit or not q.images:
            return match
        entry, depth = match.entry, match.depth
        key = np.asarray(entry.key_tokens)
        neg = np.flatnonzero(key < 0).tolist()
        seen = [(int(key[a]), int(key[b])) for a, b in zip(neg[0::2], neg[1::2])]
        for k, (start, end) in enumerate(q.images):
            if depth <= start:
                break  # a cut exactly at an image's first pad token is clean
            same = q.markers is not None and k < len(seen) and k < len(q.markers) and seen[k] == tuple(q.markers[k])
            if not same:
                depth = start  # a different (or unverifiable) image: reuse only up to it
                break
            if depth < end:
                log.warning("vlm retreat: entry %d would be reused to %d, inside image %d [%d, %d); evicting",
                            entry.entry_id, depth, k, start, end)
                self.counters.bump("vlm_retreat")
                self.remove(entry.entry_id, "vlm_retreat")
                return MISS
        if depth == match.depth:
            return match
        if depth <= 0 or depth < entry.floor:
            return MISS
        return match._replace(depth=depth, match_type="lcp")

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
        if self.cache_model is None:
            raise RuntimeError("KVManager.cache_model is not set: the engine names the model whose caches a miss gets")
        return LiveCache(make_prompt_cache(self.cache_model), 0, self.quant)

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
              scope: str = "", turn: int | None = None, priority: int = 0) -> CacheEntry | None:
        """Insert ``state`` under ``key`` (the index may decline: None), record it in its session
        and write it through to disk; ``turn``: the request's (``new_turn()``), None: its own;
        ``priority``: the request's (lower first; the less urgent entries leave RAM first).
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
                                  pool=pool, session_id=session_id, ttl=ttl, scope=scope, turn=turn,
                                  priority=priority)
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
        """Drop an entry (its session record and disk copy go with it: ``_on_evict``)."""
        self.index.remove(entry_id, reason)

    def _on_evict(self, entry: CacheEntry, reason: str) -> None:
        """Whatever takes an entry out of the index (eviction, expiry, removal): its session
        record and its disk copy go with it, and its arrays back to the allocator."""
        self.sessions.forget_entry(entry.entry_id)
        if self.disk is not None:
            self.disk.forget(entry, reason)
        entry.payload = None
        mx.clear_cache()  # hand freed buffers back to the allocator / OS

    # ---------------------------------------------------------------- the tier as a whole
    def restore_index(self) -> int:
        """Index what the disk tier holds (start-up): the entries it restored."""
        return self.disk.restore(self.index) if self.disk is not None else 0

    def held(self) -> list[tuple[CacheEntry, Any]]:
        """(entry, payload) of every RAM entry, read under the index's lock (stats, admission)."""
        return self.index.held()

    def entries(self, include_disk: bool = False) -> list[CacheEntry]:
        return self.index.entries(include_disk=include_disk)

    def disk_only(self) -> int:
        return self.index.disk_only()

    def clear(self) -> None:
        self.index.clear()

    def set_budget(self, max_bytes: int) -> None:
        """The RAM tier's byte budget (several ranks: the group's, engine/lockstep.py)."""
        self.index.config = replace(self.index.config, max_bytes=max_bytes)

    def join(self, ranks: RankGroup) -> None:
        """Several ranks hold this model: an entry's bytes are every rank's part summed (so each
        rank evicts the same entries), TTLs and last use read rank 0's clock, and the disk tier's
        reads and writes hold only where they held on every rank (cache/ranks.py)."""
        self.group_bytes = ranks.sum_bytes
        self.set_clock(ranks.clock)
        if self.disk is not None:
            self.disk.agree, self.disk.agree_union = ranks.all_ok, ranks.union

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Whose time the index's lifetimes and eviction order read (several ranks: rank 0's)."""
        self.index.clock = clock

    def drop_disk(self, clear_restored: bool) -> None:
        """The disk tier goes (another rank has none; shutdown): RAM entries stay unless
        ``clear_restored`` (what the tier restored at start is then not trusted either)."""
        if clear_restored:
            self.index.clear()
        self.index.on_spill = None
        if self.disk is not None:
            self.disk.close()
        self.disk = None

    def keep_on_disk(self) -> int:
        """DISK_KEEP_ON_EXIT: every RAM entry written to the disk tier (shutdown); the count."""
        return self.disk.keep(self.index) if self.disk is not None else 0
