"""What the server knows of a live mlx-lm cache layer beyond the layer's own fields, held beside
the layer instead of written onto it (the layer is mlx-lm's object, not ours).

    mark(layer, "fp_head", (keys, values))   # a QuantizedKVCache's full-precision head
    marked(layer, "fp_head")                 # -> the value, or None
    mark(layer, "cut", True)                 # a rotated window cut back one token

A mark lives as long as its layer: it is dropped when the layer is freed (a weak reference), so a
new layer that happens to reuse the id never sees another's marks.
"""
from __future__ import annotations

import weakref
from typing import Any

_marks: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}


def mark(layer: Any, key: str, value: Any) -> None:
    got = _marks.get(id(layer))
    if got is None or got[0]() is not layer:
        ident = id(layer)
        got = (weakref.ref(layer, lambda _r, k=ident: _marks.pop(k, None)), {})
        _marks[ident] = got
    got[1][key] = value


def marked(layer: Any, key: str, default: Any = None) -> Any:
    got = _marks.get(id(layer))
    if got is None or got[0]() is not layer:
        return default
    return got[1].get(key, default)


def marks_of(layer: Any) -> dict[str, Any]:
    """A copy of every mark ``layer`` has (for putting it back: ``set_marks``)."""
    got = _marks.get(id(layer))
    return dict(got[1]) if got is not None and got[0]() is layer else {}


def set_marks(layer: Any, marks: dict[str, Any]) -> None:
    """``layer``'s marks become exactly ``marks``."""
    got = _marks.get(id(layer))
    if got is not None and got[0]() is layer:
        got[1].clear()
    for key, value in marks.items():
        mark(layer, key, value)
