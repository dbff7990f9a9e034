#!/usr/bin/env python3
"""The host path's weight products, side by side in one process: the native loop
(backends/cpu/native_products.py, NATIVE_PRODUCTS) vs OpenBLAS's sgemm (the BLAS MLX itself uses),
over every product of one decode step of the embedded model's shapes (SmolLM2-135M: 30 layers x
q / k / v / o / gate / up / down + the tied head, 211 products, ~540 MB of float32 weights),
for several row counts. Random weights of those shapes (the cost does not depend on the values);
the two alternate, a pause after each (OpenBLAS's threads spin a while after a call), median of
``--rounds``.

    .venv/bin/python benchmarks/bench_products.py [--rows 1 8 16 32 64 128] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlxstack.config.settings import load_settings  # noqa: E402
from mlxstack.system.process_env import reexec_with  # noqa: E402

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    reexec_with(load_settings(), [__file__, *sys.argv[1:]])   # the preloaded OpenBLAS, as the server has it
    import numpy as np

    import mlx.core  # noqa: F401 - loads MLX's BLAS the way the server does
    from mlxstack.backends.cpu import host_forward, native_products

    sgemm = host_forward.blas()
    loop = native_products.load()
    if sgemm is None or loop is None:
        print("needs the preloaded OpenBLAS and a C compiler (sgemm: %s, loop: %s)" % (sgemm is not None, loop is not None))
        return 1
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(s, dtype=np.float32) for s in SHAPES]
    total = sum(w.nbytes for w in weights)

    def step(rows: int, native: bool) -> float:
        t0 = time.perf_counter()
        for w in weights:
            N, K = w.shape
            x = np.ones((rows, K), np.float32)
            if native:
                loop(x, w)
            else:
                y = np.empty((rows, N), np.float32)
                sgemm(101, 111, 112, rows, N, K, 1.0, x.ctypes.data, K, w.ctypes.data, K, 0.0, y.ctypes.data, N)
        return time.perf_counter() - t0

    print(f"{len(weights)} products, {total / 1e6:.0f} MB of weights a step")
    print("| rows | native loop ms | sgemm ms | sgemm / loop | loop GB/s |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        got: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for native in (True, False):
                got[native].append(step(rows, native))
                time.sleep(0.3)
        a, b = statistics.median(got[True]), statistics.median(got[False])
        print(f"| {rows} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f}x | {total / a / 1e9:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
