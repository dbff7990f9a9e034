"""Decode attention in one native call on MLX's CPU backend (backends/cpu/native/decode_attention.c, built
into the library of backends/cpu/native/kernels.c).

    attend = load()                       # None where it cannot be built here
    out = attend(queries, parts, scale)   # None: outside what the kernel takes -> MLX's path

On a CPU a decode step's attention is bound by op count, not arithmetic: per layer ~40 MLX ops
(products per KV head, mask, max, exp, sums, the log-sum-exp merge of a shared prefix and each
row's tail), each a graph node, an allocation and a dispatch, for a few hundred thousand
multiply-adds. Measured on the embedded model, 8 rows under a ~340-token shared prompt: ~1.3 ms
a layer through MLX ops, ~0.35 ms in this kernel (+ ~0.15 ms of binding) -- 30 layers a step.

The kernel reads MLX's buffers in place (numpy views of evaluated arrays, strides included: a
slab row cut from a longer buffer, a prefix of batch 1 shared by every row) and writes a new
array; its inputs are evaluated first (the one synchronisation it adds per layer). It takes
float32 queries / keys / values, up to 16 queries per row, masks that are None, "causal", or a
bool / float32 array broadcastable to ``[B, Hq, L, T]``, per-row part visibility, no sinks;
anything else returns None and the caller uses the cascade's MLX ops (backends/cascade.py), which compute
the same softmax (tests/test_native_attention.py holds them within float rounding).

Built once per source and compiler flags with the system C compiler (backends/cpu/native_build.py).
No compiler, a failed build or a failed self-check against the MLX path: ``load()`` returns None
and nothing changes.
"""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np

from . import native_build

log = logging.getLogger(__name__)

SOURCE = native_build.SOURCE   # native/kernels.c includes native/decode_attention.c
MAX_QUERIES = 16            # per row: a decode step or a speculative verification, not a prefill


def threads_here() -> int:
    """2 where this process may use two cores: the usable ones, capped by OPENBLAS_NUM_THREADS
    (local ranks share the cores out at start: system/blas.py share_cores_between_ranks)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        cores = min(cores, int(os.environ.get("OPENBLAS_NUM_THREADS", "") or cores))
    except ValueError:
        pass
    return 2 if cores >= 2 else 1


THREADS = threads_here()    # a call with enough work splits its rows over two threads (install_cpu_kernels re-reads it)

_i64 = ctypes.c_int64


class _Part(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("kb", _i64), ("kh", _i64), ("kt", _i64), ("vb", _i64), ("vh", _i64), ("vt", _i64),
                ("T", _i64), ("mask", ctypes.c_void_p), ("mask_is_bool", _i64),
                ("mb", _i64), ("mh", _i64), ("ml", _i64), ("mt", _i64),
                ("causal", _i64), ("rows", ctypes.c_void_p)]


def build() -> Optional[Path]:
    """The kernel's shared library, built if missing (backends/cpu/native_build.py); None without a
    compiler or on a failure."""
    return native_build.build()


def _view(a: mx.array) -> np.ndarray:
    """A numpy view of an evaluated MLX array's buffer (no copy); the last axis contiguous."""
    n = np.asarray(a)
    if n.strides[-1] != n.itemsize or any(s < 0 for s in n.strides):
        n = np.ascontiguousarray(n)
    return n


def _takes(queries: mx.array, parts: list, sinks: Optional[mx.array]) -> bool:
    """Whether the kernel takes this call -- decided from shapes and dtypes alone, before anything
    is evaluated (a call it does not take costs the MLX path nothing extra)."""
    if queries.ndim != 4 or not parts:
        return False
    B, Hq, L, D = queries.shape
    if sinks is not None or L > MAX_QUERIES or queries.dtype != mx.float32:
        return False
    Hkv, Dv = parts[0].keys.shape[1] if parts[0].keys.ndim == 4 else 0, parts[0].values.shape[-1]
    if not Hkv or Hq % Hkv:
        return False
    for p in parts:
        if not _shapes_agree(p, B, Hkv, D, Dv):
            return False
        if p.keys.dtype != mx.float32 or p.values.dtype != mx.float32:
            return False
        if isinstance(p.mask, str):
            if p.mask != "causal" or p.keys.shape[2] < L:     # causal: the queries are the last L keys
                return False
        elif p.mask is not None:
            if p.mask.dtype not in (mx.bool_, mx.float32) or p.mask.ndim > 4:
                return False
            try:
                np.broadcast_shapes(tuple(p.mask.shape), (B, Hq, L, p.keys.shape[2]))
            except ValueError:
                return False
    return True


def _shapes_agree(p: Any, B: int, Hkv: int, D: int, Dv: int) -> bool:
    """Every buffer the C loop walks has the extent the call implies: keys ``[1 | B, Hkv, T, D]``,
    values ``[same batch, Hkv, T, Dv]``, a row mask of ``B`` -- the kernel reads what its caller
    says is there, so a mismatch is the MLX path's (an error), never an out-of-bounds read."""
    k, v = p.keys, p.values
    if k.ndim != 4 or v.ndim != 4 or k.shape[0] not in (1, B) or v.shape[0] != k.shape[0]:
        return False
    if k.shape[1] != Hkv or v.shape[1] != Hkv or k.shape[2] != v.shape[2] or k.shape[3] != D or v.shape[3] != Dv:
        return False
    rows = p.rows
    return rows is None or (isinstance(rows, mx.array) and rows.size == B)


def binding(path: Path) -> Callable[..., Optional[mx.array]]:
    """``attend(queries, parts, scale, sinks=None)`` over the library at ``path``."""
    lib = ctypes.CDLL(str(path))
    fn = lib.attend
    fn.argtypes = [ctypes.c_void_p, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.POINTER(_Part), _i64,
                   ctypes.c_void_p, ctypes.c_void_p, _i64, _i64]
    fn.restype = _i64

    def attend(queries: mx.array, parts: list, scale: float, sinks: Optional[mx.array] = None) -> Optional[mx.array]:
        if not _takes(queries, parts, sinks):
            return None
        B, Hq, L, D = queries.shape
        q = queries * mx.array(scale, mx.float32)
        arrays = [q]
        for p in parts:
            arrays += [p.keys, p.values]
            arrays += [a for a in (p.rows, p.mask) if isinstance(a, mx.array)]
        mx.eval(*arrays)
        qn = np.ascontiguousarray(np.asarray(q))
        held = [qn]                                   # every buffer the call reads stays alive
        table = (_Part * len(parts))()
        total = 0
        for c, p in zip(table, parts):
            k, v = _view(p.keys), _view(p.values)
            held += [k, v]
            T = k.shape[2]
            c.k, c.v, c.T = k.ctypes.data, v.ctypes.data, T
            c.kb = 0 if k.shape[0] == 1 else k.strides[0] // 4
            c.vb = 0 if v.shape[0] == 1 else v.strides[0] // 4
            c.kh, c.kt, c.vh, c.vt = k.strides[1] // 4, k.strides[2] // 4, v.strides[1] // 4, v.strides[2] // 4
            c.causal = int(p.mask == "causal") if isinstance(p.mask, str) else 0
            if isinstance(p.mask, mx.array):
                m = np.broadcast_to(np.asarray(p.mask), (B, Hq, L, T))
                held.append(m)
                c.mask, c.mask_is_bool = m.ctypes.data, int(m.dtype == np.bool_)
                c.mb, c.mh, c.ml, c.mt = (s // m.itemsize for s in m.strides)
            if p.rows is not None:
                r = np.ascontiguousarray(np.asarray(p.rows), dtype=np.bool_)
                held.append(r)
                c.rows = r.ctypes.data
            total += T
        Hkv, Dv = parts[0].keys.shape[1], parts[0].values.shape[-1]
        out = np.empty((B, Hq, L, Dv), np.float32)
        each = (Hq // max(Hkv, 1)) * L * total + 16
        scratch = np.empty((each * THREADS,), np.float32)
        if fn(qn.ctypes.data, B, Hq, Hkv, L, D, Dv, table, len(parts), out.ctypes.data, scratch.ctypes.data,
              each, THREADS) != 0:
            return None
        return mx.array(out)

    return attend


def load() -> Optional[Callable[..., Optional[mx.array]]]:
    """The bound kernel, built if needed and checked once against the MLX path on random inputs
    (a shared prefix with hidden rows plus masked tails, and a causal part): None on any failure."""
    return native_build.load_checked(binding, _agrees, "native decode attention")


def _agrees(attend: Callable[..., Optional[mx.array]]) -> bool:
    from ..cascade import Part, attend_parts_mlx

    key = mx.random.key(7)
    k1, k2, k3, k4, k5 = mx.random.split(key, 5)
    B, Hq, Hkv, D = 3, 4, 2, 64
    q = mx.random.normal((B, Hq, 2, D), key=k1)
    pk, pv = mx.random.normal((1, Hkv, 9, D), key=k2), mx.random.normal((1, Hkv, 9, D), key=k3)
    tk, tv = mx.random.normal((B, Hkv, 12, D), key=k4)[:, :, :7], mx.random.normal((B, Hkv, 12, D), key=k5)[:, :, :7]
    seen = mx.arange(7)[None, None, None, :] < mx.array([7, 3, 1]).reshape(B, 1, 1, 1)
    cases = ([Part(pk, pv, None, mx.array([True, False, True])), Part(tk, tv, seen)], [Part(tk, tv, "causal")])
    for parts in cases:
        got = attend(q, list(parts), 0.125)
        if got is None or not mx.allclose(got, attend_parts_mlx(q, list(parts), 0.125), rtol=1e-4, atol=1e-5).item():
            log.warning("native decode attention: disagrees with the MLX path; not used")
            return False
    return True
