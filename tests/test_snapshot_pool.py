"""Which exact-depth snapshots the pool keeps (hybrid / recurrent / rotated-window models; the
floors of cache/layer_kinds.py say which depths a deeper entry can still serve).
- A client's cache_control mark every branch reads stays: the branches' deeper snapshots cannot be
  cut back to it, so they do not supersede it, and a mark two later turns (or another session)
  went their own way from is a branch point. Through the MLX server's HTTP door on the tiny hybrid.
- Follow-up turns keep the snapshot they resume from: when a conversation goes on, its older
  turn's snapshots leave first, not another conversation's newest (tiny GPT-OSS, Gemma 3, Mamba 2:
  the kinds an earlier attempt at the first rule cost their prompt[:-1] snapshots)."""
from __future__ import annotations

import itertools

import pytest

from mlxstack.cache.prompt_cache import POOL_SNAPSHOT
from tests.conftest import LiveServer, build_engine, engine_settings
from tests.test_batching import PROMPTS, convo, job
from tests.test_cache_breakpoints import anthropic, mark_position, post

ASKS = [f"Which shelf holds item {i}? Answer in one word." for i in range(3, 13)]


def record_inserts(monkeypatch, cache) -> list:
    """Every entry the index takes, in order (the eviction log names entries by id)."""
    stored = []
    insert = cache.insert

    def spy(*args, **kwargs):
        entry = insert(*args, **kwargs)
        stored.append((kwargs.get("pool"), args[1][:] if len(args) > 1 else None, entry and entry.entry_id))
        return entry

    monkeypatch.setattr(cache, "insert", spy)
    return stored


@pytest.fixture
def warm(tiny_kind_paths):
    server = LiveServer(engine_settings(tiny_kind_paths("hybrid"), cache_ttl_max_seconds=86400,
                                        speculative="off", snapshot_max_entries=8))
    yield server
    server.close()


@pytest.mark.parametrize("session", [None, "one-agent"], ids=["a-session-per-branch", "one-session"])
def test_ten_branches_at_one_mark_all_read_it(warm, monkeypatch, session):
    """Ten requests branching at one 1h cache_control mark, room for 8 snapshots: the first stores
    the mark and each its own history end and prompt[:-1] (deeper than the mark, exact depth
    only). Every branch after the first reads exactly the mark (it used to be marked superseded by
    each deeper snapshot and went first: branches 2-7 read it, 8-10 read 0); the pool evicts the branches' own
    snapshots, oldest first (history end, then prompt[:-1]), never the mark."""
    mark = mark_position(warm, ASKS[0])
    cache = warm.app.state.kv.index
    stored = record_inserts(monkeypatch, cache)
    extra = {"session_id": session} if session else {}
    read = [post(warm, "/v1/messages", {**anthropic({"type": "ephemeral", "ttl": "1h"}, ask), **extra})
            ["usage"]["cache_read_input_tokens"] for ask in ASKS]
    assert read == [0] + [mark] * 9
    snaps = [(len(tokens), eid) for pool, tokens, eid in stored if pool == POOL_SNAPSHOT]
    assert len(snaps) == 21 and snaps[0][0] == mark and all(depth > mark for depth, _ in snaps[1:])
    branch_snaps = [eid for _, eid in snaps[1:]]          # per branch: history end, prompt[:-1]
    assert cache.eviction_log == [(eid, "count") for eid in branch_snaps[:13]]
    kept = cache.entries(POOL_SNAPSHOT)
    assert sorted(e.entry_id for e in kept) == sorted([snaps[0][1]] + branch_snaps[13:])
    at_mark = cache.get(snaps[0][1])
    assert at_mark.hits == 9 and not at_mark.superseded and not at_mark.stale


KINDS = ["gpt_oss", "gemma3", "mamba2", "hybrid"]


@pytest.mark.parametrize("kind", KINDS)
def test_follow_ups_keep_their_snapshots_older_turns_leave_first(tiny_kind_paths, kind):
    """Four conversations, then a follow-up of each (the trace of test_batching's windowed kinds),
    room for 8 snapshots: every follow-up reads what it reads with room for all of them, and the
    pool evicts exactly each followed conversation's turn-1 snapshots (history end, prompt[:-1]),
    in the order the conversations went on."""
    long_user = " ".join(f"step {i}: read the file and report." for i in range(12))
    prompts = [PROMPTS[0], long_user, PROMPTS[2], PROMPTS[4]]
    lengths = [20, 40, 6, 30]

    def trace(eng):
        ticks = itertools.count()
        eng.state.kv.index.clock = lambda: float(next(ticks))     # ages by operations, not by this machine's speed
        first = [eng.run(job(convo(p), max_tokens=n, session=f"k{i}")[0]) for i, (p, n) in enumerate(zip(prompts, lengths))]
        turn1 = [(e.session_id, e.entry_id, e.hits) for e in sorted(eng.state.kv.index.entries(POOL_SNAPSHOT),
                                                                    key=lambda e: e.entry_id)]
        follow = [convo("Go on.", convo(p) + [{"role": "assistant", "content": o.text}]) for p, o in zip(prompts, first)]
        again = [eng.run(job(m, max_tokens=8, session=f"k{i}")[0]) for i, m in enumerate(follow)]
        return [o.cached_tokens for o in again], turn1

    path = tiny_kind_paths(kind)
    eng = build_engine(engine_settings(path, snapshot_max_entries=8))
    roomy = build_engine(engine_settings(path, snapshot_max_entries=64))
    cached, turn1 = trace(eng)
    assert cached == trace(roomy)[0]
    assert len(turn1) == 8 and [s for s, _, _ in turn1] == ["k0", "k0", "k1", "k1", "k2", "k2", "k3", "k3"]
    # conversation by conversation, in the order they went on; within one, by score: two never-read
    # snapshots by age (the older first); the windowed kinds' k0 opening snapshot, which the other
    # conversations' first turns read (3 hits), weighs its hits against its depth
    log = eng.state.kv.index.eviction_log
    assert [r for _, r in log] == ["count"] * 8 and len(log) == 8
    assert [{log[i][0], log[i + 1][0]} for i in range(0, 8, 2)] == [{turn1[i][1], turn1[i + 1][1]} for i in range(0, 8, 2)]
    hits = [h for _, _, h in turn1]
    assert hits == ([3] + [0] * 7 if kind in ("gpt_oss", "gemma3") else [0] * 8)
    assert [eid for eid, _ in log[2:]] == [eid for _, eid, _ in turn1[2:]]
    if kind not in ("gpt_oss", "gemma3"):
        assert [eid for eid, _ in log[:2]] == [eid for _, eid, _ in turn1[:2]]
    assert len(eng.state.kv.index.entries(POOL_SNAPSHOT)) == 8


def test_a_warm_turn_whose_echo_differs_resumes_from_its_history_end(tiny_kind_paths):
    """Six two-turn conversations on the tiny hybrid, each client echoing a reply that differs from
    the generated one, room for 8 snapshots: the warm turn resumes from turn 1's history end (the
    turn's own prompt[:-1] snapshot, deeper, cannot serve it). Every warm turn reads what it reads
    with room for all (the 5th and 6th used to read 0: the history end, marked superseded by its
    own prompt[:-1], went first); the first to leave are the history ends the warm turns passed."""
    def trace(eng):
        cache, cached, history_ends = eng.state.kv.index, [], []
        for i in range(6):
            p = PROMPTS[i % 5] + f" (conversation {i})"
            a = eng.run(job(convo(p), max_tokens=12, session=f"c{i}")[0])
            history_ends.append(min((e for e in cache.entries(POOL_SNAPSHOT) if e.session_id == f"c{i}"),
                                    key=lambda e: e.depth).entry_id)
            m = convo("Thanks. And then?", convo(p) + [{"role": "assistant", "content": "Noted: " + a.text}])
            cached.append(eng.run(job(m, max_tokens=8, session=f"c{i}")[0]).cached_tokens)
        return cached, history_ends, cache.eviction_log

    path = tiny_kind_paths("hybrid")
    cached, history_ends, evicted = trace(build_engine(engine_settings(path, snapshot_max_entries=8)))
    assert cached == trace(build_engine(engine_settings(path, snapshot_max_entries=64)))[0]
    assert all(n > 0 for n in cached)
    assert [eid for eid, _ in evicted[:3]] == history_ends[:3]
