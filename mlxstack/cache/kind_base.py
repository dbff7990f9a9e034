"""The shared part of the cache kinds (cache/layer_kinds.py has the registry and the interface's
description): the quantisation policy, the immutable ``LayerState``, the array helpers every kind
uses, the ``CacheKind`` base and the plain-KV kind the quantised and prefixed kinds build on."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

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
FP_HEAD = "fp_head"   # cache/marks.py, on a live QuantizedKVCache: (keys, values) it held in
#                      full precision when it switched (the tokens below the start)


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
    copies_prefix = False      # its first tokens can be handed out as a copy (capture, then checkout)
    class_modules: tuple[str, ...] = ("mlx_lm", "mlx_vlm")   # packages / modules its classes come from

    def matches(self, layer: Any) -> bool:
        cls = type(layer)
        mod = cls.__module__
        return cls.__name__ in self.class_names and any(mod == m or mod.startswith(m + ".") for m in self.class_modules)

    def depth(self, layer: Any) -> int | None:
        off = getattr(layer, "offset", None)
        return None if off is None else int(off)

    def floor(self, layer: Any, depth: int) -> int:
        raise NotImplementedError

    def capture_floor(self, layer: Any, depth: int) -> int:
        """Smallest depth ``capture`` can snapshot (without cutting the layer): the floor, unless
        the kind keeps what lies below it as it was."""
        return self.floor(layer, depth)

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
