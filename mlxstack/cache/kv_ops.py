"""Model-level cache verbs over the per-layer kinds (cache/layer_kinds.py).

A request works on a ``LiveCache``: the per-layer mlx cache objects the model writes into, plus
the number of tokens fed so far (pure recurrent models have no layer that knows its depth, so
the depth is counted where tokens are fed, never guessed from a layer). A stored entry holds a
``KVState``: immutable per-layer states cut to one depth.

    live = new_live_cache(model)            # or checkout(state, depth)
    ... feed tokens; live.depth grows ...
    state = capture(live)                   # after generation: immutable, evaluated
    live2 = checkout(state, depth)          # on a hit: fresh objects, cut to depth
    state.floor <= depth <= state.depth     # the depths an entry can serve
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from .marks import mark
from .prefixed_kv import PrefixedKVCache
from .layer_kinds import (FP_HEAD, KINDS, QUANTIZED_KINDS, UNBOUNDED, KVQuant, LayerState, class_from_key, class_key,
                          eval_state, kind_of, mark_layer, replayable, restore_layer)


class LiveCache:
    """The caches one request writes into, how many tokens they hold, and the KV quantisation
    policy (KV_BITS): plain KV layers become ``QuantizedKVCache`` at exactly ``quant.start``."""

    __slots__ = ("layers", "depth", "quant", "quantized", "roots")

    def __init__(self, layers: list[Any], depth: int = 0, quant: KVQuant | None = None,
                 roots: list[Any] | None = None) -> None:
        self.layers = layers
        self.depth = depth
        self.quant = quant
        self.recount()
        # per layer: None, or (keys, values, n) -- this layer's first n tokens ARE the first n of
        # those arrays, held by a stored entry or another request (a hit's entry, a shared
        # prefill): a capture stores them by reference and copies only what follows
        self.roots: list[Any] = roots if roots is not None else [None] * len(layers)

    def recount(self) -> None:
        """``quantized`` from the layers held now (a batch hands a coded row back as coded layers)."""
        self.quantized = self.quant is None or any(getattr(kind_of(c), "name", "") in QUANTIZED_KINDS
                                                   for c in self.layers)

    def advance(self, n: int) -> None:
        self.depth += n

    def quantize_boundary(self) -> int | None:
        """The depth a prefill chunk must stop at so quantisation starts exactly there."""
        return None if self.quantized else self.quant.start

    def maybe_quantize(self) -> None:
        """At ``quant.start`` tokens, switch every plain KV layer to its quantised form (mlx-lm's
        own conversion; turboquant: the layer's tokens so far kept as they are, what follows coded),
        so a cold run and a hit compute exactly the same from there on."""
        if self.quantized or self.depth < self.quant.start:
            return
        for i, layer in enumerate(self.layers):
            if kind_of(layer) is not KINDS["kv"]:
                continue
            if self.quant.scheme == "turboquant":
                from .turboquant import TurboQuantKVCache

                self.layers[i] = TurboQuantKVCache.from_kv(layer, self.quant.bits, self.quant.seed, self.depth)
            elif hasattr(layer, "to_quantized"):
                q = layer.to_quantized(group_size=self.quant.group_size, bits=self.quant.bits)
                if layer.keys is not None:   # what it held in full precision: stored entries keep it
                    mark(q, FP_HEAD, (layer.keys[..., :self.depth, :], layer.values[..., :self.depth, :]))
                self.layers[i] = q
        self.quantized = True

    @property
    def floor(self) -> int:
        """Smallest depth every layer can still be cut back to (== depth: exact only)."""
        return max((kind_of(layer).floor(layer, self.depth) for layer in self.layers), default=0)

    @property
    def capture_floor(self) -> int:
        """Smallest depth ``capture`` can snapshot it at without cutting it (at most ``floor``)."""
        return max((kind_of(layer).capture_floor(layer, self.depth) for layer in self.layers), default=0)

    def cut(self, depth: int) -> None:
        """Cut every layer back to ``depth`` (requires floor <= depth <= self.depth)."""
        if depth == self.depth:
            return
        if not self.floor <= depth < self.depth:
            raise ValueError(f"cannot cut a cache at {self.depth} (floor {self.floor}) to {depth}")
        for layer in self.layers:
            kind_of(layer).cut(layer, self.depth, depth)
        self.depth = depth
        self.roots = [r if r is None or r[2] <= depth else (r[0], r[1], depth) for r in self.roots]

    def can_share(self) -> bool:
        """Every layer can hand out its first tokens -- as a root (``share``) or, for a coded layer,
        as a copy (``KVManager.fork``) -- now or once fed."""
        kinds = [kind_of(layer) for layer in self.layers]
        return all(getattr(k, "hands_out_prefix", False) or getattr(k, "copies_prefix", False) for k in kinds)

    def share(self, depth: int) -> list[tuple[Any, Any, int]]:
        """Every layer's first ``depth`` tokens as a root ``(keys, values, depth)`` that other
        requests hold by reference (a shared prefill's followers): the layer's recorded root where
        it covers ``depth`` (the same objects, so every holder shares one root: LESSONS 42), else
        the kind's ``first`` -- a view of what the layer holds, whatever its form -- recorded as its
        root. A root record is only ever this cache's own first tokens (LESSONS 63). A layer holding
        exactly ``depth`` goes on with the root by reference: its next append writes a tail instead
        of copying its whole buffer away from the others' view of it -- not under KV quantisation,
        where a plain layer must stay one that ``maybe_quantize`` codes from the start (its next
        append copies the buffer once instead)."""
        if not 0 < depth <= self.depth:
            raise ValueError(f"cannot share {depth} tokens of a cache holding {self.depth}")
        out = []
        for i, layer in enumerate(self.layers):
            held = self.roots[i] if i < len(self.roots) else None
            if held is not None and held[2] >= depth:
                out.append((held[0], held[1], depth))
                continue
            kind = kind_of(layer)
            root = kind.first(layer, depth) if kind is not None else None
            if root is None:
                raise TypeError(f"layer {i} ({type(layer).__name__}) cannot share its first {depth} tokens")
            self.roots[i] = root
            if self.depth == depth and self.quant is None:
                self.layers[i] = PrefixedKVCache(root)
            out.append(root)
        return out

    def root_of(self, i: int) -> Any:
        """Layer ``i``'s shared root (keys, values, n), while the layer is plain KV."""
        r = self.roots[i] if i < len(self.roots) else None
        return r if r is not None and kind_of(self.layers[i]) is KINDS["kv"] else None

    def room(self) -> int:
        """Tokens one forward may add and still be cut back to any depth in between (the
        smallest layer's ``room``); a forward must not cross the KV quantisation start either."""
        room = min((kind_of(layer).room(layer, self.depth) for layer in self.layers), default=0)
        return min(room, self.quant_room())

    def quant_room(self) -> int:
        """Tokens one forward may add without crossing the KV quantisation start (a cold run
        switches exactly there)."""
        return UNBOUNDED if self.quantized else max(0, self.quant.start - self.depth)

    @property
    def replayable(self) -> bool:
        """Every layer can be put back as it was before a forward (``mark`` / ``restore``)."""
        return all(replayable(layer) for layer in self.layers)

    def mark(self) -> tuple:
        """The cache as it is now (references), for ``restore`` after a forward."""
        return self.depth, [mark_layer(layer) for layer in self.layers]

    def restore(self, mark: tuple) -> None:
        depth, layers = mark
        for layer, m in zip(self.layers, layers):
            restore_layer(layer, m)
        self.depth = depth

    def check(self) -> None:
        """Raise when a layer that knows its depth disagrees with the counted depth (a bug)."""
        for i, layer in enumerate(self.layers):
            d = kind_of(layer).depth(layer)
            if d is not None and d != self.depth and not getattr(layer, "keys", 1) is None:
                raise RuntimeError(f"bug: layer {i} ({type(layer).__name__}) holds {d} tokens, counted {self.depth}")


@dataclass(slots=True, frozen=True)
class KVState:
    layers: tuple[LayerState, ...]
    depth: int                # tokens covered
    floor: int                # smallest depth it can serve (depth: exact only)
    nbytes: int

    @property
    def offset(self) -> int:   # the name the rest of the engine used before kinds
        return self.depth

    @property
    def trimmable(self) -> bool:
        return self.floor == 0

    def can_serve(self, depth: int) -> bool:
        return self.floor <= depth <= self.depth


def new_live_cache(layers: list[Any], quant: KVQuant | None = None) -> LiveCache:
    return LiveCache(layers, 0, quant)


def capture(live: LiveCache, depth: int | None = None) -> KVState:
    """Snapshot ``live`` cut to ``depth`` (default: all of it), evaluated and never aliased."""
    depth = live.depth if depth is None else depth
    floor = live.capture_floor
    if depth != live.depth and not floor <= depth <= live.depth:
        raise ValueError(f"cannot capture a cache at {live.depth} (floor {floor}) at depth {depth}")
    layers = []
    for i, layer in enumerate(live.layers):
        kind = kind_of(layer)
        if kind is None:
            raise TypeError(f"unsupported cache layer type {type(layer).__name__}")
        root = live.root_of(i)
        layers.append(kind.capture_rooted(layer, depth, root) if root is not None
                      else kind.capture(layer, depth, live.quant))
    eval_state(layers)
    state_floor = max((s.floor for s in layers), default=0)
    return KVState(tuple(layers), depth, min(state_floor, depth), sum(s.nbytes for s in layers))


def checkout(state: KVState, depth: int | None = None, quant: KVQuant | None = None,
             by_reference: int = 0) -> LiveCache:
    """Fresh cache objects (same classes, same parameters) holding ``state`` cut to ``depth``.
    ``by_reference`` > 0 (no KV quantisation): from that depth on, plain KV layers are checked out
    as ``PrefixedKVCache`` -- the reused tokens by reference, appends into a short tail of their own
    (``KVKind.checkout_by_reference``; the model must attend such a prefix: runner/shared_prefix.py)."""
    depth = state.depth if depth is None else depth
    if not state.can_serve(depth):
        raise ValueError(f"state at {state.depth} (floor {state.floor}) cannot serve depth {depth}")
    kv = KINDS["kv"]
    roots = [kv.root(s, depth) if s.kind == kv.name else None for s in state.layers]
    layers = None
    if 0 < by_reference <= depth and quant is None and all(s.kind == kv.name for s in state.layers):
        layers = [kv.checkout_by_reference(s, depth) for s in state.layers]
        layers = None if any(x is None for x in layers) else layers
    if layers is None:
        layers = [KINDS[s.kind].checkout(s, depth) for s in state.layers]
    live = LiveCache(layers, depth, quant, roots)
    if quant is not None:
        live.maybe_quantize()   # a full-precision entry checked out at or past the start
    return live


def kv_offset(cache: LiveCache | Sequence[Any]) -> int:
    """Tokens a cache holds (a LiveCache knows; for a bare layer list, the first layer that can say)."""
    if isinstance(cache, LiveCache):
        return cache.depth
    for layer in cache:
        kind = kind_of(layer)
        d = kind.depth(layer) if kind is not None else getattr(layer, "offset", None)
        if d is not None:
            return int(d)
    return 0


# ------------------------------------------------------------------------------ serialisable form
def dump_state(state: KVState) -> tuple[dict[str, Any], dict]:
    """(flat name -> mx.array, JSON meta): what the disk tier writes."""
    arrays: dict[str, Any] = {}
    metas = []
    for i, layer in enumerate(state.layers):
        a, m = KINDS[layer.kind].dump(layer)
        arrays.update({f"l{i}.{k}": v for k, v in a.items()})
        metas.append({**m, "cls": class_key(layer.cls)})
    return arrays, {"layers": metas, "depth": state.depth, "floor": state.floor}


def load_state(arrays: dict[str, Any], meta: dict) -> KVState:
    layers = []
    for i, m in enumerate(meta["layers"]):
        prefix = f"l{i}."
        own = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
        layers.append(KINDS[m["kind"]].load(own, m, class_from_key(m["cls"])))
    return KVState(tuple(layers), int(meta["depth"]), int(meta["floor"]), sum(s.nbytes for s in layers))


def state_fingerprint(state: KVState) -> list[float]:
    """Cheap numeric digest of stored arrays (tests prove a hit never mutates an entry)."""
    sums: list[float] = []

    def walk(s: LayerState) -> None:
        for a in s.arrays:
            for x in (a if isinstance(a, (tuple, list)) else (a,)):
                if x is not None:
                    sums.append(float(mx.sum(x.astype(mx.float32)).item()))
        for c in s.children:
            walk(c)

    for layer in state.layers:
        walk(layer)
    return sums
