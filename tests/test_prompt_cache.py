"""PromptCache index behaviour on opaque fake payloads (no tensors): matching, selection,
eviction order, TTL, prefix culling, block index vs linear scan."""
from __future__ import annotations

import math
import random

import pytest

from mlxstack.cache.counters import CacheCounters
from mlxstack.cache.hashing import namespace_seed
from mlxstack.cache.prompt_cache import POOL_SNAPSHOT, PromptCache, PromptCacheConfig


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(clock=None, **kw) -> PromptCache:
    cfg = PromptCacheConfig(**{"block_size": 4, "max_entries": 8, **kw})
    return PromptCache(cfg, namespace_seed("test-model"), CacheCounters(), clock=clock or Clock())


def put(cache, tokens, model=None, nbytes=100, trimmable=True, floor=None, **kw):
    """trimmable=False is the exact-depth-only case (floor == depth); ``floor`` sets any other."""
    model = model if model is not None else tokens
    if floor is None:
        floor = 0 if trimmable else len(model)
    return cache.insert(tokens, model, payload=object(), nbytes=nbytes, floor=floor, **kw)


def toks(n, start=0):
    return list(range(start, start + n))


def test_prefix_match_reuses_whole_entry():
    c = make()
    e = put(c, toks(10))
    m = c.lookup(toks(20), toks(20))
    assert (m.entry.entry_id, m.depth, m.match_type) == (e.entry_id, 10, "prefix")


def test_exact_match_leaves_one_token_to_prefill():
    c = make()
    put(c, toks(12))
    m = c.lookup(toks(12), toks(12))
    assert (m.depth, m.match_type) == (11, "exact")


def test_supersequence_trims_to_request():
    c = make()
    put(c, toks(30))
    m = c.lookup(toks(12), toks(12))
    assert (m.depth, m.match_type) == (11, "supersequence")


def test_divergent_lcp_is_token_level_not_block_rounded():
    c = make()
    put(c, toks(30))
    req = toks(13) + [999] + toks(10, 100)
    m = c.lookup(req, req)
    assert (m.depth, m.match_type) == (13, "lcp")


def test_longest_candidate_wins_over_short_entry():
    c = make()
    put(c, toks(8))
    long = put(c, toks(40), trimmable=False)  # non-trimmable: not culled; still selected when deepest
    req = toks(40) + [7, 7]
    m = c.lookup(req, req)
    assert m.entry.entry_id == long.entry_id and m.depth == 40


def test_model_tokens_cap_reuse_even_when_canonical_matches():
    c = make()
    key = toks(20)
    model = toks(6) + [555] + toks(13, 7)
    put(c, key, model)
    m = c.lookup(toks(24), toks(24))  # canonical extends the entry; model diverges at 6
    assert m.depth == 6
    assert c.counters.get("exact_key_rejected_by_model_lcp") == 1


def test_clean_traffic_keeps_correctness_counters_zero():
    c = make()
    put(c, toks(20))
    c.lookup(toks(40), toks(40))
    c.lookup(toks(8) + [1, 2, 3], toks(8) + [1, 2, 3])
    assert c.counters.correctness() == {"vlm_retreat": 0, "hybrid_trim_miss": 0, "exact_key_rejected_by_model_lcp": 0}


def test_non_trimmable_only_reused_at_exact_depth():
    c = make()
    put(c, toks(16), trimmable=False)
    assert c.lookup(toks(20), toks(20)).depth == 16           # extends exactly: reuse
    miss = c.lookup(toks(10) + [9] * 10, toks(10) + [9] * 10)  # would need a trim
    assert miss.depth == 0
    assert c.counters.get("hybrid_trim_miss") >= 1


def test_namespaces_never_share_entries():
    a = PromptCache(PromptCacheConfig(block_size=4), namespace_seed("model-a"))
    b = PromptCache(PromptCacheConfig(block_size=4), namespace_seed("model-b"))
    put(a, toks(16))
    assert set(a.hashes(toks(16))).isdisjoint(b.hashes(toks(16)))
    assert b.lookup(toks(20), toks(20)).depth == 0


def test_disabled_cache_never_stores():
    c = make(max_entries=0)
    assert put(c, toks(16)) is None
    assert c.lookup(toks(20), toks(20)).depth == 0


def test_prefix_culling_keeps_longest_prefix_as_safety_net():
    c = make()
    a = put(c, toks(8))
    b = put(c, toks(12))
    d = put(c, toks(20))
    ids = {e.entry_id for e in c.entries()}
    assert ids == {b.entry_id, d.entry_id}
    assert (a.entry_id, "prefix_cull") in c.eviction_log


def test_identical_model_tokens_replace_not_duplicate():
    c = make()
    put(c, toks(16))
    put(c, toks(16))
    assert len(c) == 1


def test_eviction_order_by_cost_score():
    clock = Clock()
    c = make(clock, max_entries=3)
    e1 = put(c, toks(8, 100))       # short
    clock.t += 10
    e2 = put(c, toks(64, 200))      # long
    clock.t += 10
    e3 = put(c, toks(8, 300))       # short, newer
    clock.t += 10
    c.lookup(toks(8, 300) + [1], toks(8, 300) + [1])   # e3 gets a hit
    clock.t += 10
    e4 = put(c, toks(8, 400))
    # scores at insertion of e4 (now = 1040): e1 age 40/sqrt(8)/ln(e) ~ 14.1; e2 30/8 = 3.75;
    # e3 age 10/(sqrt 8 * ln(e+1)) ~ 2.7 -> e1 evicted first.
    assert [eid for eid, why in c.eviction_log if why == "count"] == [e1.entry_id]
    clock.t += 100
    put(c, toks(8, 500))
    # now e2: 130/8=16.25, e3: 110/(2.83*1.31)=29.6, e4: 100/2.83=35.4 -> e4 next
    assert [eid for eid, why in c.eviction_log if why == "count"] == [e1.entry_id, e4.entry_id]
    assert {e.entry_id for e in c.entries()} == {e2.entry_id, e3.entry_id, e4.entry_id + 1}



def test_a_less_urgent_requests_entries_leave_ram_before_a_more_urgent_ones_whatever_their_score():
    """The user's own turn (priority 0) stored first, its sub-agents' turns (priority 1) after it:
    under the count limit the sub-agents' entries go, the oldest-scored first, and the user's
    stays though its score is the worst; among equals the score decides as before; a superseded
    entry goes before any live one."""
    clock = Clock()
    c = make(clock, max_entries=3)
    user = put(c, toks(8, 100), priority=0)
    agents = []
    for start in (200, 300, 400, 500):    # the third over the limit: a sub-agent's goes, the older first
        clock.t += 50 if start == 200 else 10
        agents.append(put(c, toks(64, start), priority=1))
    a, b, x, y = agents
    count = [eid for eid, why in c.eviction_log if why == "count"]
    assert count == [a.entry_id, b.entry_id]
    assert c.score(user, clock.t) > max(c.score(e, clock.t) for e in (x, y))   # kept by urgency, not score
    assert {e.entry_id for e in c.entries()} == {user.entry_id, x.entry_id, y.entry_id}
    turn = put(c, toks(8, 100) + toks(8, 900), priority=0)   # the user's next turn supersedes its first
    assert [eid for eid, why in c.eviction_log if why == "count"] == count + [user.entry_id]
    assert {e.entry_id for e in c.entries()} == {x.entry_id, y.entry_id, turn.entry_id}


def test_score_is_finite_for_never_hit_entries():
    c = make()
    e = put(c, toks(8))
    assert math.isfinite(c.score(e, e.last_used + 5)) and c.score(e, e.last_used + 5) > 0


def test_byte_budget_evicts_until_under_budget():
    clock = Clock()
    c = make(clock, max_bytes=250)
    a = put(c, toks(8, 0), nbytes=100)
    clock.t += 1
    b = put(c, toks(8, 50), nbytes=100)
    clock.t += 1
    put(c, toks(8, 90), nbytes=100)
    assert c.nbytes <= 250
    assert [eid for eid, why in c.eviction_log if why == "bytes"] == [a.entry_id]
    assert b.entry_id in {e.entry_id for e in c.entries()}


def test_fit_makes_room_for_requests_in_flight_a_hot_session_last():
    """Admission by memory (engine/core.py): the RAM tier shrinks to what the requests in
    flight leave of the budget, victims in the eviction order -- a session hit turn after turn
    (its hits carried to each new turn's entry) outlives a one-off side request of its age."""
    clock = Clock()
    c = make(clock, max_bytes=1000)
    hot = put(c, toks(32, 0), nbytes=300)
    for turn in range(3):                                  # the main agent: three more turns
        clock.t += 1
        c.lookup(toks(32 + 8 * turn, 0) + [7], toks(32 + 8 * turn, 0) + [7])
        hot = put(c, toks(40 + 8 * turn, 0), nbytes=300)
    side = put(c, toks(32, 5000), nbytes=300)              # a side request, as old as the last turn
    clock.t += 5
    net = [e for e in c.entries() if e.superseded]         # the previous turn, kept as a safety net
    assert len(net) == 1 and c.nbytes == 900
    assert c.fit(900) == 0                                 # already within: nothing leaves
    assert c.fit(600) == 1 and c.fit(300) == 1
    assert [eid for eid, why in c.eviction_log if why == "admission"] == [net[0].entry_id, side.entry_id]
    assert {e.entry_id for e in c.entries()} == {hot.entry_id}
    assert c.fit(0) == 1 and c.nbytes == 0 and c.counters.get("evictions_admission") == 3


def test_ttl_expires_idle_entries():
    clock = Clock()
    c = make(clock, ttl_seconds=60)
    put(c, toks(16))
    clock.t += 61
    assert c.lookup(toks(20), toks(20)).depth == 0
    assert len(c) == 0 and c.eviction_log[-1][1] == "ttl"


def test_snapshot_pool_has_its_own_count_limit():
    c = make(snapshot_max_entries=2)
    for i in range(4):
        put(c, toks(8, 100 * i), trimmable=False, pool=POOL_SNAPSHOT)
    put(c, toks(8, 900))
    assert len(c.entries(POOL_SNAPSHOT)) == 2 and len(c.entries("kv")) == 1


@pytest.mark.parametrize("seed", range(5))
def test_block_index_and_linear_scan_agree(seed):
    rng = random.Random(seed)
    with_index = make(max_entries=50, use_block_index=True)
    linear = make(max_entries=50, use_block_index=False)
    base = [rng.randrange(50) for _ in range(64)]
    for _ in range(20):
        cut = rng.randrange(4, 64)
        entry = base[:cut] + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
        trim = rng.random() < 0.7
        put(with_index, entry, trimmable=trim)
        put(linear, entry, trimmable=trim)
    for _ in range(30):
        cut = rng.randrange(1, 64)
        req = base[:cut] + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
        for broad in (False, True):
            a = with_index.lookup(req, req, broad=broad)
            b = linear.lookup(req, req, broad=broad)
            assert (a.depth, a.match_type, a.entry and a.entry.entry_id) == (b.depth, b.match_type, b.entry and b.entry.entry_id)


def test_superseded_safety_net_is_evicted_before_live_sessions():
    """14 sessions x 2 turns with room for 24 entries: each session's turn-2 entry supersedes its
    turn-1 entry; the superseded ones go first, every live session keeps its newest entry."""
    clock = Clock()
    c = make(clock, max_entries=24)
    live = {}
    for turn in (1, 2):
        for s in range(14):
            clock.t += 1
            base = toks(8 * turn, 1000 * s)
            if turn == 2:
                c.lookup(base, base)                     # the session's warm turn hits turn 1
            live[s] = put(c, base, session_id=f"s{s}").entry_id
    kept = {e.entry_id for e in c.entries()}
    assert set(live.values()) <= kept
    evicted = [eid for eid, why in c.eviction_log if why == "count"]
    assert len(evicted) == 4 and all(c.get(eid) is None for eid in evicted)


def test_extension_inherits_hits_of_the_entry_it_supersedes():
    c = make()
    put(c, toks(8))
    c.lookup(toks(12), toks(12))
    c.lookup(toks(12), toks(12))
    longer = put(c, toks(16))
    assert longer.hits == 2
    assert [e.superseded for e in sorted(c.entries(), key=lambda e: e.depth)] == [True, False]


def test_matches_shorter_than_a_block_are_misses():
    c = make()
    put(c, toks(3) + [7] * 20)
    m = c.lookup(toks(3) + [8] * 20, toks(3) + [8] * 20)
    assert m.depth == 0 and m.match_type == "miss"


def test_hybrid_trim_miss_counts_only_when_it_cost_reuse():
    c = make()
    put(c, toks(16), trimmable=False)                  # usable: exact extension
    put(c, toks(12) + [9] * 12, trimmable=False)       # would need a trim to 12 < 16
    assert c.lookup(toks(20), toks(20)).depth == 16
    assert c.counters.get("hybrid_trim_miss") == 0
    c2 = make()
    put(c2, toks(30), trimmable=False)                 # would need a trim to 20
    assert c2.lookup(toks(20) + [5, 5], toks(20) + [5, 5]).depth == 0
    assert c2.counters.get("hybrid_trim_miss") == 1


def test_incremental_hash_chain_equals_a_fresh_chain():
    from mlxstack.cache.hashing import block_hash_chain

    c = make()
    rng = random.Random(3)
    base = [rng.randrange(1000) for _ in range(103)]
    c.hashes(base)
    for extended in (base + [1, 2, 3, 4, 5], base[:50] + [9] * 30, base, base[:3]):
        assert c.hashes(extended) == block_hash_chain(c.seed, extended, 4)


def test_entry_serves_only_depths_at_or_above_its_floor():
    # A chunked-attention entry holding [start, depth) serves depths >= its chunk floor only.
    c = make()
    e = put(c, toks(40), floor=24)
    assert e.floor == 24 and not e.trimmable
    hit = c.lookup(toks(28) + [999] * 8, toks(28) + [999] * 8)        # LCP 28 >= floor: served at 28
    assert (hit.entry is e, hit.depth, hit.match_type) == (True, 28, "lcp")
    miss = c.lookup(toks(20) + [999] * 8, toks(20) + [999] * 8)       # LCP 20 < floor 24: a miss
    assert miss.depth == 0 and not miss.hit
    assert c.counters.get("hybrid_trim_miss") == 1                     # a trim would have given 20


def test_prefix_cull_only_removes_prefixes_the_new_entry_can_serve():
    c = make()
    a = put(c, toks(8), trimmable=False)     # exact-depth entries cover no prefix of their own
    b = put(c, toks(16), trimmable=False)
    d = put(c, toks(24), trimmable=False)
    assert len(c) == 3
    # a new entry with floor 12 covers the 16- and 24-token prefixes but not the 8-token one
    e = put(c, toks(32), floor=12)
    ids = {x.entry_id for x in c.entries()}
    assert ids == {a.entry_id, d.entry_id, e.entry_id}
    assert [r for r in c.eviction_log if r[1] == "prefix_cull"][-1] == (b.entry_id, "prefix_cull")
    # the one it covers is superseded; the one below its floor still serves its own depth
    assert c.get(d.entry_id).superseded and not c.get(a.entry_id).superseded


def test_a_deeper_exact_depth_snapshot_does_not_supersede_a_shallower_one():
    """Floor rule: an entry is superseded only by a newer one of its pool that serves its depth
    (newer floor <= its depth, its tokens a prefix). Exact-depth snapshots never cover each other,
    and a deeper one does not take the hits of a depth it cannot serve."""
    c = make(snapshot_max_entries=8)
    mark = put(c, toks(16), trimmable=False, pool=POOL_SNAPSHOT, session_id="a")
    c.lookup(toks(16) + [900] * 8, toks(16) + [900] * 8)
    deeper = put(c, toks(16) + [900] * 8, trimmable=False, pool=POOL_SNAPSHOT, session_id="b")
    assert not mark.superseded and deeper.hits == 0 and mark.hits == 1
    cut_back = put(c, toks(16) + [900] * 12, floor=8, pool=POOL_SNAPSHOT, session_id="b")
    assert mark.superseded and cut_back.hits == 1      # floor 8 <= 16: it serves the mark's depth


def test_a_branch_point_outlives_the_branches_and_a_passed_turn_goes_first():
    """Exact-depth snapshots (floor == depth), room for 4. A mark M that two later turns left on
    lines of their own is a branch point: kept by its score, the branches' own snapshots go oldest
    first. A snapshot one later turn of its own session continued past (its conversation's older
    turn) goes before the live ones."""
    clock = Clock()
    c = make(clock=clock, snapshot_max_entries=4)

    def turn(session, *depth_tokens):   # a request: its lookup (a branch reads M), then its stores
        t = c.new_turn()
        clock.t += 1
        c.lookup(depth_tokens[-1] + [1], depth_tokens[-1] + [1])
        return [put(c, tk, trimmable=False, pool=POOL_SNAPSHOT, session_id=session, turn=t) for tk in depth_tokens]

    m, h1 = turn("s", toks(16), toks(16) + [901] * 4)
    h2, = turn("s", toks(16) + [902] * 4)           # one line from M, same session: not yet a branch point
    assert m.passed and m.stale and not h1.passed
    h3, = turn("s", toks(16) + [903] * 4)           # a second line: a branch point
    assert not m.stale and m.lines == (h2.turn, h3.turn)
    h4, = turn("s", toks(16) + [904] * 4)
    assert c.eviction_log == [(h1.entry_id, "count")]
    # a conversation going on: h4's next turn continues past it, so h4 is stale and leaves first
    nxt, = turn("s", toks(16) + [904] * 4 + [905] * 4)
    assert h4.stale and c.eviction_log[-1] == (h4.entry_id, "count")
    assert {e.entry_id for e in c.entries(POOL_SNAPSHOT)} == {m.entry_id, h2.entry_id, h3.entry_id, nxt.entry_id}


def test_another_sessions_line_makes_a_branch_point_and_a_side_request_passes_nothing():
    c = make(snapshot_max_entries=8)
    m = put(c, toks(16), trimmable=False, pool=POOL_SNAPSHOT, session_id="a")
    put(c, toks(16) + [7] * 4, trimmable=False, pool=POOL_SNAPSHOT, session_id="b")
    assert m.passed and m.shared and not m.stale
    side = put(c, toks(8, 500), trimmable=False, pool=POOL_SNAPSHOT, session_id="a")   # same session, unrelated
    assert not side.passed and len(m.lines) == 1


class Spill:
    """on_spill stand-in for the disk tier: every entry it is handed gets a disk id."""

    def __init__(self) -> None:
        self.spilled: list[int] = []

    def __call__(self, entry, reason) -> int:
        self.spilled.append(entry.entry_id)
        return 10_000 + entry.entry_id


def make_spilling(clock=None, **kw):
    spill = Spill()
    cfg = PromptCacheConfig(**{"block_size": 4, "max_entries": 8, **kw})
    return PromptCache(cfg, namespace_seed("test-model"), CacheCounters(), clock=clock or Clock(), on_spill=spill), spill


def filled_in_order(max_bytes, sizes):
    """A spilling cache and one entry per size, inserted a second apart (the oldest first)."""
    clock = Clock()
    c, spill = make_spilling(clock, max_bytes=max_bytes)
    entries = []
    for start, n in zip((0, 50, 90), sizes):
        entries.append(put(c, toks(8, start), nbytes=n))
        clock.t += 1
    return c, spill, entries


def test_an_entry_alone_over_the_byte_budget_evicts_nothing_else_and_goes_to_disk():
    # issue 23 #2: the old order removed every other entry (and its disk copy) first, then
    # noticed the new entry alone was over budget and spilled it: an empty RAM tier.
    c, spill, (a, b, big) = filled_in_order(max_bytes=250, sizes=(100, 100, 300))
    assert [e.entry_id for e in c.entries()] == [a.entry_id, b.entry_id]
    assert spill.spilled == [big.entry_id] and big.on_disk_only
    assert c.eviction_log == [(big.entry_id, "spill_bytes")]
    assert c.lookup(toks(12, 90), toks(12, 90)).entry is big       # still findable (on disk)


def test_byte_pressure_spills_victims_instead_of_removing_them():
    c, spill, (a, b, d) = filled_in_order(max_bytes=250, sizes=(100, 100, 100))
    assert spill.spilled == [a.entry_id] and a.on_disk_only and c.get(a.entry_id) is a
    assert [e.entry_id for e in c.entries()] == [b.entry_id, d.entry_id] and c.nbytes == 200
    assert c.eviction_log == [(a.entry_id, "spill_bytes")]


@pytest.mark.parametrize("pool,limits,nbytes", [("kv", {"max_bytes": 250}, 300),
                                                ("snapshot", {"snapshot_max_entries": 0}, 50)])
def test_promoting_an_entry_ram_cannot_hold_keeps_it_disk_only_and_evicts_nothing(pool, limits, nbytes):
    # issue 23 #2: promote() evicted the entry it promoted and returned it with payload None,
    # which the engine counted as a hit and then failed on (AttributeError) at every retry.
    clock = Clock()
    c, spill = make_spilling(clock, **limits)
    a = put(c, toks(8, 0), nbytes=100)
    disk = c.insert_disk_entry(toks(8, 90), toks(8, 90), disk_id=7, nbytes=nbytes, floor=0, pool=pool)
    assert c.promote(disk.entry_id, object(), nbytes) is False
    assert disk.on_disk_only and disk.disk_id == 7 and c.get(disk.entry_id) is disk
    assert [e.entry_id for e in c.entries()] == [a.entry_id] and spill.spilled == [] and c.eviction_log == []
    fits = c.insert_disk_entry(toks(8, 40), toks(8, 40), disk_id=8, nbytes=100, floor=0)
    payload = object()
    assert c.promote(fits.entry_id, payload, 100) is True and fits.payload is payload


# --- session partitioning (CACHE_SESSION_PARTITIONING, issue 44) --------------------------------------
def test_partitioning_takes_the_sessions_own_entry_among_equally_deep_matches():
    clock = Clock()
    c = make(clock)
    own = put(c, toks(8) + [100, 101, 102, 103], session_id="A")
    clock.t += 1
    other = put(c, toks(8) + [200, 201, 202, 203], session_id="B")      # used more recently
    request = toks(8) + [300, 301, 302, 303]
    m = c.lookup(request, request)                                       # global: most recently used
    assert (m.entry.entry_id, m.depth, m.match_type, m.preferred) == (other.entry_id, 8, "lcp", False)
    m = c.lookup(request, request, prefer_session="A")
    assert (m.entry.entry_id, m.depth, m.match_type, m.preferred) == (own.entry_id, 8, "lcp", True)
    assert (own.hits, other.hits) == (1, 1)                              # the hit went to the entry chosen
    m = c.lookup(request, request, prefer_session="A")                   # A's is the most recently used now:
    assert (m.entry.entry_id, m.preferred) == (own.entry_id, False)      # the global pick is its own already
    m = c.lookup(request, request, prefer_session="C")                   # no entry of its own: global
    assert (m.entry.entry_id, m.preferred) == (own.entry_id, False)
    m = c.lookup(request, request, prefer_session="B")
    assert (m.entry.entry_id, m.preferred) == (other.entry_id, True)


def test_partitioning_never_trades_depth_or_a_ram_hit_for_the_sessions_own_entry():
    clock = Clock()
    c = make(clock)
    put(c, toks(8) + [100, 101, 102, 103], session_id="A")
    clock.t += 1
    deeper = put(c, toks(12) + [200, 201, 202, 203], session_id="B")
    request = toks(12) + [300, 301, 302, 303]
    m = c.lookup(request, request, prefer_session="A")
    assert (m.entry.entry_id, m.depth, m.preferred) == (deeper.entry_id, 12, False)
    # an own entry on disk only does not displace an equally deep RAM pick (no load for nothing) ...
    d = make(clock)
    on_disk = d.insert_disk_entry(toks(8) + [100, 101, 102, 103], toks(8) + [100, 101, 102, 103], disk_id=5,
                                  nbytes=100, floor=0, session_id="A")
    clock.t += 1
    in_ram = put(d, toks(8) + [200, 201, 202, 203], session_id="B")
    m = d.lookup(request[:8] + [9, 9, 9, 9], request[:8] + [9, 9, 9, 9], prefer_session="A")
    assert (m.entry.entry_id, m.depth, m.preferred) == (in_ram.entry_id, 8, False)
    # ... but wins when the global pick needs a load as well
    d.remove(in_ram.entry_id)
    other_disk = d.insert_disk_entry(toks(8) + [200, 201, 202, 203], toks(8) + [200, 201, 202, 203], disk_id=6,
                                     nbytes=100, floor=0, session_id="B", last_used=clock.t + 5)
    m = d.lookup(request[:8] + [9, 9, 9, 9], request[:8] + [9, 9, 9, 9], prefer_session="A")
    assert (m.entry.entry_id, m.preferred) == (on_disk.entry_id, True) and other_disk.hits == 0


def test_partitioning_reuses_exactly_as_deep_as_global_lookup_on_random_traffic():
    rng = random.Random(44)
    clock = Clock()
    c = make(clock, max_entries=64)
    stored = []
    for i in range(40):
        base = stored[rng.randrange(len(stored))][: rng.randrange(4, 24)] if stored and rng.random() < 0.7 else []
        model = base + [rng.randrange(50) for _ in range(rng.randrange(4, 16))]
        put(c, model, session_id=f"s{rng.randrange(4)}")
        stored.append(model)
        clock.t += 1
    preferred = 0
    for _ in range(300):
        base = stored[rng.randrange(len(stored))]
        req = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
        session = f"s{rng.randrange(5)}"
        for broad in (False, True):
            plain = c.lookup(req, req, broad=broad)
            scoped = c.lookup(req, req, broad=broad, prefer_session=session)
            assert scoped.depth == plain.depth
            if scoped.hit:
                assert list(scoped.entry.model_tokens[: scoped.depth]) == req[: scoped.depth]
            if scoped.preferred:
                preferred += 1
                assert scoped.entry.session_id == session != plain.entry.session_id
    assert preferred > 0      # the traffic did exercise the preference


def test_partitioning_keeps_the_active_sessions_entry_warm_under_eviction():
    """Two entries, room for two. Session A sends a side request that matches A's entry and B's
    (more recently used) equally deep, and stores its own entry: without partitioning the hit
    refreshes B's entry and A's is evicted, so A's next real turn reuses only the shared prefix."""
    def run(partition: bool) -> tuple[int, list]:
        clock = Clock()
        c = make(clock, max_entries=2)
        a = put(c, toks(8) + toks(8, 100), session_id="A")
        clock.t += 1
        b = put(c, toks(8) + toks(8, 200), session_id="B")
        clock.t += 1
        side = toks(8) + toks(8, 300)
        m = c.lookup(side, side, prefer_session="A" if partition else "")
        assert m.depth == 8
        clock.t += 1
        put(c, side + [1, 2, 3, 4], session_id="A")
        clock.t += 1
        turn = toks(8) + toks(8, 100) + toks(8, 400)
        return c.lookup(turn, turn, prefer_session="A" if partition else "").depth, \
            [(eid, reason) for eid, reason in c.eviction_log], a.entry_id, b.entry_id

    depth_off, log_off, a, b = run(False)
    depth_on, log_on, a2, b2 = run(True)
    assert (depth_off, log_off) == (8, [(a, "count")])
    assert (depth_on, log_on) == (16, [(b2, "count")])
