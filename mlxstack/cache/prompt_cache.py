"""Global prompt cache: entries keyed by canonical block-hash chains, accepted by model tokens.

Invariants (each has a test in tests/test_prompt_cache.py):
- Discovery is canonical (block-hash chain of the cache key); acceptance is model-space: the
  reuse depth is the token LCP of the entry's ``model_tokens`` and the request's, capped by the
  entry's physical depth and leaving at least one token to prefill.
- An entry is reused only at a depth it can serve: ``floor <= depth <= entry depth``. Plain KV
  has floor 0; an entry whose cache cannot be cut back (recurrent state, a rotated sliding
  window) has floor == depth (exact depth only); a chunked-attention entry has its chunk floor.
- Entries are opaque payloads with a byte size: this module never touches tensors.
- Two tiers share one index: RAM entries (payload held) and disk entries (payload None,
  ``disk_id`` set; loaded on a hit and promoted). Count / byte limits and eviction apply to RAM
  entries only; an evicted RAM entry is spilled (``on_spill`` returns its disk id) and stays
  findable as a disk entry, else it is removed. Byte pressure spills too (never deletes a disk
  copy), and an entry RAM can never hold (alone over the byte budget, or of a pool whose limit
  is 0) leaves RAM first without evicting anything for it; promoting such an entry leaves it
  disk-only, and the request is served from the state it loaded.
- Session partitioning (``prefer_session``) only changes WHICH entry serves among those that
  match equally deep: the session's own entry (the one it stored) over the global pick (most
  recently used), never one that costs a disk load the global pick would not. The depth is the
  global lookup's, always.
- Scopes (a tenant and its ``cache_salt``): an entry is stored in one scope and found, served,
  superseded and replaced only in it -- its block hashes hang from a seed the scope enters
  (``hashing.scoped_seed``), and every candidate is checked for its scope as well.
- Eviction order is deterministic: TTL first (an entry's own lifetime, a client breakpoint's,
  else its pool's), then superseded entries (a newer entry of the pool serves their depth: its
  floor is at or below it), then passed ones (a later turn continued past them on one line of its
  own session: a conversation's older turns), then highest cost score
  ``age / (sqrt(length) * ln(e + hits))`` (ln(e + 0) = 1, so a never-hit entry is well defined),
  ties broken by older entry id. An entry a later turn continued past is still a branch point --
  kept by its score -- when two later turns each went their own way from it, or another session
  did (a shared prefix, a client's cache mark every branch reads).

    cache = PromptCache(PromptCacheConfig(...), seed=namespace_seed("model"))
    match = cache.lookup(key_tokens, model_tokens)
    cache.insert(key_tokens, model_tokens, payload, nbytes=..., floor=0)
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, NamedTuple, Sequence

import numpy as np

from .counters import CacheCounters
from .hashing import BlockHash, block_hash_chain, scoped_seed
from .lcp import as_tokens, lcp

POOL_KV = "kv"
POOL_SNAPSHOT = "snapshot"


@dataclass(slots=True)
class CacheEntry:
    entry_id: int
    key_tokens: np.ndarray
    model_tokens: np.ndarray
    block_hashes: list[BlockHash]
    payload: Any
    nbytes: int
    floor: int            # smallest depth the payload can serve (== depth: exact only)
    pool: str
    session_id: str
    created: float
    last_used: float
    hits: int = 0
    superseded: bool = False   # a newer entry of its pool serves its depth (kept only as a safety net)
    turn: int = 0              # the store that made it: the entries one request stores share it
    passed: bool = False       # a later turn's entry extends it (its conversation went on)
    lines: tuple[int, ...] = ()  # later turns that went their own way from it (extending no deeper entry since)
    shared: bool = False       # ... one of them another session's
    disk_id: int | None = None  # its copy on the disk tier (written through or spilled)
    ttl: float | None = None    # its own idle lifetime (a client's breakpoint ttl); None: the pool's
    scope: str = ""             # the cache scope it was stored in (tenant + cache_salt): served in it only
    priority: int = 0           # the storing request's priority (lower: more urgent): the less urgent leave RAM first

    @property
    def depth(self) -> int:
        return len(self.model_tokens)

    @property
    def trimmable(self) -> bool:
        return self.floor == 0

    @property
    def on_disk_only(self) -> bool:
        return self.payload is None and self.disk_id is not None

    @property
    def stale(self) -> bool:
        """Its conversation went on past it on one line of its own: no request is known to branch
        here (evicted after the superseded, before the rest)."""
        return self.passed and len(self.lines) < 2 and not self.shared


class MatchResult(NamedTuple):
    entry: CacheEntry | None
    depth: int            # model tokens reused (KV offset after checkout)
    match_type: str       # exact | prefix | supersequence | lcp | miss
    canonical_blocks: int  # leading canonical blocks shared with the chosen entry
    preferred: bool = False  # the request's own session's entry, chosen over the global pick of equal depth

    @property
    def hit(self) -> bool:
        return self.entry is not None and self.depth > 0


MISS = MatchResult(None, 0, "miss", 0)


@dataclass(frozen=True)
class PromptCacheConfig:
    block_size: int = 16
    max_entries: int = 24
    max_bytes: int = 0               # 0 = unlimited
    ttl_seconds: float = 1800.0      # 0 = never
    use_block_index: bool = True
    snapshot_max_entries: int = 8
    snapshot_ttl_seconds: float = 1800.0


@dataclass
class _PoolLimits:
    max_entries: int
    ttl: float


class PromptCache:
    def __init__(
        self,
        config: PromptCacheConfig,
        seed: BlockHash,
        counters: CacheCounters | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[CacheEntry, str], None] | None = None,
        on_spill: Callable[[CacheEntry, str], int | None] | None = None,
    ) -> None:
        self.config = config
        self.seed = seed
        self.counters = counters or CacheCounters()
        self.clock = clock
        self.on_evict = on_evict
        self.on_spill = on_spill    # RAM eviction -> disk id of its copy, or None (then removed)
        self._entries: dict[int, CacheEntry] = {}
        self._index: dict[BlockHash, set[int]] = {}
        self._next_id = 1
        self._next_turn = 1          # disk entries indexed at start-up are turn 0: older than any store
        self._lock = threading.RLock()  # readers of stats may be other threads
        self._limits = {
            POOL_KV: _PoolLimits(config.max_entries, config.ttl_seconds),
            POOL_SNAPSHOT: _PoolLimits(config.snapshot_max_entries, config.snapshot_ttl_seconds),
        }
        self.eviction_log: list[tuple[int, str]] = []  # (entry_id, reason), most recent last
        self._recent_chains: list[tuple[np.ndarray, list[BlockHash]]] = []

    # ------------------------------------------------------------------ public API
    @property
    def enabled(self) -> bool:
        return self.config.max_entries > 0

    def hashes(self, key_tokens: Sequence[int], scope: str = "") -> list[BlockHash]:
        """Block-hash chain of a key in ``scope``: the scope enters the chain at its root (the
        seed), so every block of another scope hashes apart. Agents resend a growing prefix, so
        the chain continues from the longest block-aligned prefix of a recently hashed key of the
        same scope (chained hashes make ``chain(prefix) + chain(rest, seed=last)`` equal to
        ``chain(whole)``)."""
        tokens = as_tokens(key_tokens)
        bs = self.config.block_size
        reuse: list[BlockHash] = []
        for old_scope, old_tokens, old_hashes in self._recent_chains:
            if old_scope != scope:
                continue
            n = min(lcp(old_tokens, tokens) // bs, len(old_hashes))
            if n > len(reuse):
                reuse = old_hashes[:n]
        rest = block_hash_chain(reuse[-1] if reuse else scoped_seed(self.seed, scope), tokens[len(reuse) * bs:], bs)
        chain = reuse + rest
        self._recent_chains.append((scope, tokens, chain))
        del self._recent_chains[:-8]
        return chain

    def lookup(
        self,
        key_tokens: Sequence[int],
        model_tokens: Sequence[int],
        *,
        broad: bool = False,
        extra_candidates: Iterable[int] = (),
        key_hashes: list[BlockHash] | None = None,
        prefer_session: str = "",
        scope: str = "",
    ) -> MatchResult:
        """Best reusable entry for a request.

        ``broad=False``: candidates are the entries sharing the deepest run of leading canonical
        blocks (O(blocks) through the index). ``broad=True`` (secondary lookup) verifies every
        entry sharing at least one block plus ``extra_candidates`` (e.g. the session's entries).
        ``prefer_session`` (CACHE_SESSION_PARTITIONING): among the candidates reusing the same
        (deepest) depth, an entry this session stored wins over the global pick (``preferred``).
        Only entries stored in ``scope`` are candidates (their hashes hang from its seed too).
        """
        if not self.enabled:
            return MISS
        with self._lock:
            self._expire()
            key = as_tokens(key_tokens)
            model = as_tokens(model_tokens)
            hashes = key_hashes if key_hashes is not None else self.hashes(key, scope)
            shared = {eid: n for eid, n in self._shared_blocks(hashes).items() if self._entries[eid].scope == scope}
            if not shared:
                cands: dict[int, int] = {}
            elif broad:
                cands = dict(shared)
            else:
                deepest = max(shared.values())
                cands = {eid: n for eid, n in shared.items() if n == deepest}
            for eid in extra_candidates:
                if eid in self._entries and self._entries[eid].scope == scope:
                    cands.setdefault(eid, shared.get(eid, 0))
            best = MISS
            trim_loss = 0
            hid = False
            results = []
            for eid, nblocks in cands.items():
                result, would_be, hid_here = self._verify(self._entries[eid], key, model, nblocks)
                trim_loss = max(trim_loss, would_be)
                hid = hid or hid_here
                results.append(result)
                if result.depth > best.depth or (
                    result.depth == best.depth and result.depth > 0 and best.entry is not None
                    and result.entry.last_used > best.entry.last_used
                ):
                    best = result
            if prefer_session and best.hit and best.entry.session_id != prefer_session:
                best = self._own_pick(results, best, prefer_session)
            # Counted once per lookup, and only when they cost reuse.
            if trim_loss > best.depth:
                self.counters.bump("hybrid_trim_miss")
            if hid:
                self.counters.bump("exact_key_rejected_by_model_lcp")
            if best.hit:
                best.entry.hits += 1
                best.entry.last_used = self.clock()
            return best

    def new_turn(self) -> int:
        """A turn number for the entries one request stores (``insert(turn=...)``)."""
        with self._lock:
            self._next_turn += 1
            return self._next_turn - 1

    def insert(
        self,
        key_tokens: Sequence[int],
        model_tokens: Sequence[int],
        payload: Any,
        *,
        nbytes: int,
        floor: int = 0,
        pool: str = POOL_KV,
        session_id: str = "",
        ttl: float | None = None,
        scope: str = "",
        turn: int | None = None,
        priority: int = 0,
    ) -> CacheEntry | None:
        """Store an entry in ``scope``; ``ttl``: its own idle lifetime (cache/lifetimes.py), else its
        pool's; ``turn``: the request's (``new_turn()``: a request's turn entry and its snapshots
        share one), None: a turn of its own; ``priority``: the storing request's (``_victim``)."""
        if not self.enabled or self._limits[pool].max_entries <= 0:
            return None
        with self._lock:
            now = self.clock()
            key = as_tokens(key_tokens).copy()
            model = as_tokens(model_tokens).copy()
            # Same model tokens in the same pool and scope: replace rather than duplicate.
            for e in list(self._entries.values()):
                if e.pool == pool and e.scope == scope and e.depth == len(model) and np.array_equal(e.model_tokens, model):
                    self._remove(e.entry_id, "replaced")
            entry = CacheEntry(
                entry_id=self._next_id, key_tokens=key, model_tokens=model,
                block_hashes=self.hashes(key, scope), payload=payload, nbytes=int(nbytes),
                floor=min(int(floor), len(model)), pool=pool, session_id=session_id, created=now, last_used=now,
                ttl=ttl, scope=scope, turn=self.new_turn() if turn is None else int(turn), priority=int(priority),
            )
            self._next_id += 1
            self._entries[entry.entry_id] = entry
            for h in entry.block_hashes:
                self._index.setdefault(h, set()).add(entry.entry_id)
            self._supersede_prefixes(entry)
            self._expire()
            self._enforce_limits(protect=entry.entry_id)
            return entry if entry.entry_id in self._entries else None

    def remove(self, entry_id: int, reason: str = "removed") -> None:
        with self._lock:
            self._remove(entry_id, reason)

    def insert_disk_entry(self, key_tokens: Sequence[int], model_tokens: Sequence[int], *, disk_id: int,
                          nbytes: int, floor: int, pool: str = POOL_KV, session_id: str = "",
                          last_used: float | None = None, scope: str = "") -> CacheEntry | None:
        """Index an entry that lives on the disk tier only (start-up: its index is read, its
        tensors are not). It never culls or evicts anything: RAM limits do not count it."""
        if not self.enabled:
            return None
        with self._lock:
            now = self.clock()
            key = as_tokens(key_tokens).copy()
            model = as_tokens(model_tokens).copy()
            entry = CacheEntry(
                entry_id=self._next_id, key_tokens=key, model_tokens=model, block_hashes=self.hashes(key, scope),
                payload=None, nbytes=int(nbytes), floor=min(int(floor), len(model)), pool=pool,
                session_id=session_id, created=now, last_used=now if last_used is None else last_used,
                disk_id=int(disk_id), scope=scope)
            self._next_id += 1
            self._entries[entry.entry_id] = entry
            for h in entry.block_hashes:
                self._index.setdefault(h, set()).add(entry.entry_id)
            return entry

    def promote(self, entry_id: int, payload: Any, nbytes: int) -> bool:
        """A disk entry was loaded: hold its payload in RAM if RAM can hold it (the limits apply
        again; this entry is protected from the eviction its promotion may cause). An entry that
        can never be held -- alone over the byte budget, or of a pool whose limit is 0 -- stays
        disk-only and nothing else is evicted for it. Either way the caller serves the request
        from the payload it loaded; True when the entry is now held in RAM."""
        with self._lock:
            e = self._entries.get(entry_id)
            if e is None:
                return False
            if not self._can_hold(e.pool, int(nbytes)):
                return False
            e.payload, e.nbytes = payload, int(nbytes)
            self._enforce_limits(protect=entry_id)
            return e.payload is not None

    def forget_disk(self, disk_ids: Iterable[int]) -> None:
        """The disk tier dropped these (its own LRU, or a corrupt file): RAM copies stay, disk-only
        entries leave the index."""
        wanted = set(disk_ids)
        if not wanted:
            return
        with self._lock:
            for e in list(self._entries.values()):
                if e.disk_id in wanted:
                    e.disk_id = None
                    if e.payload is None:
                        self._remove(e.entry_id, "disk_evicted")

    def clear(self) -> None:
        with self._lock:
            for eid in list(self._entries):
                self._remove(eid, "cleared")

    def get(self, entry_id: int) -> CacheEntry | None:
        return self._entries.get(entry_id)

    def entries(self, pool: str | None = None, *, include_disk: bool = False) -> list[CacheEntry]:
        """Entries held in RAM (plus disk-only ones with ``include_disk``)."""
        with self._lock:
            return [e for e in self._entries.values()
                    if (pool is None or e.pool == pool) and (include_disk or e.payload is not None)]

    def held(self) -> list[tuple[CacheEntry, Any]]:
        """(entry, payload) for every entry held in RAM, read under the lock: another thread may
        spill or evict an entry (payload -> None) at any moment, so readers use this payload,
        never ``entry.payload`` read again later."""
        with self._lock:
            return [(e, e.payload) for e in self._entries.values() if e.payload is not None]

    def disk_only(self) -> int:
        """How many entries live on the disk tier only (read under the lock)."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.payload is None)

    @property
    def nbytes(self) -> int:
        """Bytes held in RAM."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values() if e.payload is not None)

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ matching
    def _shared_blocks(self, hashes: list[BlockHash]) -> dict[int, int]:
        """entry id -> number of leading request blocks it shares (>= 1 only)."""
        shared: dict[int, int] = {}
        if self.config.use_block_index:
            for depth, h in enumerate(hashes, start=1):
                ids = self._index.get(h)
                if not ids:
                    break  # chained hashes: nothing deeper can match
                for eid in ids:
                    shared[eid] = depth
            return shared
        for e in self._entries.values():  # linear scan: same answers, O(entries * blocks)
            n = 0
            for a, b in zip(e.block_hashes, hashes):
                if a != b:
                    break
                n += 1
            if n:
                shared[e.entry_id] = n
        return shared

    @staticmethod
    def _own_pick(results: list[MatchResult], best: MatchResult, session_id: str) -> MatchResult:
        """The session's own entry among those reusing ``best.depth`` (most recently used first),
        unless it lives on disk only while ``best`` is in RAM; else ``best`` itself."""
        own = [r for r in results if r.depth == best.depth and r.entry.session_id == session_id
               and (r.entry.payload is not None or best.entry.payload is None)]
        if not own:
            return best
        return max(own, key=lambda r: r.entry.last_used)._replace(preferred=True)

    def _verify(self, e: CacheEntry, key: np.ndarray, model: np.ndarray, nblocks: int) -> tuple[MatchResult, int, bool]:
        """(result, depth a trim would have given an entry that cannot serve it, canonical-hid-a-difference)."""
        common = lcp(e.model_tokens, model)
        depth = min(common, e.depth, len(model) - 1)
        # The entry's canonical key matched in full but the model tokens diverged before its end:
        # canonicalisation made two different model inputs look equal.
        key_common = lcp(e.key_tokens, key)
        hid = key_common >= min(len(e.key_tokens), len(key)) and common < min(e.depth, len(model))
        if depth < self.config.block_size:   # a few template-header tokens are not a hit
            return MatchResult(e, 0, "miss", nblocks), 0, hid
        if depth < e.floor:
            return MatchResult(e, 0, "miss", nblocks), depth, hid
        if common == e.depth == len(model):
            kind = "exact"
        elif common == e.depth:
            kind = "prefix"
        elif common == len(model):
            kind = "supersequence"
        else:
            kind = "lcp"
        return MatchResult(e, depth, kind, nblocks), 0, hid

    # ------------------------------------------------------------------ eviction
    def score(self, e: CacheEntry, now: float) -> float:
        age = max(0.0, now - e.last_used)
        return age / (math.sqrt(max(1, e.depth)) * math.log(math.e + e.hits))

    def _expire(self) -> None:
        now = self.clock()
        for e in list(self._entries.values()):
            ttl = self._limits[e.pool].ttl if e.ttl is None else e.ttl
            if e.payload is not None and ttl > 0 and now - e.last_used > ttl:
                self._evict(e, "ttl")

    def _evict(self, e: CacheEntry, reason: str) -> None:
        """Leave RAM: spilled to the disk tier when it takes it (still indexed), else removed."""
        disk_id = e.disk_id
        if disk_id is None and self.on_spill is not None and not e.superseded:
            disk_id = self.on_spill(e, reason)
        if disk_id is None:
            self._remove(e.entry_id, reason)
            return
        e.disk_id, e.payload = disk_id, None
        self.counters.bump("evictions")
        self.counters.bump(f"evictions_{reason}")
        self.counters.bump("spills")
        self.eviction_log.append((e.entry_id, f"spill_{reason}"))
        del self.eviction_log[:-256]

    def _ram(self) -> list[CacheEntry]:
        return [e for e in self._entries.values() if e.payload is not None]

    def _victim(self, pool: str | None, protect: int, keep: Collection[int] = ()) -> CacheEntry | None:
        now = self.clock()
        pool_entries = [e for e in self._ram() if (pool is None or e.pool == pool) and e.entry_id != protect
                        and e.entry_id not in keep]
        if not pool_entries:
            return None
        # superseded, then stale, then the least urgent requests' entries (a user's own session
        # outlives its sub-agents' under one count or byte limit: LESSONS 95), then the score
        return max(pool_entries, key=lambda e: (e.superseded, e.stale, e.priority, self.score(e, now), -e.entry_id))

    def _can_hold(self, pool: str, nbytes: int) -> bool:
        """Whether RAM can ever hold an entry of ``nbytes`` in ``pool`` (the limits, not the load)."""
        budget = self.config.max_bytes
        return self._limits[pool].max_entries > 0 and not (budget and nbytes > budget)

    def _enforce_limits(self, protect: int) -> None:
        """Bring RAM back within the count and byte limits. An entry that alone breaks them leaves
        RAM first (spilled when the disk tier takes it), so nothing else is evicted for room it
        could never use; the other victims are spilled too, never removed: byte pressure is a
        reason to leave RAM, not to forget an entry (and its disk copy)."""
        new = self._entries.get(protect)
        if new is not None and new.payload is not None and not self._can_hold(new.pool, new.nbytes):
            self._evict(new, "bytes" if self._limits[new.pool].max_entries > 0 else "count")
        for pool, limits in self._limits.items():
            while sum(1 for e in self._ram() if e.pool == pool) > limits.max_entries:
                victim = self._victim(pool, protect)
                if victim is None:
                    break
                self._evict(victim, "count")
        budget = self.config.max_bytes
        while budget and sum(e.nbytes for e in self._ram()) > budget:
            victim = self._victim(None, protect)
            if victim is None:
                break
            self._evict(victim, "bytes")

    def fit(self, nbytes: int, keep: Collection[int] = ()) -> int:
        """Bring the RAM tier down to ``nbytes`` (requests in flight need the rest of the budget):
        victims in the usual order (superseded, then cold / shallow / rarely hit: a hot session's
        entries last), spilled to the disk tier when it takes them. Entries in ``keep`` (checked out
        by requests in flight: they hold the arrays, so spilling them frees nothing) stay.
        Returns how many left RAM."""
        with self._lock:
            left = 0
            while sum(e.nbytes for e in self._ram()) > max(0, nbytes):
                victim = self._victim(None, 0, keep)
                if victim is None:
                    break
                self._evict(victim, "admission")
                left += 1
            return left

    def _supersede_prefixes(self, new: CacheEntry) -> None:
        """Entries whose model tokens are a strict prefix of ``new``'s, in either pool and tier.

        Superseded -- first eviction victims, ``new`` inheriting their hit count (the same
        conversation, one turn further) -- are only those of its pool ``new`` can serve itself
        (their depth >= its floor); all but the longest of them are culled (the longest stays as
        a safety net). A prefix below ``new``'s floor (an exact-depth snapshot under a recurrent
        state or a rotated window) is not: ``new`` cannot be cut back to it, so it still serves
        what only it can -- a branch at its depth.

        A prefix from an earlier turn is ``passed`` (its conversation went on); where ``new``
        extends no deeper entry of a turn since, ``new``'s turn went its own way from it: a line.
        Two lines, or one of another session, make it a branch point (``CacheEntry.stale``)."""
        prefixes = [
            e for e in self._entries.values()
            if e.entry_id != new.entry_id and e.scope == new.scope and e.depth < new.depth
            and lcp(e.model_tokens, new.model_tokens) == e.depth
        ]
        if not prefixes:
            return
        prefixes.sort(key=lambda e: e.depth)
        for i, e in enumerate(prefixes):
            if e.turn >= new.turn:
                continue
            e.passed = True
            if new.turn not in e.lines and not any(e.turn <= f.turn < new.turn for f in prefixes[i + 1:]
                                                   if f.depth > e.depth):
                e.lines += (new.turn,)
                e.shared = e.shared or bool(e.session_id and new.session_id and e.session_id != new.session_id)
        covered = [e for e in prefixes if e.pool == new.pool and e.depth >= new.floor]
        if not covered:
            return
        new.hits = max(new.hits, max(e.hits for e in covered))
        for e in covered:
            e.superseded = True
        for e in covered[:-1]:
            self._remove(e.entry_id, "prefix_cull")

    def _remove(self, entry_id: int, reason: str) -> None:
        e = self._entries.pop(entry_id, None)
        if e is None:
            return
        for h in e.block_hashes:
            ids = self._index.get(h)
            if ids is not None:
                ids.discard(entry_id)
                if not ids:
                    del self._index[h]
        if reason != "replaced":
            self.counters.bump("evictions")
            self.counters.bump(f"evictions_{reason}")
        self.eviction_log.append((entry_id, reason))
        del self.eviction_log[:-256]
        if self.on_evict is not None:
            self.on_evict(e, reason)
