"""KV / state bytes resident in RAM (issue 20 item 4, ``mlxstack_kv_bytes``): the requests in flight
(each array counted once, by its allocated size) plus the RAM cache tier."""
from __future__ import annotations

import urllib.request
from concurrent.futures import Future

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxstack.engine.batch import batching_support
from mlxstack.engine.kv_bytes import resident_bytes
from mlxstack.engine.scheduler import Scheduler
from tests.conftest import LiveServer, build_engine, engine_settings
from tests.test_engine import job
from tests.test_speculation import COPY, LOOP


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
    sched = Scheduler(eng, 4, 256, batching=batching_support(eng)[0])
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
