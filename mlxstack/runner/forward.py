"""The one door to a model's forward: every forward the server runs goes through ``forward``.

    attach(model, backend)            # at load (engine/factory.py): the backend serving this model
    logits = forward(model, tokens, cache)
    fed = feed_rows(model, caches, rows)   # several rows' prompts on their own caches, or False

A backend (backends/base.py) may compute a forward itself -- the CPU backend's host path for
decode-sized calls of float32 Llama-family models -- and returns None when it does not apply;
the model's own ``__call__`` runs then. Nothing is patched onto mlx-lm's classes for this: the
backend is found by the model object it was attached to, so another model in the same process
(a draft model, a test's second model) runs plainly unless it was given one too.
"""
from __future__ import annotations

from typing import Any

from ..cache.marks import mark, marked


def attach(model: Any, backend: Any) -> None:
    """``backend`` serves ``model``'s forwards from now on (None: the model's own ``__call__``);
    held beside the model (cache/marks.py), never written onto it."""
    mark(model, "backend", backend)


def backend_of(model: Any) -> Any:
    return marked(model, "backend")


def forward(model: Any, inputs: Any, cache: Any, **kwargs: Any) -> Any:
    """``model(inputs, cache=cache, **kwargs)``, or the attached backend's own forward of it."""
    backend = backend_of(model)
    if backend is not None and not kwargs:
        out = backend.forward_rows(model, inputs, cache)
        if out is not None:
            return out
    return model(inputs, cache=cache, **kwargs)


def feed_rows(model: Any, caches: list[list[Any]], rows: list[list[int]]) -> bool:
    """Feed each row's tokens into its own caches in one pass when the attached backend can
    (False: the caller feeds them through ``forward``)."""
    backend = backend_of(model)
    return bool(backend is not None and backend.feed_rows(model, caches, rows))


def exact_positions(model: Any, quant: Any) -> int | None:
    """Under KV quantisation (KV_BITS, either scheme), the most positions a row a forward of
    ``model`` may carry for its K / V to be the same bits whatever the call (the attached
    backend's batch-invariant size: backends/base.py ``exact_positions``); None otherwise --
    without KV quantisation float rounding never becomes a different code."""
    if quant is None:
        return None
    backend = backend_of(model)
    return backend.exact_positions(model) if backend is not None else None
