"""What the server knows of an mlx-lm object -- a cache layer, a model -- beyond its own fields,
held beside the object instead of written onto it (the object is mlx-lm's, not ours).

    mark(layer, "fp_head", (keys, values))   # a QuantizedKVCache's full-precision head
    marked(layer, "fp_head")                 # -> the value, or None
    mark(layer, "cut", True)                 # a rotated window cut back one token
    mark(model, "backend", backend)          # the backend computing a model's forwards (runner/forward.py)
    mark(model, "host_plan", plan)           # the CPU host path's plan (backends/cpu/host_forward.py)

A mark lives as long as its object: it is dropped when the object is freed (a weak reference), so
a new object that happens to reuse the id never sees another's marks.
"""
from __future__ import annotations

import weakref
from typing import Any

_marks: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}


def _held(obj: Any) -> dict[str, Any] | None:
    """``obj``'s marks, or None when it has none (an entry under its id is another, freed object's
    only until the weak reference's callback has dropped it)."""
    got = _marks.get(id(obj))
    return got[1] if got is not None and got[0]() is obj else None


def _drop(ident: int, ref: weakref.ref) -> None:
    """A freed object's marks leave -- only its own entry, never a newer object's under the same id."""
    got = _marks.get(ident)
    if got is not None and got[0] is ref:
        del _marks[ident]


def mark(obj: Any, key: str, value: Any) -> None:
    held = _held(obj)
    if held is None:
        ident = id(obj)
        held = {}
        _marks[ident] = (weakref.ref(obj, lambda ref, k=ident: _drop(k, ref)), held)
    held[key] = value


def marked(obj: Any, key: str, default: Any = None) -> Any:
    held = _held(obj)
    return default if held is None else held.get(key, default)


def marks_of(obj: Any) -> dict[str, Any]:
    """A copy of every mark ``obj`` has (for putting it back: ``set_marks``)."""
    return dict(_held(obj) or {})


def set_marks(obj: Any, marks: dict[str, Any]) -> None:
    """``obj``'s marks become exactly ``marks``."""
    held = _held(obj)
    if held is not None:
        held.clear()
    for key, value in marks.items():
        mark(obj, key, value)
