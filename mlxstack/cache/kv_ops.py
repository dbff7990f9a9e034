"""The few verbs every cache kind shares, over mlx-lm per-layer cache lists.

A stored entry holds a ``KVState``: per-layer immutable array references cut to the
physical offset. ``checkout`` builds fresh cache objects from it, so generation after a
hit can never mutate the stored entry (mlx arrays are values; new Python array objects
are made by slicing, and slice-assignment only rebinds the working cache's own objects).

    state = capture(cache)                 # after generation: trim-to-offset + eval
    working = checkout(state, depth)       # on a hit: fresh objects, trimmed to depth
    kv_offset(working) == depth
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache


@dataclass(slots=True, frozen=True)
class LayerState:
    kind: str                 # "kv" | "arrays"
    arrays: tuple[Any, ...]   # kv: (keys, values); arrays: per-slot arrays (None allowed)
    offset: int               # tokens covered (kv); arrays: the depth at capture


@dataclass(slots=True, frozen=True)
class KVState:
    layers: tuple[LayerState, ...]
    offset: int               # physical token depth (first layer with .offset)
    trimmable: bool
    nbytes: int


def kv_offset(cache: Sequence[Any]) -> int:
    """Physical KV depth: the first layer that exposes ``.offset`` (hybrids mix ArraysCache)."""
    for layer in cache:
        off = getattr(layer, "offset", None)
        if off is not None:
            return int(off)
    return 0


def is_trimmable(cache: Sequence[Any]) -> bool:
    return bool(cache) and all(layer.is_trimmable() for layer in cache)


def _array_nbytes(arrays: Sequence[Any]) -> int:
    return sum(int(a.nbytes) for a in arrays if a is not None)


def capture(cache: Sequence[Any], depth: int | None = None) -> KVState:
    """Snapshot a working cache, cut to ``depth`` (default: its physical offset).

    Only KVCache and ArraysCache layers are supported; anything else raises TypeError so a new
    cache kind is never stored half-understood.
    """
    offset = kv_offset(cache)
    depth = offset if depth is None else depth
    trimmable = is_trimmable(cache)
    if depth != offset and not trimmable:
        raise ValueError(f"cannot cut a non-trimmable cache from {offset=} to {depth=}")
    layers: list[LayerState] = []
    to_eval: list[Any] = []
    for layer in cache:
        if isinstance(layer, KVCache):
            if layer.keys is None:
                layers.append(LayerState("kv", (None, None), 0))
                continue
            k = layer.keys[..., :depth, :]
            v = layer.values[..., :depth, :]
            layers.append(LayerState("kv", (k, v), depth))
            to_eval += [k, v]
        elif isinstance(layer, ArraysCache):
            arrays = tuple(layer.cache)
            layers.append(LayerState("arrays", arrays, depth))
            to_eval += [a for a in arrays if a is not None]
        else:
            raise TypeError(f"unsupported cache layer type {type(layer).__name__}")
    mx.eval(to_eval)
    nbytes = sum(_array_nbytes(s.arrays) for s in layers)
    return KVState(tuple(layers), depth, trimmable, nbytes)


def checkout(state: KVState, depth: int | None = None) -> list[Any]:
    """Fresh cache objects holding ``state`` cut to ``depth`` (<= state.offset)."""
    depth = state.offset if depth is None else depth
    if depth > state.offset:
        raise ValueError(f"checkout depth {depth} beyond stored offset {state.offset}")
    if depth != state.offset and not state.trimmable:
        raise ValueError(f"non-trimmable state stored at {state.offset} cannot serve depth {depth}")
    out: list[Any] = []
    for layer in state.layers:
        if layer.kind == "kv":
            c = KVCache()
            k, v = layer.arrays
            if k is not None:
                # Slicing makes new array objects: the working cache never aliases the store.
                c.keys = k[..., :depth, :]
                c.values = v[..., :depth, :]
                c.offset = depth
            out.append(c)
        else:
            c = ArraysCache(len(layer.arrays))
            c.cache = list(layer.arrays)
            out.append(c)
    return out


def state_fingerprint(state: KVState) -> list[float]:
    """Cheap numeric digest of stored arrays (tests prove a hit never mutates an entry)."""
    sums = []
    for layer in state.layers:
        for a in layer.arrays:
            if a is not None:
                sums.append(float(mx.sum(a.astype(mx.float32)).item()))
    return sums
