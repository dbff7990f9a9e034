"""KV quantisation (issue 11, KV_BITS): the live cache switches to mlx-lm's QuantizedKVCache at
exactly QUANTIZED_KV_START tokens, stored entries keep K/V quantised, and a hit at or past the
start is the *same quantised computation* as a cold run -- greedy tokens exact. Bytes per token
and per-layer round-trip error are measured here; a reuse below the start is dequantised and only
approximate (agreement is reported by scripts/bench_kv_quant.py, not asserted to be exact).
"""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlxstack.cache.kv_ops import LiveCache, capture, checkout
from mlxstack.cache.layer_kinds import KVQuant
from mlxstack.runtime.generate import feed
from tests.conftest import build_engine, engine_settings
from tests.test_disk_cache import run_turns
from tests.test_model_families import TURNS


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
    for e in warm.state.prompt_cache.entries():
        assert {s.kind for s in e.payload.layers} == {"quantized"}


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
        live = LiveCache(make_prompt_cache(model), 0, KVQuant(bits, 64, 10**9))   # live stays full precision
        feed(model, live, prompt, 64)
        stored = capture(live)                        # ... and is quantised at capture
        assert stored.nbytes / ref.nbytes <= max_ratio, (bits, stored.nbytes, ref.nbytes)
        for i, (r, s) in enumerate(zip(ref.layers, stored.layers)):
            for full_kv, q in zip(r.arrays, s.arrays):
                back = mx.dequantize(*q, group_size=64, bits=bits)
                groups = full_kv.reshape(*full_kv.shape[:-1], -1, 64)
                step = (groups.max(axis=-1) - groups.min(axis=-1)) / (2**bits - 1)
                diff = mx.abs(back - full_kv).reshape(groups.shape)
                # mx.quantize's affine groups (scale and bias rounded themselves) keep every value
                # within one quantisation step of the original, and the mean well under half a step
                assert bool(mx.all(diff.max(axis=-1) <= step * 1.01).item()), (bits, i)
                assert float((diff.mean(axis=-1) / step).max().item()) < 0.5, (bits, i)


def test_a_stored_entry_below_the_start_is_dequantised_into_a_full_precision_cache(tiny_dense_hd64_path):
    model, _ = load(str(tiny_dense_hd64_path))
    q = KVQuant(8, 64, 200)
    live = LiveCache(make_prompt_cache(model), 0, q)
    feed(model, live, list(range(2000, 2150)), 50)
    state = capture(live)
    assert {s.kind for s in state.layers} == {"quantized"}
    below = checkout(state, 120, q)
    assert all(isinstance(c, KVCache) for c in below.layers) and below.depth == 120 and not below.quantized
    at_or_past = checkout(state, 150, KVQuant(8, 64, 100))
    assert all(isinstance(c, QuantizedKVCache) for c in at_or_past.layers) and at_or_past.quantized


def test_models_that_cannot_attend_over_quantised_kv_run_without_it(tiny_kind_paths, tiny_dense_path):
    # gpt_oss attention uses sinks (mlx-lm's quantised SDPA refuses them); the dense fixture's
    # head_dim 16 is narrower than any quantisation group: both serve, unquantised, with a warning.
    for path in (tiny_kind_paths("gpt_oss"), tiny_dense_path):
        eng = build_engine(engine_settings(path, kv_bits="8", quantized_kv_start=0))
        assert eng.state.kv_quant is None
        out, _ = run_turns(eng, TURNS[:2])
        assert out[1].cached_tokens > 0
