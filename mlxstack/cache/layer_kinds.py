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

Where the kinds live: the shared base and the plain-KV kind in ``kind_base``, the quantised kinds in
``quantized_kinds``, the attention windows in ``window_kinds``; here the kinds that read the registry
(a CacheList is its members' kinds), the prefixed kind, the registry itself and the layout probe.
Import them from here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx

from .kind_base import (FP_HEAD, UNBOUNDED, CacheKind, KVKind, KVQuant, LayerState, _fresh, _joined,
                        _plain_state, _rooted_state, rooted)
from .marks import marks_of, set_marks
from .quantized_kinds import QuantizedKind, TurboQuantKind
from .state_codes import checked, restore
from .window_kinds import ChunkedKind, RotatingKind

__all__ = ["FP_HEAD", "UNBOUNDED", "KINDS", "QUANTIZED_KINDS", "KVQuant", "LayerState", "CacheKind", "CacheLayout",
           "class_from_key", "class_key", "eval_state", "kind_of", "mark_layer", "probe_layout", "replayable",
           "restore_layer", "rooted"]


class ArraysKind(CacheKind):
    """``ArraysCache`` (SSM / conv / gated-delta state): the state after exactly ``depth``
    tokens; it cannot be cut back, so it serves its exact depth only. A stored state may hold
    TurboQuant codes of its arrays (RECURRENT_STATE_BITS, coded at store: cache/state_codes.py)."""
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
        c.cache = restore(state)          # new objects; a stored state's codes decoded (RECURRENT_STATE_BITS)
        return c

    def cut(self, layer: Any, depth: int, target: int) -> None:
        if target != depth:
            raise ValueError(f"recurrent state at {depth} cannot be cut to {target}")

    def load(self, arrays: dict[str, Any], meta: dict, cls: type) -> LayerState:
        return checked(super().load(arrays, meta, cls))


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
    class_modules = ("mlxstack.cache.prefixed_kv",)
    always_trimmable = True
    hands_out_prefix = True

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
    return {k: list(v) if isinstance(v, list) else v for k, v in vars(layer).items()}, marks_of(layer)


def restore_layer(layer: Any, mark: Any) -> None:
    if hasattr(layer, "caches"):
        for c, m in zip(layer.caches, mark):
            restore_layer(c, m)
        return
    fields, marks = mark
    for k in [k for k in vars(layer) if k not in fields]:
        delattr(layer, k)
    for k, v in fields.items():
        setattr(layer, k, list(v) if isinstance(v, list) else v)
    set_marks(layer, marks)


def replayable(layer: Any) -> bool:
    kind = kind_of(layer)
    if kind is None or not kind.replayable:
        return False
    return all(replayable(c) for c in layer.caches) if hasattr(layer, "caches") else True
