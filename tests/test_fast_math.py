"""CPU kernels (backends/cpu/fast_math.py, backends/cpu/kernels.py, the plain path of
backends/cascade.py): the fast exp against mx.exp, attention against mx.fast's over every
mask form, blocked prefills, and the model's logits with the kernels on vs off."""
from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxstack.backends import cascade as sa
from mlxstack.backends.cpu.kernels import install_cpu_kernels
from mlxstack.backends.cpu.fast_math import fast_exp, fast_silu, fast_swiglu


def test_fast_exp_matches_mx_exp():
    x = mx.random.uniform(-87.0, 88.0, (200_000,), key=mx.random.key(1))
    a, b = fast_exp(x), mx.exp(x)
    assert mx.max(mx.abs(a - b) / b).item() < 2e-7
    edges = mx.array([-float("inf"), -1e30, -100.0, -88.5, 0.0, 1.0, -1.0])
    assert fast_exp(edges).tolist()[:4] == [0.0, 0.0, 0.0, 0.0]      # masked scores weigh exactly 0
    assert fast_exp(edges).tolist()[4] == 1.0
    assert abs(fast_exp(edges).tolist()[5] - 2.718281828) < 1e-6
    half = fast_exp(mx.array([-3.0, 2.0], dtype=mx.float16))
    assert half.dtype == mx.float16 and abs(half.tolist()[1] - 7.389) < 0.01


def test_fast_silu_and_swiglu_match_mlx():
    from mlx_lm.models.activations import swiglu

    x = mx.random.uniform(-200.0, 200.0, (50_000,), key=mx.random.key(2))
    g = mx.random.normal((50_000,), key=mx.random.key(3))
    def close(a, b):
        return mx.max(mx.abs(a - b) / (1.0 + mx.abs(b))).item() < 1e-6      # |x| up to 200

    assert close(fast_silu(x), nn.silu(x)) and close(fast_swiglu(g, x), swiglu(g, x))
    assert not mx.any(mx.isnan(fast_silu(mx.array([-1e4, 1e4, -90.0])))).item()


def _strided(B, H, T, D, seed):
    """Keys as a cache hands them: the first T positions of a longer buffer (a strided view)."""
    buf = mx.random.normal((B, H, T + 37, D), key=mx.random.key(seed))
    return buf[..., :T, :]


@pytest.mark.parametrize("B,L,T", [(1, 1, 300), (3, 1, 300), (1, 200, 700), (2, 9, 40), (1, 64, 64)])
def test_plain_attention_matches_mx_fast(B, L, T):
    sa.use_exp(fast_exp)
    try:
        q = mx.random.normal((B, 6, L, 16), key=mx.random.key(4))
        k, v = _strided(B, 2, T, 16, 5), _strided(B, 2, T, 16, 6)
        masks = [None, "causal"]
        lens = mx.array([T - 3 * i for i in range(B)])
        masks.append((mx.arange(T)[None, :] >= (T - lens)[:, None]).reshape(B, 1, 1, T))   # left padding
        for mask in masks:
            ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
            out = sa.attend_blocked(q, k, v, 0.25, mask)
            assert mx.max(mx.abs(out - ref)).item() < 2e-5, mask
        sinks = mx.random.normal((6,), key=mx.random.key(7))
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal", sinks=sinks)
        assert mx.max(mx.abs(sa.attend_blocked(q, k, v, 0.25, "causal", sinks) - ref)).item() < 2e-5
    finally:
        sa.use_exp(None)


def test_a_long_prefill_runs_in_causal_blocks():
    """A 600-query causal prefill over 900 keys is attended in blocks that stop at their last query."""
    seen = []
    real = sa.attend_parts

    def spy(queries, parts, scale, sinks=None):
        seen.append((queries.shape[2], parts[0].keys.shape[2]))
        return real(queries, parts, scale, sinks)

    q = mx.random.normal((1, 4, 600, 8), key=mx.random.key(8))
    k, v = _strided(1, 2, 900, 8, 9), _strided(1, 2, 900, 8, 10)
    sa.attend_parts = spy
    try:
        out = sa.attend_blocked(q, k, v, 0.3, "causal")
    finally:
        sa.attend_parts = real
    block = sa.BLOCK_SCORES // (4 * 900)        # 36 queries per block
    assert seen[0] == (block, 300 + block) and seen[-1] == (600 - block * (len(seen) - 1), 900)
    assert len(seen) == -(-600 // block)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")
    assert mx.max(mx.abs(out - ref)).item() < 2e-5


def test_install_on_and_off(tiny_dense_path):
    """On: the model's module routes attention and swiglu here, logits within 1e-4 of mlx-lm's own
    and the same greedy token; off: mlx-lm's functions, bit for bit."""
    from mlx_lm import load
    from mlx_lm.models import activations, base

    model, _ = load(str(tiny_dense_path))
    mod = sys.modules[type(model).__module__]
    ids = mx.array([[5, 9, 14, 3, 27, 8, 11, 2, 19, 4]])
    try:
        assert install_cpu_kernels("off") is False
        hook = mod.scaled_dot_product_attention
        assert hook is base.scaled_dot_product_attention and hook.__wrapped_original__.__module__ == base.__name__
        assert sa._exp is mx.exp and sa._plain is False
        if hasattr(mod, "swiglu"):
            assert mod.swiglu is activations.swiglu
        off = model(ids)
        assert install_cpu_kernels("on") is True
        if hasattr(mod, "swiglu"):
            assert mod.swiglu is fast_swiglu
        assert sa._exp is fast_exp and sa._plain is True
        on = model(ids)
        assert mx.max(mx.abs(on - off)).item() < 1e-4
        assert mx.array_equal(on.argmax(-1), off.argmax(-1)).item()
        install_cpu_kernels("off")
        assert mx.array_equal(model(ids), off).item()                      # bit for bit again
    finally:
        install_cpu_kernels("auto")
