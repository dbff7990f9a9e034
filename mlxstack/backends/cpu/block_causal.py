"""Opt-in CPU attention for long causal prefills: block-causal matmul + softmax.

On MLX's CPU backend ``mx.fast.scaled_dot_product_attention`` has no fused kernel: it runs
Q@K^T, the mask, a softmax and P@V over the full (queries x keys) score matrix. With a causal
mask half of that matrix is thrown away, and the softmax (exp over heads x L x L floats) is the
dominant cost past ~1k tokens (the matmuls go to BLAS and are cheap with OpenBLAS).

``block_causal_sdpa`` splits the queries into blocks and lets block i attend only to the keys it
can see (``[0, offset + end_i)``), so about half the scores are never computed. Per row the
softmax is over exactly the same unmasked elements, so the result matches mx.fast up to float
rounding (see tests/test_cpu_attention.py).

It is opt-in: ``patch_mlx_lm_attention()`` swaps mlx-lm's ``scaled_dot_product_attention`` for
the model modules named, delegating every case other than a plain causal prefill (decode,
array masks, sinks, quantized KV caches) to the original.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx


def block_causal_sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, block: int = 256) -> mx.array:
    """Causal attention for q (B, Hq, L, D) against k, v (B, Hkv, S, D), S >= L (cache offset S-L)."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    offset = S - L
    qs = (q * mx.array(scale, q.dtype)).reshape(B, Hkv, rep, L, D)
    k5 = k[:, :, None]
    v5 = v[:, :, None]
    outs = []
    for start in range(0, L, block):
        end = min(start + block, L)
        kv_end = offset + end
        scores = qs[:, :, :, start:end] @ k5[:, :, :, :kv_end].swapaxes(-1, -2)
        q_pos = mx.arange(offset + start, offset + end)[:, None]
        k_pos = mx.arange(kv_end)[None]
        scores = mx.where(q_pos >= k_pos, scores, mx.array(-float("inf"), scores.dtype))
        probs = mx.softmax(scores, axis=-1, precise=True)
        outs.append(probs @ v5[:, :, :, :kv_end])
    out = mx.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]
    return out.reshape(B, Hq, L, D)


def make_sdpa(original: Any, block: int = 256, min_queries: int = 512) -> Any:
    """A drop-in for mlx_lm.models.base.scaled_dot_product_attention."""

    def sdpa(queries, keys, values, cache, scale: float, mask: Optional[Any], sinks: Optional[Any] = None):
        if (
            isinstance(mask, str)
            and mask == "causal"
            and sinks is None
            and not hasattr(cache, "bits")
            and queries.shape[2] >= min_queries
        ):
            return block_causal_sdpa(queries, keys, values, scale=scale, block=block)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    sdpa.__mlxstack_block_causal__ = True  # type: ignore[attr-defined]
    return sdpa


@contextmanager
def patch_mlx_lm_attention(modules: Sequence[str] = ("mlx_lm.models.llama",), block: int = 256, min_queries: int = 512) -> Iterator[None]:
    """Temporarily route the named mlx-lm model modules' causal prefills through block_causal_sdpa."""
    from mlx_lm.models import base

    saved = []
    for name in modules:
        mod = importlib.import_module(name)
        saved.append((mod, mod.scaled_dot_product_attention))
        mod.scaled_dot_product_attention = make_sdpa(base.scaled_dot_product_attention, block, min_queries)
    try:
        yield
    finally:
        for mod, fn in saved:
            mod.scaled_dot_product_attention = fn
