"""Parity of the opt-in block-causal CPU attention with mx.fast.scaled_dot_product_attention."""
from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from mlxstack.backends.cpu.block_causal import block_causal_sdpa, make_sdpa  # noqa: E402


@pytest.mark.parametrize("L,S,block", [(300, 300, 64), (128, 448, 50), (64, 64, 256), (1, 40, 16)])
def test_block_causal_matches_fast_sdpa(L: int, S: int, block: int):
    mx.random.seed(0)
    q = mx.random.normal((1, 9, L, 64))
    k = mx.random.normal((1, 3, S, 64))
    v = mx.random.normal((1, 3, S, 64))
    scale = 64 ** -0.5
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    got = block_causal_sdpa(q, k, v, scale=scale, block=block)
    assert got.shape == ref.shape
    assert mx.allclose(got, ref, atol=1e-5, rtol=1e-4).item()


def test_make_sdpa_delegates_non_causal():
    calls = []

    def original(q, k, v, cache, scale, mask, sinks=None):
        calls.append(mask)
        return q

    f = make_sdpa(original, block=8, min_queries=4)
    q = mx.zeros((1, 2, 2, 4))
    f(q, q, q, cache=None, scale=1.0, mask=None)
    f(q, q, q, cache=None, scale=1.0, mask="causal")  # too few queries
    assert calls == [None, "causal"]
