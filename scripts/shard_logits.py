#!/usr/bin/env python3
"""How far a split model's logits are from one process's: the tolerance DISTRIBUTED works within.

Starts N local ranks over the ring backend (as the server does), loads the model on each, splits it
(mlx-lm's ``shard`` / ``pipeline``), runs a prompt's prefill and ``--tokens`` greedy decode steps
with a KV cache, and compares on rank 0 with the same model unsplit: the largest absolute logit
difference (prefill and decode), the largest relative to the logits' spread, and whether every
greedy token is the same. Prints one JSON line.

    .venv/bin/python scripts/shard_logits.py --ranks 3 --mode tensor             # the embedded SmolLM2
    .venv/bin/python scripts/shard_logits.py --ranks 2 --mode pipeline --model PATH
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT = ("You are a coding agent. Read the repository, run the tests, and report what failed and why. "
          "The failing test is test_parser.py::test_nested_lists; the traceback points at parse_block.")


def model_path(arg: str) -> str:
    if arg:
        return arg
    from mlxstack.config.settings import load_settings
    from mlxstack.models.loader import resolve_model_path

    return str(resolve_model_path(load_settings(env={"MODEL_PATH": ""}))[0])


def run_rank(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxstack.models.device import is_cpu_only, upcast_for_cpu
    from mlxstack.models.sharding import shard

    group = mx.distributed.init(strict=True, backend="ring")
    path = model_path(args.model)

    def greedy(model, tokenizer):
        ids = tokenizer.encode(PROMPT)
        cache = make_prompt_cache(model)
        logits = model(mx.array([ids]), cache=cache)[0].astype(mx.float32)
        steps, toks = [logits], []
        tok = int(logits[-1].argmax().item())
        for _ in range(args.tokens):
            toks.append(tok)
            out = model(mx.array([[tok]]), cache=cache)[0, -1].astype(mx.float32)
            steps.append(out[None])
            tok = int(out.argmax().item())
        mx.eval(steps)
        return steps, toks

    split, tokenizer = load(path, lazy=True)
    if is_cpu_only():
        upcast_for_cpu(split)
    shard(split, args.mode, group)
    mx.eval(split.parameters())
    got, got_toks = greedy(split, tokenizer)
    if group.rank() != 0:
        return
    whole, tokenizer = load(path)
    if is_cpu_only():
        upcast_for_cpu(whole)
    ref, ref_toks = greedy(whole, tokenizer)
    diffs = [float(mx.abs(a - b).max().item()) for a, b in zip(got, ref)]
    spread = max(float((r.max() - r.min()).item()) for r in ref)
    print(json.dumps({"model": Path(path).name, "mode": args.mode, "ranks": group.size(),
                      "prefill_max_abs": diffs[0], "decode_max_abs": max(diffs[1:]) if len(diffs) > 1 else 0.0,
                      "max_rel_to_spread": max(diffs) / spread, "greedy_tokens_equal": got_toks == ref_toks,
                      "tokens": len(ref_toks)}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--mode", default="tensor", choices=["tensor", "pipeline"])
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=20)
    args = ap.parse_args()
    if "MLX_RANK" in os.environ:
        run_rank(args)
        return 0
    from mlxstack.launcher.ranks import free_ports, rank_env, ring_hostfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ring_hostfile(free_ports(args.ranks)), f)
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=rank_env(dict(os.environ), r, f.name))
             for r in range(args.ranks)]
    codes = [p.wait() for p in procs]
    os.unlink(f.name)
    return max(abs(c) for c in codes)


if __name__ == "__main__":
    sys.exit(main())
