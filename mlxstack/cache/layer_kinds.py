"""One interface for every per-layer cache kind mlx-lm and mlx-vlm build.

Each kind answers the same few verbs (the way mlx-lm's ``models/cache.py`` gives every cache
``state`` / ``meta_state`` / ``is_trimmable`` / ``trim`` / ``nbytes`` / ``from_state``):

    kind = kind_of(layer)                    # None: a class we do not understand
    kind.depth(layer)                         # tokens the layer holds (None: recurrent, unknown)
    kind.floor(layer, depth)                  # smallest depth it can still be cut back to
    state = kind.capture(layer, depth)        # immutable LayerState cut to ``depth``
    layer2 = kind.checkout(state, d)          # fresh object of the same class, same parameters
    kind.cut(layer, depth, d)                 # cut a live layer back to d (floor <= d <= depth)
    kind.room(layer, depth)                   # tokens one forward may add and still cut back
    root = kind.first(layer, d)               # its first d tokens as (keys, values, d), others may hold
    arrays, meta = kind.dump(state)           # flat arrays + JSON meta (the disk tier's form)
    state = kind.load(arrays, meta, cls)      # the inverse

What each kind can serve (``floor``):
- ``KVCache`` / ``QuantizedKVCache``: any depth <= stored (floor 0).
- ``RotatingKVCache``: any depth while nothing has rotated out (every token since 0 still held,
  in order); after that only its exact depth.
- ``ChunkedKVCache`` (llama4): depths whose attention chunk starts at or after the first token
  it still holds, i.e. ``d >= ceil(start_position / chunk) * chunk``; never before. (mlx-lm's
  own ``trim`` clamps silently there, so it is never used.)
- ``ArraysCache`` (SSM / conv state): exact depth only.
- ``CacheList``: the depths all its members can serve.

Checkout never aliases a stored array: slice assignment (``keys[..., a:b, :] = k``) rewrites
the Python array object it is applied to, so every array handed to a live cache is a new
object made by indexing (LESSONS.md §2).

Why one module of ~500 lines: the kinds are one registry behind one interface, and each kind's
verbs are read against the others' (a CacheList is its members' kinds; the quantised kind builds
its full-precision head with KVKind's code): split per kind, every file would import the rest.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx


@dataclass(slots=True, frozen=True)
class KVQuant:
    """KV quantisation (KV_BITS): the live cache switches to ``QuantizedKVCache`` (uniform) or
    ``TurboQuantKVCache`` (turboquant) at exactly ``start`` tokens. A stored entry holds what a cold run holds: full precision below ``start``,
    quantised from it -- so a hit below the start is full precision and one at or past it is the
    same quantised computation (both exact)."""
    bits: int
    group_size: int
    start: int
    scheme: str = "uniform"     # uniform (mlx-lm's QuantizedKVCache) | turboquant (cache/turboquant.py)
    seed: int = 0               # turboquant: the rotation's seed


UNBOUNDED = 1 << 30             # room() of a layer any forward can be cut back from
FP_HEAD = "_mlxstack_fp_head"   # on a live QuantizedKVCache: (keys, values) it held in full
#                                 precision when it switched (the tokens below the start)


@dataclass(slots=True, frozen=True)
class LayerState:
    """An immutable copy of one layer's cache, cut to ``depth`` tokens."""
    kind: str                          # registry name: kv | quantized | rotating | chunked | arrays | list
    cls: type                          # the exact class checkout rebuilds (mlx-lm's or mlx-vlm's)
    arrays: tuple[Any, ...]            # kind-specific order; None allowed (an unset state slot)
    params: tuple[tuple[str, int], ...]  # constructor parameters and positions (max_size, keep, idx, ...)
    depth: int
    floor: int                         # smallest depth this state can serve
    children: tuple["LayerState", ...] = ()

    def param(self, name: str) -> int:
        return dict(self.params)[name]

    @property
    def nbytes(self) -> int:
        own = sum(_nbytes(a) for a in self.arrays)
        return own + sum(c.nbytes for c in self.children)


def _nbytes(a: Any) -> int:
    if a is None:
        return 0
    if isinstance(a, (tuple, list)):
        return sum(_nbytes(x) for x in a)
    return int(a.nbytes)


def _fresh(a: Any) -> Any:
    """A new Python array object over the same value (never the stored object itself)."""
    if a is None:
        return None
    if isinstance(a, (tuple, list)):
        return type(a)(_fresh(x) for x in a)
    return a[...]


def _cut_tokens(a: Any, n: int) -> Any:
    """First ``n`` positions along the token axis (-2) of an array or a quantized triple."""
    if isinstance(a, (tuple, list)):
        return tuple(x[..., :n, :] for x in a)
    return a[..., :n, :]


def _joined(root: Any, tail: Any, p: int, depth: int, room: bool) -> Any:
    """``root[:p] + tail[:depth - p]`` along the token axis; with ``room`` the buffer has 256 more
    positions (a KVCache appends there in place; its ``offset`` says what is valid)."""
    parts = [root[..., :p, :], tail[..., :depth - p, :]]
    return mx.concatenate(parts + [_room(tail)] if room else parts, axis=-2)


def _room(a: Any) -> Any:
    """256 zero positions shaped like ``a``: room a checked-out buffer appends into in place."""
    return mx.zeros((*a.shape[:-2], 256, a.shape[-1]), dtype=a.dtype)


def _rooted_state(cls: type, root: tuple[Any, Any, int], depth: int, tail: tuple[Any, Any] | None) -> LayerState:
    """A plain-KV state whose first ``p`` tokens are ``root``'s arrays (the objects, by reference)
    and the rest ``tail`` (copied by the caller); with ``depth <= p`` it is all root."""
    rk, rv, p = root
    if depth <= p:
        return LayerState(KVKind.name, cls, (rk[..., :0, :], rv[..., :0, :], rk, rv), (("prefix", depth),), depth, 0)
    return LayerState(KVKind.name, cls, (tail[0], tail[1], rk, rv), (("prefix", p),), depth, 0)


def rooted(state: LayerState) -> bool:
    """A plain-KV state whose first tokens are a shared root (KVKind.capture_rooted)."""
    return state.kind == "kv" and len(state.arrays) == 4


def _plain_state(cls: type, keys: Any, values: Any, depth: int) -> LayerState:
    """A full-precision ``KVCache`` state of the first ``depth`` tokens of ``keys`` / ``values``."""
    return LayerState(KVKind.name, cls, (_cut_tokens(keys, depth), _cut_tokens(values, depth)), (), depth, 0)


def _kv_class(cls: type) -> type:
    """The ``KVCache`` class of the package (mlx-lm or mlx-vlm) that defines ``cls``."""
    return getattr(sys.modules[cls.__module__], "KVCache")


class CacheKind:
    """Base of every kind: subclasses fill in the verbs for their layer layout."""
    name = ""
    class_names: tuple[str, ...] = ()
    always_trimmable = False   # every reachable state has floor 0 (no checkpoints needed)
    replayable = True          # a forward only rebinds or writes past what ``mark`` keeps (restore + replay)
    hands_out_prefix = False   # ``first`` answers: its first tokens can be held by reference elsewhere

    def matches(self, layer: Any) -> bool:
        cls = type(layer)
        return cls.__name__ in self.class_names and cls.__module__.startswith(("mlx_lm.", "mlx_vlm."))

    def depth(self, layer: Any) -> int | None:
        off = getattr(layer, "offset", None)
        return None if off is None else int(off)

    def floor(self, layer: Any, depth: int) -> int:
        raise NotImplementedError

    def capture(self, layer: Any, depth: int, quant: KVQuant | None = None) -> LayerState:
        raise NotImplementedError

    def checkout(self, state: LayerState, depth: int) -> Any:
        raise NotImplementedError

    def cut(self, layer: Any, depth: int, target: int) -> None:
        raise NotImplementedError

    def room(self, layer: Any, depth: int) -> int:
        """How many tokens one forward may add to the layer such that it can still be cut back
        to any depth in between (speculative decoding verifies drafts that way). 0: none."""
        return 0

    def first(self, layer: Any, depth: int) -> tuple[Any, Any, int] | None:
        """The layer's first ``depth`` tokens as a root ``(keys, values, depth)``: arrays whose first
        ``depth`` positions are exactly what the layer holds there, whatever form it holds them in
        (a shared prefill's fork hands them to its followers by reference). None: this kind cannot
        (not plain KV), or the layer holds fewer tokens. LESSONS 63."""
        return None

    # ---- serialisable form: named arrays + JSON-able meta (the disk tier stores these)
    def dump(self, state: LayerState) -> tuple[dict[str, Any], dict]:
        arrays: dict[str, Any] = {}
        for i, a in enumerate(state.arrays):
            if isinstance(a, (tuple, list)):
                for j, x in enumerate(a):
                    arrays[f"{i}.{j}"] = x
            elif a is not None:
                arrays[str(i)] = a
        shape = ["t" if isinstance(a, (tuple, list)) else ("n" if a is None else "a") for a in state.arrays]
        meta = {"kind": self.name, "slots": shape, "params": dict(state.params),
                "depth": state.depth, "floor": state.floor}
        return arrays, meta

    def load(self, arrays: dict[str, Any], meta: dict, cls: type) -> LayerState:
        slots: list[Any] = []
        for i, s in enumerate(meta["slots"]):
            if s == "n":
                slots.append(None)
            elif s == "a":
                slots.append(arrays[str(i)])
            else:
                j, parts = 0, []
                while f"{i}.{j}" in arrays:
                    parts.append(arrays[f"{i}.{j}"])
                    j += 1
                slots.append(tuple(parts))
        return LayerState(self.name, cls, tuple(slots), tuple(sorted(meta["params"].items())),
                          int(meta["depth"]), int(meta["floor"]))


# ------------------------------------------------------------------------------ attention KV
class KVKind(CacheKind):
    """``KVCache``: keys/values [B, heads, tokens, dim]; any depth can be served."""
    name = "kv"
    class_names = ("KVCache",)
    always_trimmable = True
    hands_out_prefix = True

    def floor(self, layer: Any, depth: int) -> int:
        return 0

    def capture(self, layer: Any, depth: int, quant: KVQuant | None = None) -> LayerState:
        # A full-precision layer is stored as it is, KV_BITS or not: it is below the start (the
        # live cache switches there), where a cold run is full precision too.
        if layer.keys is None:
            return LayerState(self.name, type(layer), (None, None), (), 0, 0)
        return _plain_state(type(layer), layer.keys, layer.values, depth)

    def checkout(self, state: LayerState, depth: int) -> Any:
        c = state.cls()
        k, v = self.whole(state, depth)
        if k is not None:
            c.keys, c.values = k, v
            c.offset = depth
        return c

    # ---- a shared root: the first ``prefix`` tokens held once for every entry that reuses them
    def capture_rooted(self, layer: Any, depth: int, root: tuple[Any, Any, int]) -> LayerState:
        """Like ``capture``, but the first ``p`` tokens are ``root`` (arrays another entry or
        request holds: the same objects, never copied) and only ``[p, depth)`` is copied out.
        Slots: (tail keys, tail values, root keys, root values); param ``prefix`` = p."""
        if layer.keys is None:
            return self.capture(layer, depth)
        p = root[2]
        tail = lambda a: mx.contiguous(a[..., p:depth, :])  # noqa: E731 - a copy: the live buffer is not kept
        return _rooted_state(type(layer), root, depth, (tail(layer.keys), tail(layer.values)) if depth > p else None)

    def whole(self, state: LayerState, depth: int, room: bool = True) -> tuple[Any, Any]:
        """The state's keys / values cut to ``depth`` as new array objects (a rooted state past
        its root: root + tail, one copy -- with ``room``, 256 positions to append in place)."""
        if not rooted(state):
            k, v = state.arrays
            return (None, None) if k is None else (_cut_tokens(k, depth), _cut_tokens(v, depth))
        k, v, rk, rv = state.arrays
        p = state.param("prefix")
        if depth <= p:
            return _cut_tokens(rk, depth), _cut_tokens(rv, depth)
        return _joined(rk, k, p, depth, room), _joined(rv, v, p, depth, room)

    def checkout_by_reference(self, state: LayerState, depth: int) -> Any:
        """A ``PrefixedKVCache`` holding ``state``'s first tokens by reference (the very arrays:
        ``root``) and only what follows a rooted state's root as its own tail (copied, with room):
        the first append writes a short tail instead of copying every reused token into a new
        buffer (copy-free warm turns). None where a plain ``KVCache`` checkout is the only form
        (another class, nothing held)."""
        from mlx_lm.models.cache import KVCache

        from .prefixed_kv import PrefixedKVCache

        root = self.root(state, depth)
        if state.cls is not KVCache or root is None:
            return None
        rk, rv, n = root
        if depth <= n:
            return PrefixedKVCache((rk, rv, depth))
        k, v = state.arrays[0], state.arrays[1]            # a rooted state's tail past its root
        tail = lambda a: mx.concatenate([a[..., :depth - n, :], _room(a)], axis=-2)  # noqa: E731
        return PrefixedKVCache((rk, rv, n), tail(k), tail(v), depth - n)

    def root(self, state: LayerState, depth: int) -> tuple[Any, Any, int] | None:
        """What a cache checked out of ``state`` at ``depth`` shares with it: (keys, values, n) --
        its first n tokens are the first n of these arrays (the objects themselves)."""
        if state.arrays[0] is None or depth <= 0:
            return None
        if not rooted(state):
            return state.arrays[0], state.arrays[1], depth
        return state.arrays[2], state.arrays[3], min(depth, state.param("prefix"))

    def dump(self, state: LayerState) -> tuple[dict[str, Any], dict]:
        if rooted(state):               # on disk a rooted state is one plain state (the root inlined)
            k, v = self.whole(state, state.depth, room=False)
            return super().dump(LayerState(self.name, state.cls, (k, v), (), state.depth, 0))
        return super().dump(state)

    def cut(self, layer: Any, depth: int, target: int) -> None:
        layer.offset = target

    def room(self, layer: Any, depth: int) -> int:
        return UNBOUNDED

    def first(self, layer: Any, depth: int) -> tuple[Any, Any, int] | None:
        if layer.keys is None or not 0 < depth <= layer.offset:
            return None
        return _cut_tokens(layer.keys, depth), _cut_tokens(layer.values, depth), depth


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
        head = getattr(layer, FP_HEAD, None) if layer.keys is not None else None
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
            setattr(c, FP_HEAD, (_fresh(hk), _fresh(hv)))
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
    always_trimmable = False
    hands_out_prefix = False

    def matches(self, layer: Any) -> bool:
        cls = type(layer)
        return cls.__name__ in self.class_names and cls.__module__ == "mlxstack.cache.turboquant"

    def floor(self, layer: Any, depth: int) -> int:
        return layer.fp_head

    def first(self, layer: Any, depth: int) -> tuple[Any, Any, int] | None:
        return None

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


class RotatingKind(CacheKind):
    """``RotatingKVCache`` (sliding-window layers).

    - While every token since 0 is still held in order (``_idx == offset``) it serves any depth.
    - Once the window has rotated it serves its exact depth, restored byte for byte (buffer
      layout, ``_idx``) as the model left it -- and one token less when the ring is full
      (``keep == 0``, decode's one-token writes): the next query at depth d needs the W-1 keys
      before it, which the ring still holds; the dropped token's slot is the next one written
      (in-place) or the first one trimmed (concatenating prefill). Only one such cut is sound, so
      the layer is marked and cuts no further.
    """
    name = "rotating"
    class_names = ("RotatingKVCache",)
    CUT_MARK = "_mlxstack_cut"

    @staticmethod
    def _in_order(layer: Any) -> bool:
        return layer.keys is None or (layer._idx == layer.offset and layer.keys.shape[2] >= layer.offset)

    def _one_back(self, layer: Any) -> bool:
        return (layer.keep == 0 and layer.keys.shape[2] == layer.max_size and layer._idx >= 1
                and layer.offset > layer.max_size and not getattr(layer, self.CUT_MARK, False))

    def floor(self, layer: Any, depth: int) -> int:
        if self._in_order(layer):
            return 0
        return depth - 1 if self._one_back(layer) else depth

    def capture(self, layer: Any, depth: int, quant: KVQuant | None = None) -> LayerState:
        base = (("keep", int(layer.keep)), ("max_size", int(layer.max_size)))
        if layer.keys is None:
            return LayerState(self.name, type(layer), (None, None), base + (("cut", 0), ("idx", 0)), 0, 0)
        if self._in_order(layer):
            return LayerState(self.name, type(layer), (_cut_tokens(layer.keys, depth), _cut_tokens(layer.values, depth)),
                              base + (("cut", 0), ("idx", depth)), depth, 0)
        back = layer.offset - depth
        if back not in (0, 1) or (back == 1 and not self._one_back(layer)):
            raise ValueError(f"rotated sliding-window cache at {layer.offset} cannot be cut to {depth}")
        cut = 1 if back == 1 or getattr(layer, self.CUT_MARK, False) else 0
        return LayerState(self.name, type(layer), (_fresh(layer.keys), _fresh(layer.values)),
                          base + (("cut", cut), ("idx", int(layer._idx) - back)), depth, depth)

    def checkout(self, state: LayerState, depth: int) -> Any:
        c = state.cls(max_size=state.param("max_size"), keep=state.param("keep"))
        k, v = state.arrays
        if k is None:
            return c
        if state.floor == 0:
            c.keys, c.values = _cut_tokens(k, depth), _cut_tokens(v, depth)
            c.offset, c._idx = depth, depth
        else:
            c.keys, c.values = _fresh(k), _fresh(v)
            c.offset, c._idx = state.depth, state.param("idx")
            if state.param("cut"):
                setattr(c, self.CUT_MARK, True)
        return c

    def cut(self, layer: Any, depth: int, target: int) -> None:
        if not self._in_order(layer):
            setattr(layer, self.CUT_MARK, True)
        layer._idx -= depth - target
        layer.offset = target

    def room(self, layer: Any, depth: int) -> int:
        # only while nothing rotates out, during the forward or after it (a forward of S tokens
        # concatenates them in temporal order; the window trims once it passes max_size)
        return max(0, int(layer.max_size) - depth - 1) if self._in_order(layer) else 0


class ChunkedKind(CacheKind):
    """``ChunkedKVCache`` (llama4 chunked attention): holds tokens [start_position, offset).
    A query at position d attends to its own chunk, which starts at ``d // chunk * chunk``;
    depth d can be served only when that chunk start is still held."""
    name = "chunked"
    class_names = ("ChunkedKVCache",)
    replayable = True          # a forward rebinds a trimmed front and writes past the offset: mark / restore undo it

    def floor(self, layer: Any, depth: int) -> int:
        start, chunk = int(layer.start_position), int(layer.chunk_size)
        return min(depth, math.ceil(start / chunk) * chunk)

    def capture(self, layer: Any, depth: int, quant: KVQuant | None = None) -> LayerState:
        start = int(layer.start_position)
        params = (("chunk_size", int(layer.chunk_size)), ("start", start))
        if layer.keys is None:
            return LayerState(self.name, type(layer), (None, None), params, 0, 0)
        floor = self.floor(layer, int(layer.offset))
        if depth < floor and depth != layer.offset:
            raise ValueError(f"chunked cache holding [{start}, {layer.offset}) cannot be cut to {depth}")
        held = depth - start
        return LayerState(self.name, type(layer), (_cut_tokens(layer.keys, held), _cut_tokens(layer.values, held)),
                          params, depth, min(floor, depth))

    def checkout(self, state: LayerState, depth: int) -> Any:
        c = state.cls(chunk_size=state.param("chunk_size"))
        k, v = state.arrays
        if k is None:
            return c
        start = state.param("start")
        c.keys, c.values = _cut_tokens(k, depth - start), _cut_tokens(v, depth - start)
        c.offset, c.start_position = depth, start
        return c

    def cut(self, layer: Any, depth: int, target: int) -> None:
        layer.offset = target


class ArraysKind(CacheKind):
    """``ArraysCache`` (SSM / conv / gated-delta state): the state after exactly ``depth``
    tokens; it cannot be cut back, so it serves its exact depth only."""
    name = "arrays"
    class_names = ("ArraysCache", "MambaCache")

    def depth(self, layer: Any) -> int | None:
        return None

    def floor(self, layer: Any, depth: int) -> int:
        return depth

    def capture(self, layer: Any, depth: int, quant: KVQuant | None = None) -> LayerState:
        return LayerState(self.name, type(layer), tuple(_fresh(a) for a in layer.cache), (("size", len(layer.cache)),),
                          depth, depth)

    def checkout(self, state: LayerState, depth: int) -> Any:
        c = state.cls(state.param("size"))
        c.cache = [_fresh(a) for a in state.arrays]
        return c

    def cut(self, layer: Any, depth: int, target: int) -> None:
        if target != depth:
            raise ValueError(f"recurrent state at {depth} cannot be cut to {target}")


class ListKind(CacheKind):
    """``CacheList``: several caches for one layer; serves what all of them serve."""
    name = "list"
    class_names = ("CacheList",)

    def depth(self, layer: Any) -> int | None:
        for c in layer.caches:
            d = kind_of(c).depth(c)
            if d is not None:
                return d
        return None

    def floor(self, layer: Any, depth: int) -> int:
        return max((kind_of(c).floor(c, depth) for c in layer.caches), default=0)

    def capture(self, layer: Any, depth: int, quant: KVQuant | None = None) -> LayerState:
        children = tuple(kind_of(c).capture(c, depth, quant) for c in layer.caches)
        floor = max((c.floor for c in children), default=0)
        return LayerState(self.name, type(layer), (), (), depth, floor, children)

    def checkout(self, state: LayerState, depth: int) -> Any:
        return state.cls(*(KINDS[c.kind].checkout(c, depth) for c in state.children))

    def cut(self, layer: Any, depth: int, target: int) -> None:
        for c in layer.caches:
            kind_of(c).cut(c, depth, target)

    def room(self, layer: Any, depth: int) -> int:
        return min((kind_of(c).room(c, depth) for c in layer.caches), default=0)

    def dump(self, state: LayerState) -> tuple[dict[str, Any], dict]:
        arrays: dict[str, Any] = {}
        metas = []
        for i, child in enumerate(state.children):
            a, m = KINDS[child.kind].dump(child)
            arrays.update({f"c{i}.{k}": v for k, v in a.items()})
            metas.append({**m, "cls": class_key(child.cls)})
        return arrays, {"kind": self.name, "children": metas, "depth": state.depth, "floor": state.floor}

    def load(self, arrays: dict[str, Any], meta: dict, cls: type) -> LayerState:
        children = []
        for i, m in enumerate(meta["children"]):
            prefix = f"c{i}."
            own = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
            children.append(KINDS[m["kind"]].load(own, m, class_from_key(m["cls"])))
        return LayerState(self.name, cls, (), (), int(meta["depth"]), int(meta["floor"]), tuple(children))


class PrefixedKind(CacheKind):
    """``PrefixedKVCache`` (cache/prefixed_kv.py): a plain KV layer whose first tokens are a prefix
    held by reference (a row handed back by a decode batch whose rows share one). Any depth; it is
    stored as a rooted plain-KV state (the prefix by reference, the tail copied), so every entry,
    checkout and disk file is the plain kind's."""
    name = "prefixed"
    class_names = ("PrefixedKVCache",)
    always_trimmable = True
    hands_out_prefix = True

    def matches(self, layer: Any) -> bool:
        cls = type(layer)
        return cls.__name__ in self.class_names and cls.__module__ == "mlxstack.cache.prefixed_kv"

    def floor(self, layer: Any, depth: int) -> int:
        return 0

    def capture(self, layer: Any, depth: int, quant: KVQuant | None = None) -> LayerState:
        from mlx_lm.models.cache import KVCache

        if not layer.n_prefix:
            k, v = layer.tail(depth)
            return _plain_state(KVCache, k, v, depth) if k is not None else LayerState("kv", KVCache, (None, None), (), 0, 0)
        tail = layer.tail(depth) if depth > layer.n_prefix else None
        return _rooted_state(KVCache, layer.prefix, depth, tail and (mx.contiguous(tail[0]), mx.contiguous(tail[1])))

    def checkout(self, state: LayerState, depth: int) -> Any:
        raise TypeError("a prefixed layer is stored as a plain KV state")

    def cut(self, layer: Any, depth: int, target: int) -> None:
        n = layer.n_prefix
        if target >= n:
            layer.offset = target
        else:                       # into the prefix: a shorter prefix, no tail
            rk, rv, _ = layer.prefix
            layer.prefix, layer.keys, layer.values, layer.offset = (rk, rv, target), None, None, target

    def room(self, layer: Any, depth: int) -> int:
        return UNBOUNDED

    def first(self, layer: Any, depth: int) -> tuple[Any, Any, int] | None:
        """Within the prefix: the prefix's own arrays (the same objects, so every holder of them is
        recognised as sharing one root: LESSONS 42); past it: prefix + tail joined, one copy --
        never the tail buffer alone (its position 0 is token ``n_prefix``, not token 0)."""
        if not 0 < depth <= layer.offset:
            return None
        n = layer.n_prefix
        if not n:
            tk, tv = layer.tail(depth)
            return tk, tv, depth
        rk, rv, _ = layer.prefix
        if depth <= n:
            return rk, rv, depth
        return _joined(rk, layer.keys, n, depth, False), _joined(rv, layer.values, n, depth, False), depth


KINDS: dict[str, CacheKind] = {k.name: k for k in (KVKind(), QuantizedKind(), RotatingKind(), ChunkedKind(),
                                                   ArraysKind(), ListKind(), PrefixedKind(), TurboQuantKind())}
QUANTIZED_KINDS = frozenset({"quantized", "turboquant"})     # the live forms past QUANTIZED_KV_START


def kind_of(layer: Any) -> CacheKind | None:
    """The kind handling ``layer``'s class, or None for a class this module does not know."""
    for kind in KINDS.values():
        if kind.matches(layer):
            return kind
    return None


# ------------------------------------------------------------------------------ classes on disk
def class_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def class_from_key(key: str) -> type:
    """Resolve a stored class name; only cache classes of mlx-lm / mlx-vlm are accepted, so a
    file on disk can never name an arbitrary importable object."""
    import importlib

    module, _, name = key.partition(":")
    if key == "mlxstack.cache.turboquant:TurboQuantKVCache":
        from .turboquant import TurboQuantKVCache

        return TurboQuantKVCache
    if module not in ("mlx_lm.models.cache", "mlx_vlm.models.cache") or "." in name:
        raise ValueError(f"refusing cache class {key!r} (not an mlx-lm / mlx-vlm cache class)")
    cls = getattr(importlib.import_module(module), name, None)
    if not isinstance(cls, type) or not any(name in k.class_names for k in KINDS.values()):
        raise ValueError(f"unknown cache class {key!r}")
    return cls


# ------------------------------------------------------------------------------ a model's layout
@dataclass(frozen=True)
class CacheLayout:
    """What one freshly built cache of a model looks like (probed once at load)."""
    kinds: tuple[str, ...]             # per layer: a kind name, or "?ClassName" for an unknown class
    unknown: tuple[str, ...] = field(default=())

    @property
    def supported(self) -> bool:
        return not self.unknown

    @property
    def always_trimmable(self) -> bool:
        """Every state this layout reaches can be cut to any depth (plain KV): no checkpoints."""
        return self.supported and all(KINDS[k].always_trimmable for k in self.kinds)

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for k in self.kinds:
            counts[k] = counts.get(k, 0) + 1
        return "+".join(f"{n}x{k}" for k, n in counts.items())


def probe_layout(cache: Sequence[Any]) -> CacheLayout:
    kinds, unknown = [], []
    for layer in cache:
        kind = kind_of(layer)
        if kind is None or (kind.name == "list" and any(kind_of(c) is None for c in layer.caches)):
            name = type(layer).__name__ if kind is None else "CacheList(" + ",".join(
                type(c).__name__ for c in layer.caches) + ")"
            unknown.append(name)
            kinds.append("?" + name)
        else:
            kinds.append(kind.name)
    return CacheLayout(tuple(kinds), tuple(dict.fromkeys(unknown)))


def eval_state(states: Sequence[LayerState], extra: Callable[[list], None] | None = None) -> None:
    """Materialise every array of ``states`` (a capture must not keep the live graph alive)."""
    out: list[Any] = []

    def walk(s: LayerState) -> None:
        for a in s.arrays:
            if isinstance(a, (tuple, list)):
                out.extend(x for x in a if x is not None)
            elif a is not None:
                out.append(a)
        for c in s.children:
            walk(c)

    for s in states:
        walk(s)
    if out:
        mx.eval(out)


# ------------------------------------------------------------------------------ before a forward
def mark_layer(layer: Any) -> Any:
    """What ``layer`` holds now, as references: a forward rebinds its arrays (concatenation,
    recurrent state) or writes past its offset, so putting these back undoes it (speculative
    decoding on caches that cannot be cut: restore, then replay the accepted tokens)."""
    if hasattr(layer, "caches"):                                   # CacheList
        return [mark_layer(c) for c in layer.caches]
    return {k: list(v) if isinstance(v, list) else v for k, v in vars(layer).items()}


def restore_layer(layer: Any, mark: Any) -> None:
    if hasattr(layer, "caches"):
        for c, m in zip(layer.caches, mark):
            restore_layer(c, m)
        return
    for k in [k for k in vars(layer) if k not in mark]:
        delattr(layer, k)
    for k, v in mark.items():
        setattr(layer, k, list(v) if isinstance(v, list) else v)


def replayable(layer: Any) -> bool:
    kind = kind_of(layer)
    if kind is None or not kind.replayable:
        return False
    return all(replayable(c) for c in layer.caches) if hasattr(layer, "caches") else True
