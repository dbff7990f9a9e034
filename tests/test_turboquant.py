"""TurboQuant KV quantisation (KV_QUANT_SCHEME=turboquant, cache/turboquant.py): the codebook is the
Lloyd-Max quantiser of the rotated coordinate's distribution, decoding is exact whatever the number
of vectors decoded at once, the norm is kept, and through the engine a hit at or past
QUANTIZED_KV_START is the same computation as a cold run with the same scheme -- from RAM, from disk,
under speculation -- while stored entries hold codes, a fraction of the float bytes."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxstack.cache import turboquant as tq
from mlxstack.cache.kv_ops import LiveCache, capture, checkout
from mlxstack.cache.layer_kinds import KINDS, KVQuant
from mlxstack.runner.generate import feed
from tests.conftest import build_engine, engine_settings
from tests.test_disk_cache import run_turns
from tests.test_model_families import TURNS

SEED = tq.SEED


def tq_engine(path, bits="4", start=0, cache=True, **extra):
    if not cache:
        extra["prompt_cache_max_entries_global"] = 0
    return build_engine(engine_settings(path, kv_bits=bits, kv_quant_scheme="turboquant", quantized_kv_start=start,
                                        **extra))


# ------------------------------------------------------------------ the codebook and the codes
@pytest.mark.parametrize("bits", tq.BITS)
def test_the_codebook_is_lloyd_max_for_the_rotated_coordinate(bits):
    """Symmetric, increasing, on the 2^-12 grid, boundaries the midpoints; each centroid the mean of
    its cell under the coordinate's density (Lloyd's condition, up to the grid snap); at 64
    dimensions near the Gaussian Lloyd-Max values (0.4528 / 1.510 at 2 bits, 0.2451 / 0.7560 / 1.344
    / 2.152 at 3)."""
    c, b = tq.codebook(bits, 64)
    assert len(c) == 2 ** bits and np.all(np.diff(c) > 0) and np.allclose(c, -c[::-1])
    assert np.array_equal(np.round(c / tq.GRID) * tq.GRID, c) and np.allclose(b, (c[1:] + c[:-1]) / 2)
    t = np.linspace(-7.9999, 7.9999, 800_001)
    w = np.exp(30.5 * np.log1p(-(t * t) / 64))
    cell = np.searchsorted(b, t)
    means = np.bincount(cell, weights=w * t) / np.bincount(cell, weights=w)
    assert np.max(np.abs(means - c)) < 2 * tq.GRID + 1e-6
    gauss = {2: [0.4528, 1.510], 3: [0.2451, 0.7560, 1.344, 2.152]}
    if bits in gauss:
        assert np.allclose(c[2 ** (bits - 1):], gauss[bits], atol=0.05)


@pytest.mark.parametrize("bits", tq.BITS)
def test_codes_pack_and_decode_exactly(bits):
    """Every code survives packing; decoding one vector at a time gives the very floats one call
    over all of them gives (what the live cache decoded == what a stored entry decodes to); the
    decoded vector keeps the original's norm; the error is what Lloyd-Max at this width allows,
    also with an outlier channel (the rotation spreads it)."""
    book = tq.scheme(bits, 64, SEED)
    codes = mx.random.randint(0, 2 ** bits, (5, 64), key=mx.random.key(bits)).astype(mx.uint32)
    assert mx.array_equal(book._unpack(book._pack(codes)), codes).item()
    x = mx.random.normal((2, 3, 29, 64), key=mx.random.key(7)) * 2
    x = x.at[..., 5].add(30.0)
    packed, f = book.encode(x)
    assert packed.dtype == mx.uint8 and packed.shape == (2, 3, 29, 64 * bits // 8) and f.shape == (2, 3, 29, 1)
    whole = book.decode(packed, f)
    one = mx.concatenate([book.decode(packed[..., i:i + 1, :], f[..., i:i + 1, :]) for i in range(29)], axis=-2)
    assert mx.array_equal(one, whole).item()
    norms = mx.sqrt(mx.sum(x * x, axis=-1))
    assert float(mx.max(mx.abs(mx.sqrt(mx.sum(whole * whole, axis=-1)) - norms) / norms).item()) < 1e-5
    rel = float((mx.sqrt(mx.sum((whole - x) ** 2)) / mx.sqrt(mx.sum(x * x))).item())
    bound = {2: 0.36, 3: 0.20, 4: 0.11, 8: 0.01}[bits]        # sqrt of Lloyd-Max's Gaussian MSE, + margin
    assert rel < bound, (bits, rel)
    assert tq.bytes_per_vector(bits, 64) == 64 * bits // 8 + 4


@pytest.mark.parametrize("bits", tq.BITS)
def test_the_table_lookup_finds_the_nearest_centroid_as_counting_boundaries_does(bits):
    """Encoding's O(1) lookup (a table of fine bins, one comparison) gives the code a count of the
    boundaries below each coordinate gives: random values, values on and next to every boundary,
    values past the table's ends."""
    book = tq.scheme(bits, 64, SEED)
    b = book.bounds
    eps = mx.array(1e-7, dtype=mx.float32)
    t = mx.concatenate([mx.random.normal((4096,), key=mx.random.key(bits)) * 2, b, b - eps, b + eps,
                        mx.array([-1e6, 1e6, -book.edge, book.edge, 0.0], dtype=mx.float32)])
    want = mx.sum(t[:, None] > b, axis=-1).astype(mx.uint32)
    assert mx.array_equal(book._nearest(t), want).item()


def test_what_turboquant_cannot_serve_is_said_in_one_line():
    with pytest.raises(tq.SchemeError, match="KV_BITS=5 is not a TurboQuant width"):
        tq.codebook(5, 64)
    with pytest.raises(tq.SchemeError, match="head dimension 12 has no power-of-two block"):
        tq.scheme(4, 12)
    assert tq.rotation_block(96) == 32 and tq.rotation_block(512) == 256


# ------------------------------------------------------------------ the live cache and stored states
def test_a_stored_entry_holds_codes_and_checks_out_what_a_cold_run_holds(tiny_dense_hd64_path):
    model, _ = load(str(tiny_dense_hd64_path))
    q = KVQuant(4, 64, 100, "turboquant", SEED)
    tokens = list(range(2000, 2150))
    live = LiveCache(make_prompt_cache(model), 0, q)
    feed(model, live, tokens, 10)
    assert all(isinstance(c, tq.TurboQuantKVCache) and c.fp_head == 100 for c in live.layers)
    state = capture(live)
    assert {s.kind for s in state.layers} == {"turboquant"}
    full = LiveCache(make_prompt_cache(model))
    feed(model, full, tokens, 10)
    ref = capture(full)
    # stored: 100 float tokens + 50 tokens of codes (32 bytes + a 4-byte factor a vector)
    per_token_float = ref.nbytes / 150
    want = 100 * per_token_float + 50 * per_token_float * 36 / 256
    assert state.nbytes == pytest.approx(want, rel=1e-6)
    for depth in (60, 100, 110, 120, 150):      # chunk-aligned: the cold run's rows are the entry's (LESSONS 23)
        cold = LiveCache(make_prompt_cache(model), 0, q)
        feed(model, cold, tokens[:depth], 10)
        hit = checkout(state, depth, q)
        assert hit.depth == depth and hit.quantized == cold.quantized == (depth >= 100)
        for h, c in zip(hit.layers, cold.layers):
            assert type(h) is type(c) and h.offset == c.offset == depth, depth
            assert mx.array_equal(h.keys[..., :depth, :], c.keys[..., :depth, :]).item(), depth
            assert mx.array_equal(h.values[..., :depth, :], c.values[..., :depth, :]).item(), depth
        nxt = mx.array([[7, 8, 9]], dtype=mx.int32)
        assert mx.array_equal(model(nxt, cache=hit.layers), model(nxt, cache=cold.layers)).item(), depth
        again = capture(hit)                # and it stores again what it was checked out from
        assert again.depth == depth and again.nbytes == capture(cold).nbytes
    below = capture(live, 60)               # under the head: the plain floats as they were (a fork's copy)
    assert {s.kind for s in below.layers} == {"kv"} and below.depth == 60
    for b, c in zip(checkout(below, 60, q).layers, checkout(state, 60, q).layers):
        assert type(b) is type(c) is KVCache and mx.array_equal(b.keys[..., :60, :], c.keys[..., :60, :]).item()
    with pytest.raises(ValueError):
        live.cut(60)                        # a cut stays at or past the head
    cut = checkout(state, 150, q)
    cut.cut(120)                            # speculation takes back drafts: codes go with them
    assert all(c.codes.offset == 20 and c.offset == 120 for c in cut.layers)
    assert capture(cut).nbytes == capture(checkout(state, 120, q)).nbytes
    with pytest.raises(ValueError):
        cut.cut(90)                         # never below the full-precision head


def test_disk_form_round_trips_and_refuses_what_it_did_not_write(tiny_dense_hd64_path):
    model, _ = load(str(tiny_dense_hd64_path))
    q = KVQuant(3, 64, 0, "turboquant", SEED)
    live = LiveCache(make_prompt_cache(model), 0, q)
    feed(model, live, list(range(300, 340)), 16)
    s = capture(live).layers[0]
    kind = KINDS["turboquant"]
    arrays, meta = kind.dump(s)
    back = kind.load(arrays, meta, s.cls)
    assert back.params == s.params and back.depth == 40
    for a, b in zip(back.arrays, s.arrays):
        assert (a is None and b is None) or mx.array_equal(a, b).item()
    bad = {**meta, "params": {k: v for k, v in meta["params"].items() if k != "seed"}}
    with pytest.raises(ValueError, match="seed"):
        kind.load(arrays, bad, s.cls)


# ------------------------------------------------------------------ through the engine
@pytest.mark.parametrize("bits,start", [("4", 0), ("3", 0), ("2", 96)])
def test_turboquant_hits_equal_a_turboquant_cold_run(tiny_dense_hd64_path, bits, start):
    warm, cold = tq_engine(tiny_dense_hd64_path, bits, start), tq_engine(tiny_dense_hd64_path, bits, start, cache=False)
    assert warm.state.kv_quant == KVQuant(int(bits), 64, start, "turboquant", SEED)
    w, _ = run_turns(warm, TURNS)
    c, _ = run_turns(cold, TURNS)
    assert [o.raw_text for o in w] == [o.raw_text for o in c]
    hits = [o for o in w[1:] if o.cached_tokens]
    assert len(hits) == 3 and all(o.cached_tokens >= start for o in hits)
    for e in warm.state.kv.index.entries():
        assert {s.kind for s in e.payload.layers} == ({"turboquant"} if e.depth > start else {"kv"})
    stats = warm.state.stats()
    assert stats["kv_quant"] == {"scheme": "turboquant", "bits": int(bits), "group_size": 64, "start": start,
                                 "seed": SEED}
    assert stats["quantized_bytes"] > 0


def test_turboquant_entries_survive_the_disk_tier_and_another_seed_never_reads_them(tiny_dense_hd64_path, tmp_path):
    """After a restart the disk tier serves the codes: the reply is the one the same history gets
    from the entry in RAM (the same codes decode to the same floats), the prefix from disk. (Against
    a cold run whose prefill chunks fall elsewhere, 4-bit codes can turn OpenBLAS's chunk-dependent
    last bits into whole buckets on this random-weight model: LESSONS 23 -- the RAM test above runs
    the cold reference over the same chunks.)"""
    from mlxstack.engine.factory import disk_namespace_parts
    from tests.test_disk_cache import disk_settings
    from tests.test_engine import job

    kw = dict(kv_bits="4", kv_quant_scheme="turboquant", quantized_kv_start=96)
    first = build_engine(disk_settings(tiny_dense_hd64_path, tmp_path / "a", **kw))
    _, messages = run_turns(first, TURNS[:2])
    first.state.close()
    again = build_engine(disk_settings(tiny_dense_hd64_path, tmp_path / "a", **kw))
    assert again.state.disk.restored >= 2
    ram = build_engine(disk_settings(tiny_dense_hd64_path, tmp_path / "b", **kw))
    _, ram_messages = run_turns(ram, TURNS[:2])
    assert ram_messages == messages
    follow = messages + [{"role": "user", "content": TURNS[2]}]
    warm = again.run(job(follow, max_tokens=8, session="disk")[0])
    ref = ram.run(job(follow, max_tokens=8, session="disk")[0])
    assert warm.raw_text == ref.raw_text and warm.cached_tokens == ref.cached_tokens >= 96
    assert (warm.timings["cache_tier"], ref.timings["cache_tier"]) == ("disk", "ram")
    # the namespace names scheme and seed: another scheme or seed opens another one
    parts = disk_namespace_parts(again.loaded, again.renderer, again.state.layout, again.settings, again.state.kv_quant)
    assert parts["kv_quant"] == [4, 64, 96, "turboquant", SEED]
    again.state.close()
    ram.state.close()


# ------------------------------------------------------------------ batched decode (slab rows)
def _lone_step(live: LiveCache, k: mx.array, v: mx.array) -> None:
    """One forward's K / V into a lone sequence, as the engine feeds it: quantised before, and a
    forward across QUANTIZED_KV_START cut there (runner/generate.py feed)."""
    n, cut = k.shape[2], live.quant_room()
    if 0 < cut < n:
        _lone_step(live, k[..., :cut, :], v[..., :cut, :])
        _lone_step(live, k[..., cut:, :], v[..., cut:, :])
        return
    live.maybe_quantize()
    live.layers[0].update_and_fetch(k, v)
    live.advance(n)


def test_slab_rows_code_what_lone_layers_code_and_hand_back_the_same_codes():
    """Three sequences stepped together in one slab (one coded from the start, one crossing
    QUANTIZED_KV_START mid-batch, one never reaching it) hold, when they leave, exactly the floats
    and the codes each holds stepped alone -- through a multi-position forward (drafts), a rewind of
    rejected drafts, a rebuild into a smaller slab and a join from a lone coded layer."""
    from mlxstack.cache.slab import SlabKVCache, place_own_layers

    quant = KVQuant(4, 64, 20, "turboquant", SEED)
    rng = np.random.default_rng(3)
    heads, dim = 2, 64

    def kv(n, rows=1):
        return (mx.array(rng.standard_normal((rows, heads, n, dim)).astype(np.float32)),
                mx.array(rng.standard_normal((rows, heads, n, dim)).astype(np.float32)))

    lones = []
    for n in (24, 17, 3):                                # past the start, below it, far below it
        live = LiveCache([KVCache()], 0, quant)
        k, v = kv(min(n, quant.start))
        _lone_step(live, k, v)
        if n > quant.start:
            _lone_step(live, *kv(n - quant.start))
        lones.append(live)
    assert [type(lv.layers[0]).__name__ for lv in lones] == ["TurboQuantKVCache", "KVCache", "KVCache"]
    slab = SlabKVCache.empty(4, quant)
    for row, lv in enumerate(lones):
        place_own_layers([slab], row, lv.layers)
    for step in range(6):
        width = 3 if step == 2 else 1
        k, v = kv(width, rows=4)
        slab.update_and_fetch(k, v)
        for row, lv in enumerate(lones):
            _lone_step(lv, k[row:row + 1], v[row:row + 1])
        if width == 3:                                   # rows keep 1, 3 and 2 of the three positions
            for row, back in ((0, 2), (2, 1)):
                slab.rewind(row, back)
                lones[row].layers[0].trim(back)
                lones[row].depth -= back
            slab.rewind(3, 2)
            slab.settle([0, 1, 2])
    slab = slab.rebuilt(4, [2, 0, 1])                    # rows move: 2 -> 0, 0 -> 1, 1 -> 2
    order = [2, 0, 1]
    joiner = LiveCache([KVCache()], 0, quant)          # 30 tokens in full precision (an old entry)
    joiner.layers[0].update_and_fetch(*kv(30))
    joiner.advance(30)
    place_own_layers([slab], 3, joiner.layers)
    lones, order = lones + [joiner], order + [3]
    k, v = kv(1, rows=4)
    slab.update_and_fetch(k, v)
    for row, i in enumerate(order):
        _lone_step(lones[i], k[row:row + 1], v[row:row + 1])
    for row, i in enumerate(order):
        got, want = slab.take(row, whole=True), lones[i].layers[0]
        assert type(got) is type(want), (row, i)
        n = want.offset
        assert got.offset == n
        assert mx.array_equal(got.keys[..., :n, :], want.keys[..., :n, :]).item()
        assert mx.array_equal(got.values[..., :n, :], want.values[..., :n, :]).item()
        if isinstance(want, tq.TurboQuantKVCache):
            assert got.fp_head == want.fp_head
            for a, b in zip(got.coded(n), want.coded(n)):
                assert mx.array_equal(a, b).item(), (row, i)
    # coding starts at exactly the start: 17 + 1 + 1 = 19, then three positions cross 20 -- coded
    # from 20 on, in the slab's one forward as in the lone run's two chunks; a layer already past the
    # start without codes (the joiner: a full-precision checkout of 30) from where it is
    assert [lones[i].layers[0].fp_head for i in (0, 1, 3)] == [20, 20, 30]
    assert type(lones[2].layers[0]) is KVCache                                  # never reached the start


@pytest.mark.parametrize("start", [0, 40])
def test_turboquant_rows_decode_batched_and_equal_each_request_alone(tiny_dense_hd64_path, start):
    """KV_QUANT_SCHEME=turboquant batches (uniform KV_BITS does not): four requests decoded together
    reply as each does alone, store coded entries, and a warm turn on one of them equals a cold run."""
    from mlxstack.runner.batch import batching_support
    from tests.test_batching import run_batched
    from tests.test_engine import job

    eng = tq_engine(tiny_dense_hd64_path, "4", start)
    assert batching_support(eng) == (True, "")
    uniform = build_engine(engine_settings(tiny_dense_hd64_path, kv_bits="4", quantized_kv_start=start))
    assert batching_support(uniform)[0] is False
    prompts = [[{"role": "user", "content": f"list {i} things about {topic}"}]
               for i, topic in enumerate(["rivers", "rust", "tea", "maps"])]
    jobs = [job(p, max_tokens=24, session=f"tq{i}")[0] for i, p in enumerate(prompts)]
    outs, sizes = run_batched(eng, jobs)
    assert max(sizes) == 4
    alone = tq_engine(tiny_dense_hd64_path, "4", start, cache=False)
    refs = [alone.run(job(p, max_tokens=24, session=f"r{i}")[0]) for i, p in enumerate(prompts)]
    assert [o.raw_text for o in outs] == [r.raw_text for r in refs]
    kinds = {s.kind for e in eng.state.kv.index.entries() for s in e.payload.layers}
    assert kinds == {"turboquant"}
    follow = prompts[1] + [{"role": "assistant", "content": outs[1].text}, {"role": "user", "content": "and then?"}]
    warm = eng.run(job(follow, max_tokens=12, session="tq1")[0])
    cold = alone.run(job(follow, max_tokens=12, session="c1")[0])
    assert warm.cached_tokens > start and warm.raw_text == cold.raw_text
