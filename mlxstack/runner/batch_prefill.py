"""Prefill several short prompts in one forward pass (dense KV models, with batching on).

A warm agent turn prefills only its new tokens -- often a few dozen. On a CPU (or any machine
where a small forward is bound by reading the weights, not by arithmetic) eight such prefills one
after another cost eight weight reads; together they cost one. So when several sequences are
waiting with short remainders, the scheduler feeds them together:

    layers = prefill_together(engine, seqs)   # every seq's remaining prompt, one BatchKVCache

1. their own KV layers are merged into one ``BatchKVCache`` per layer (left-padded to a common
   length, as decode batching does);
2. the prompt tokens before each one's last are fed as one right-padded ``[B, T]`` forward; the
   padding's K/V is rolled to the left edge afterwards (``finalize``), where the mask hides it --
   mlx-lm's ``BatchGenerator.prompt`` does the same;
3. every last prompt token is left for the first decode step, where it rides in the batched
   ``[B, 1]`` forward with everyone else's token (as mlx-lm's BatchGenerator does) -- one forward
   less per join, and the same shape as the last-token forward of the single-sequence path.

The returned layers hold every sequence's KV; the decode group copies each row into its slab.
Each sequence's ``LiveCache`` depth is advanced by what it was fed.

``feed_together`` is the same forward for caches that go their own way afterwards: sequences that
finish in the same decode step close their turns (last sampled token + turn closer) in one pass.
"""
from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..cache.prefixed_kv import PrefixedKVCache
from ..config import faults
from .mlx_stream import generation_stream
from .rows import Row
from .forward import exact_positions, feed_rows, forward
from .generate import feed


def right_padded(rows: list[list[int]], width: int) -> mx.array:
    return mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.int32)


def _forward_padded(model: Any, layers: list[Any], rows: list[list[int]]) -> None:
    """One right-padded forward of ``rows`` into merged BatchKVCache ``layers`` (padding's K/V
    rolled to the left edge, where the mask hides it)."""
    width = max(len(r) for r in rows)
    if not width:
        return
    pad = [width - len(r) for r in rows]
    for layer in layers:
        layer.prepare(right_padding=pad)
    forward(model, right_padded(rows, width), layers)
    for layer in layers:
        layer.finalize()
    mx.eval([x for layer in layers for x in (layer.keys, layer.values, layer.offset)])


def holds_prefixed(lives: list[Any]) -> bool:
    """Whether any of these LiveCaches holds a prefix by reference (a shared prefill's follower,
    a finished sharing row): such rows batch only on slab layers, which need every row to hold
    at least one token already."""
    return any(isinstance(layer, PrefixedKVCache) for lv in lives for layer in lv.layers)


def _turboquant(lives: list[Any]) -> Any:
    """The KV_QUANT_SCHEME=turboquant policy these LiveCaches follow, or None."""
    quant = lives[0].quant
    return quant if quant is not None and quant.scheme == "turboquant" else None


def _switched(lives: list[Any]) -> None:
    """TurboQuant rows already at or past the start switch to coded layers before they are fed, as
    a lone feed does (``LiveCache.maybe_quantize``): both doors below call it first."""
    if _turboquant(lives) is not None:
        for lv in lives:
            lv.maybe_quantize()


def _merged(lives: list[Any], min_shared: int | None = None) -> list[Any]:
    """One batched layer per layer holding every LiveCache's KV (left-padded, in order): with
    ``min_shared``, slab layers in which rows sharing a root of at least that many tokens hold it
    once (cache/slab.py; attended by cascade), else mlx-lm BatchKVCache copies of each. TurboQuant
    rows (``_switched`` first) always go on slab layers, which code each row as its own layer would
    (cache/turboquant_rows.py)."""
    prefixed = holds_prefixed(lives)
    quant = _turboquant(lives)
    if quant is not None or prefixed or min_shared is not None and all(lv.depth > 0 for lv in lives) \
            and any(r is not None and r[2] >= min_shared for lv in lives for r in lv.roots):
        from ..cache.slab import stack_layers

        return stack_layers([lv.layers for lv in lives], [lv.roots for lv in lives], min_shared, quant)
    from mlx_lm.models.cache import BatchKVCache

    return [BatchKVCache.merge([lv.layers[i] for lv in lives]) for i in range(len(lives[0].layers))]


def _crosses(lives: list[Any], rows: list[list[int]]) -> bool:
    """Whether feeding ``rows`` crosses some LiveCache's KV quantisation start (only a slab's
    coding splits a forward there; the host path feeds each row's layers as they are)."""
    return any(lv.quant is not None and not lv.quantized and lv.depth < lv.quant.start < lv.depth + len(r)
               for lv, r in zip(lives, rows))


def _past_exact(model: Any, lives: list[Any], rows: list[list[int]]) -> int | None:
    """The backend's batch-invariant call size under KV quantisation when some row is longer than it
    (such rows are not fed in one batched forward: LESSONS 79), else None."""
    exact = exact_positions(model, lives[0].quant)
    return exact if exact is not None and max(len(r) for r in rows) > exact else None


def feed_together(model: Any, lives: list[Any], rows: list[list[int]], min_shared: int | None = None) -> bool:
    """Feed ``rows[i]`` into ``lives[i]`` (plain-KV LiveCaches) in one forward; each keeps its own
    layers (a copy of its row) and its depth advances by what it was fed. When the model's backend can
    (the CPU backend's host path) each row is fed on its own layers in place, the products shared:
    nothing is merged into a batch and split again. False (nothing done: the caller feeds each
    alone) for a row longer than a batch-invariant call under KV quantisation (LESSONS 79)."""
    if _past_exact(model, lives, rows) is not None:
        return False
    with mx.stream(generation_stream()):
        _switched(lives)
        if not _crosses(lives, rows) and feed_rows(model, [lv.layers for lv in lives], rows):
            for lv, r in zip(lives, rows):
                lv.advance(len(r))
                lv.maybe_quantize()
            return True
        layers = _merged(lives, min_shared)
        _forward_padded(model, layers, rows)
        own = [[layer.extract(i) for layer in layers] for i in range(len(lives))]
        mx.eval([x for row in own for c in row for x in (c.keys, c.values)])
    for lv, r, row in zip(lives, rows, own):   # all or nothing: a failure above advanced none of them
        lv.layers = row
        lv.advance(len(r))
        lv.recount()
    return True


def prefill_together(model: Any, seqs: list[Row], min_shared: int | None = None) -> list[Any]:
    """Feed every sequence's remaining prompt but its last token; return the batched layers
    (rows in ``seqs`` order; with ``min_shared`` a prefix they share is held once)."""
    for s in seqs:
        if s.pos < 0:
            s.pos = s.start
    faults.hit("prefill_batch", ",".join(s.job.request_id for s in seqs))
    _switched([s.live for s in seqs])
    heads = [list(s.prep.model_tokens[s.pos:-1]) for s in seqs]
    exact = _past_exact(model, [s.live for s in seqs], heads)
    if exact is not None:
        # each row fed on its own in batch-invariant calls (its codes never depend on the rows
        # beside it: LESSONS 79), then batched
        for s, h in zip(seqs, heads):   # a failure leaves every row's position at its own depth
            feed(model, s.live, h, exact)
            s.pos = len(s.prep.model_tokens) - 1
        return _merged([s.live for s in seqs], min_shared)
    layers = _merged([s.live for s in seqs], min_shared)
    with mx.stream(generation_stream()):
        _forward_padded(model, layers, heads)
    for s, h in zip(seqs, heads):
        s.live.advance(len(h))
        s.pos = len(s.prep.model_tokens) - 1
    return layers
