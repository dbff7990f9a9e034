"""The attention-window kinds: sliding windows (``RotatingKVCache``) and llama4's chunked attention
(``ChunkedKVCache``), whose depths they can serve depend on what has left the window."""
from __future__ import annotations

import math
from typing import Any

from .kind_base import (CacheKind, KVQuant, LayerState, _cut_tokens, _fresh)
from .marks import mark, marked


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
    CUT_MARK = "cut"   # cache/marks.py: a rotated window cut back one token

    @staticmethod
    def _in_order(layer: Any) -> bool:
        return layer.keys is None or (layer._idx == layer.offset and layer.keys.shape[2] >= layer.offset)

    def _one_back(self, layer: Any) -> bool:
        return (layer.keep == 0 and layer.keys.shape[2] == layer.max_size and layer._idx >= 1
                and layer.offset > layer.max_size and not marked(layer, self.CUT_MARK, False))

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
        cut = 1 if back == 1 or marked(layer, self.CUT_MARK, False) else 0
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
                mark(c, self.CUT_MARK, True)
        return c

    def cut(self, layer: Any, depth: int, target: int) -> None:
        if not self._in_order(layer):
            mark(layer, self.CUT_MARK, True)
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
