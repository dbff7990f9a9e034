"""Attention over a shared prefix plus each row's own tail, merged by log-sum-exp (cascade).

A cache whose first ``p`` positions are an immutable prefix held once for many sequences
(``cache/shared_kv.py``: one session's hit, or every row of a decode batch that shares a system
prompt) hands the model only its own tail from ``update_and_fetch``; the prefix is attended here:

    out = attend_parts(queries, [Part(pk, pv, rows=use), Part(tk, tv, mask=m)], scale, sinks)

Each part gives its softmax numerator and log-sum-exp; the parts are merged exactly (up to float
rounding) into the softmax over their concatenation, so the result is the attention a plain cache
holding ``prefix + tail`` computes. A prefix held once (``keys`` of batch 1) is attended by every
row in ONE matrix product per KV head -- all rows' queries (``rows x heads-per-group``) against
one copy of the prefix -- instead of each row reading its own padded copy.

``install()`` routes mlx-lm's ``scaled_dot_product_attention`` (the name every model module
imported from ``mlx_lm.models.base``) through ``sdpa``: a cache without a shared prefix goes to
the original unchanged; a cache with one comes here. A model that does not call that function is
caught by the engine's check at load (``engine/shared_prefix.py``), which then never shares.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx

_NEG_INF = -float("inf")


@dataclass(frozen=True)
class Part:
    """Keys / values ``[B or 1, Hkv, T, D]`` attended by every query; ``mask``: None, "causal"
    (the queries are the last ``L`` of the ``T`` keys) or an array broadcastable to
    ``[B, Hq, L, T]`` (bool: True = visible; else additive); ``rows``: with keys of batch 1 and
    several rows, a bool ``[B]`` saying which rows see this part at all."""
    keys: mx.array
    values: mx.array
    mask: Any = None
    rows: Optional[mx.array] = None


def _masked(scores: mx.array, mask: Any, L: int, T: int) -> mx.array:
    """``scores`` [B, Hkv, rep, L, T] with ``mask`` applied."""
    if mask is None:
        return scores
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        if L == 1:
            return scores
        q = mx.arange(T - L, T)[:, None]
        return mx.where(q >= mx.arange(T)[None], scores, _NEG_INF)
    if mask.ndim == 4:                                  # [B|1, H|1, L, T] -> [B|1, H|1 -> groups]
        b, h = mask.shape[0], mask.shape[1]
        rep = scores.shape[2]
        mask = mask.reshape(b, 1, 1, L, T) if h == 1 else mask.reshape(b, h // rep, rep, L, T)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, _NEG_INF)
    return scores + mask.astype(scores.dtype)


def _f32(a: mx.array) -> mx.array:
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def _weights(scores: mx.array, may_be_empty: bool) -> tuple[mx.array, mx.array]:
    """(exp(scores - lse), lse); with ``may_be_empty`` a fully masked row gives 0 and -inf."""
    lse = mx.logsumexp(scores, axis=-1, keepdims=True)
    if may_be_empty:
        return mx.exp(scores - mx.where(mx.isinf(lse), 0.0, lse)), lse
    return mx.exp(scores - lse), lse


def _attend_one(q5: mx.array, part: Part) -> tuple[mx.array, mx.array]:
    """q5 [B, Hkv, rep, L, D] (already scaled) against one part -> (out [B, Hkv, rep, L, Dv], lse)."""
    B, Hkv, rep, L, D = q5.shape
    k, v = part.keys, part.values
    T = k.shape[2]
    if k.shape[0] == 1 and B > 1:
        # one copy for every row: all rows' queries against it in one product per KV head
        qf = q5.transpose(1, 0, 2, 3, 4).reshape(Hkv, B * rep * L, D)
        scores = _f32(qf @ k[0].swapaxes(-1, -2)).reshape(Hkv, B, rep, L, T).transpose(1, 0, 2, 3, 4)
        if part.rows is not None:
            scores = mx.where(part.rows.reshape(B, 1, 1, 1, 1), scores, _NEG_INF)
        scores = _masked(scores, part.mask, L, T)
        probs, lse = _weights(scores, part.rows is not None or part.mask is not None)
        pf = probs.astype(v.dtype).transpose(1, 0, 2, 3, 4).reshape(Hkv, B * rep * L, T)
        out = (pf @ v[0]).reshape(Hkv, B, rep, L, v.shape[-1]).transpose(1, 0, 2, 3, 4)
        return out, lse
    scores = _masked(_f32(q5 @ k[:, :, None].swapaxes(-1, -2)), part.mask, L, T)     # [B, Hkv, rep, L, T]
    probs, lse = _weights(scores, not (part.mask is None or isinstance(part.mask, str)))
    return probs.astype(v.dtype) @ v[:, :, None], lse


def attend_parts(queries: mx.array, parts: list[Part], scale: float, sinks: Optional[mx.array] = None) -> mx.array:
    """Softmax attention of ``queries`` [B, Hq, L, D] over the concatenation of ``parts``; at
    least one part must leave every query something to attend (a causal tail always does)."""
    B, Hq, L, D = queries.shape
    Hkv = parts[0].keys.shape[1]
    rep = Hq // Hkv
    q5 = (queries * mx.array(scale, queries.dtype)).reshape(B, Hkv, rep, L, D)
    outs = [_attend_one(q5, p) for p in parts]
    total = outs[0][1]
    for _, lse in outs[1:]:
        total = mx.logaddexp(total, lse)
    if sinks is not None:
        total = mx.logaddexp(total, _f32(sinks).reshape(1, Hkv, rep, 1, 1))
    out = None
    for o, lse in outs:
        term = _f32(o) * mx.exp(lse - total)
        out = term if out is None else out + term
    return out.astype(queries.dtype).reshape(B, Hq, L, -1)


# ------------------------------------------------------------------------------ the model hook
def split_mask(mask: Any, p: int) -> tuple[Any, Any]:
    """A mask over ``prefix + tail`` keys -> (the prefix's, the tail's). "causal" and None: the
    prefix is wholly visible (every query comes after it); the tail keeps the causal rule."""
    if mask is None or isinstance(mask, str):
        return None, mask
    return mask[..., :p], mask[..., p:]


def sdpa_with_prefix(original: Any) -> Any:
    """A drop-in for ``mlx_lm.models.base.scaled_dot_product_attention``: caches that carry a shared
    prefix (``shared_prefix()`` -> None, or (keys, values, rows, full_mask): ``full_mask`` when the
    model's mask covers prefix + tail, else it covers the tail only) are attended as prefix + tail."""

    def sdpa(queries, keys, values, cache, scale: float, mask: Optional[Any], sinks: Optional[Any] = None):
        shared = getattr(cache, "shared_prefix", None)
        prefix = shared() if shared is not None else None
        if prefix is None:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        pk, pv, rows, full_mask = prefix
        pmask, tail_mask = split_mask(mask, pk.shape[2]) if full_mask else (None, mask)
        parts = [Part(pk, pv, pmask, rows), Part(keys, values, tail_mask)]
        return attend_parts(queries, parts, scale, sinks)

    sdpa.__mlxstack_shared_prefix__ = True  # type: ignore[attr-defined]
    return sdpa


def install() -> int:
    """Route every loaded mlx-lm / mlx-vlm model module's ``scaled_dot_product_attention`` through
    ``sdpa_with_prefix`` (idempotent; modules imported later are covered by calling it again after
    a model is loaded). Returns how many modules were patched now."""
    from mlx_lm.models import base

    original = base.scaled_dot_product_attention
    if getattr(original, "__mlxstack_shared_prefix__", False):
        original = original.__wrapped_original__  # type: ignore[attr-defined]
    wrapped = sdpa_with_prefix(original)
    wrapped.__wrapped_original__ = original  # type: ignore[attr-defined]
    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith(("mlx_lm.models.", "mlx_vlm.models.")) or mod is None:
            continue
        fn = getattr(mod, "scaled_dot_product_attention", None)
        if fn is original:
            setattr(mod, "scaled_dot_product_attention", wrapped)
            n += 1
    return n
