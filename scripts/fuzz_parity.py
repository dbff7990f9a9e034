#!/usr/bin/env python3
"""The differential fuzzer's long run (tests/fuzz): concurrent agent traffic against the real
engine and scheduler, every reply compared token for token with a cold engine serving the same
request alone, over every cache kind and many combinations of settings, until time is up.

    .venv/bin/python scripts/fuzz_parity.py --minutes 30 [--kinds dense hybrid ...] [--seed 1]
        [--examples 4] [--steps 20] [--out fuzz-found/]

Each run draws one combination (kind, SHARED_PREFIX_MIN_TOKENS, speculation, KV_BITS with its
scheme (uniform / turboquant) and start, a byte budget that spills and parks, the disk tier with restarts, the prefill chunk) and
runs the Hypothesis state machine from the next seed. A finding is shrunk and written to
``--out`` as a ready pytest file (``test_found_<combination>_<seed>.py``: copy it into tests/ to
keep it). The summary line gives requests, combinations, features covered, mismatches and errors;
the exit status is 1 when anything was found.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KINDS = ("dense", "dense_hd64", "llama_hd64", "hybrid", "gemma3", "llama4", "mamba2", "lfm2", "gpt_oss", "embedded")


def models(folder: Path):
    """kind -> model folder (the tiny fixtures built once into ``folder``; the embedded model)."""
    from mlxstack.models.embedded_model import ensure_embedded_model
    from tests.conftest import _model_cache_dir
    from tests.fixtures import tiny_models as tm
    from tests.fixtures.tiny_gpt_oss import build_tiny_gpt_oss

    embedded = Path(ensure_embedded_model(_model_cache_dir()))
    builders = {"dense": tm.build_tiny_dense, "dense_hd64": tm.build_tiny_dense_hd64,
                "llama_hd64": tm.build_tiny_llama_hd64, "hybrid": tm.build_tiny_hybrid,
                "gemma3": tm.build_tiny_gemma3, "llama4": tm.build_tiny_llama4, "mamba2": tm.build_tiny_mamba2,
                "lfm2": tm.build_tiny_lfm2, "gpt_oss": build_tiny_gpt_oss}

    def path(kind: str) -> Path:
        if kind == "embedded":
            return embedded
        out = folder / kind
        if not (out / "config.json").exists():
            out.mkdir(parents=True, exist_ok=True)
            builders[kind](out, embedded)
        return out

    return path


def draw(kind: str, rnd: random.Random):
    """One combination of the warm engine's settings for ``kind``."""
    from tests.fuzz.harness import Config

    kv = kind in ("dense_hd64", "llama_hd64", "embedded") and rnd.random() < (0.3 if kind == "embedded" else 0.8)
    # TurboQuant's codes only where the CPU backend's exact path takes the model (a Llama): off it a
    # code may land one bucket over after a hit, by the CPU's rounding (LESSONS 93)
    exact = kind in ("llama_hd64", "embedded")
    scheme = rnd.choice(["uniform", "turboquant"]) if kv and exact else "uniform"
    bits = rnd.choice([4, 8] if scheme == "uniform" else [2, 3, 4, 8]) if kv else None
    return Config(kind, min_shared=rnd.choice([8, 16, 32] if kind != "embedded" else [32, 64]),
                  speculative=rnd.random() < 0.7, kv_bits=bits, kv_scheme=scheme,
                  quant_start=rnd.choice([0, 16, 40]) if kv else 0,
                  budget_tokens=rnd.choice([0, 0, 60, 120, 400]), disk=rnd.random() < 0.5,
                  max_sequences=rnd.choice([2, 4, 8, 8]),
                  chunk=rnd.choice([16, 64, 64] if kind != "embedded" else [64, 256]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--examples", type=int, default=4, help="examples per run (one combination)")
    ap.add_argument("--steps", type=int, default=20, help="rules per example")
    ap.add_argument("--out", type=Path, default=REPO / "fuzz-found")
    ap.add_argument("--models", type=Path, default=Path.home() / ".cache" / "mlxstack" / "fuzz-models")
    args = ap.parse_args()
    from mlxstack.config.settings import load_settings
    from mlxstack.system.process_env import reexec_with

    reexec_with(load_settings(env={}), [str(Path(__file__).resolve()), *sys.argv[1:]])   # OpenBLAS, as the server
    import logging
    import tempfile

    from tests.fuzz.harness import Totals
    from tests.fuzz.machine import run_machine

    logging.disable(logging.WARNING)
    path = models(args.models)
    args.out.mkdir(parents=True, exist_ok=True)
    rnd, seed, deadline = random.Random(args.seed), args.seed, time.monotonic() + args.minutes * 60
    totals, runs, found, combos = Totals(), 0, [], set()
    kinds = list(args.kinds)
    while time.monotonic() < deadline:
        kind = kinds[runs % len(kinds)]
        config = draw(kind, rnd)
        combos.add(config.name())
        case = args.out / f"test_found_{config.name().replace('-', '_').replace('@', '_')}_{seed}.py"
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                steps = args.steps if kind != "embedded" else max(6, args.steps // 2)   # ~10x a tiny model's step
                run_machine(config, path(kind), Path(tmp), seed=seed, examples=args.examples, steps=steps,
                            reproducer=case, totals=totals)
                verdict = "ok"
            except AssertionError:
                verdict = f"FOUND -> {case}"
                found.append({"config": config.name(), "seed": seed, "case": str(case),
                              "findings": list(totals.last_findings)})
        print(f"[{time.monotonic() - deadline + args.minutes * 60:7.0f}s] {config.name()} seed {seed}: {verdict} "
              f"({time.monotonic() - t0:.0f}s)", flush=True)
        seed += 1
        runs += 1
    kinds_found = [f for f in found for x in f["findings"] if x.startswith("mismatch") or x.startswith("prompt")]
    errors = [f for f in found for x in f["findings"] if x.startswith("error")]
    summary = {"minutes": args.minutes, "runs": runs, "combinations": len(combos), "kinds": kinds,
               "examples": totals.examples, "requests": totals.requests, "compared": totals.compared,
               "hung_up": totals.hung_up, "refused": totals.refused, "reused_tokens": totals.reused_tokens,
               "shared_prefills": totals.shared_prefills, "parked": totals.parked, "restarts": totals.restarts,
               "features": sorted(totals.features), "runs_with_mismatches": len(kinds_found),
               "runs_with_errors": len(errors), "found": found}
    print(totals.line())
    print(json.dumps(summary))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
