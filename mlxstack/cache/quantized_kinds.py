"""The quantised KV kinds (KV_BITS): mlx-lm's ``QuantizedKVCache`` (uniform) and ours,
``TurboQuantKVCache`` (KV_QUANT_SCHEME=turboquant). Both keep the tokens before QUANTIZED_KV_START
in full precision (KVKind's code) and serve any depth at or past that head."""
from __future__ import annotations

from typing import Any

import mlx.core as mx

from .marks import mark, marked
from .kind_base import (FP_HEAD, KVKind, KVQuant, LayerState, _cut_tokens, _fresh, _kv_class, _plain_state, _room)


class QuantizedKind(KVKind):
    """``QuantizedKVCache``: keys/values are (packed, scales, biases) triples; any depth.

    Stored as a cold run holds it: the first ``fp_head`` tokens in full precision (what the live
    cache held when it switched at KV_BITS' start; 0 for a cache quantised from its first token)
    and the rest quantised. Checked out at or below ``fp_head`` it is a full-precision
    ``KVCache``; past it, the head is quantised again -- per token, so exactly the bytes the cold
    run's ``to_quantized`` made (LESSONS.md §20) -- in front of the stored quantised tail.
    Slots: (tail keys, tail values, head keys, head values)."""
    name = "quantized"
    class_names = ("QuantizedKVCache",)
    hands_out_prefix = False     # (packed, scales, biases) triples: never a plain root

    def first(self, layer: Any, depth: int) -> tuple[Any, Any, int] | None:
        return None

    def capture(self, layer: Any, depth: int, quant: KVQuant | None = None) -> LayerState:
        head = marked(layer, FP_HEAD) if layer.keys is not None else None
        n = 0 if head is None else int(head[0].shape[-2])
        if head is not None and depth <= n:   # below the switch: the full-precision head alone
            return _plain_state(_kv_class(type(layer)), head[0], head[1], depth)
        params = (("bits", int(layer.bits)), ("fp_head", n), ("group_size", int(layer.group_size)))
        if layer.keys is None:
            return LayerState(self.name, type(layer), (None, None, None, None), params, 0, 0)
        tail = lambda t: tuple(x[..., n:depth, :] for x in t)  # noqa: E731
        return LayerState(self.name, type(layer),
                          (tail(layer.keys), tail(layer.values), *(head if n else (None, None))), params, depth, 0)

    def checkout(self, state: LayerState, depth: int) -> Any:
        params = dict(state.params)
        group, bits, n = params["group_size"], params["bits"], params["fp_head"]
        k, v, hk, hv = state.arrays
        if k is not None and depth <= n:    # a full-precision KVCache, exactly as KVKind checks one out
            return super().checkout(_plain_state(_kv_class(state.cls), hk, hv, depth), depth)
        c = state.cls(group_size=group, bits=bits)
        if k is None:
            return c
        if n:
            whole = lambda h, t: tuple(  # noqa: E731
                mx.concatenate([hq, tq[..., :depth - n, :]], axis=-2)
                for hq, tq in zip(mx.quantize(h, group_size=group, bits=bits), t))
            c.keys, c.values = whole(hk, k), whole(hv, v)
            mark(c, FP_HEAD, (_fresh(hk), _fresh(hv)))
        else:
            c.keys, c.values = _cut_tokens(k, depth), _cut_tokens(v, depth)
        c.offset = depth
        return c

    def load(self, arrays: dict[str, Any], meta: dict, cls: type) -> LayerState:
        if "fp_head" not in meta["params"] or len(meta["slots"]) != 4:
            # written before entries kept their full-precision head: reused below the start it
            # would be approximate, so it is refused (the disk tier drops it: a miss, never wrong)
            raise ValueError("quantized layer state without its full-precision head (older format)")
        return super().load(arrays, meta, cls)


class TurboQuantKind(KVKind):
    """``TurboQuantKVCache`` (cache/turboquant.py): float K / V for attention, TurboQuant codes for
    the tokens from ``fp_head`` on; any depth at or past the head.

    Stored as a cold run holds it: the first ``fp_head`` tokens in full precision and the codes of
    the rest (never the decoded floats: that is the memory it saves). Checked out at or below the
    head it is a full-precision ``KVCache``; past it, the codes are decoded again -- exactly the
    floats the live cache decoded token by token (the codebook's integer centroids: exact in any
    order) -- behind the head. Slots: (key codes, value codes, key f, value f, head keys, head
    values); params bits, fp_head, seed."""
    name = "turboquant"
    class_names = ("TurboQuantKVCache",)
    class_modules = ("mlxstack.cache.turboquant",)
    always_trimmable = False
    hands_out_prefix = False     # floats and codes: a follower gets a copy (KVManager.fork) ...
    copies_prefix = True

    def floor(self, layer: Any, depth: int) -> int:
        return layer.fp_head

    def capture_floor(self, layer: Any, depth: int) -> int:
        return 0     # the full-precision head is kept as it was: below it, a plain layer's state

    def first(self, layer: Any, depth: int) -> tuple[Any, Any, int] | None:
        """... and the floats the layer attends as a root beside it: exactly what its codes decode
        to (decoding is exact), so the rows of a decode slab hold them once (cascade attention)
        while each row keeps its own codes (cache/turboquant_rows.py)."""
        if layer.keys is None or not 0 < depth <= layer.offset:
            return None
        return _cut_tokens(layer.keys, depth), _cut_tokens(layer.values, depth), depth

    def capture(self, layer: Any, depth: int, quant: KVQuant | None = None) -> LayerState:
        n = layer.fp_head
        if layer.keys is not None and depth <= n:
            return _plain_state(_kv_class(type(layer)), layer.keys, layer.values, depth)
        params = (("bits", layer.code_bits), ("fp_head", n), ("seed", layer.seed))
        if layer.keys is None:
            return LayerState(self.name, type(layer), (None,) * 6, params, 0, 0)
        head = (_cut_tokens(layer.keys, n), _cut_tokens(layer.values, n)) if n else (None, None)
        return LayerState(self.name, type(layer), (*layer.coded(depth), *head), params, depth, 0)

    def checkout(self, state: LayerState, depth: int) -> Any:
        from .turboquant import scheme

        p = dict(state.params)
        n = p["fp_head"]
        ck, cv, fk, fv, hk, hv = state.arrays
        if ck is not None and depth <= n:
            return KVKind.checkout(self, _plain_state(_kv_class(state.cls), hk, hv, depth), depth)
        c = state.cls(p["bits"], p["seed"], fp_head=n)
        if ck is None:
            return c
        m = depth - n
        book = scheme(p["bits"], ck.shape[-1] * 8 // p["bits"], p["seed"])     # bytes of codes -> head_dim
        parts = (_cut_tokens(ck, m), _cut_tokens(cv, m), _cut_tokens(fk, m), _cut_tokens(fv, m))
        keys, values = book.decode(parts[0], parts[2]), book.decode(parts[1], parts[3])
        if n:
            keys, values = mx.concatenate([hk[..., :n, :], keys], axis=-2), mx.concatenate([hv[..., :n, :], values], axis=-2)
        c.keys, c.values = mx.concatenate([keys, _room(keys)], axis=-2), mx.concatenate([values, _room(values)], axis=-2)
        c.offset = depth
        c.codes.keys, c.codes.values, c.codes.offset = parts[0], parts[1], m
        c.scales.keys, c.scales.values, c.scales.offset = parts[2], parts[3], m
        return c

    def cut(self, layer: Any, depth: int, target: int) -> None:
        layer.cut(target)

    def load(self, arrays: dict[str, Any], meta: dict, cls: type) -> LayerState:
        if not {"bits", "fp_head", "seed"} <= set(meta["params"]) or len(meta["slots"]) != 6:
            raise ValueError("turboquant layer state without its bits, seed or full-precision head")
        return super().load(arrays, meta, cls)
