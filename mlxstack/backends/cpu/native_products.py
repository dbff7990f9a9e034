"""A few rows times a weight matrix in one native loop (backends/cpu/native/row_products.c, built into
the library of backends/cpu/native/kernels.c, whose helper thread it shares with the decode attention).

    products = load()                  # None where it cannot be built or disagrees here
    y = products(x, w)                 # x [M, K] float32, w [N, K] row-major -> x @ w.T [M, N]

A decode step of 8 rows multiplies 8 vectors by every weight matrix of the model: ~540 MB of
float32 weights read for ~1 GFLOP. OpenBLAS's sgemm packs the weight into its own layout on
every call before multiplying (for a few rows that copy is most of the work) and reads it at
~7-10 GB/s here; this loop reads each weight row once, in place, on two threads, near the
machine's memory bandwidth (benchmarks/bench_products.py: ~1.9x faster at 1 row, ~1.5x at 8, level
with sgemm at 64-128; past ``MAX_ROWS`` the host path keeps OpenBLAS).

Each (row, output) dot product runs the same instructions whatever the other rows of the call
are: a row gives the same bits alone or in a batch of up to ``MAX_ROWS`` (checked at load beside
the agreement with a float64 reference). Within float rounding of sgemm, not bit for bit.
"""
from __future__ import annotations

import ctypes
import logging
import platform
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from . import native_build
from .native_attention import threads_here

log = logging.getLogger(__name__)

MAX_ROWS = 128              # rows a call (8 rows x 16 positions); more: OpenBLAS (measured level at 128)

_i64 = ctypes.c_int64


def build() -> Optional[Path]:
    """The native kernels' library (backends/cpu/native/kernels.c includes row_products.c)."""
    return native_build.build()


def binding(path: Path, threads: Optional[int] = None) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """``products(x, w)`` over the library at ``path``: ``x`` [M, K] (made C-contiguous), ``w``
    [N, K] C-contiguous float32 (not checked per call: the host path's plan holds such views)."""
    fn = ctypes.CDLL(str(path)).row_products
    fn.argtypes = [ctypes.c_void_p, _i64, _i64, ctypes.c_void_p, _i64, ctypes.c_void_p, _i64]
    fn.restype = ctypes.c_int
    n_threads = threads_here() if threads is None else threads

    def products(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        M, K = x.shape
        N = w.shape[0]
        y = np.empty((M, N), np.float32)
        fn(x.ctypes.data, M, K, w.ctypes.data, N, y.ctypes.data, n_threads)
        return y

    return products


def fast_here(cpuinfo: Optional[str] = None, machine: Optional[str] = None) -> bool:
    """Whether this CPU runs the loop as it was written: fused multiply-adds on vector registers. On
    x86 that needs AVX2 and FMA -- without them ``__builtin_fmaf`` is a libm call per multiply-add
    and a decode step takes seconds, however right its results are (the load check tests only
    correctness). Arm's NEON always has them."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i386", "i686"):
        return True
    return {"avx2", "fma"} <= native_build.cpu_features(cpuinfo)[0]


def faster(products: Callable[[np.ndarray, np.ndarray], np.ndarray],
           reference: Callable[[np.ndarray, np.ndarray], np.ndarray], rows: tuple[int, ...] = (1, 8),
           shape: tuple[int, int] = (2048, 2048), repeats: int = 5,
           clock: Callable[[], float] = time.perf_counter) -> tuple[bool, dict[int, float]]:
    """(whether ``products`` beats ``reference`` -- OpenBLAS's sgemm, what the host path uses
    without the loop -- at every row count of a decode step, {rows: its time / the reference's}),
    each the best of ``repeats`` on a weight larger than the caches (read from memory, as a
    model's are). Correct is not enough: a loop that is slow here (no vector FMA, a starved core)
    must not run (NATIVE_PRODUCTS=auto)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape, dtype=np.float32)
    ratios: dict[int, float] = {}
    for m in rows:
        x = rng.standard_normal((m, shape[1]), dtype=np.float32)
        best = {}
        for name, fn in (("loop", products), ("ref", reference)):
            times = []
            for _ in range(repeats):
                start = clock()
                fn(x, w)
                times.append(clock() - start)
            best[name] = min(times)
        ratios[m] = best["loop"] / best["ref"] if best["ref"] > 0 else float("inf")
    return all(r <= 1.0 for r in ratios.values()), ratios


def load() -> Optional[Callable[[np.ndarray, np.ndarray], np.ndarray]]:
    """The bound loop, built if needed and checked once: None on any failure, and on a CPU the loop
    would be slow on (``fast_here``)."""
    if not fast_here():
        log.info("native row products: this CPU lacks AVX2 / FMA; the products stay with OpenBLAS")
        return None
    return native_build.load_checked(binding, agrees, "native row products")


def agrees(products: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> bool:
    """Against a float64 reference on shapes with every tail (K not a multiple of the vector
    width, N not a multiple of the block, M past a row group), and row by row: each row alone
    gives the bits it gives in the batch."""
    rng = np.random.default_rng(11)
    for M, N, K in ((9, 203, 77), (3, 130, 64), (1, 64, 1000), (MAX_ROWS, 66, 33)):
        x = rng.standard_normal((M, K), dtype=np.float32)
        w = rng.standard_normal((N, K), dtype=np.float32)
        got = products(x, w)
        ref = x.astype(np.float64) @ w.astype(np.float64).T
        if not np.allclose(got, ref, rtol=1e-4, atol=1e-4 * np.sqrt(K)):
            log.warning("native row products: disagree with the reference; not used")
            return False
        if not all(np.array_equal(products(x[r:r + 1], w)[0], got[r]) for r in (0, M // 2, M - 1)):
            log.warning("native row products: a row's result depends on the others; not used")
            return False
    return True
