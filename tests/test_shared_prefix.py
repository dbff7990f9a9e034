"""One copy of a shared prefix (issue 20): cascade attention, rooted cache entries, a decode
slab whose rows share a prefix, and requests that arrive together prefilling it once."""
from __future__ import annotations

from concurrent.futures import Future

import mlx.core as mx
import pytest

from mlxstack.cache.kv_ops import capture, checkout, dump_state, load_state
from mlxstack.cache.layer_kinds import KINDS, rooted
from mlx_lm.models.cache import KVCache

from mlxstack.cache.prefixed_kv import PrefixedKVCache
from mlxstack.runner.batch import batching_support
from mlxstack.cache.slab import SlabKVCache
from mlxstack.runner.kv_bytes import resident_bytes
from mlxstack.engine.core import EngineCore
from mlxstack.runner.shared_prefix import shared_prefix_ok
from mlxstack.backends.cascade import Part, attend_parts
from mlxstack.runner.generate import feed
from tests.conftest import build_engine, engine_settings
from tests.test_engine import job

pytestmark = pytest.mark.slow  # sub-agents under one prompt on the embedded model (docs/testing.md#tiers)

SYSTEM = "You are a careful sub-agent. Read the files first, change little, test every change. " * 14


# ------------------------------------------------------------------------------ the attention
def _full(pk, tk, B):
    return mx.concatenate([mx.broadcast_to(pk, (B, *pk.shape[1:])), tk], axis=2)


@pytest.mark.parametrize("L", [1, 5])
def test_cascade_equals_attention_over_the_concatenation(L):
    mx.random.seed(3)
    B, Hq, Hkv, D, P, T = 4, 6, 2, 16, 37, 9
    q = mx.random.normal((B, Hq, L, D))
    pk, pv = mx.random.normal((1, Hkv, P, D)), mx.random.normal((1, Hkv, P, D))
    tk, tv = mx.random.normal((B, Hkv, T, D)), mx.random.normal((B, Hkv, T, D))
    sinks = mx.random.normal((Hq,))
    # the causal rule over the tail; row 2 does not see the prefix at all
    rows = mx.array([True, True, False, True])
    qpos = mx.arange(T - L, T)[:, None]
    tail_mask = mx.broadcast_to((qpos >= mx.arange(T)[None])[None, None], (B, 1, L, T))
    full_mask = mx.concatenate([mx.broadcast_to(rows.reshape(B, 1, 1, 1), (B, 1, L, P)), tail_mask], axis=-1)
    for s in (None, sinks):
        ref = mx.fast.scaled_dot_product_attention(q, _full(pk, tk, B), _full(pv, tv, B), scale=0.25,
                                                   mask=full_mask, sinks=s)
        out = attend_parts(q, [Part(pk, pv, rows=rows), Part(tk, tv, "causal" if L > 1 else None)], 0.25, s)
        assert out.shape == ref.shape
        assert mx.abs(out - ref).max().item() < 1e-5


def test_cascade_with_left_padded_tails_and_a_row_that_sees_nothing():
    """A decode slab's case: the tails are views of a longer buffer with per-row left padding (an
    array mask), one row does not share the prefix, one free row sees nothing at all (output 0,
    never NaN); equal to attention over each row's concatenation."""
    mx.random.seed(5)
    B, Hq, Hkv, D, P, T, L = 5, 6, 2, 16, 23, 11, 1
    q = mx.random.normal((B, Hq, L, D))
    pk, pv = mx.random.normal((1, Hkv, P, D)), mx.random.normal((1, Hkv, P, D))
    buf_k, buf_v = mx.random.normal((B, Hkv, T + 5, D)), mx.random.normal((B, Hkv, T + 5, D))
    tk, tv = buf_k[..., :T, :], buf_v[..., :T, :]
    rows = mx.array([True, False, True, True, False])
    pad = mx.array([0, 3, 7, 0, T])                         # row 4: no prefix, every column padding
    tail_mask = (mx.arange(T)[None] >= pad[:, None]).reshape(B, 1, 1, T)
    out = attend_parts(q, [Part(pk, pv, rows=rows), Part(tk, tv, tail_mask)], 0.25)
    full_mask = mx.concatenate([mx.broadcast_to(rows.reshape(B, 1, 1, 1), (B, 1, L, P)), tail_mask], axis=-1)
    ref = mx.fast.scaled_dot_product_attention(q[:4], _full(pk, tk, B)[:4], _full(pv, tv, B)[:4], scale=0.25,
                                               mask=full_mask[:4])
    assert mx.abs(out[:4] - ref).max().item() < 1e-5
    assert mx.all(out[4] == 0).item()


def test_cascade_one_row_with_a_full_mask_split_at_the_prefix():
    from mlxstack.backends.cascade import split_mask

    mx.random.seed(4)
    Hq, Hkv, D, P, T, L = 4, 4, 8, 12, 6, 6
    q = mx.random.normal((1, Hq, L, D))
    pk, pv = mx.random.normal((1, Hkv, P, D)), mx.random.normal((1, Hkv, P, D))
    tk, tv = mx.random.normal((1, Hkv, T, D)), mx.random.normal((1, Hkv, T, D))
    mask = mx.arange(P, P + L)[:, None] >= mx.arange(P + T)[None]          # a causal array mask
    ref = mx.fast.scaled_dot_product_attention(q, mx.concatenate([pk, tk], 2), mx.concatenate([pv, tv], 2),
                                               scale=0.3, mask=mask)
    pm, tm = split_mask(mask, P)
    out = attend_parts(q, [Part(pk, pv, pm), Part(tk, tv, tm)], 0.3)
    assert mx.abs(out - ref).max().item() < 1e-5


# ------------------------------------------------------------------------------ rooted entries
@pytest.fixture(scope="module")
def dense_engine(tiny_dense_path):
    return build_engine(engine_settings(tiny_dense_path))


def test_a_hit_stores_only_what_follows_its_root(dense_engine):
    eng = dense_engine
    model = eng.loaded.model
    first = eng.new_cache()
    feed(model, first, list(range(100, 140)), 16)
    entry = capture(first)                                    # a cold turn's entry: plain
    assert not any(rooted(s) for s in entry.layers)
    live = checkout(entry, 30)                                # a hit at 30 of its 40 tokens
    assert all(r is not None and r[0] is s.arrays[0] and r[2] == 30 for r, s in zip(live.roots, entry.layers))
    feed(model, live, list(range(200, 210)), 16)
    second = capture(live)
    for s, e in zip(second.layers, entry.layers):
        assert rooted(s) and s.arrays[2] is e.arrays[0] and s.param("prefix") == 30
        assert s.arrays[0].shape[2] == 10                     # only the 10 new tokens were copied
    # the tier counts the shared root once
    apart = sum(resident_bytes([x]) for x in (entry, second))
    assert resident_bytes([entry, second]) == apart - sum(s.arrays[2].nbytes + s.arrays[3].nbytes
                                                          for s in second.layers)
    # what it serves is exactly the plain cache's tokens, at every depth, and on disk it is plain
    plain = capture(live).layers
    for depth in (7, 30, 35, 40):
        a = checkout(second, depth)
        assert a.depth == depth
        for la, lb in zip(a.layers, live.layers):
            assert la.offset == depth
            assert mx.array_equal(la.keys[..., :depth, :], lb.keys[..., :depth, :]).item()
            assert mx.array_equal(la.values[..., :depth, :], lb.values[..., :depth, :]).item()
    arrays, meta = dump_state(second)
    back = load_state(arrays, meta)
    assert not any(rooted(s) for s in back.layers)
    for s, p in zip(back.layers, plain):
        k, _ = KINDS["kv"].whole(p, p.depth, room=False)
        assert mx.array_equal(s.arrays[0], k).item()
    # a checkout of the rooted entry shares the ROOT (the first entry's arrays), not its copy
    third = checkout(second, 40)
    assert all(r[0] is e.arrays[0] and r[2] == 30 for r, e in zip(third.roots, entry.layers))


# ------------------------------------------------------------------------------ the slab
def test_slab_rows_share_one_prefix_and_take_gives_the_whole_sequence(dense_engine):
    eng = dense_engine
    assert shared_prefix_ok(eng)
    model = eng.loaded.model
    base = eng.new_cache()
    feed(model, base, list(range(100, 120)), 16)
    root = capture(base)
    lives = []
    for tail in ([1, 2, 3], [4, 5, 6, 7, 8]):
        live = checkout(root, 20)
        feed(model, live, tail, 16)
        lives.append(live)
    slab = SlabKVCache.empty(4)
    for r, live in enumerate(lives):
        layer = live.layers[0]
        slab.place(r, layer.keys, layer.values, layer.offset, live.roots[0], 16)
    assert slab.shares == [True, True, False, False] and slab.prefix[2] == 20
    assert slab.keys.shape[2] >= 5 and slab._idx == 5                   # tails only: 3 and 5 columns
    assert slab.offset.tolist()[:2] == [23, 25]                          # RoPE positions count the prefix
    for r, live in enumerate(lives):
        whole = slab.take(r, whole=True)
        assert type(whole) is KVCache and whole.offset == live.layers[0].offset
        assert mx.array_equal(whole.keys[..., :whole.offset, :], live.layers[0].keys[..., :whole.offset, :]).item()
        back = slab.take(r)                              # the prefix by reference, the tail copied
        assert type(back) is PrefixedKVCache and back.prefix[0] is live.roots[0][0] and back.offset == whole.offset
        assert back.keys.shape[2] >= back.offset - 20
        again = back.whole()
        assert mx.array_equal(again.keys, whole.keys[..., :whole.offset, :]).item()
    # a root shorter than the minimum is not shared
    other = SlabKVCache.empty(2)
    layer = lives[0].layers[0]
    other.place(0, layer.keys, layer.values, layer.offset, lives[0].roots[0], 64)
    assert other.shares == [False, False] and other.prefix is None


def test_a_row_handed_back_with_its_prefix_by_reference_decodes_stores_and_cuts_exactly(dense_engine):
    """A PrefixedKVCache (what a finished row of a sharing batch becomes): a forward on it gives
    the logits of the same tokens on one plain buffer; captured, it is a rooted plain-KV state
    (the prefix by reference); cut back into the prefix, it serves the shorter depth."""
    from mlxstack.cache.kv_ops import LiveCache

    eng = dense_engine
    model = eng.loaded.model
    plain = eng.new_cache()
    feed(model, plain, list(range(100, 130)), 16)
    entry = capture(plain)
    lives = []
    for _ in range(2):
        live = checkout(entry, 24)
        feed(model, live, [5, 6, 7], 16)
        lives.append(live)
    slab = SlabKVCache.empty(2)
    for r, live in enumerate(lives):
        slab.place(r, live.layers[0].keys, live.layers[0].values, 27, live.roots[0], 8)
    layers = []
    for li in range(len(lives[0].layers)):
        s2 = SlabKVCache.empty(2)
        for r, live in enumerate(lives):
            lay = live.layers[li]
            s2.place(r, lay.keys, lay.values, 27, live.roots[li], 8)
        layers.append(s2.take(0))
    assert all(type(x) is PrefixedKVCache for x in layers)
    pre = LiveCache(layers, 27)
    ref = checkout(entry, 24)
    feed(model, ref, [5, 6, 7], 16)
    nxt = mx.array([[9, 10, 11]], dtype=mx.int32)
    a = model(nxt, cache=pre.layers)
    b = model(nxt, cache=ref.layers)
    assert mx.abs(a - b).max().item() < 1e-4
    pre.advance(3)
    ref.advance(3)
    assert mx.argmax(a[0, -1]).item() == mx.argmax(b[0, -1]).item()
    state = capture(pre)
    assert all(rooted(x) and x.arrays[2] is e.arrays[0] and x.param("prefix") == 24
               for x, e in zip(state.layers, entry.layers))
    back = checkout(state, 30)
    for x, y in zip(back.layers, pre.layers):
        assert mx.array_equal(x.keys[..., :30, :], y.whole().keys).item()
    pre.cut(20)                                            # into the prefix
    assert all(x.offset == 20 and x.prefix[2] == 20 and x.keys is None for x in pre.layers)
    short = capture(pre)
    assert short.depth == 20 and all(x.arrays[2] is e.arrays[0] for x, e in zip(short.layers, entry.layers))


# ------------------------------------------------------------------------------ arriving together
def _messages(i):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {i}: look at module {i}."}]


def _run(engine, jobs):
    sched = EngineCore(engine, 8, 128, batching=batching_support(engine)[0])
    futures, shares = [], []
    for j in jobs:
        f = Future()
        f.set_running_or_notify_cancel()
        sched.admit(j, f)
        futures.append(f)
    while not sched.idle():
        sched.step()
        if sched.group.slab:
            shares.append(sum(sched.group.slab[0].shares))
    return [f.result() for f in futures], sched, shares


def test_requests_arriving_together_prefill_the_common_prompt_once(tiny_dense_path):
    alone = build_engine(engine_settings(tiny_dense_path))
    solo = [alone.run(job(_messages(i), max_tokens=8, session=f"a{i}")[0]) for i in range(3)]
    eng = build_engine(engine_settings(tiny_dense_path))
    outs, sched, shares = _run(eng, [job(_messages(i), max_tokens=8, session=f"b{i}")[0] for i in range(3)])
    assert [o.text for o in outs] == [o.text for o in solo]              # token for token
    assert sched.shared_prefills == 2
    n = outs[0].prompt_tokens
    shared = eng.state.counters.snapshot()["shared_prefill_tokens"]
    assert [o.cached_tokens for o in outs[1:]] == [shared // 2] * 2 and shared // 2 >= n - 20
    assert max(shares) == 3                                              # every row held the prefix once
    stats = eng.state.stats()
    assert stats["tier_kv_bytes"] < stats["bytes"] * 0.5                 # the entries share it too


def test_a_follower_whose_leader_fails_prefills_on_its_own(tiny_dense_path):
    from mlxstack.config import faults

    eng = build_engine(engine_settings(tiny_dense_path))
    alone = build_engine(engine_settings(tiny_dense_path))
    expect = alone.run(job(_messages(1), max_tokens=6, session="c1")[0]).text
    j0, _ = job(_messages(0), max_tokens=6, session="d0")
    j0.request_id = "leader"
    j1, _ = job(_messages(1), max_tokens=6, session="d1")
    with faults.injected("prefill_chunk@leader"):
        sched = EngineCore(eng, 8, 128, batching=True)
        f0, f1 = Future(), Future()
        for f, j in ((f0, j0), (f1, j1)):
            f.set_running_or_notify_cancel()
            sched.admit(j, f)
        assert sched.prefilling[1].follows is not None
        while not sched.idle():
            sched.step()
    assert f0.exception() is not None
    assert f1.result().text == expect and sched.shared_prefills == 0


def test_shared_prefix_min_tokens_zero_keeps_every_copy_and_the_same_replies(tiny_dense_path):
    eng = build_engine(engine_settings(tiny_dense_path, shared_prefix_min_tokens=0))
    outs, sched, shares = _run(eng, [job(_messages(i), max_tokens=8, session=f"z{i}")[0] for i in range(3)])
    on = build_engine(engine_settings(tiny_dense_path))
    outs_on, sched_on, _ = _run(on, [job(_messages(i), max_tokens=8, session=f"y{i}")[0] for i in range(3)])
    assert sched.shared_prefills == 0 and not any(shares) and sched.group.min_shared is None
    assert sched_on.shared_prefills == 2
    assert [o.text for o in outs] == [o.text for o in outs_on]


def test_a_batch_row_on_another_prefix_than_the_slabs_is_placed_whole(dense_engine):
    from mlxstack.cache.slab import place_batch_rows, stack_layers

    eng = dense_engine
    model = eng.loaded.model
    roots, lives = [], []
    for start in (100, 300):                                 # two different prefixes of 12 tokens
        base = eng.new_cache()
        feed(model, base, list(range(start, start + 12)), 16)
        root = capture(base)
        live = checkout(root, 12)
        feed(model, live, [1, 2, 3], 16)
        roots.append(root)
        lives.append(live)
    batch = stack_layers([lives[0].layers], [lives[0].roots], 8)      # holds prefix A once
    assert batch[0].shares[0]
    slab = [SlabKVCache.empty(2) for _ in batch]
    for li, s in enumerate(slab):                                      # the slab's prefix is B
        s.place(0, lives[1].layers[li].keys, lives[1].layers[li].values, 15, lives[1].roots[li], 8)
    place_batch_rows(slab, [1], batch, [0], [lives[0].roots], 8)
    for li, s in enumerate(slab):
        assert s.shares == [True, False]
        back = s.take(1)
        assert back.offset == 15
        assert mx.array_equal(back.keys[..., :15, :], lives[0].layers[li].keys[..., :15, :]).item()


def test_followers_and_fresh_requests_arriving_together_all_get_their_replies(embedded_model_path):
    """Regression (found by bench_speculative's 8-session load, prompt cache off): two long prompts
    (an agent's file edit) and two short ones, each sent by two agents at once. The followers of a
    shared prefill hold the leader's prefix by reference; a fresh short request with nothing
    prefilled yet must not be batched onto slab rows with them (an empty row cannot be placed:
    every request failed with "a decoding sequence holds at least its prompt"). Each reply is the
    one it gets alone."""
    code = "\n".join(f"def handle_{n}(request, store):\n    item = store.get(request.{n}_id)\n"
                     f"    if item is None:\n        raise NotFound('{n}')\n    return render(item, status={200 + i})"
                     for i, n in enumerate(["user", "order", "invoice", "product", "cart", "payment"]))
    long_ = [[{"role": "system", "content": "You are a code editor. You output only code."},
              {"role": "user", "content": "```python\n" + code + "\n```\nRename `render` to `render_item`."}],
             [{"role": "user", "content": "Rewrite this with KeyError for NotFound:\n" + code}]]
    short = [[{"role": "user", "content": "Write a short story about a robot."}],
             [{"role": "user", "content": "Explain a hash map."}]]
    convos = long_ * 2 + short * 2
    alone = build_engine(engine_settings(embedded_model_path, prompt_cache_max_entries_global=0))
    solo = [alone.run(job(m, max_tokens=4, session=f"a{i}")[0]) for i, m in enumerate(convos)]
    eng = build_engine(engine_settings(embedded_model_path, prompt_cache_max_entries_global=0))
    sched = EngineCore(eng, 16, 512, batching=batching_support(eng)[0])   # the bench's chunk: one step fits all
    futures = []
    for i, m in enumerate(convos):
        futures.append(Future())
        futures[-1].set_running_or_notify_cancel()
        sched.admit(job(m, max_tokens=4, session=f"b{i}")[0], futures[-1])
    while not sched.idle():
        sched.step()
    outs = [f.result() for f in futures]
    assert [o.text for o in outs] == [o.text for o in solo]
    assert sched.shared_prefills >= 2 and sched.failed == 0


def test_a_slab_filled_at_once_equals_one_placed_row_by_row(dense_engine):
    """SlabKVCache.fill (a batch joining an empty slab: place_batch_rows) builds each layer in one
    concatenation: the same rows, padding, RoPE offsets, shared prefix and next-step logits as
    placing the rows one by one -- with the longest row in the middle, a row on its root, and a
    row without one (held whole)."""
    from mlxstack.cache.slab import _own_planned, place_own_layers

    eng = dense_engine
    model = eng.loaded.model
    base = eng.new_cache()
    feed(model, base, list(range(100, 120)), 16)
    root = capture(base)
    lives = []
    for tail in ([1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]):
        live = checkout(root, 20)
        feed(model, live, tail, 16)
        lives.append(live)
    alone = eng.new_cache()
    feed(model, alone, [7, 7, 8, 9], 16)                   # no root: its whole sequence is the row
    lives.append(alone)
    layers, roots = [lv.layers for lv in lives], [lv.roots for lv in lives]
    filled = [SlabKVCache.empty(4) for _ in layers[0]]
    for i, slab in enumerate(filled):
        slab.fill([_own_planned(slab, r, layers[r][i], roots[r][i], 16) for r in range(4)])
    placed = [SlabKVCache.empty(4) for _ in layers[0]]
    for r in range(4):
        place_own_layers(placed, r, layers[r], roots[r], 16)
    for a, b in zip(filled, placed):
        assert a._idx == b._idx == 7 and a.shares == b.shares == [True, True, True, False]
        assert a.prefix[0] is b.prefix[0] and a.prefix[2] == b.prefix[2] == 20
        assert a.left_padding.tolist() == b.left_padding.tolist() == [4, 0, 6, 3]
        assert a.offset.tolist() == b.offset.tolist() == [23, 27, 21, 4]
        assert a.gap == b.gap == [0, 0, 0, 0]
        assert mx.array_equal(a.keys[..., :7, :], b.keys[..., :7, :]).item()
        assert mx.array_equal(a.values[..., :7, :], b.values[..., :7, :]).item()
    step = mx.array([[3], [1], [4], [1]])
    assert mx.array_equal(model(step, cache=filled), model(step, cache=placed)).item()
