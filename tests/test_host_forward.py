"""The host path for decode-sized forwards (backends/cpu/host_forward.py), reached as the CPU
backend's ``forward_rows`` / ``feed_rows`` through runner/forward.py (nothing patched on mlx-lm's
class: ``model(...)`` is always mlx-lm's own): RoPE bit for bit MLX's own, logits and KV within
float rounding of mlx-lm's forward for every cache layout it takes -- the backend's counter
proving the host path computed them, not a silent fall back to the model -- nothing taken that it
cannot do, a model whose weights change falls back at once, and an engine whose batched replies
are the same with it on and off."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlxstack.cache.prefixed_kv import PrefixedKVCache
from mlxstack.cache.slab import SlabKVCache
from mlxstack.backends.cpu import host_forward as hf
from mlxstack.backends.cpu.backend import CpuBackend
from mlxstack.runner.forward import attach, backend_of, feed_rows, forward
from tests.conftest import blas_preload_missing, build_engine, engine_settings
from tests.test_batching import run_batched
from tests.test_engine import job


# The host path runs only with an optimised BLAS preloaded for MLX (its products are that BLAS's
# sgemm); without one it is off and every test of what it computes skips, saying why
NO_BLAS = blas_preload_missing()
needs_blas = pytest.mark.skipif(NO_BLAS is not None, reason=NO_BLAS or "")


def tiny_llama(seed=0, **over):
    """A random-weight mlx-lm Llama in memory: 3 layers, 4 query heads over 2 KV heads."""
    mx.random.seed(seed)
    args = dict(model_type="llama", hidden_size=64, num_hidden_layers=3, intermediate_size=96,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97,
                rope_theta=10000.0)
    args.update(over)
    model = llama.Model(llama.ModelArgs(**args))
    # norms away from 1 and larger weights: the outputs depend on every term
    for block in model.model.layers:
        for norm in (block.input_layernorm, block.post_attention_layernorm):
            norm.weight = mx.random.uniform(0.5, 1.5, norm.weight.shape)
    mx.eval(model.parameters())
    return model


def mlx_forward(model, tokens, cache):
    """mlx-lm's own forward: the model's ``__call__``, never the host path."""
    return model(tokens, cache=cache)


def host(model):
    """The host path installed on ``model`` and a CPU backend attached to it (as engine/factory.py
    does): True when the path applies."""
    ok = hf.install(model)
    attach(model, CpuBackend())
    return ok


def ours(model, tokens, cache):
    """The forward the runner runs: the attached backend's ``forward_rows``, or the model's own."""
    return forward(model, tokens, cache)


def close(a, b, tol=2e-5):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max()), np.abs(a - b).max()


@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("dims", [32, 16])
@pytest.mark.parametrize("offset", [0, 4093, [7, 0, 5000]])
def test_rope_is_bit_for_bit_mlx(traditional, dims, offset):
    rope = nn.RoPE(dims, traditional=traditional, base=100000.0)
    B, H, T = 3, 5, 4
    x = mx.random.normal((B, H, T, 32), key=mx.random.key(3))
    off = mx.array(offset) if isinstance(offset, list) else offset
    want = np.asarray(rope(x, offset=off))
    got = hf._rotate(np.asarray(x).transpose(0, 2, 1, 3), hf._rope_table(rope, off, B, T)).transpose(0, 2, 1, 3)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("over", [{}, {"tie_word_embeddings": False}, {"attention_bias": True, "mlp_bias": True},
                                  {"rope_traditional": True, "head_dim": 32}])
@needs_blas
def test_same_logits_and_kv_as_mlx_lm(over):
    model = tiny_llama(**over)
    assert host(model) and hf.enabled(model)
    backend = backend_of(model)
    prompt = mx.array([[5, 17, 3, 88, 41, 9]])
    mine, theirs = [KVCache() for _ in range(3)], [KVCache() for _ in range(3)]
    close(ours(model, prompt, mine), mlx_forward(model, prompt, theirs))
    for tok in (12, 60, 2):
        step = mx.array([[tok]])
        close(ours(model, step, mine), mlx_forward(model, step, theirs))
    assert backend.host_calls == 4              # every call above ran on the host path, none fell back
    for a, b in zip(mine, theirs):
        assert a.offset == b.offset == 9
        close(a.keys[..., :9, :], b.keys[..., :9, :])
        close(a.values[..., :9, :], b.values[..., :9, :])


@needs_blas
def test_batched_layouts_match_mlx_lm():
    """Left-padded batch rows (mlx-lm's BatchKVCache), a slab with ragged ends after a rewind
    (speculation), a shared prefix held once, a prefixed single cache: the same as mlx-lm."""
    model = tiny_llama(1)
    assert host(model)
    rows = mx.array([[3, 9, 4, 6], [8, 1, 2, 3], [70, 71, 72, 73]])

    def run(forward, make):
        cache = make()
        out = [forward(model, rows, cache)]
        for toks in ([[4], [5], [6]], [[7, 8], [9, 10], [11, 12]]):
            out.append(forward(model, mx.array(toks), cache))
        return out, cache

    for make in (lambda: [BatchKVCache([1, 0, 2]) for _ in range(3)], lambda: [SlabKVCache([2, 0, 1]) for _ in range(3)]):
        got, _ = run(ours, make)
        want, _ = run(mlx_forward, make)
        for a, b in zip(got, want):
            close(a, b)

    def ragged(forward):
        cache = [SlabKVCache([0, 0, 0]) for _ in range(3)]
        forward(model, rows, cache)
        for layer in cache:
            layer.rewind(1, 2)
            layer.settle([0, 1, 2])
        return forward(model, mx.array([[1, 2], [3, 4], [5, 6]]), cache)

    close(ragged(ours), ragged(mlx_forward))
    taken = backend_of(model).host_calls
    assert taken == 2 * 3 + 2                   # both layouts' three calls, the ragged pair: all on the host path

    def prefixed(forward):
        base = [KVCache() for _ in range(3)]
        forward(model, mx.array([[11, 12, 13, 14, 15]]), base)
        cache = [PrefixedKVCache((c.keys, c.values, 5)) for c in base]
        return forward(model, mx.array([[16, 17]]), cache), forward(model, mx.array([[18]]), cache)

    for a, b in zip(prefixed(ours), prefixed(mlx_forward)):
        close(a, b)
    assert backend_of(model).host_calls == taken + 3


@needs_blas
def test_takes_only_what_it_can_do():
    model = tiny_llama(2)
    fresh = lambda: [KVCache() for _ in range(3)]  # noqa: E731
    assert hf.forward(model, mx.array([[1, 2]]), fresh()) is None          # not installed
    assert host(model)
    assert hf.forward(model, mx.array([[1, 2]]), fresh()) is not None
    assert hf.forward(model, mx.array([list(range(hf.MAX_POSITIONS + 1))]), fresh()) is None   # a prefill
    assert hf.forward(model, mx.array([[1]]), None) is None
    assert hf.forward(model, mx.array([[1]]), fresh(), input_embeddings=mx.zeros((1, 1, 64))) is None
    assert hf.forward(model, mx.array([[1]]), [QuantizedKVCache() for _ in range(3)]) is None   # groups of 64, heads of 16
    assert hf.forward(model, mx.array([[1]]), [RotatingKVCache(max_size=8) for _ in range(3)]) is None
    assert hf.forward(model, mx.array([[1]]), fresh()[:2]) is None
    # a long call still runs (mlx-lm's forward) through the same entry point, not on the host path
    backend = backend_of(model)
    long = mx.array([list(range(20))])
    assert backend.forward_rows(model, long, fresh()) is None
    close(ours(model, long, fresh()), mlx_forward(model, long, fresh()))
    assert backend.host_calls == 0
    ours(model, mx.array([[1, 2]]), fresh())
    assert backend.host_calls == 1


@needs_blas
def test_nothing_is_patched_on_the_model_class():
    """The host path is the attached backend's: mlx-lm's class keeps its own ``__call__``, a model
    called directly runs mlx-lm's forward (the backend never sees it), and a model the backend was
    not attached to runs plainly through the runner's door too."""
    model = tiny_llama(8)
    assert host(model)
    assert llama.Model.__call__.__module__ == llama.__name__ and llama.Model.__call__.__qualname__ == "Model.__call__"
    assert "__call__" not in model.__dict__
    backend = backend_of(model)
    model(mx.array([[1, 2]]), cache=[KVCache() for _ in range(3)])
    assert backend.host_calls == 0
    other = tiny_llama(8)
    assert hf.install(other) and backend_of(other) is None               # a plan, but no backend attached
    close(ours(other, mx.array([[1, 2]]), [KVCache() for _ in range(3)]),
          mlx_forward(other, mx.array([[1, 2]]), [KVCache() for _ in range(3)]), tol=0)
    assert backend.host_calls == 0


@needs_blas
def test_models_it_does_not_take():
    assert not hf.install(tiny_llama(3, layer_types=["full_attention", "sliding_attention", "full_attention"],
                                     sliding_window=4))
    quantised = tiny_llama(3)
    nn.quantize(quantised, group_size=32, bits=4)
    assert not hf.install(quantised) and not hf.enabled(quantised)
    from mlx_lm.models import qwen3

    other = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=1, intermediate_size=96,
                                        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                        vocab_size=97, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
                                        tie_word_embeddings=True))
    assert not hf.install(other)


@needs_blas
def test_replaced_weights_fall_back_at_once():
    """Weights swapped after install (a reload, an adapter): never the old views -- mlx-lm's
    forward from then on, with the new weights."""
    model = tiny_llama(4)
    assert host(model)
    proj = model.model.layers[1].mlp.down_proj
    proj.weight = proj.weight * 3.0
    mx.eval(proj.weight)
    tokens = mx.array([[4, 5, 6]])
    got = ours(model, tokens, [KVCache() for _ in range(3)])
    assert not hf.enabled(model)
    close(got, mlx_forward(model, tokens, [KVCache() for _ in range(3)]), tol=0)


@needs_blas
@pytest.mark.slow
def test_batched_replies_are_the_same_on_and_off(embedded_model_path):
    """The embedded model (SmolLM2, a Llama), 4 agents under one system prompt decoding together
    (a shared prefix in the slab, speculation on): the replies with the host path equal mlx-lm's
    forward token for token, and the host path took the decode steps."""
    system = {"role": "system", "content": "You are a careful assistant. " * 60}
    convos = [[system, {"role": "user", "content": f"Tell me about the number {n}."}] for n in (3, 17, 42, 99)]
    eng = build_engine(engine_settings(embedded_model_path, prompt_cache_max_entries_global=0))
    model = eng.loaded.model
    assert hf.enabled(model)
    backend = backend_of(model)
    assert backend is not None and backend.name == "cpu"
    plan = hf._plan_of(model)
    shapes = []
    original = hf.forward

    def counted(m, inputs, cache, input_embeddings=None):
        out = original(m, inputs, cache, input_embeddings)
        if out is not None:
            shapes.append(tuple(inputs.shape))
        return out

    def replies(tag):
        jobs = [job(m, max_tokens=12, session=f"{tag}{i}")[0] for i, m in enumerate(convos)]
        return [o.text for o in run_batched(eng, jobs, budget=512)[0]]

    hf.forward = counted
    try:
        before = backend.host_calls
        on = replies("on")
        assert backend.host_calls > before
        hf._set_plan(model, None)
        off = replies("off")
    finally:
        hf.forward = original
        hf._set_plan(model, plan)
    assert (4, 1) in shapes                      # 4 rows, one token each: the decode steps
    assert on == off and all(on)


@needs_blas
def test_replaced_bias_falls_back():
    model = tiny_llama(5, attention_bias=True)
    assert host(model)
    q = model.model.layers[0].self_attn.q_proj
    q.bias = q.bias + 1.0
    mx.eval(q.bias)
    tokens = mx.array([[4, 5]])
    close(ours(model, tokens, [KVCache() for _ in range(3)]), mlx_forward(model, tokens, [KVCache() for _ in range(3)]), tol=0)
    assert not hf.enabled(model)


def _prompted(model, tokens):
    cache = [KVCache() for _ in range(3)]
    mlx_forward(model, mx.array([tokens]), cache)
    return cache


@needs_blas
def test_feed_rows_on_each_rows_own_cache():
    """Three rows at different depths (one holding its prefix by reference) fed 3, 1 and 2 tokens
    in one pass on their own layers: the KV each row's own mlx-lm forward writes, in place."""
    model = tiny_llama(6)
    assert host(model)
    prompts, feeds = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]], [[20, 21, 22], [23], [24, 25]]

    def rows():
        out = [_prompted(model, p) for p in prompts]
        out[2] = [PrefixedKVCache((c.keys, c.values, 6)) for c in out[2]]
        return out

    mine, theirs = rows(), rows()
    assert feed_rows(model, mine, feeds)                  # the runner's door: the backend's feed_rows
    assert backend_of(model).rows_fed == 1
    for cache, feed in zip(theirs, feeds):
        mlx_forward(model, mx.array([feed]), cache)
    for a_row, b_row, p, f in zip(mine, theirs, prompts, feeds):
        for a, b in zip(a_row, b_row):
            assert a.offset == b.offset == len(p) + len(f)
            n = a.offset - (6 if isinstance(a, PrefixedKVCache) else 0)
            close(a.keys[..., :n, :], b.keys[..., :n, :])
            close(a.values[..., :n, :], b.values[..., :n, :])
    step = mx.array([[3]])
    for a_row, b_row in zip(mine, theirs):
        close(ours(model, step, a_row), mlx_forward(model, step, b_row))


@needs_blas
def test_feed_rows_declines_or_puts_everything_back(monkeypatch):
    model = tiny_llama(7)
    assert host(model)
    assert not hf.feed_rows(model, [_prompted(model, [1, 2])], [list(range(hf.MAX_POSITIONS + 1))])
    assert not hf.feed_rows(model, [[BatchKVCache([0]) for _ in range(3)]], [[1]])
    caches = [_prompted(model, [1, 2, 3]), _prompted(model, [4, 5])]
    before = [[(c.keys, c.offset) for c in row] for row in caches]
    calls = []
    real = hf._attend_rows

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 4:                       # the second layer's second row
            raise RuntimeError("injected")
        return real(*a, **k)

    monkeypatch.setattr(hf, "_attend_rows", failing)
    with pytest.raises(RuntimeError, match="injected"):
        hf.feed_rows(model, caches, [[7, 8], [9]])
    assert all(c.keys is k and c.offset == o for row, was in zip(caches, before) for c, (k, o) in zip(row, was))
    monkeypatch.setattr(hf, "_attend_rows", real)
    assert hf.feed_rows(model, caches, [[7, 8], [9]])
    assert [c.offset for c in caches[0]] == [5] * 3 and [c.offset for c in caches[1]] == [3] * 3


@needs_blas
def test_a_positions_kv_is_the_same_bits_however_its_prompt_was_cut():
    """With the native products and the native attention kernel, the host path is batch-invariant:
    64 tokens fed in calls of 16, one at a time or cut anywhere leave the same bits in every
    layer's K / V, so the CPU backend names 16 as its exact call size (the engine feeds
    TurboQuant prompts in such calls: LESSONS 79); with sgemm's products it names none."""
    from mlxstack.backends.cpu import kernels as cpu_kernels
    from mlxstack.backends.cascade import native_in_use, use_native

    products = hf.products_in_use()
    if cpu_kernels.native_kernel() is None or not hf.use_native_products(True):
        hf.use_products(products)
        pytest.skip("no C compiler here: the native kernels are not built")
    model = tiny_llama(11)
    assert host(model)
    was = native_in_use()
    use_native(cpu_kernels.native_kernel())
    try:
        assert backend_of(model).exact_positions(model) == hf.MAX_POSITIONS
        tokens = [(7 * i + 3) % 97 for i in range(64)]

        def fed(cuts):
            cache = [KVCache() for _ in model.layers]
            at = 0
            for n in cuts:
                ours(model, mx.array([tokens[at:at + n]]), cache)
                at += n
            assert at == 64
            return [(c.keys[..., :64, :], c.values[..., :64, :]) for c in cache]

        calls = backend_of(model).host_calls
        ref = fed([16] * 4)
        for cuts in ([1] * 64, [5, 11, 16, 7, 9, 16], [16, 15, 1, 16, 16], [3] * 21 + [1]):
            for (k, v), (k2, v2) in zip(ref, fed(cuts)):
                assert mx.array_equal(k, k2).item() and mx.array_equal(v, v2).item(), cuts
        assert backend_of(model).host_calls - calls == 4 + 64 + 6 + 5 + 22   # every call on the host path
        hf.use_native_products(False)
        assert backend_of(model).exact_positions(model) is None
    finally:
        hf.use_products(products)
        if not was:
            use_native(None)


def _codes_of(cache, n):
    return [x[..., :n, :] for c in cache for t in (c.keys, c.values) for x in t]


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_uniform_kv_codes_are_the_same_bytes_however_the_prompt_was_cut(bits):
    """KV_BITS uniform on the host path: a ``QuantizedKVCache`` layer is written by its own
    ``update_and_fetch`` (mx.quantize per token) and attended through the native kernel over the
    floats mx.dequantize gives back -- so, as for float layers, 64 tokens fed in calls of 16, one at
    a time or cut anywhere leave the same codes, scales and biases in every layer, every call on the
    host path; a step over the same codes is within float rounding of mlx-lm's forward (its quantised
    attention), and a model whose heads the groups do not divide is not taken."""
    from mlxstack.backends.cpu import kernels as cpu_kernels
    from mlxstack.backends.cascade import native_in_use, use_native

    products = hf.products_in_use()
    if cpu_kernels.native_kernel() is None or not hf.use_native_products(True):
        hf.use_products(products)
        pytest.skip("no C compiler here: the native kernels are not built")
    model = tiny_llama(12, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    assert host(model)
    was = native_in_use()
    use_native(cpu_kernels.native_kernel())
    fresh = lambda: [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]  # noqa: E731
    try:
        assert backend_of(model).exact_positions(model) == hf.MAX_POSITIONS
        tokens = [(5 * i + 2) % 97 for i in range(64)]

        def fed(cuts):
            cache, at = fresh(), 0
            for n in cuts:
                ours(model, mx.array([tokens[at:at + n]]), cache)
                at += n
            assert at == 64
            return _codes_of(cache, 64)

        calls = backend_of(model).host_calls
        ref = fed([16] * 4)
        for cuts in ([1] * 64, [5, 11, 16, 7, 9, 16], [3] * 21 + [1]):
            assert all(mx.array_equal(a, b).item() for a, b in zip(ref, fed(cuts))), cuts
        assert backend_of(model).host_calls - calls == 4 + 64 + 6 + 22
        # the same codes in both caches (a copy), then one step each way: float rounding apart
        mine = fresh()
        ours(model, mx.array([tokens[:12]]), mine)
        theirs = fresh()
        for a, b in zip(theirs, mine):
            a.keys, a.values = tuple(mx.array(x) for x in b.keys), tuple(mx.array(x) for x in b.values)
            a.offset = b.offset
        close(ours(model, mx.array([[3]]), mine), mlx_forward(model, mx.array([[3]]), theirs))
        assert backend_of(model).host_calls - calls == 4 + 64 + 6 + 22 + 2
        narrow = [QuantizedKVCache(group_size=128, bits=bits) for _ in model.layers]     # a group wider than a head
        assert hf.forward(model, mx.array([[1]]), narrow) is None
    finally:
        hf.use_products(products)
        if not was:
            use_native(None)
