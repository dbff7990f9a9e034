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
caught by the engine's check at load (``runner/shared_prefix.py``), which then never shares.
Every backend installs it (backends/mlx.py: on Metal and on a CPU alike); the CPU backend
(backends/cpu/kernels.py) adds a faster exp (``use_exp``), the attention of caches without a
shared prefix (``attend_blocked``) and the native decode kernel (``use_native``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx

_NEG_INF = -float("inf")


@dataclass(frozen=True)
class Part:
    """Keys / values ``[B or 1, Hkv, T, D]`` attended by every query; ``mask``: None, "causal"
    (the queries are the last ``L`` of the ``T`` keys) or an array broadcastable to
    ``[B, Hq, L, T]`` (bool: True = visible; else additive); ``rows``: with keys of batch 1 and
    several rows, a bool ``[B]`` saying which rows see this part at all. With ``bits``, keys and
    values are ``mx.quantize``'s (codes, scales, biases) of groups of ``group_size`` (a
    QuantizedKVCache's), attended as the floats ``mx.dequantize`` gives back."""
    keys: Any
    values: Any
    mask: Any = None
    rows: Optional[mx.array] = None
    bits: int = 0
    group_size: int = 0

    def floats(self) -> "Part":
        """This part with float keys / values (``mx.dequantize``'s, where it holds codes)."""
        if not self.bits:
            return self
        kw = dict(group_size=self.group_size, bits=self.bits)
        return Part(mx.dequantize(*self.keys, **kw), mx.dequantize(*self.values, **kw), self.mask, self.rows)


def _masked(scores: mx.array, mask: Any, L: int, T: int, heads_first: bool = False) -> mx.array:
    """``scores`` [B, Hkv, rep, L, T] (``heads_first``: [Hkv, B, rep, L, T]) with ``mask`` applied."""
    if mask is None:
        return scores
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        if L == 1:
            return scores
        q = mx.arange(T - L, T)[:, None]
        return mx.where(q >= mx.arange(T)[None], scores, _NEG_INF)
    if mask.ndim == 4:                                  # [B|1, H|1, L|1, T] -> [B|1, H|1 -> groups]
        b, h, lm, tm = mask.shape
        rep = scores.shape[2]
        if h == 1:
            mask = mask.reshape(1, b, 1, lm, tm) if heads_first else mask.reshape(b, 1, 1, lm, tm)
        else:
            mask = mask.reshape(b, h // rep, rep, lm, tm)
            mask = mask.transpose(1, 0, 2, 3, 4) if heads_first else mask
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, _NEG_INF)
    return scores + mask.astype(scores.dtype)


def _f32(a: mx.array) -> mx.array:
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


_exp = mx.exp     # the exp over scores: backends/cpu/fast_math.fast_exp where it measures faster
_plain = False    # attend caches without a shared prefix here too (backends/cpu/kernels.py: a CPU)


def use_exp(exp: Optional[Callable[[mx.array], mx.array]]) -> None:
    """Attention here with ``exp`` (the CPU backend's ``fast_exp``) and for every float cache, or
    (None) with ``mx.exp`` and mlx-lm's own attention for caches without a shared prefix."""
    global _exp, _plain
    _exp, _plain = (exp, True) if exp is not None else (mx.exp, False)


@dataclass
class _Partial:
    """One part's softmax pieces: unnormalised output ``sum_j exp(s_j - m) v_j``, its denominator
    ``sum_j exp(s_j - m)`` and the max ``m`` (-inf where every key of the part is masked)."""
    out: mx.array
    den: mx.array
    top: mx.array


def _exp_scores(scores: mx.array, may_be_empty: bool) -> tuple[mx.array, mx.array, mx.array]:
    """(exp(scores - max), their sum, max): ONE exp per score (the cost of attention on a CPU)."""
    top = scores.max(axis=-1, keepdims=True)
    shift = mx.where(mx.isinf(top), 0.0, top) if may_be_empty else top
    e = _exp(scores - shift)
    return e, e.sum(axis=-1, keepdims=True), top


def _scores_per_head(q5: mx.array, keys: mx.array) -> mx.array:
    """[Hkv, B * rep * L, T]: every query of KV head h against ``keys[0, h]``. One product per
    head on a single-index view (``keys`` is often cut from a longer buffer): MLX's CPU matmul
    copies an operand it cannot hand to BLAS as it is, and a batched product over a strided view,
    or a view of a view, is one (measured: 3-4x slower at 2k keys)."""
    B, Hkv, rep, L, D = q5.shape
    return mx.stack([q5[:, h].reshape(B * rep * L, D) @ keys[0, h].T for h in range(Hkv)])


def _values_per_head(e: mx.array, values: mx.array) -> mx.array:
    """[Hkv, rows, Dv]: ``e[h] @ values[0, h]`` per head (as above)."""
    return mx.stack([e[h] @ values[0, h] for h in range(e.shape[0])])


def _batch_first(a: mx.array) -> mx.array:
    """[Hkv, B, ...] -> [B, Hkv, ...] (a reshape when B == 1: a transpose would leave a strided
    array, and every elementwise op on one takes MLX's slow generic loop)."""
    return a.reshape(a.shape[1], a.shape[0], *a.shape[2:]) if a.shape[1] == 1 else a.transpose(1, 0, 2, 3, 4)


def _attend_one(q5: mx.array, part: Part) -> _Partial:
    """q5 [B, Hkv, rep, L, D] (already scaled) against one part."""
    B, Hkv, rep, L, D = q5.shape
    k, v = part.keys, part.values
    T = k.shape[2]
    if k.shape[0] == 1:
        # one copy for every row (or one row): every query of a head group in one product, the
        # scores kept heads-first (contiguous) through the softmax
        scores = _f32(_scores_per_head(q5, k)).reshape(Hkv, B, rep, L, T)
        if part.rows is not None:
            scores = mx.where(part.rows.reshape(1, B, 1, 1, 1), scores, _NEG_INF)
        scores = _masked(scores, part.mask, L, T, heads_first=True)
        e, den, top = _exp_scores(scores, part.rows is not None or not (part.mask is None or isinstance(part.mask, str)))
        out = _values_per_head(e.astype(v.dtype).reshape(Hkv, B * rep * L, T), v).reshape(Hkv, B, rep, L, v.shape[-1])
        return _Partial(_batch_first(out), _batch_first(den), _batch_first(top))
    qf = q5.reshape(B, Hkv, rep * L, D)              # a head group's queries in one product
    scores = _masked(_f32(qf @ k.swapaxes(-1, -2)).reshape(B, Hkv, rep, L, T), part.mask, L, T)
    e, den, top = _exp_scores(scores, not (part.mask is None or isinstance(part.mask, str)))
    out = (e.astype(v.dtype).reshape(B, Hkv, rep * L, T) @ v).reshape(B, Hkv, rep, L, v.shape[-1])
    return _Partial(out, den, top)


_native: Optional[Callable[..., Optional[mx.array]]] = None   # backends/cpu/native_attention.py, when on


def use_native(attend: Optional[Callable[..., Optional[mx.array]]]) -> None:
    """Decode-sized calls through the native kernel (``attend``), or MLX ops only (None)."""
    global _native
    _native = attend


def native_in_use() -> bool:
    return _native is not None


def attend_parts(queries: mx.array, parts: list[Part], scale: float, sinks: Optional[mx.array] = None) -> mx.array:
    """Softmax attention of ``queries`` [B, Hq, L, D] over the concatenation of ``parts``; at
    least one part must leave every query something to attend (a causal tail always does).
    The native kernel where it is on and takes the call, else MLX ops (``attend_parts_mlx``)."""
    if _native is not None:
        out = _native(queries, parts, scale, sinks)
        if out is not None:
            return out
    return attend_parts_mlx(queries, parts, scale, sinks)


def attend_parts_mlx(queries: mx.array, parts: list[Part], scale: float, sinks: Optional[mx.array] = None) -> mx.array:
    """``attend_parts`` in MLX ops (any device, any shape)."""
    parts = [p.floats() for p in parts]
    B, Hq, L, D = queries.shape
    Hkv = parts[0].keys.shape[1]
    rep = Hq // Hkv
    q5 = (queries * mx.array(scale, queries.dtype)).reshape(B, Hkv, rep, L, D)
    outs = [_attend_one(q5, p) for p in parts]
    sink = None if sinks is None else _f32(sinks).reshape(1, Hkv, rep, 1, 1)
    if len(outs) == 1 and sink is None:
        only = outs[0]                               # a fully masked query (a free slab row) gives 0
        den = mx.where(only.den > 0, only.den, 1.0)
        return (_f32(only.out) / den).astype(queries.dtype).reshape(B, Hq, L, -1)
    top = outs[0].top                                # the merge: every part rescaled to the overall max
    for o in outs[1:]:
        top = mx.maximum(top, o.top)
    if sink is not None:
        top = mx.maximum(top, sink)
    top = mx.where(mx.isinf(top), 0.0, top)          # a query that sees no key at all gives 0
    num, den = None, None
    for o in outs:
        w = mx.exp(o.top - top)                      # [.., L, 1]: exact exp, few elements
        term, d = _f32(o.out) * w, o.den * w
        num, den = (term, d) if num is None else (num + term, den + d)
    if sink is not None:
        den = den + mx.exp(sink - top)
    den = mx.where(den > 0, den, 1.0)
    return (num / den).astype(queries.dtype).reshape(B, Hq, L, -1)


BLOCK_SCORES = 1 << 17   # scores per query block of a long prefill (~0.5 MB: stays in cache)


def attend_blocked(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
                   sinks: Optional[mx.array] = None) -> mx.array:
    """``attend_parts`` over one part, a long prefill in query blocks: each block's scores fit in
    cache (MLX's CPU ops over a multi-MB array run 3-4x slower per element, measured), and with a
    causal mask a block attends only the keys up to its last query (about half the scores of a
    cold prefill are never computed). The same softmax per query, so the same result."""
    B, Hq, L, D = queries.shape
    T = keys.shape[2]
    block = max(16, BLOCK_SCORES // max(1, Hq * T))
    if B != 1 or L <= block or not (mask is None or isinstance(mask, str)):
        return attend_parts(queries, [Part(keys, values, mask)], scale, sinks)
    causal = mask == "causal"
    outs = []
    for start in range(0, L, block):
        end = min(L, start + block)
        upto = T - L + end if causal else T
        outs.append(attend_parts(queries[:, :, start:end], [Part(keys[..., :upto, :], values[..., :upto, :], mask)],
                                 scale, sinks))
    return mx.concatenate(outs, axis=2)


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
            if _plain and not isinstance(keys, (tuple, list)):
                return attend_blocked(queries, keys, values, scale, mask, sinks)
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


def installed() -> int:
    """How many loaded mlx-lm / mlx-vlm model modules attend through ``sdpa_with_prefix`` now."""
    return sum(1 for name, mod in list(sys.modules.items())
               if name.startswith(("mlx_lm.models.", "mlx_vlm.models.")) and mod is not None
               and getattr(getattr(mod, "scaled_dot_product_attention", None), "__mlxstack_shared_prefix__", False))
