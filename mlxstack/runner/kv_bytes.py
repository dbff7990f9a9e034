"""KV / state bytes resident in RAM for the requests in flight, each array counted once.

    n = resident_bytes([slab_layers, seq.live.layers, ...])   # unique mx arrays, allocated size
    n = live_bytes(group, others)          # the decode group's rows and slabs, the other requests in flight

What the ``mlxstack_kv_bytes`` gauge adds to the RAM cache tier: a batch's slab (one array per
layer for all of its rows: counted once, not once per row), the caches of rows that decode on
their own, prompts being prefilled, snapshots taken during prefill, and the draft model's caches.
An array is counted by its allocated size (a KV buffer grows in steps of 256 tokens), once however
many caches refer to it -- a cache checked out of the prompt cache shares the entry's arrays until
its first append.
"""
from __future__ import annotations

from typing import Any, Collection, Iterable

import mlx.core as mx

from ..cache.kv_ops import LiveCache
from .generate import feed
from .mlx_stream import generation_stream

_CACHE_MODULES = ("mlx_lm.", "mlx_vlm.", "mlxstack.")


def _unwritten_view(layer: Any, root: Any) -> bool:
    """A plain KV layer still holding the view of its root it was given (a checkout or a fork,
    before its first append: KVCache grows by concatenating into a new buffer, so a layer whose
    buffer is exactly its root's first n tokens has not copied them). Its memory is the root's."""
    keys = getattr(layer, "keys", None)
    return root is not None and keys is not None and keys.shape[-2] == root[2] == getattr(layer, "offset", -1)


def _collect(obj: Any, seen: dict[int, int], depth: int = 0) -> None:
    if obj is None or depth > 6:
        return
    if isinstance(obj, LiveCache):
        roots = obj.roots
        for i, layer in enumerate(obj.layers):
            root = roots[i] if i < len(roots) else None
            if _unwritten_view(layer, root):
                _collect(root[:2], seen, depth + 1)
            else:
                _collect(layer, seen, depth + 1)
        return
    if isinstance(obj, mx.array):
        seen[id(obj)] = obj.nbytes
    elif hasattr(type(obj), "resident_arrays"):      # an object that lists its own (TurboQuant row codes)
        obj.resident_arrays(seen)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _collect(x, seen, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            _collect(x, seen, depth + 1)
    elif type(obj).__module__.startswith(_CACHE_MODULES) and hasattr(obj, "__dict__") \
            and not hasattr(obj, "parameters"):           # a cache object, never a model
        for x in vars(obj).values():
            _collect(x, seen, depth + 1)
    elif hasattr(type(obj), "__slots__") and type(obj).__module__.startswith("mlxstack."):
        for name in type(obj).__slots__:
            _collect(getattr(obj, name, None), seen, depth + 1)


def resident_arrays(objects: Iterable[Any]) -> dict[int, int]:
    """id -> allocated bytes of the distinct mx arrays reachable from ``objects``."""
    seen: dict[int, int] = {}
    for obj in objects:
        _collect(obj, seen)
    return seen


def resident_bytes(objects: Iterable[Any], besides: Collection[int] = ()) -> int:
    """Bytes of the distinct mx arrays reachable from ``objects`` (caches, lists of cache layers,
    captured states), each counted once by its allocated size -- less the arrays whose ids are in
    ``besides`` (the RAM cache tier's: a prefix checked out by reference is the tier's memory,
    counted there once; LESSONS 63)."""
    return sum(n for i, n in resident_arrays(objects).items() if i not in besides)


def live_bytes(group: Any, others: Iterable[Any] = (), besides: Collection[int] = ()) -> int:
    """Everything the requests in flight hold right now -- the decode group's slab and rows (a
    batch set aside whole among them: runner/batch.py DecodeGroup) and ``others`` (prompts in
    prefill with their snapshots, replied turns waiting to be closed, preempted rows), with the
    rows' draft model caches -- each array once, less the arrays in ``besides`` (the RAM tier's)."""
    objects: list[Any] = [group.slab, group.paused_slab]
    for seq in [*group.seqs, *others]:
        objects.append(seq.live)
        objects.append(seq.snapshots)
        drafter = getattr(seq.spec, "drafter", None)
        objects.append(getattr(getattr(drafter, "then", drafter), "cache", None))
    return resident_bytes(objects, besides)


def _token_part(layer: Any) -> tuple[int, int]:
    """(bytes that grow with the tokens, bytes that do not) of one cache layer holding ``n``
    tokens in ``cap`` allocated positions: keys / values (plain or quantised tuples) scale with
    the positions; anything else (recurrent / conv state, offsets) is per sequence."""
    grows, fixed, seen = 0, 0, set()
    for name, value in vars(layer).items() if hasattr(layer, "__dict__") else ():
        parts = value if isinstance(value, (list, tuple)) else [value]
        for a in parts:
            if not isinstance(a, mx.array) or id(a) in seen:
                continue
            seen.add(id(a))
            if name in ("keys", "values") and a.ndim >= 3 and a.shape[-2] > 0:
                grows += a.nbytes // a.shape[-2]
            else:
                fixed += a.nbytes
    for child in getattr(layer, "caches", ()) or ():
        g, f = _token_part(child)
        grows, fixed = grows + g, fixed + f
    return grows, fixed


def token_bytes(live: LiveCache) -> tuple[int, int]:
    """(bytes per token, bytes per sequence) of a model's cache, from a ``live`` cache that was fed
    at least one token (pure over its arrays): what one more request will hold is about
    ``per_token * tokens + per_sequence`` (a sliding window counts as if it never rotated)."""
    grows, fixed = 0, 0
    for layer in live.layers:
        g, f = _token_part(layer)
        grows, fixed = grows + g, fixed + f
    return grows, fixed


def measured_token_bytes(ctx: Any) -> tuple[int, int]:
    """``token_bytes`` of the context's model (runner/rows.py RunnerContext, or an engine carrying
    one): a fresh cache fed one token (one small forward)."""
    from .rows import context_of

    ctx = context_of(ctx)
    with mx.stream(generation_stream()):
        live = ctx.new_cache()
        feed(ctx.model, live, [0], 1)
    return token_bytes(live)
