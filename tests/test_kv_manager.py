"""The KV manager (cache/manager.py): the one set of verbs a request's KV goes through. Real
tiny model, real caches; parity against a cold prefill of the same tokens."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxstack.cache.manager import MISS, POOL_KV, Lookup
from mlxstack.runner.generate import feed
from tests.conftest import build_engine, engine_settings


@pytest.fixture(scope="module")
def engine(tiny_dense_path):
    return build_engine(engine_settings(tiny_dense_path))


TOKENS = [(7 * i + 3) % 90 + 5 for i in range(40)]


def fed(engine, tokens):
    live = engine.state.kv.new()
    feed(engine.loaded.model, live, tokens, 512)
    return live


def next_logits(engine, live, token):
    from mlxstack.runner.generate import last_logits
    return last_logits(engine.loaded.model, live, token)


def same_answer(a, b) -> bool:
    """A cold prefill computes the prefix in chunks of another shape: the same next token, logits
    equal to float rounding (the project's parity is on tokens)."""
    return int(mx.argmax(a).item()) == int(mx.argmax(b).item()) and mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()


def test_a_miss_checks_out_the_models_empty_caches_and_a_hit_exactly_its_depth(engine):
    kv = engine.state.kv
    empty = kv.checkout(MISS, None)
    assert empty.depth == 0 and len(empty.layers) == len(fed(engine, TOKENS[:1]).layers)
    state = kv.snapshot(fed(engine, TOKENS))
    entry = kv.store(TOKENS, TOKENS, state, pool=POOL_KV, session_id="s", parent=None, ttl=None, inserted=[])
    match = engine.state.kv.index.lookup(TOKENS[:30] + [1, 2], TOKENS[:30] + [1, 2])
    assert match.hit and match.entry.entry_id == entry.entry_id and match.depth == 30
    live = kv.checkout(match, match.entry.payload)
    assert live.depth == 30
    stored_keys = match.entry.payload.layers[0].arrays[0]
    assert mx.array_equal(live.layers[0].keys[..., :30, :], stored_keys[..., :30, :]).item()   # the entry's own KV
    cold = fed(engine, TOKENS[:30])
    assert same_answer(next_logits(engine, live, TOKENS[30]), next_logits(engine, cold, TOKENS[30]))
    kv.remove(entry.entry_id, "test")


def test_a_fork_holds_the_leaders_first_tokens_by_reference_and_answers_as_a_cold_prefill(engine):
    kv = engine.state.kv
    leader = fed(engine, TOKENS[:24])
    follower = kv.fork(leader, 16)
    assert follower.depth == 16 and follower.roots and all(r[2] == 16 for r in follower.roots)
    for root, layer in zip(follower.roots, leader.layers):                # the leader's arrays, not a copy
        assert mx.array_equal(root[0], layer.keys[..., :16, :]).item()
    feed(engine.loaded.model, leader, TOKENS[24:32], 512)                 # the leader goes on: the follower is untouched
    feed(engine.loaded.model, follower, [11, 12, 13], 512)
    cold = fed(engine, TOKENS[:16] + [11, 12, 13])
    assert same_answer(next_logits(engine, follower, 14), next_logits(engine, cold, 14))
    own = fed(engine, TOKENS[:32])
    assert same_answer(next_logits(engine, leader, 9), next_logits(engine, own, 9))


def test_store_records_the_session_and_hands_back_the_id_before_anything_can_fail(engine):
    kv, st = engine.state.kv, engine.state
    inserted: list[int] = []
    state = kv.snapshot(fed(engine, TOKENS))
    entry = kv.store(TOKENS, TOKENS, state, pool=POOL_KV, session_id="sess-a", parent=None, ttl=60.0,
                     inserted=inserted)
    assert inserted == [entry.entry_id] and entry.depth == len(TOKENS)
    assert entry.entry_id in st.sessions.candidates("sess-a")
    kv.remove(entry.entry_id, "test")
    assert entry.entry_id not in st.sessions.candidates("sess-a")   # the session record goes with it


def test_find_drops_an_entry_whose_tensors_cannot_be_loaded_and_looks_again(engine):
    kv, st = engine.state.kv, engine.state
    state = kv.snapshot(fed(engine, TOKENS))
    entry = kv.store(TOKENS, TOKENS, state, pool=POOL_KV, session_id="sess-b", parent=None, ttl=None, inserted=[])
    entry.payload = None                      # as a disk-only entry whose file is gone (no disk tier here)
    before = st.counters.snapshot().get("disk_load_failures", 0)
    query = Lookup(np.array(TOKENS), np.array(TOKENS), session_id="sess-b")
    assert kv.match(query).entry.entry_id == entry.entry_id          # what find's first try finds
    found = kv.find(query)
    assert not found.match.hit and found.stored is None and not found.gave_up   # the second try: a miss
    assert st.counters.snapshot().get("disk_load_failures", 0) == before + 1
    assert kv.index.get(entry.entry_id) is None and kv.match(query).hit is False
