"""Prefill and decode on an explicit cache: the one generation loop every request uses.

    logits = prefill(model, cache, tokens[P:], step=512)          # feeds all but nothing more
    for tok in decode(model, cache, logits, history, params):      # yields token ids
        ...

Unlike ``mlx_lm.generate_step``, the repetition penalty sees the *whole* history (cached prefix
included), so a cache hit never changes sampling, and the caller can checkpoint the cache right
before the last prompt token is fed (the pre-generation snapshot for hybrid models).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import make_repetition_penalty, make_sampler

from .mlx_stream import generation_stream


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 256
    max_tokens: int = 256
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)


class Aborted(RuntimeError):
    """The caller's abort check fired between prefill chunks (watchdog or disconnect)."""


def feed(model: nn.Module, cache: list[Any], tokens: Sequence[int], step: int,
         should_stop: Callable[[], bool] | None = None) -> None:
    """Run ``tokens`` through the model into ``cache`` in chunks (no logits kept).

    ``should_stop`` is checked between chunks (never mid-eval): a long prefill can be abandoned.
    """
    with mx.stream(generation_stream()):
        for start in range(0, len(tokens), step):
            if should_stop is not None and start and should_stop():
                raise Aborted("prefill abandoned")
            chunk = mx.array(list(tokens[start:start + step]), dtype=mx.int32)[None]
            model(chunk, cache=cache)
            mx.eval([c.state for c in cache])
    mx.clear_cache()


def last_logits(model: nn.Module, cache: list[Any], token: int) -> mx.array:
    """Feed one token and return its next-token logits (float32, shape [vocab])."""
    with mx.stream(generation_stream()):
        logits = model(mx.array([[token]], dtype=mx.int32), cache=cache)[:, -1, :]
        logits = logits.astype(mx.float32).squeeze(0)
        mx.eval(logits)
    return logits


def prefill(
    model: nn.Module,
    cache: list[Any],
    tokens: Sequence[int],
    step: int = 512,
    checkpoint: Callable[[list[Any]], None] | None = None,
    at: Sequence[int] = (),
    should_stop: Callable[[], bool] | None = None,
) -> mx.array:
    """Feed ``tokens`` (>= 1) and return the logits after the last one.

    ``checkpoint(cache)`` runs whenever the fed count reaches a position in ``at`` (0 < k < len),
    e.g. the end of the last history message (a point the next turn will extend) or
    ``len(tokens) - 1``: the cache then covers exactly ``tokens[:k]``.
    """
    if not tokens:
        raise ValueError("prefill needs at least one token")
    done = 0
    for k in sorted({k for k in at if 0 < k < len(tokens)}):
        feed(model, cache, tokens[done:k], step, should_stop)
        done = k
        if checkpoint is not None:
            checkpoint(cache)
    feed(model, cache, tokens[done:-1], step, should_stop)
    return last_logits(model, cache, tokens[-1])


def decode(
    model: nn.Module,
    cache: list[Any],
    first_logits: mx.array,
    history: Sequence[int],
    params: SamplingParams,
    should_stop: Callable[[], bool] = lambda: False,
) -> Iterator[int]:
    """Yield sampled token ids until max_tokens, a stop token, or ``should_stop()``.

    As in mlx-lm, step n+1 is built from the still-lazy token n and dispatched *before* token n
    is read back, so graph construction overlaps computation. The cache can therefore hold one
    token more than was consumed (a stop token, or the token before an abort): callers read the
    physical offset from the cache rather than counting.
    """
    if params.seed is not None:
        mx.random.seed(params.seed)
    sampler = make_sampler(params.temperature, params.top_p, params.min_p, 1, params.top_k)
    penalty = (
        make_repetition_penalty(params.repetition_penalty, params.repetition_context_size)
        if params.repetition_penalty and params.repetition_penalty != 1.0 else None
    )
    ctx = params.repetition_context_size
    stream = generation_stream()
    # The penalty window stays an mx array so the next step can be built before y is known.
    window = mx.array(list(history[-ctx:]), dtype=mx.int32) if penalty is not None else None

    def sample(logits: mx.array) -> mx.array:
        logits = logits[None] if logits.ndim == 1 else logits
        if penalty is not None and window is not None and window.size:
            logits = penalty(window, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs)

    def step(tok: mx.array) -> mx.array:
        nonlocal window
        with mx.stream(stream):
            if window is not None:
                window = mx.concatenate([window, tok.reshape(-1).astype(mx.int32)])[-ctx:]
            logits = model(tok.reshape(1, 1), cache=cache)[:, -1, :]
            return sample(logits)

    with mx.stream(stream):
        y = sample(first_logits)
    mx.async_eval(y)
    produced = 0
    while True:
        produced += 1
        next_y = None
        if produced < params.max_tokens:
            next_y = step(y)
            mx.async_eval(next_y)
        tok = int(y.item())
        yield tok
        if next_y is None or tok in params.stop_token_ids or should_stop():
            return
        y = next_y
