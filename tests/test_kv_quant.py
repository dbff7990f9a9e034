"""KV quantisation (issue 11, KV_BITS): the live cache switches to mlx-lm's QuantizedKVCache at
exactly QUANTIZED_KV_START tokens, stored entries keep K/V quantised, and a hit at or past the
start is the *same quantised computation* as a cold run -- greedy tokens exact -- and an entry keeps
full precision below the start, so a reuse there is exact too (issue 23 #5). Bytes per token and
the round-trip error of quantisation are measured here.
"""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlxstack.cache.kv_ops import LiveCache, capture, checkout
from mlxstack.cache.layer_kinds import KVQuant
from mlxstack.runner.generate import feed
from tests.conftest import build_engine, engine_settings
from tests.test_disk_cache import run_turns
from tests.test_model_families import TURNS

pytestmark = pytest.mark.slow  # quantised parity sweeps (docs/testing.md#tiers)


def q_engine(path, bits="8", start=0, cache=True):
    extra = {} if cache else {"prompt_cache_max_entries_global": 0}
    return build_engine(engine_settings(path, kv_bits=bits, kv_group_size=64, quantized_kv_start=start, **extra))


@pytest.mark.parametrize("bits,start", [("8", 0), ("4", 0), ("8", 96)])
def test_quantised_hits_equal_a_quantised_cold_run(tiny_dense_hd64_path, bits, start):
    warm, cold = q_engine(tiny_dense_hd64_path, bits, start), q_engine(tiny_dense_hd64_path, bits, start, cache=False)
    assert warm.state.kv_quant == KVQuant(int(bits), 64, start)
    w, _ = run_turns(warm, TURNS)
    c, _ = run_turns(cold, TURNS)
    assert [o.raw_text for o in w] == [o.raw_text for o in c]
    hits = [o for o in w[1:] if o.cached_tokens]
    assert len(hits) == 3 and all(o.cached_tokens >= start for o in hits)
    for e in warm.state.kv.index.entries():         # full precision below the start, as cold
        assert {s.kind for s in e.payload.layers} == ({"quantized"} if e.depth > start else {"kv"})


def test_the_switch_happens_at_exactly_the_start(tiny_dense_hd64_path):
    model, _ = load(str(tiny_dense_hd64_path))
    q = KVQuant(8, 64, 40)
    for step in (7, 64):                         # whatever the chunking, the switch is at 40
        live = LiveCache(make_prompt_cache(model), 0, q)
        feed(model, live, list(range(100, 139)), step)
        assert live.depth == 39 and all(isinstance(c, KVCache) for c in live.layers)
        feed(model, live, [500], step)
        assert live.depth == 40 and all(isinstance(c, QuantizedKVCache) for c in live.layers)


def test_bytes_per_token_and_round_trip_error_per_layer(tiny_dense_hd64_path):
    model, _ = load(str(tiny_dense_hd64_path))
    prompt = list(range(1000, 1300))
    full = LiveCache(make_prompt_cache(model))
    feed(model, full, prompt, 64)
    ref = capture(full)
    for bits, max_ratio in ((8, 0.30), (4, 0.17)):   # float32 K/V: 8-bit ~ 1.125/4, 4-bit ~ 0.625/4
        live = LiveCache(make_prompt_cache(model), 0, KVQuant(bits, 64, 0))   # quantised from token 0
        feed(model, live, prompt, 64)
        stored = capture(live)
        assert {s.kind for s in stored.layers} == {"quantized"} and stored.depth == 300
        assert stored.nbytes / ref.nbytes <= max_ratio, (bits, stored.nbytes, ref.nbytes)
        # Layer 0's K/V do not depend on attention, so they are exactly the quantised reference;
        # deeper layers attended over quantised K/V (a different computation).
        for full_kv, q in zip(ref.layers[0].arrays, stored.layers[0].arrays[:2]):
            assert all(bool(mx.array_equal(a, b).item())
                       for a, b in zip(q, mx.quantize(full_kv, group_size=64, bits=bits)))
            back = mx.dequantize(*q, group_size=64, bits=bits)
            groups = full_kv.reshape(*full_kv.shape[:-1], -1, 64)
            step = (groups.max(axis=-1) - groups.min(axis=-1)) / (2**bits - 1)
            diff = mx.abs(back - full_kv).reshape(groups.shape)
            # mx.quantize's affine groups (scale and bias rounded themselves) keep every value
            # within one quantisation step of the original, and the mean well under half a step
            assert bool(mx.all(diff.max(axis=-1) <= step * 1.01).item()), bits
            assert float((diff.mean(axis=-1) / step).max().item()) < 0.5, bits


def _head(a, n):
    return tuple(x[..., :n, :] for x in a) if isinstance(a, (tuple, list)) else a[..., :n, :]


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and bool(mx.array_equal(a, b).item())


def test_a_stored_entry_holds_what_a_cold_run_holds_on_both_sides_of_the_start(tiny_dense_hd64_path):
    # issue 23 #5: entries used to be quantised whole, so a hit below the start was dequantised
    # (approximate) while a cold run is full precision there. Now: full precision below, exact.
    model, _ = load(str(tiny_dense_hd64_path))
    q = KVQuant(8, 64, 100)
    tokens = list(range(2000, 2150))
    live = LiveCache(make_prompt_cache(model), 0, q)
    feed(model, live, tokens, 10)      # the same chunk rows as every cold run below (LESSONS §23)
    state = capture(live)
    assert {s.kind for s in state.layers} == {"quantized"} and dict(state.layers[0].params)["fp_head"] == 100
    for depth in (60, 90, 100, 120, 150):
        cold = LiveCache(make_prompt_cache(model), 0, q)
        feed(model, cold, tokens[:depth], 10)
        hit = checkout(state, depth, q)
        assert hit.depth == depth and hit.quantized == cold.quantized == (depth >= 100)
        for h, c in zip(hit.layers, cold.layers):
            assert type(h) is type(c) and h.offset == c.offset == depth, depth
            assert _same(_head(h.keys, depth), _head(c.keys, depth)), depth
            assert _same(_head(h.values, depth), _head(c.values, depth)), depth
        nxt = mx.array([[7, 8, 9]], dtype=mx.int32)     # and the next forward is the same computation
        assert bool(mx.array_equal(model(nxt, cache=hit.layers), model(nxt, cache=cold.layers)).item()), depth
    below = capture(live, 80) if live.floor <= 80 else None
    assert below is not None and {s.kind for s in below.layers} == {"kv"}
    assert below.nbytes == sum(s.nbytes for s in capture(checkout(state, 80, q)).layers)


def test_a_hit_below_the_start_from_a_deeper_entry_equals_a_cold_run(tiny_dense_hd64_path):
    # Two conversations share a system prompt shorter than the start; the first one's entries run
    # past it. The second one reuses the shared part (below the start) -- full precision, exact.
    warm = q_engine(tiny_dense_hd64_path, "4", 96)
    cold = q_engine(tiny_dense_hd64_path, "4", 96, cache=False)
    w1, _ = run_turns(warm, TURNS[:2], session="a")
    assert max(e.depth for e in warm.state.kv.index.entries()) > 96
    other = ["A different opening question about rivers and the sea."] + TURNS[1:3]
    w, _ = run_turns(warm, other, session="b")
    c, _ = run_turns(cold, other, session="b")
    assert [o.raw_text for o in w] == [o.raw_text for o in c]
    assert 16 <= w[0].cached_tokens < 96          # the shared system prompt, below the start


def test_models_that_cannot_attend_over_quantised_kv_run_without_it(tiny_kind_paths, tiny_dense_path):
    # gpt_oss attention uses sinks (mlx-lm's quantised SDPA refuses them); the dense fixture's
    # head_dim 16 is narrower than any quantisation group: both serve, unquantised, with a warning.
    for path in (tiny_kind_paths("gpt_oss"), tiny_dense_path):
        eng = build_engine(engine_settings(path, kv_bits="8", quantized_kv_start=0))
        assert eng.state.kv_quant is None
        out, _ = run_turns(eng, TURNS[:2])
        assert out[1].cached_tokens > 0


def test_quantised_entries_with_a_full_precision_head_survive_the_disk_tier(tiny_dense_hd64_path, tmp_path):
    from tests.test_disk_cache import disk_settings
    from tests.test_engine import job

    kw = dict(kv_bits="4", kv_group_size=64, quantized_kv_start=96)
    first = build_engine(disk_settings(tiny_dense_hd64_path, tmp_path, **kw))
    _, messages = run_turns(first, TURNS[:2])
    first.state.close()
    again = build_engine(disk_settings(tiny_dense_hd64_path, tmp_path, **kw))
    assert again.state.disk.restored >= 2
    cold = q_engine(tiny_dense_hd64_path, "4", 96, cache=False)
    _, cold_messages = run_turns(cold, TURNS[:2])
    tiers = []
    for follow in (messages[:2] + [{"role": "user", "content": "Something else, briefly."}],   # below the start
                   messages + [{"role": "user", "content": TURNS[2]}]):                       # past it
        warm = again.run(job(follow, max_tokens=8, session="disk")[0])
        ref = cold.run(job(follow, max_tokens=8, session="disk")[0])
        assert warm.raw_text == ref.raw_text and warm.cached_tokens >= 16
        tiers.append((warm.timings["cache_tier"], warm.cached_tokens >= 96))
    assert tiers[0] == ("disk", False) and tiers[1][1]       # the second may find the promoted entry
    again.state.close()


@pytest.mark.parametrize("bits,start", [("4", 0), ("8", 16)])
def test_on_a_batch_invariant_backend_every_stored_uniform_code_is_a_cold_feeds(embedded_model_path, bits, start):
    """The embedded Llama on the CPU backend (host path, native products and attention): uniform
    KV_BITS layers are on the batch-invariant path (attention over mx.dequantize's floats in the
    native kernel) and prompts are fed in calls of its exact size, so three sub-agents under one
    system prompt -- the second and third reusing the first's entry and prefilling their own rest --
    and a next turn reusing prompt and decode-computed reply store codes, scales, biases and
    full-precision head equal, byte for byte, to a cold feed of the same tokens, and reply as lone
    cold runs. Measured without it (mlx-lm's quantised attention, prefill chunks of 512): every
    entry ~1/3 of its code arrays' elements apart from a cold feed, and at 4 bits a reuse's reply
    unlike its cold run's."""
    from mlxstack.cache.kind_base import FP_HEAD
    from mlxstack.cache.marks import marked
    from mlxstack.runner.forward import exact_positions
    from tests.test_engine import job
    from tests.test_shared_prefix import _messages

    kw = dict(kv_bits=bits, quantized_kv_start=start)
    eng = build_engine(engine_settings(embedded_model_path, **kw))
    model, quant = eng.loaded.model, eng.state.kv_quant
    if exact_positions(model, quant) is None:
        pytest.skip("no batch-invariant path here (no C compiler: the native kernels are not built)")
    outs = [eng.run(job(_messages(i), max_tokens=12, session=f"s{i}")[0]) for i in range(3)]
    follow = _messages(1) + [{"role": "assistant", "content": outs[1].text}, {"role": "user", "content": "And module 7?"}]
    outs.append(eng.run(job(follow, max_tokens=12, session="s1")[0]))
    assert outs[0].cached_tokens == 0 and all(o.cached_tokens > 200 for o in outs[1:])
    entries = eng.state.kv.index.entries()
    assert len(entries) == 4
    for e in entries:
        assert {s.kind for s in e.payload.layers} == {"quantized"}
        cold = LiveCache(make_prompt_cache(model), 0, quant)
        feed(model, cold, [int(t) for t in e.model_tokens], 512)
        hit = checkout(e.payload, e.depth, quant)
        for h, c in zip(hit.layers, cold.layers):
            assert type(h) is type(c) is QuantizedKVCache and h.offset == c.offset == e.depth
            assert _same(_head(h.keys, e.depth), _head(c.keys, e.depth)), e.depth
            assert _same(_head(h.values, e.depth), _head(c.values, e.depth)), e.depth
            head, cold_head = marked(h, FP_HEAD), marked(c, FP_HEAD)
            assert (head is None) == (cold_head is None) == (start == 0)
            if head is not None:
                assert _same(list(head), list(cold_head))
    alone = build_engine(engine_settings(embedded_model_path, prompt_cache_max_entries_global=0, **kw))
    solo = [alone.run(job(_messages(i), max_tokens=12, session=f"a{i}")[0]) for i in range(3)]
    solo.append(alone.run(job(follow, max_tokens=12, session="a1")[0]))
    assert [o.raw_text for o in outs] == [o.raw_text for o in solo]
