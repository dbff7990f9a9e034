"""TurboQuant's coder on the host (numpy) for decode-sized calls (KV_QUANT_SCHEME=turboquant, CPU).

    turboquant.use_coder(HostCoder())       # CpuBackend.install, with the host path on

A decode step codes every layer's new K / V vectors: a handful of positions a row. MLX's graph for
that (cache/turboquant.py ``Scheme.code_unpacked``: rotation, norms, the codebook comparison, the
decoded vectors) is some fifteen kernels a layer, bound by op count on the CPU (LESSONS 72); the
same arithmetic in numpy on arrays this small is a few microseconds an op. Calls of more than
``MAX_POSITIONS`` positions (a prefill chunk) stay in MLX, so the choice depends on the number of
positions only: a row is coded alike batched and alone.

The contract (``use_coder``): codes by the same rule -- a coordinate's code is the number of
boundaries below it; numpy's sums may round a coordinate lying on a boundary the other way -- and
decoded vectors that are exactly ``Scheme.decode(pack(codes), f)``: the centroids' integers times
the Hadamard matrix (exact small-integer sums), then the same two float32 products in the same
order, so a stored entry gives back, bit for bit, the floats the live cache attended.
"""
from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

from .host_forward import MAX_POSITIONS


class HostCoder:
    """``Scheme.code_pair`` in numpy for calls of at most ``MAX_POSITIONS`` positions."""

    def __init__(self) -> None:
        self.calls = 0                      # calls it took (the rest went to MLX)
        self._tables: dict[tuple[int, int, int], tuple] = {}

    def _table(self, book: Any) -> tuple:
        key = (book.bits, book.dim, book.seed)
        got = self._tables.get(key)
        if got is None:
            got = self._tables[key] = (np.array(book.signs, dtype=np.float32), np.array(book.h, dtype=np.float32),
                                       np.array(book.ints, dtype=np.float32), np.array(book.bounds, dtype=np.float32),
                                       np.float32(math.sqrt(book.block)))
        return got

    def __call__(self, book: Any, keys: mx.array, values: mx.array) -> tuple | None:
        if keys.ndim < 2 or keys.shape[-2] > MAX_POSITIONS or keys.dtype != mx.float32 or values.dtype != mx.float32:
            return None
        signs, h, ints, bounds, root = self._table(book)
        x = np.stack([np.asarray(keys), np.asarray(values)])
        norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True, dtype=np.float32))
        u = ((x * signs).reshape(-1, book.block) @ h).reshape(x.shape)
        codes = np.searchsorted(bounds, u / np.maximum(norm, np.float32(1e-30)), side="left")
        c = ints[codes]
        f = (norm / (root * np.sqrt(np.sum(c * c, axis=-1, keepdims=True, dtype=np.float32)))).astype(np.float32)
        out = ((c.reshape(-1, book.block) @ h).reshape(x.shape) * f) * signs
        codes = codes.astype(np.uint8)
        self.calls += 1
        return ((mx.array(codes[0]), mx.array(f[0]), mx.array(out[0])),
                (mx.array(codes[1]), mx.array(f[1]), mx.array(out[1])))
