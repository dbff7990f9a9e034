"""Prompt feeding on an explicit ``LiveCache``: what every prefill chunk and turn close runs.

    logits = prefill(model, live, tokens[P:], step=512)              # live.depth grows by len
    feed(model, live, tokens, step)                                   # no logits
    logits = last_logits(model, live, token)

The caller can checkpoint the cache at chosen positions of the prompt (snapshots for caches that
cannot be cut back later). Decoding has one loop, the decode group's (runner/batch.py), for every
request: rows of a batch and a request served alone alike (LESSONS 90).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..cache.kv_ops import LiveCache
from .mlx_stream import generation_stream
from .sampling import Sampler, SamplingParams
from .forward import exact_positions, forward

__all__ = ["Aborted", "SamplingParams", "Sampler", "feed", "last_logits", "prefill", "cache_arrays"]


class Aborted(RuntimeError):
    """The caller's abort check fired between prefill chunks (watchdog or disconnect)."""


def cache_arrays(live: LiveCache) -> list[Any]:
    """Every mx array the live cache holds (for mx.eval after a chunk)."""
    out = []
    for layer in live.layers:
        out += [v for _, v in tree_flatten(layer.state) if isinstance(v, mx.array)]
    return out


# A prompt's last chunk at most this long yields the first token's logits in its own forward (the
# output head over every position of the chunk: ~FOLD_MAX / 4 GFLOP on SmolLM2) instead of a second
# forward for the last token alone (a pass over every weight and the whole context: ~150 ms at 4k
# tokens here). Longer tails keep the separate one-token forward.
FOLD_MAX = 64


def folds(rest: int) -> bool:
    """Whether a prompt's last ``rest`` tokens are fed in one forward that yields the logits."""
    return 1 < rest <= FOLD_MAX


def feed(model: nn.Module, live: LiveCache, tokens: Sequence[int], step: int,
         should_stop: Callable[[], bool] | None = None,
         boundary: Callable[[LiveCache], int | None] | None = None,
         logits: bool = False) -> mx.array | None:
    """Run ``tokens`` through the model into ``live`` in chunks of at most ``step``; with
    ``logits`` return the next-token logits after the last one (float32, [vocab]), else None
    (MLX never computes the output head nobody evaluates).

    ``should_stop`` is checked between chunks (never mid-eval), so a long prefill can be
    abandoned; ``boundary(live)`` may name an absolute depth a chunk must not cross (a chunk is
    cut there, e.g. where the KV cache switches to quantised storage). Under KV quantisation on a
    backend with a batch-invariant path, chunks are at most its size (``exact_positions``): a
    position's codes then never depend on how its prompt was chunked (LESSONS 79).
    """
    exact = exact_positions(model, live.quant)
    if exact is not None:
        step = min(step, exact)
    out = None
    with mx.stream(generation_stream()):
        pos = 0
        while pos < len(tokens):
            if should_stop is not None and pos and should_stop():
                raise Aborted("prefill abandoned")
            live.maybe_quantize()   # at QUANTIZED_KV_START exactly, before the tokens past it are fed
            n = min(step, len(tokens) - pos)
            for stop_at in (boundary(live) if boundary is not None else None, live.quantize_boundary()):
                if stop_at is not None and live.depth < stop_at < live.depth + n:
                    n = stop_at - live.depth
            chunk = mx.array(list(tokens[pos:pos + n]), dtype=mx.int32)[None]
            y = forward(model, chunk, live.layers)
            live.advance(n)
            last = logits and pos + n == len(tokens)
            if last:
                out = y[:, -1, :].astype(mx.float32).squeeze(0)
            live.maybe_quantize()
            mx.eval(cache_arrays(live) + ([out] if last else []))
            pos += n
    mx.clear_cache()
    return out


def last_logits(model: nn.Module, live: LiveCache, token: int) -> mx.array:
    """Feed one token and return its next-token logits (float32, shape [vocab])."""
    with mx.stream(generation_stream()):
        live.maybe_quantize()
        logits = forward(model, mx.array([[token]], dtype=mx.int32), live.layers)[:, -1, :]
        live.advance(1)
        logits = logits.astype(mx.float32).squeeze(0)
        mx.eval(logits)
    return logits


def prefill(
    model: nn.Module,
    live: LiveCache,
    tokens: Sequence[int],
    step: int = 512,
    checkpoint: Callable[[LiveCache], None] | None = None,
    at: Sequence[int] = (),
    should_stop: Callable[[], bool] | None = None,
    boundary: Callable[[LiveCache], int | None] | None = None,
) -> mx.array:
    """Feed ``tokens`` (>= 1) and return the logits after the last one.

    ``checkpoint(live)`` runs whenever the fed count reaches a position in ``at`` (0 < k < len),
    e.g. the end of the last history message (a point the next turn will extend) or
    ``len(tokens) - 1``: the cache then covers exactly ``tokens[:k]``.
    """
    if not tokens:
        raise ValueError("prefill needs at least one token")
    done = 0
    for k in sorted({k for k in at if 0 < k < len(tokens)}):
        feed(model, live, tokens[done:k], step, should_stop, boundary)
        done = k
        if checkpoint is not None:
            checkpoint(live)
    rest = tokens[done:]
    if folds(len(rest)):   # one forward, not two (FOLD_MAX)
        return feed(model, live, rest, step, should_stop, boundary, logits=True)
    feed(model, live, rest[:-1], step, should_stop, boundary)
    return last_logits(model, live, tokens[-1])
