"""The native decode-attention kernel (backends/cpu/native_attention.py): the same softmax as the MLX
ops path for every input shape the attention hook hands it, per-row results independent of the
batch, None for what it does not take, no kernel where it cannot build, and an engine whose
batched replies are the same with it on and off."""
from __future__ import annotations

import mlx.core as mx
import pytest

from mlxstack.backends.cpu import kernels as cpu_kernels, native_attention
from mlxstack.backends import cascade as sa
from mlxstack.backends.cascade import Part, attend_parts_mlx
from tests.conftest import build_engine, engine_settings
from tests.test_batching import run_batched
from tests.test_engine import job

attend = cpu_kernels.native_kernel()
needs_kernel = pytest.mark.skipif(attend is None, reason="no C compiler here: the kernel is not built")


def _rand(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


def _close(parts, q, scale=0.125):
    got = attend(q, parts, scale)
    assert got is not None
    want = attend_parts_mlx(q, parts, scale)
    assert got.shape == want.shape and got.dtype == mx.float32
    assert mx.max(mx.abs(got - want)).item() < 2e-6
    return got


@needs_kernel
@pytest.mark.parametrize("L", [1, 3])
def test_shared_prefix_and_masked_tails_match_the_mlx_path(L):
    """A decode slab: a prefix of batch 1 seen by some rows, each row's tail a view cut from a
    longer buffer with its own length (a bool mask)."""
    B, Hq, Hkv, D = 6, 9, 3, 64
    q = _rand((B, Hq, L, D), 1)
    pk, pv = _rand((1, Hkv, 37, D), 2), _rand((1, Hkv, 37, D), 3)
    tk, tv = _rand((B, Hkv, 40, D), 4)[:, :, :29], _rand((B, Hkv, 40, D), 5)[:, :, :29]
    rows = mx.array([True, True, False, True, False, True])
    lengths = mx.array([29, 12, 5, 29, 1, 20]).reshape(B, 1, 1, 1)
    seen = mx.arange(29)[None, None, None, :] < lengths
    _close([Part(pk, pv, None, rows), Part(tk, tv, seen)], q)


@needs_kernel
@pytest.mark.parametrize("L", [1, 4, 16])
def test_one_causal_part_matches_the_mlx_path(L):
    q = _rand((2, 4, L, 64), 6)
    k, v = _rand((2, 2, 50, 64), 7), _rand((2, 2, 50, 64), 8)
    _close([Part(k, v, "causal")], q)
    _close([Part(k, v, None)], q)


@needs_kernel
def test_additive_and_broadcast_masks_and_wide_heads_match_the_mlx_path():
    """A float (additive) mask per head, a mask broadcast over rows, head size 128, one query head
    per KV head."""
    q = _rand((3, 4, 2, 128), 9)
    k, v = _rand((3, 4, 21, 128), 10), _rand((3, 4, 21, 128), 11)
    additive = mx.where(_rand((3, 4, 2, 21), 12) > 0.5, -float("inf"), _rand((3, 4, 2, 21), 13))
    additive[..., 0] = 0.0                                    # every query keeps a key
    _close([Part(k, v, additive)], q)
    window = (mx.arange(21)[None, :] >= mx.array([[3], [4]]))[None, None]   # [1, 1, L, T]
    _close([Part(k, v, window)], q)


@needs_kernel
def test_a_query_that_sees_no_key_gives_zero_as_the_mlx_path_does():
    """A free slab row: hidden from the prefix and its tail fully masked."""
    q = _rand((2, 2, 1, 64), 14)
    pk, pv = _rand((1, 1, 8, 64), 15), _rand((1, 1, 8, 64), 16)
    tk, tv = _rand((2, 1, 5, 64), 17), _rand((2, 1, 5, 64), 18)
    seen = mx.array([True] * 5 + [False] * 5).reshape(2, 1, 1, 5)
    got = _close([Part(pk, pv, None, mx.array([True, False])), Part(tk, tv, seen)], q)
    assert mx.array_equal(got[1], mx.zeros_like(got[1])).item()
    assert mx.min(mx.abs(got[0])).item() > 0


@needs_kernel
def test_a_row_gets_the_same_bits_alone_and_in_a_batch():
    """Each row is computed on its own, in a fixed order: batching rows changes nothing (the MLX
    path's batched products may round differently with the batch)."""
    B, Hq, Hkv, D = 5, 9, 3, 64
    q = _rand((B, Hq, 1, D), 19)
    pk, pv = _rand((1, Hkv, 60, D), 20), _rand((1, Hkv, 60, D), 21)
    tk, tv = _rand((B, Hkv, 30, D), 22), _rand((B, Hkv, 30, D), 23)
    seen = mx.arange(30)[None, None, None, :] < mx.array([30, 9, 17, 2, 25]).reshape(B, 1, 1, 1)
    batch = attend(q, [Part(pk, pv), Part(tk, tv, seen)], 0.125)
    for b in range(B):
        one = attend(q[b:b + 1], [Part(pk, pv), Part(tk[b:b + 1], tv[b:b + 1], seen[b:b + 1])], 0.125)
        assert mx.array_equal(one[0], batch[b]).item()


@needs_kernel
def test_a_query_gets_the_same_bits_whatever_call_it_is_in():
    """Position 37's query over keys 0..37: alone (one query, 38 keys), inside a 16-query causal
    call over 46 keys, and as a slab row -- a prefix part held once plus its own tail behind 5 or
    11 padding slots -- gives the same bits: the softmax's sum runs in lanes by key position, not
    by the call's buffer (LESSONS 79: what a position's K / V need under KV quantisation). Before,
    the sum's lanes followed the call's key count and the three calls differed in the last bits."""
    Hq, Hkv, D, p = 9, 3, 64, 37
    K, V, Q = _rand((1, Hkv, 46, D), 40), _rand((1, Hkv, 46, D), 41), _rand((1, Hq, 46, D), 42)
    alone = attend(Q[:, :, p:p + 1], [Part(K[:, :, :p + 1], V[:, :, :p + 1], "causal")], 0.125)
    within = attend(Q[:, :, 30:46], [Part(K, V, "causal")], 0.125)[:, :, p - 30:p - 29]
    assert mx.array_equal(alone, within).item()
    for pad in (5, 11):
        tk = mx.concatenate([mx.zeros((1, Hkv, pad, D)), K[:, :, 20:p + 1]], axis=2)
        tv = mx.concatenate([mx.zeros((1, Hkv, pad, D)), V[:, :, 20:p + 1]], axis=2)
        seen = (mx.arange(tk.shape[2]) >= pad)[None, None, None, :]
        slab = attend(Q[:, :, p:p + 1], [Part(K[:, :, :20], V[:, :, :20]), Part(tk, tv, seen)], 0.125)
        assert mx.array_equal(alone, slab).item(), pad


@needs_kernel
def test_what_the_kernel_does_not_take_goes_back_to_the_mlx_path():
    q = _rand((1, 2, 1, 64), 24)
    k, v = _rand((1, 2, 9, 64), 25), _rand((1, 2, 9, 64), 26)
    assert attend(q, [Part(k, v)], 0.1, sinks=mx.zeros((2,))) is None                  # sinks
    assert attend(_rand((1, 2, 17, 64), 27), [Part(k, v, "causal")], 0.1) is None       # a prefill
    assert attend(q.astype(mx.float16), [Part(k, v)], 0.1) is None                     # float16
    assert attend(q, [Part(k, v, mx.zeros((1, 1, 1, 9), mx.bfloat16))], 0.1) is None   # bf16 mask
    assert attend(_rand((1, 2, 1, 40), 28), [Part(_rand((1, 2, 9, 40), 29), _rand((1, 2, 9, 40), 30))], 0.1) is None
    # attend_parts then computes it with MLX ops
    out = sa.attend_parts(q, [Part(k, v)], 0.1, sinks=mx.zeros((2,)))
    assert mx.array_equal(out, attend_parts_mlx(q, [Part(k, v)], 0.1, sinks=mx.zeros((2,)))).item()


def test_no_compiler_no_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXSTACK_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert native_attention.build() is None
    assert native_attention.load() is None
    assert list(tmp_path.iterdir()) == []                     # no half-written library left


@needs_kernel
def test_built_once_per_source_and_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXSTACK_NATIVE_DIR", str(tmp_path))
    first = native_attention.build()
    assert first is not None and first.parent == tmp_path and first.name.startswith("kernels-")
    stamp = first.stat().st_mtime_ns
    assert native_attention.build() == first and first.stat().st_mtime_ns == stamp   # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]                       # no temporaries
    assert native_attention.load() is not None


@needs_kernel
def test_the_switches(tiny_dense_path):
    try:
        assert cpu_kernels.install_cpu_kernels("on", native="off") is True
        assert cpu_kernels.native_attention_on() is False
        assert cpu_kernels.install_cpu_kernels("on") is True
        assert cpu_kernels.native_attention_on() is True
        assert cpu_kernels.install_cpu_kernels("off") is False
        assert cpu_kernels.native_attention_on() is False       # never without the CPU kernels
    finally:
        cpu_kernels.install_cpu_kernels("auto")


@pytest.mark.slow
@needs_kernel
def test_batched_replies_are_the_same_with_the_kernel_on_and_off(embedded_model_path, monkeypatch):
    """The embedded model, 4 agents under one system prompt decoding together (a shared prefix in
    the slab, speculation on): the replies with the kernel equal those without, and the kernel
    took the decode steps."""
    system = {"role": "system", "content": "You are a careful assistant. " * 60}
    convos = [[system, {"role": "user", "content": f"Tell me about the number {n}."}] for n in (3, 17, 42, 99)]
    eng = build_engine(engine_settings(embedded_model_path, prompt_cache_max_entries_global=0))
    assert cpu_kernels.native_attention_on()
    calls = []
    kernel = sa._native

    def counted(q, parts, scale, sinks=None):
        out = kernel(q, parts, scale, sinks)
        calls.append((q.shape[0], len(parts), out is not None))
        return out

    def replies(tag):
        jobs = [job(m, max_tokens=12, session=f"{tag}{i}")[0] for i, m in enumerate(convos)]
        return [o.text for o in run_batched(eng, jobs, budget=512)[0]]

    monkeypatch.setattr(sa, "_native", counted)
    on = replies("on")
    assert any(b == 4 and n == 2 and took for b, n, took in calls)     # 4 rows over prefix + tails
    monkeypatch.setattr(sa, "_native", None)
    off = replies("off")
    assert on == off and all(on)


@needs_kernel
def test_rows_split_over_two_threads_are_bit_for_bit_one_thread(monkeypatch):
    """A call with enough work runs half its rows on a second thread: the same bits as one thread
    (each row's arithmetic is the same), and the same as the MLX path within rounding."""
    B, Hq, Hkv, D = 8, 9, 3, 64
    q = _rand((B, Hq, 1, D), 21)
    pk, pv = _rand((1, Hkv, 340, D), 22), _rand((1, Hkv, 340, D), 23)
    tk, tv = _rand((B, Hkv, 130, D), 24), _rand((B, Hkv, 130, D), 25)
    seen = mx.arange(130)[None, None, None, :] < mx.array([130, 90, 1, 64, 128, 7, 30, 100]).reshape(B, 1, 1, 1)
    parts = [Part(pk, pv, None, mx.array([True] * 7 + [False])), Part(tk, tv, seen)]
    monkeypatch.setattr(native_attention, "THREADS", 2)
    two = _close(parts, q)
    monkeypatch.setattr(native_attention, "THREADS", 1)
    one = _close(parts, q)
    assert mx.array_equal(one, two).item()


def test_shapes_the_kernel_would_read_past_go_back_to_the_mlx_path():
    """The C loop walks what its caller says is there: keys / values / row masks whose extents do not
    agree with the queries are refused before any buffer is read (an error of the MLX path, never an
    out-of-bounds read)."""
    q = _rand((3, 4, 1, 64), 40)
    k, v = _rand((1, 2, 9, 64), 41), _rand((1, 2, 9, 64), 42)
    assert native_attention._takes(q, [Part(k, v)], None)                                  # the reference case
    bad = [
        [Part(_rand((1, 3, 9, 64), 43), _rand((1, 3, 9, 64), 44))],                         # 4 heads over 3 KV heads
        [Part(k, _rand((1, 2, 8, 64), 45))],                                                # values shorter than keys
        [Part(k, v), Part(_rand((3, 2, 5, 64), 46), _rand((3, 2, 5, 32), 47))],             # value widths differ
        [Part(_rand((2, 2, 9, 64), 48), _rand((2, 2, 9, 64), 49))],                         # 2 rows of keys, 3 queries
        [Part(_rand((1, 2, 9, 32), 50), _rand((1, 2, 9, 64), 51))],                         # key width != query width
        [Part(k, v, None, mx.array([True, False]))],                                        # a row mask for 2 of 3 rows
        [Part(_rand((3, 4, 1, 64), 52), _rand((3, 4, 1, 64), 53), "causal")],               # (fine: 1 query, 1 key)
    ]
    verdicts = [native_attention._takes(q, parts, None) for parts in bad]
    assert verdicts == [False, False, False, False, False, False, True]
    causal_short = [Part(_rand((1, 2, 2, 64), 54), _rand((1, 2, 2, 64), 55), "causal")]
    assert not native_attention._takes(_rand((1, 4, 3, 64), 56), causal_short, None)        # 3 queries, 2 keys


def _codes(x, bits, group=64):
    """mx.quantize's (codes, scales, biases) of ``x`` -- a QuantizedKVCache's layout -- and the
    floats mx.dequantize gives back for them."""
    q = mx.quantize(x, group_size=group, bits=bits)
    return q, mx.dequantize(*q, group_size=group, bits=bits)


@needs_kernel
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_quantised_keys_and_values_are_attended_as_exactly_the_floats_they_dequantise_to(bits, group):
    """A part holding mx.quantize's codes (uniform KV_BITS) gives the same bits as a part holding
    the floats mx.dequantize makes of them: the kernel dequantises each block exactly as
    mx.dequantize does (the product rounded before the sum, never fused), then runs the float
    path's arithmetic -- causal, unmasked, a bool mask, a prefix part held once, views cut from a
    longer buffer -- and the MLX path over the dequantised floats agrees within rounding."""
    B, Hq, Hkv, D = 2, 9, 3, 64
    (kq, kf), (vq, vf) = _codes(_rand((B, Hkv, 256, D), 60), bits, group), _codes(_rand((B, Hkv, 256, D), 61), bits, group)
    cut = lambda t, n: tuple(x[..., :n, :] for x in t)  # noqa: E731
    (pq, pf), (pvq, pvf) = _codes(_rand((1, Hkv, 24, D), 62), bits, group), _codes(_rand((1, Hkv, 24, D), 63), bits, group)
    seen = mx.arange(77)[None, None, None, :] < mx.array([77, 30]).reshape(B, 1, 1, 1)
    for L, mask in ((1, None), (5, "causal"), (16, "causal"), (1, seen)):
        q = _rand((B, Hq, L, D), 64 + L)
        coded = [Part(cut(kq, 77), cut(vq, 77), mask, None, bits, group)]
        floats = [Part(kf[..., :77, :], vf[..., :77, :], mask)]
        got = attend(q, coded, 0.125)
        assert got is not None and mx.array_equal(got, attend(q, floats, 0.125)).item(), (L, mask)
        assert mx.max(mx.abs(got - attend_parts_mlx(q, coded, 0.125))).item() < 2e-6
        two = [Part(pq, pvq, None, mx.array([True, False]), bits, group), *coded]
        assert mx.array_equal(attend(q, two, 0.125), attend(q, [Part(pf, pvf, None, mx.array([True, False])), *floats],
                                                               0.125)).item()


@needs_kernel
def test_one_visible_quantised_value_comes_back_as_mx_dequantize_gives_it():
    """With one key visible its weight is exactly 1: the output is that value as dequantised,
    which is mx.dequantize's float bit for bit (for every width and a head of 128)."""
    for bits in (3, 4, 8):
        vq, vf = _codes(_rand((1, 1, 8, 128), 70 + bits), bits)
        one = mx.array([True] + [False] * 7).reshape(1, 1, 1, 8)
        out = attend(_rand((1, 2, 1, 128), 71), [Part(vq, vq, one, None, bits, 64)], 0.1)
        assert mx.array_equal(out[0, 0, 0], vf[0, 0, 0]).item() and mx.array_equal(out[0, 1, 0], vf[0, 0, 0]).item()


def test_quantised_parts_the_kernel_cannot_read_go_back_to_the_mlx_path():
    """Codes whose widths or dtypes do not agree with the queries are refused before any buffer
    is read; attend_parts then attends mx.dequantize's floats with MLX ops."""
    q = _rand((1, 4, 1, 64), 80)
    (kq, _), (vq, _) = _codes(_rand((1, 2, 9, 64), 81), 4), _codes(_rand((1, 2, 9, 64), 82), 4)
    assert native_attention._takes(q, [Part(kq, vq, None, None, 4, 64)], None)
    bad = [Part(kq, vq, None, None, 8, 64),                                  # 4-bit codes read as 8-bit
           Part(kq, vq, None, None, 4, 32),                                  # scales of 64 read as of 32
           Part(kq, vq, None, None, 7, 64),                                  # no such width
           Part((kq[0], kq[1].astype(mx.float16), kq[2]), vq, None, None, 4, 64),
           Part(kq, tuple(x[..., :5, :] for x in vq), None, None, 4, 64)]   # values shorter than keys
    assert [native_attention._takes(q, [p], None) for p in bad] == [False] * len(bad)
    ref = Part(kq, vq, None, None, 4, 64)
    assert mx.array_equal(sa.attend_parts_mlx(q, [ref], 0.1), attend_parts_mlx(q, [ref.floats()], 0.1)).item()
