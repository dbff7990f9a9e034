"""KV / state bytes resident in RAM (issue 20 item 4, ``mlxstack_kv_bytes``): the requests in flight
(each array counted once, by its allocated size) plus the RAM cache tier."""
from __future__ import annotations

import urllib.request
from concurrent.futures import Future

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlxstack.runner.batch import batching_support
from mlxstack.runner.kv_bytes import resident_bytes
from mlxstack.engine.core import EngineCore
from tests.conftest import LiveServer, build_engine, engine_settings
from tests.test_engine import job
from tests.test_speculation import COPY, LOOP

pytestmark = pytest.mark.slow  # KV accounting through the engine and HTTP (docs/testing.md#tiers)


def test_an_array_two_caches_share_counts_once():
    a, b = KVCache(), KVCache()
    keys = mx.zeros((1, 2, 256, 16))                   # 32 KiB
    values = mx.zeros((1, 2, 256, 16))
    a.keys, a.values = keys, values
    b.keys, b.values = keys, mx.zeros((1, 2, 512, 16))  # the entry's keys, its own values
    assert resident_bytes([[a]]) == 2 * 32768
    assert resident_bytes([[a], [b]]) == 32768 * 2 + 65536
    assert resident_bytes([None, [], [KVCache()]]) == 0


def test_a_batch_counts_its_slab_once_and_nothing_after_it_ends(tiny_dense_path):
    """Two rows decoding together hold one slab per layer (rows x capacity x 2 KV heads x 16 dims,
    float32, keys and values) plus each layer's per-row offsets and paddings: nothing per row on
    top. When they finish, nothing is in flight and the gauge is the cache tier's bytes."""
    eng = build_engine(engine_settings(tiny_dense_path, speculative="off"))
    sched = EngineCore(eng, 4, 256, batching=batching_support(eng)[0])
    futures = []
    for messages, session in ((LOOP, "a"), (COPY, "b")):
        j, _ = job(messages, max_tokens=30, session=session)
        f: Future = Future()
        f.set_running_or_notify_cancel()
        sched.admit(j, f)
        futures.append(f)
    while len(sched.group) < 2:
        sched.step()
    slab = sched.group.slab
    rows, cap = slab[0].keys.shape[0], slab[0].keys.shape[2]
    layers = len(slab)
    assert (layers, rows) == (2, 2) and cap % 256 == 0
    kv = layers * 2 * rows * cap * 2 * 16 * 4
    bookkeeping = layers * 2 * rows * 4                 # offset and left_padding, int32 per row
    assert eng.state.live_kv_bytes == kv + bookkeeping
    stats = eng.state.stats()
    assert stats["kv_bytes"] == stats["live_kv_bytes"] + stats["bytes"]
    while not sched.idle():
        sched.step()
    assert all(f.result().completion_tokens > 0 for f in futures)
    stats = eng.state.stats()
    assert stats["live_kv_bytes"] == 0 and stats["kv_bytes"] == stats["bytes"] > 0


def test_the_gauge_counts_the_draft_models_stored_caches(tiny_dense_path):
    server = LiveServer(engine_settings(tiny_dense_path, speculative="draft", draft_model=str(tiny_dense_path)))
    try:
        server.app.engine.speculation.draft.cost = 0.0
        import json

        body = {"messages": LOOP, "max_tokens": 16, "temperature": 0}
        req = urllib.request.Request(server.base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()
        stats = server.app.engine.state.stats()
        store = server.app.engine.speculation.draft.store
        assert len(store) == 1 and stats["live_kv_bytes"] == store.nbytes > 0
        with urllib.request.urlopen(server.base + "/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
        assert f"mlxstack_kv_bytes {float(stats['bytes'] + store.nbytes)}" in metrics
    finally:
        server.close()


def test_token_bytes_of_a_fresh_cache(tiny_dense_path):
    """The admission estimate's unit: 2 layers x keys and values x 2 KV heads x 16 dims x 4 bytes
    per token; a plain KV cache holds nothing per sequence beyond its tokens."""
    from mlxstack.runner.kv_bytes import token_bytes
    from mlxstack.runner.generate import feed

    eng = build_engine(engine_settings(tiny_dense_path, speculative="off"))
    live = eng.new_cache()
    feed(eng.loaded.model, live, [1, 2, 3], 8)
    assert token_bytes(live) == (2 * 2 * 2 * 16 * 4, 0)


def _run(sched, messages, max_tokens):
    futures, seqs = [], []
    for i, m in enumerate(messages):
        j, _ = job(m, max_tokens=max_tokens, session=f"adm{i}")
        f: Future = Future()
        f.set_running_or_notify_cancel()
        sched.admit(j, f)
        futures.append(f)
    return futures


def test_admission_by_memory_parks_the_request_that_would_pass_the_budget(tiny_dense_path):
    """KV_budget = what two of three requests need (prompt + generated tokens at 512 bytes a token,
    plus a little): the first two start, the third is parked -- no row, nothing admitted behind it
    -- and starts only once what is held in flight lets it; the replies are those of an engine
    without a memory limit, token for token."""
    from mlxstack.scheduler.policy import GROWTH

    convos = [LOOP, COPY, [{"role": "user", "content": "Count from one to twenty."}]]
    free = build_engine(engine_settings(tiny_dense_path, speculative="off"))
    ref_sched = EngineCore(free, 4, 256, batching=batching_support(free)[0])
    ref = _run(ref_sched, convos, 20)
    while not ref_sched.idle():
        ref_sched.step()
    ref = [f.result() for f in ref]
    assert ref_sched.parked_total == 0
    need = [512 * (o.prompt_tokens + min(20, GROWTH)) for o in ref]
    budget = need[0] + need[1] + 512 * 4
    assert budget < need[0] + need[1] + need[2]
    eng = build_engine(engine_settings(tiny_dense_path, speculative="off", prompt_cache_max_bytes=budget))
    sched = EngineCore(eng, 4, 256, batching=batching_support(eng)[0])
    futures = _run(sched, convos, 20)
    third = sched.parked
    assert third is not None and third.job is not None and len(sched.prefilling) == 2
    assert sched.active == 3 and not sched.has_room() and sched.parked_total == 1
    while sched.parked is not None:
        assert not futures[2].done()
        sched.step()
        if sched.parked is not None:   # still waiting: the two in flight hold more than it may add
            assert sched.committed_bytes() + sched.need_bytes(third) > budget
    assert futures[0].done() and futures[1].done()    # their rows held more than the budget left
    while not sched.idle():
        sched.step()
    got = [f.result() for f in futures]
    assert [o.text for o in got] == [o.text for o in ref]
    assert [o.completion_tokens for o in got] == [o.completion_tokens for o in ref]
    assert sched.parked_total == 1 and sched.has_room()


def test_a_request_alone_always_runs_whatever_the_budget(tiny_dense_path):
    eng = build_engine(engine_settings(tiny_dense_path, speculative="off", prompt_cache_max_bytes=1024))
    sched = EngineCore(eng, 4, 256, batching=batching_support(eng)[0])
    futures = _run(sched, [LOOP, COPY], 8)
    assert sched.parked is not None and len(sched.prefilling) == 1
    while not sched.idle():
        sched.step()
    assert all(f.result().completion_tokens == 8 for f in futures) and sched.parked_total == 1


def test_a_request_waits_for_memory_over_http_and_says_so(tiny_dense_path):
    """Through the server: while a long streamed reply is in flight, a second request under a
    budget that leaves no room waits (stats and /metrics say so), then gets the reply it gets alone."""
    import json
    import threading

    server = LiveServer(engine_settings(tiny_dense_path, speculative="off", prompt_cache_max_bytes=4096,
                                        max_concurrent_sequences=4))
    try:
        def post(messages, max_tokens, stream=False):
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
            return urllib.request.urlopen(urllib.request.Request(
                server.base + "/v1/chat/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"}), timeout=120)

        alone = json.load(post(COPY, 12))["choices"][0]["message"]["content"]
        first = post(LOOP, 400, stream=True)
        first.readline()                       # the long reply is streaming: it is in flight
        out: dict = {}
        second = threading.Thread(target=lambda: out.update(r=json.load(post(COPY, 12))))
        second.start()
        seen_waiting = False
        while second.is_alive():
            with urllib.request.urlopen(server.base + "/v1/cache/stats", timeout=30) as resp:
                sched = json.load(resp)["scheduler"]
            seen_waiting |= sched["waiting_for_memory"] == 1
            second.join(0.01)
        rest = first.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        assert out["r"]["choices"][0]["message"]["content"] == alone
        with urllib.request.urlopen(server.base + "/v1/cache/stats", timeout=30) as resp:
            sched = json.load(resp)["scheduler"]
        assert sched["waited_for_memory_total"] == 1 and sched["waiting_for_memory"] == 0 and seen_waiting
        with urllib.request.urlopen(server.base + "/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
        assert "mlxstack_waited_for_memory_total 1.0" in metrics and "mlxstack_waiting_for_memory 0.0" in metrics
    finally:
        server.close()


def _turn_then_follow_up(eng):
    """A stored first turn (one entry) and the job of its follow-up, which hits it."""
    msgs = [{"role": "system", "content": "You are a careful assistant. " * 8}, {"role": "user", "content": "Hello."}]
    first = eng.run(job(list(msgs), max_tokens=8, session="a")[0])
    follow = msgs + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    return job(follow, max_tokens=8, session="a")[0]


def test_a_prefix_checked_out_by_reference_is_counted_once_in_the_tier(tiny_dense_path):
    """A warm turn checked out copy-free holds the entry's arrays: they are the RAM tier's memory,
    counted there; the requests in flight add only what they hold of their own."""
    eng = build_engine(engine_settings(tiny_dense_path, shared_prefix_min_tokens=8))
    follow = _turn_then_follow_up(eng)
    [(entry, payload)] = eng.state.kv.index.held()
    sched = EngineCore(eng, 4, 256, batching=batching_support(eng)[0])
    f = Future()
    f.set_running_or_notify_cancel()
    sched.admit(follow, f)
    sched.account()
    [seq] = sched.prefilling
    assert all(layer.prefix[0] is s.arrays[0] for layer, s in zip(seq.live.layers, payload.layers))   # by reference
    assert eng.state.live_kv_bytes == 0                                  # nothing of its own yet
    stats = eng.state.stats()
    assert stats["kv_bytes"] == stats["tier_kv_bytes"] == resident_bytes([payload])
    while not sched.idle():
        sched.step()
    assert f.result().cached_tokens > 0


def test_admission_never_spills_the_entry_a_request_in_flight_holds(tiny_dense_path):
    """A second request arrives while the first holds the stored entry by reference: the budget
    leaves it room only once that entry is counted once, and the RAM tier then yields what it can
    -- never the entry in flight (spilling it frees nothing and loses a hot entry)."""
    eng = build_engine(engine_settings(tiny_dense_path, shared_prefix_min_tokens=8, speculative="off"))
    follow = _turn_then_follow_up(eng)
    [(entry, payload)] = eng.state.kv.index.held()
    sched = EngineCore(eng, 4, 256, batching=batching_support(eng)[0])
    futures = _run(sched, [[{"role": "user", "content": "Count from one to ten."}]], 8)   # an unrelated request
    f = Future()
    f.set_running_or_notify_cancel()
    sched.admit(follow, f)                                               # in flight beside it
    sched.account()
    other = job([{"role": "user", "content": "Name three colours."}], max_tokens=8, session="c")[0]
    probe = eng.start(other)
    eng.state.cache_budget = sched.committed_bytes() + sched.need_bytes(probe) + entry.nbytes // 2
    g = Future()
    g.set_running_or_notify_cancel()
    sched.admit(other, g)
    assert sched.parked is None and len(sched.prefilling) == 3           # room, with the prefix counted once
    assert [e.entry_id for e, _ in eng.state.kv.index.held()] == [entry.entry_id]   # still in RAM
    while not sched.idle():
        sched.step()
    assert all(x.result().completion_tokens > 0 for x in (*futures, f, g))
