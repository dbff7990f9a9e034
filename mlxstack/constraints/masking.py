"""Token bitmasks onto MLX logits: one row, or the whole batch with one mask array (as vLLM does).

    logits = apply_mask(logits, row.mask_words())             # [V] or [1, V]; lazy
    masks = BatchMasks()
    words = masks.fill(rows)                                   # [B, W] int32, all-ones for free rows
    logits = apply_mask(logits, words)                         # [B, V]: the same, row by row

The mask travels as int32 words (32 tokens each, 1/8 of a bool mask) and is unpacked by MLX next to
the logits. ``BatchMasks.fill`` computes the engaged rows' masks in parallel on llguidance's own
thread pool (``LLExecutor``; the GIL is released). It is not on the decode path: on the 2-core dev
box it was slower than masking row by row in each row's sampler (benchmarks/bench_structured.py:
157 vs 89 us per 8-row step), so runner/sampling.py masks one row at a time; the bench keeps
measuring both.
"""
from __future__ import annotations

import math
from typing import Sequence

import llguidance as llg
import mlx.core as mx
import numpy as np

from .row import RowConstraint, words_for

__all__ = ["BatchMasks", "allowed_mask", "apply_mask"]

# A constant, never a lazy op: MLX streams are per thread, and a lazy array made at import (on the
# importing thread's default stream) fails when the inference thread evaluates it.
_SHIFTS = mx.array(np.arange(32, dtype=np.int32))


def allowed_mask(words: np.ndarray | mx.array, width: int) -> mx.array:
    """Bool mask ``[..., width]`` from bitmask words ``[..., ceil(width / 32)]`` (lazy)."""
    w = words if isinstance(words, mx.array) else mx.array(np.ascontiguousarray(words))
    bits = (mx.expand_dims(w, -1) >> _SHIFTS) & 1                  # [..., W, 32]
    bits = bits.reshape(*w.shape[:-1], w.shape[-1] * 32)
    return bits[..., :width].astype(mx.bool_)


def apply_mask(logits: mx.array, words: np.ndarray | mx.array | None) -> mx.array:
    """``logits`` ([V], or [B, V] with [B, W] words) with every token the mask does not allow at
    -inf (None: unchanged)."""
    if words is None:
        return logits
    return mx.where(allowed_mask(words, logits.shape[-1]), logits, -math.inf)


class BatchMasks:
    """Next-token masks for a batch's rows in one [B, W] array, engaged rows computed in parallel."""

    def __init__(self, threads: int | None = None) -> None:
        self.executor = llg.LLExecutor(threads)

    def fill(self, rows: Sequence[RowConstraint | None], width: int | None = None) -> np.ndarray | None:
        """Masks for ``rows`` (None or a free row: all ones); None when no row is constrained."""
        live = [(i, r) for i, r in enumerate(rows) if r is not None]
        if not live:
            return None
        width = width or live[0][1].width
        nwords = words_for(width)
        out = np.full((len(rows), nwords), -1, dtype=np.int32)
        work = []
        constrained = False
        for i, row in live:
            fixed = row.fixed_mask()
            if fixed is None:
                continue
            constrained = True
            if fixed is False:
                work.append((i, row))
            else:
                out[i, :] = fixed[:nwords]
        if work:
            lw = max(words_for(r.tok.vocab_size) for _, r in work)     # llguidance's mask size
            raw = np.zeros((len(rows), lw), dtype=np.int32)           # llguidance wants exactly its size
            self.executor.unsafe_compute_mask_ptr([(r.matcher, i) for i, r in work], raw.ctypes.data, lw * 4, len(rows))
            for i, row in work:
                out[i, :] = row.finish_mask(raw[i].copy())
        return out if constrained else None
