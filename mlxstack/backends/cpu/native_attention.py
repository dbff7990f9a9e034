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
float32 queries / keys / values -- or a part's keys / values as mx.quantize's codes, scales and
biases (a QuantizedKVCache's: attended as the floats mx.dequantize gives back, bit for bit) --, up to
16 queries per row, masks that are None, "causal", or a bool / float32 array broadcastable to
``[B, Hq, L, T]``, per-row part visibility, no sinks; anything else returns None and the caller uses the cascade's MLX ops (backends/cascade.py), which compute
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


class _View(ctypes.Structure):
    _fields_ = [("p", ctypes.c_void_p), ("b", _i64), ("h", _i64), ("t", _i64)]


class _Part(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("kb", _i64), ("kh", _i64), ("kt", _i64), ("vb", _i64), ("vh", _i64), ("vt", _i64),
                ("T", _i64), ("mask", ctypes.c_void_p), ("mask_is_bool", _i64),
                ("mb", _i64), ("mh", _i64), ("ml", _i64), ("mt", _i64),
                ("causal", _i64), ("rows", ctypes.c_void_p),
                ("bits", _i64), ("group", _i64), ("kq", _View * 3), ("vq", _View * 3)]


QUANT_BITS = (2, 3, 4, 5, 6, 8)     # mx.quantize's widths (codes at bit i * bits of a row, little-endian)


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


def _width(p: Any, x: Any) -> int:
    """The float width of one of a part's key / value buffers (0: not one the kernel reads): a
    float32 ``[., ., T, D]`` array, or with ``p.bits`` mx.quantize's (uint32 codes, float32 scales,
    float32 biases) of one shape ``[., ., T, D * bits / 32]`` / ``[., ., T, D / group_size]``."""
    if not p.bits:
        return x.shape[-1] if isinstance(x, mx.array) and x.ndim == 4 and x.dtype == mx.float32 else 0
    if p.bits not in QUANT_BITS or p.group_size <= 0 or not isinstance(x, (tuple, list)) or len(x) != 3:
        return 0
    w, sc, bi = x
    if w.ndim != 4 or w.dtype != mx.uint32 or sc.dtype != mx.float32 or bi.dtype != mx.float32:
        return 0
    d = w.shape[-1] * 32 // p.bits
    if sc.shape != bi.shape or sc.shape[:3] != w.shape[:3] or sc.shape[-1] * p.group_size != d:
        return 0
    return d


def _geometry(p: Any) -> Optional[tuple[int, int, int, int, int]]:
    """(batch, Hkv, T, D, Dv) of a part's keys / values, or None where the kernel cannot read them."""
    D, Dv = _width(p, p.keys), _width(p, p.values)
    if not D or not Dv:
        return None
    k = p.keys[0] if p.bits else p.keys
    v = p.values[0] if p.bits else p.values
    if k.shape[:3] != v.shape[:3]:
        return None
    return k.shape[0], k.shape[1], k.shape[2], D, Dv


def _takes(queries: mx.array, parts: list, sinks: Optional[mx.array]) -> bool:
    """Whether the kernel takes this call -- decided from shapes and dtypes alone, before anything
    is evaluated (a call it does not take costs the MLX path nothing extra)."""
    if queries.ndim != 4 or not parts:
        return False
    B, Hq, L, D = queries.shape
    if sinks is not None or L > MAX_QUERIES or queries.dtype != mx.float32:
        return False
    first = _geometry(parts[0])
    if first is None:
        return False
    Hkv, Dv = first[1], first[4]
    if not Hkv or Hq % Hkv:
        return False
    for p in parts:
        if not _shapes_agree(p, B, Hkv, D, Dv):
            return False
        T = _geometry(p)[2]
        if isinstance(p.mask, str):
            if p.mask != "causal" or T < L:     # causal: the queries are the last L keys
                return False
        elif p.mask is not None:
            if p.mask.dtype not in (mx.bool_, mx.float32) or p.mask.ndim > 4:
                return False
            try:
                np.broadcast_shapes(tuple(p.mask.shape), (B, Hq, L, T))
            except ValueError:
                return False
    return True


def _shapes_agree(p: Any, B: int, Hkv: int, D: int, Dv: int) -> bool:
    """Every buffer the C loop walks has the extent the call implies: keys ``[1 | B, Hkv, T, D]``,
    values ``[same batch, Hkv, T, Dv]`` (as floats, or as the codes, scales and biases of that
    many floats), a row mask of ``B`` -- the kernel reads what its caller says is there, so a
    mismatch is the MLX path's (an error), never an out-of-bounds read."""
    g = _geometry(p)
    if g is None or g[0] not in (1, B) or g[1] != Hkv or g[3] != D or g[4] != Dv:
        return False
    rows = p.rows
    return rows is None or (isinstance(rows, mx.array) and rows.size == B)


def _strides(c: Any, n: np.ndarray, size: int) -> None:
    """A ``_View``'s pointer and (batch, head, token) strides, in elements, of numpy view ``n``
    (batch stride 0: one copy for every row)."""
    c.p = n.ctypes.data
    c.b = 0 if n.shape[0] == 1 else n.strides[0] // size
    c.h, c.t = n.strides[1] // size, n.strides[2] // size


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
            arrays += [*p.keys, *p.values] if p.bits else [p.keys, p.values]
            arrays += [a for a in (p.rows, p.mask) if isinstance(a, mx.array)]
        mx.eval(*arrays)
        qn = np.ascontiguousarray(np.asarray(q))
        held = [qn]                                   # every buffer the call reads stays alive
        table = (_Part * len(parts))()
        total = 0
        for c, p in zip(table, parts):
            if p.bits:                                 # codes, scales, biases: dequantised block by block
                c.bits, c.group = p.bits, p.group_size
                for views, arrays3 in ((c.kq, p.keys), (c.vq, p.values)):
                    for view, a in zip(views, arrays3):
                        n = _view(a)
                        held.append(n)
                        _strides(view, n, 4)
                T = p.keys[0].shape[2]
            else:
                k, v = _view(p.keys), _view(p.values)
                held += [k, v]
                T = k.shape[2]
                c.k, c.v = k.ctypes.data, v.ctypes.data
                c.kb = 0 if k.shape[0] == 1 else k.strides[0] // 4
                c.vb = 0 if v.shape[0] == 1 else v.strides[0] // 4
                c.kh, c.kt, c.vh, c.vt = k.strides[1] // 4, k.strides[2] // 4, v.strides[1] // 4, v.strides[2] // 4
            c.T = T
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
        _, Hkv, _, _, Dv = _geometry(parts[0])
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
    # a QuantizedKVCache's codes: the kernel attends the floats mx.dequantize gives back
    quantized = [[Part(mx.quantize(tk, group_size=32, bits=bits), mx.quantize(tv, group_size=32, bits=bits), "causal",
                       None, bits, 32)] for bits in (3, 4, 8)]
    for parts in (*cases, *quantized):
        got = attend(q, list(parts), 0.125)
        if got is None or not mx.allclose(got, attend_parts_mlx(q, list(parts), 0.125), rtol=1e-4, atol=1e-5).item():
            log.warning("native decode attention: disagrees with the MLX path; not used")
            return False
    return True
