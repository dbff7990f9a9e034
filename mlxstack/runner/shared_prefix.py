"""Whether a loaded model may attend a shared prefix held once (cascade attention).

    if shared_prefix_ok(engine): ...     # rows of a decode batch that share a root keep only tails

A slab whose rows share a prefix (cache/slab.py ``SlabKVCache.prefix``) relies on the
model calling mlx-lm's ``scaled_dot_product_attention`` with the cache it updated
(backends/cascade.py routes that call through the cascade). A model that attends some other
way would silently ignore the prefix, so this is checked once per engine with the real model: two
sequences that share a prefix, stepped together with the prefix held once, must give the logits
each gives on its own cache. Any difference or error: the prefix is never shared (rows hold
their whole sequences, as before).
"""
from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..cache.kv_ops import LiveCache, capture, checkout
from ..backends.cascade import install
from .generate import feed
from .forward import forward

from .rows import context_of

log = logging.getLogger("mlxstack.shared_prefix")


def shared_prefix_ok(ctx: Any) -> bool:
    """Checked once per model context (runner/rows.py RunnerContext; the answer is kept in its memo)."""
    ctx = context_of(ctx)
    known = ctx.memo.get("shared_prefix_ok")
    if known is None:
        known = _check(ctx)
        ctx.memo["shared_prefix_ok"] = known
        if known:
            log.info("shared prefixes: rows of a decode batch that share a cached prefix hold it once")
    return known


def _close(a: Any, b: Any) -> bool:
    return bool(mx.allclose(a, b, atol=1e-3, rtol=1e-3).item())


def _by_reference_agrees(model: Any, root: Any) -> bool:
    """A copy-free checkout (``checkout(..., by_reference)``: the prefix by reference, a tail of
    its own) fed a several-token chunk, then a rooted one past its root with a tail copied in,
    then single tokens: the logits of a plain copy fed the same, at every step. The slab check
    above never builds a ``PrefixedKVCache``, whose mask spans prefix + tail (``full_mask``)."""
    plain, ref = checkout(root, root.depth), checkout(root, root.depth, None, by_reference=1)
    for chunk in ([7, 8, 9, 10], [11], [12, 13]):
        want = feed(model, plain, chunk, 16, logits=True)
        got = feed(model, ref, chunk, 16, logits=True)
        if got is None or want is None or not _close(got, want):
            return False
    grown = capture(ref)                        # rooted: the first 6 tokens by reference, 7 copied
    again, copy = checkout(grown, 11, None, by_reference=1), checkout(grown, 11)
    return _close(feed(model, again, [21, 22, 23], 16, logits=True), feed(model, copy, [21, 22, 23], 16, logits=True))


def _check(ctx: Any) -> bool:
    from ..cache.slab import stack_layers

    quant = ctx.kv_quant
    if ctx.is_vlm or quant is not None and quant.scheme != "turboquant":
        return False
    install()
    model = ctx.model
    try:
        # the model's attention over a prefix held once, on float caches: TurboQuant rows attend
        # floats too (their decoded vectors), the codes kept beside them (cache/turboquant_rows.py)
        base = LiveCache(make_prompt_cache(model), 0, None)
        feed(model, base, list(range(100, 106)), 16)
        root = capture(base)

        def lives() -> list[Any]:
            out = []
            for tail in ([7, 8, 9], [11, 12, 13, 14, 15]):
                live = checkout(root, root.depth)
                feed(model, live, tail, 16)
                out.append(live)
            return out

        nxt = mx.array([[21], [22]], dtype=mx.int32)
        alone = [forward(model, nxt[i:i + 1], lv.layers)[:, -1, :] for i, lv in enumerate(lives())]
        rows = lives()
        batch = stack_layers([lv.layers for lv in rows], [lv.roots for lv in rows], 1)
        if not any(getattr(layer, "shared_prefix", lambda: None)() is not None for layer in batch):
            return False
        together = forward(model, nxt, batch)[:, -1, :]
        if not all(_close(together[i], alone[i][0]) for i in range(2)):
            return False
        return _by_reference_agrees(model, root)
    except Exception as exc:  # noqa: BLE001 - any failure: never share
        log.info("shared prefixes off: %s: %s", type(exc).__name__, exc)
        return False
