"""TurboQuant's coder on the host for decode-sized calls (KV_QUANT_SCHEME=turboquant, CPU).

    turboquant.use_coder(HostCoder(load()))   # CpuBackend.install, with the host path on

A decode step codes every layer's new K / V vectors: a handful of positions a row. MLX's graph for
that (cache/turboquant.py ``Scheme.code_pair``: rotation, norms, the codebook comparison, the
decoded vectors, the packing) is some fifteen kernels a layer, bound by op count on the CPU
(LESSONS 72). Here it is one native call a layer for K and V together (native/turboquant_code.c,
built with the other kernels and checked at load: ``load``), or -- without a compiler, or where the
check fails -- the same arithmetic in numpy. Calls of more than ``MAX_POSITIONS`` positions (a
prefill chunk) stay in MLX, so the choice depends on the number of positions only: a row is coded
alike batched and alone.

The contract (``use_coder``): codes by the same rule -- a coordinate's code is the number of
boundaries below it; another order of sums may round a coordinate lying on a boundary the other
way -- and decoded vectors that are exactly ``Scheme.decode(packed, f)``: the centroids' integers
times the Hadamard matrix (exact small-integer sums), then the same two float32 products in the
same order, so a stored entry gives back, bit for bit, the floats the live cache attended.
"""
from __future__ import annotations

import ctypes
import logging
import math
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np

from . import native_build
from .host_forward import MAX_POSITIONS

log = logging.getLogger(__name__)

_i64 = ctypes.c_int64
Coder = Callable[["_Table", np.ndarray, np.ndarray], Optional[tuple]]     # (table, k, v) -> (packed, f, out)
NATIVE = "native turboquant coder"       # its name in native_build.problem()


class _Table:
    """One scheme's arrays as the host reads them."""

    def __init__(self, book: Any) -> None:
        self.bits, self.dim, self.block = book.bits, book.dim, book.block
        self.group, self.group_bytes = book.group, book.group_bytes
        self.signs = np.ascontiguousarray(np.array(book.signs, dtype=np.float32))
        self.h = np.array(book.h, dtype=np.float32)
        self.ints = np.ascontiguousarray(np.array(book.ints, dtype=np.float32))
        self.bounds = np.ascontiguousarray(np.array(book.bounds, dtype=np.float32))
        self.root = float(np.float32(math.sqrt(book.block)))
        self.shifts = np.array([book.bits * i for i in range(book.group)], dtype=np.uint32)
        self.row_bytes = book.dim // book.group * book.group_bytes
        self.pointers = (self.signs.ctypes.data, self.bounds.ctypes.data, self.ints.ctypes.data)


def binding(path: Path) -> Coder:
    """``code(table, k, v)`` over the library at ``path``: ``k`` / ``v`` [n, dim] float32 -> (packed
    [2n, bytes] uint8, f [2n, 1] float32, decoded [2n, dim] float32) -- k's n vectors, then v's --
    or None when the library refuses the call."""
    fn = ctypes.CDLL(str(path)).tq_code
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, _i64, _i64, _i64, ctypes.c_void_p, ctypes.c_void_p, _i64,
                   ctypes.c_void_p, ctypes.c_float, _i64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int

    def code(t: _Table, k: np.ndarray, v: np.ndarray) -> Optional[tuple]:
        k, v = np.ascontiguousarray(k, dtype=np.float32), np.ascontiguousarray(v, dtype=np.float32)
        n = k.shape[0]
        if v.shape != k.shape:
            return None
        packed = np.empty((2 * n, t.row_bytes), np.uint8)
        f = np.empty((2 * n, 1), np.float32)
        out = np.empty((2 * n, t.dim), np.float32)
        if fn(k.ctypes.data, v.ctypes.data, n, t.dim, t.block, t.pointers[0], t.pointers[1], t.bounds.size,
              t.pointers[2], t.root, t.bits, packed.ctypes.data, f.ctypes.data, out.ctypes.data):
            return None
        return packed, f, out

    return code


def numpy_code(t: _Table, k: np.ndarray, v: np.ndarray) -> tuple:
    """The same as the native call, in numpy."""
    x = np.concatenate([k, v])
    norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True, dtype=np.float32))
    u = ((x * t.signs).reshape(-1, t.block) @ t.h).reshape(x.shape)
    codes = np.searchsorted(t.bounds, u / np.maximum(norm, np.float32(1e-30)), side="left")
    c = t.ints[codes]
    f = (norm / (np.float32(t.root) * np.sqrt(np.sum(c * c, axis=-1, keepdims=True, dtype=np.float32))))
    f = f.astype(np.float32)
    out = ((c.reshape(-1, t.block) @ t.h).reshape(x.shape) * f) * t.signs
    groups = codes.astype(np.uint32).reshape(x.shape[0], -1, t.group) << t.shifts
    word = np.bitwise_or.reduce(groups, axis=-1)
    packed = np.stack([(word >> (8 * i)) & 0xFF for i in range(t.group_bytes)], axis=-1).astype(np.uint8)
    return packed.reshape(x.shape[0], t.row_bytes), f, out


def agrees(code: Coder) -> bool:
    """Against MLX's coder (cache/turboquant.py) at every width, two head sizes and a block
    smaller than the head: decoded vectors bit for bit what the packed codes decode to, codes the
    same but where a coordinate lies within rounding of a boundary, f within rounding."""
    from ...cache import turboquant as tq

    rng = np.random.default_rng(44)
    for bits in tq.BITS:
        for dim in (64, 128, 96):
            book = tq.scheme(bits, dim, tq.SEED)
            x = (rng.standard_normal((48, dim)) * rng.uniform(0.1, 9, (1, dim))).astype(np.float32)
            got = code(_Table(book), x[:24], x[24:])
            if got is None:
                log.warning("%s: refused a %d-dimensional call; not used", NATIVE, dim)
                return False
            packed, f, out = got
            want_packed, want_f, _ = book.code(mx.array(x))
            if not mx.array_equal(book.decode(mx.array(packed), mx.array(f)), mx.array(out)).item():
                log.warning("%s: decoded vectors differ from what the codes decode to; not used", NATIVE)
                return False
            same = np.asarray(book.unpack(mx.array(packed))) == np.asarray(book.unpack(want_packed))
            if same.mean() < 0.999 or not np.allclose(f, np.asarray(want_f), rtol=1e-5):
                log.warning("%s: codes disagree with MLX's coder; not used", NATIVE)
                return False
    return True


def load() -> Optional[Coder]:
    """The native coder, built with the other kernels and checked once; None on any failure (the
    numpy form codes instead)."""
    return native_build.load_checked(binding, agrees, NATIVE)


class HostCoder:
    """``Scheme.code_pair`` on the host for calls of at most ``MAX_POSITIONS`` positions: the
    native call when given one (``load``), else numpy."""

    def __init__(self, native: Optional[Coder] = None) -> None:
        self.native = native
        self.calls = 0                      # calls it took (the rest went to MLX)
        self._tables: dict[tuple[int, int, int], _Table] = {}

    @property
    def form(self) -> str:
        return "native" if self.native is not None else "numpy"

    def __call__(self, book: Any, keys: mx.array, values: mx.array) -> tuple | None:
        if keys.ndim < 2 or keys.shape[-2] > MAX_POSITIONS or keys.dtype != mx.float32 or values.dtype != mx.float32:
            return None
        key = (book.bits, book.dim, book.seed)
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = _Table(book)
        shape = keys.shape
        k, v = np.asarray(keys).reshape(-1, shape[-1]), np.asarray(values).reshape(-1, shape[-1])
        got = self.native(t, k, v) if self.native is not None else None
        packed, f, out = got if got is not None else numpy_code(t, k, v)
        half = k.shape[0]
        lead = shape[:-1]
        self.calls += 1
        return tuple((mx.array(packed[s].reshape(*lead, t.row_bytes)), mx.array(f[s].reshape(*lead, 1)),
                      mx.array(out[s].reshape(shape)))
                     for s in (slice(0, half), slice(half, None)))
