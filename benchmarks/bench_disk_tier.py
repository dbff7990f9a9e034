"""Disk tier cost: put() latency on the calling thread vs the background write, write and load
cost per MB, and how much a background write stalls a decode-like loop on another thread.

    .venv/bin/python benchmarks/bench_disk_tier.py                      # 10 / 100 / 400 MB records
    .venv/bin/python benchmarks/bench_disk_tier.py --sizes-mb 10 --dir /tmp/x

Records are shaped like an embedded-model KV cache (30 layers x keys/values float32) and
the per-1k-token cost uses its 46,080 bytes/token (30 layers x 2 x 3 KV heads x 64 x 4 bytes).
"verify" is verified_path() (CRC pass, payload not kept) on a warm file.
"Cold" loads drop the file from the page cache first (posix_fadvise DONTNEED after fsync).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the stall probe's matmul must not spin BLAS threads
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxstack.cache.disk.tier import DiskRecord, DiskTier, disk_namespace

EMBEDDED_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


def make_record(total_bytes: int, layers: int = 30) -> DiskRecord:
    per = total_bytes // (2 * layers) // 4
    rng = np.random.default_rng(0)
    block = rng.standard_normal(per, dtype=np.float32)
    tensors = {}
    for i in range(layers):
        tensors[f"{i}.keys"] = block.copy()
        tensors[f"{i}.values"] = block.copy()
    tokens = np.arange(total_bytes // EMBEDDED_BYTES_PER_TOKEN + 1, dtype=np.int64)
    return DiskRecord(tokens, tokens, tensors, {"layers": layers})


def decode_like_gaps(stop: threading.Event, gaps: list[float]) -> None:
    """A loop that holds and releases the GIL like a decode step: small numpy work + Python."""
    a = np.random.default_rng(1).standard_normal((96, 96), dtype=np.float32)
    last = time.perf_counter()
    while not stop.is_set():
        a = np.tanh(a @ a * 0.01)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def measure_gaps(seconds: float, during=None) -> list[float]:
    gaps: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=decode_like_gaps, args=(stop, gaps))
    t.start()
    if during is None:
        time.sleep(seconds)
    else:
        during()
    stop.set()
    t.join()
    return gaps


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 100, 400])
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench_disk_tier_"))
    ns = disk_namespace(bench=True)
    baseline = measure_gaps(1.0)
    print(f"decode-like loop idle: median step {statistics.median(baseline) * 1e3:.3f} ms, "
          f"max {max(baseline) * 1e3:.2f} ms")
    print(f"{'size':>7} {'put ms':>8} {'write s':>8} {'write MB/s':>10} {'load warm s':>11} {'MB/s':>7} {'verify s':>8} "
          f"{'load cold s':>11} {'MB/s':>7} {'step max ms':>11} {'step p99 ms':>11} {'write ms/1k tok':>15}")
    try:
        for mb in args.sizes_mb:
            record = make_record(mb << 20)
            rows = []
            for _ in range(args.repeats):
                shutil.rmtree(root / ns, ignore_errors=True)
                tier = DiskTier(root, ns, 1 << 40)
                box = {}

                def write(tier=tier, box=box, record=record):
                    t0 = time.perf_counter()
                    box["id"] = tier.put(record)
                    box["put"] = time.perf_counter() - t0
                    tier.flush()
                    box["write"] = time.perf_counter() - t0

                gaps = measure_gaps(0, during=write)
                entry_id, nbytes = box["id"], tier.entries()[0].nbytes
                path = tier.entries_dir / f"{entry_id}.safetensors"
                t0 = time.perf_counter()
                got = tier.load(entry_id)
                warm = time.perf_counter() - t0
                assert got is not None
                del got
                t0 = time.perf_counter()
                assert tier.verified_path(entry_id) == path
                verify = time.perf_counter() - t0
                drop_page_cache(path)
                t0 = time.perf_counter()
                got = tier.load(entry_id)
                cold = time.perf_counter() - t0
                assert got is not None
                del got
                tier.close()
                rows.append((box["put"], box["write"], warm, verify, cold, max(gaps),
                             sorted(gaps)[int(0.99 * (len(gaps) - 1))], nbytes))
            put, write, warm, verify, cold, gmax, gp99, nbytes = (statistics.median(c) for c in zip(*rows))
            mbytes = nbytes / (1 << 20)
            per_1k = write / (nbytes / EMBEDDED_BYTES_PER_TOKEN / 1000) * 1e3
            print(f"{mb:>5}MB {put * 1e3:>8.2f} {write:>8.3f} {mbytes / write:>10.0f} {warm:>11.3f} "
                  f"{mbytes / warm:>7.0f} {verify:>8.3f} {cold:>11.3f} {mbytes / cold:>7.0f} {gmax * 1e3:>11.2f} "
                  f"{gp99 * 1e3:>11.3f} {per_1k:>15.1f}")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
