"""A request's prompt into its live cache: one chunk a step for a text model, or the rest in one
call of the backend's own prefill (a VLM: embeddings and positions, runner/vlm.py ``WholePrefill``).

    done = prefill_chunk(ctx, row, budget, defer_last)   # True once the prompt is fed or abandoned
    feed_deferred(ctx, row)          # a deferred last prompt token, fed now (a row that will not decode)

The engine core calls these with the step's plan (scheduler/plan.py: which request, how many
tokens); they never call the engine. Of a row (engine/request.py ``Request``) they read its
prompt's model tokens, ``start``, ``checkpoints`` and ``stops``, and advance what the prefill owns:
``live``, ``pos``, ``logits``, ``snapshots`` (the KV at each checkpoint: cache/kv_ops.py
``capture``), ``prefill_aborted`` and ``decode_model``. The request's hang-up and watchdog
(runner/rows.py ``halted``: data) are heard between a chunk's forwards too (LESSONS 90): the chunk
stops there and the request ends with what it computed (engine/finish.py salvage).
"""
from __future__ import annotations

from typing import Callable

from ..cache.kv_ops import capture
from ..config import faults
from .generate import Aborted, feed, folds, last_logits
from .rows import Row, RunnerContext, halted


def prefill_chunk(ctx: RunnerContext, seq: Row, budget: int, defer_last: bool) -> bool:
    """Feed up to ``budget`` more prompt tokens (stopping at checkpoints, which are captured);
    True once the prompt is done (``seq.logits`` set) or the request was abandoned between
    chunks (``seq.prefill_aborted``). A short rest (runner/generate ``folds``) is fed with the last
    one, in one forward; otherwise, with ``defer_last``, the last prompt token is left for the first
    batched decode step (``seq.logits`` stays None, ``seq.pos`` is ``n - 1``)."""
    tokens = seq.prep.model_tokens
    n = len(tokens)

    def stop() -> bool:
        return halted(ctx, seq)

    if seq.pos < 0:
        seq.pos = seq.start
    elif stop():
        seq.prefill_aborted = True
        return True
    if ctx.whole_prefill is not None:
        return _whole(ctx, seq, stop)
    end = min(n - 1, seq.pos + max(1, budget))
    stop_at = min([k for k in (*seq.checkpoints, *seq.stops) if seq.pos < k <= end], default=end)
    faults.hit("prefill_chunk", seq.job.request_id)
    fed = stop_at > seq.pos
    try:
        if stop_at == n - 1 and n - 1 not in (*seq.checkpoints, *seq.stops) and folds(n - seq.pos):
            # the rest is short: its forward yields the first token's logits too (runner/generate
            # FOLD_MAX) -- no second forward for the last token, alone or in the batch's next step
            seq.logits = feed(ctx.model, seq.live, tokens[seq.pos:], ctx.prefill_step, stop, logits=True)
            seq.pos = n
            return True
        if fed:
            feed(ctx.model, seq.live, tokens[seq.pos:stop_at], ctx.prefill_step, stop)
    except Aborted:
        seq.prefill_aborted = True
        return True
    if fed:
        seq.pos = stop_at
        if stop_at in seq.checkpoints:
            seq.snapshots.append(capture(seq.live))
    if seq.pos == n - 1 and defer_last:
        return True
    if seq.pos == n - 1:
        seq.logits = last_logits(ctx.model, seq.live, tokens[-1])
        seq.pos = n
        return True
    return False


def _whole(ctx: RunnerContext, seq: Row, stop: Callable[[], bool]) -> bool:
    """The rest of the prompt in one call of the backend's own prefill (``ctx.whole_prefill``),
    checkpoints captured on the way; the row then decodes through the module that prefill set up
    (``decode_model``: a VLM's language model with the prompt's position delta)."""
    try:
        seq.logits, seq.decode_model = ctx.whole_prefill(
            seq.live, seq.prep, seq.pos, lambda live: seq.snapshots.append(capture(live)),
            [k - seq.pos for k in seq.checkpoints if k > seq.pos], stop)
    except Aborted:
        seq.prefill_aborted = True
        return True
    seq.pos = len(seq.prep.model_tokens)
    return True


def feed_deferred(ctx: RunnerContext, seq: Row) -> None:
    """Feed a deferred last prompt token now (a sequence that will not decode after all)."""
    if seq.logits is None and seq.pos == len(seq.prep.model_tokens) - 1:
        seq.logits = last_logits(ctx.model, seq.live, seq.prep.model_tokens[-1])
        seq.pos = len(seq.prep.model_tokens)

