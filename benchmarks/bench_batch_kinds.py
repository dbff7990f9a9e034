#!/usr/bin/env python3
"""Batched decode per cache kind, in process: one decode step of ONE sequence vs one step of 8
sequences in one forward (the DecodeGroup's batched layers: slab rows for KV layers, mlx-lm's
BatchRotatingKVCache / batched ArraysCache for the others), on random-weight models of the
embedded model's size (~135M parameters: 576 hidden, 30 layers, 9 heads / 3 KV heads) in four
layouts: dense (llama), sliding window (gemma3_text, window 512, 5 of 6 layers sliding),
conv hybrid (lfm2) and recurrent (mamba2). Also checks that each row of the batch gives the
logits its sequence gives alone.

    .venv/bin/python benchmarks/bench_batch_kinds.py [--context 600] [--rows 8] [--kinds llama gemma3_text]
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402

from mlxstack.cache.slab import stack_layers  # noqa: E402

COMMON = {"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
          "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
          "tie_word_embeddings": True}
CONFIGS = {
    "llama": {"model_type": "llama", "rope_theta": 100000.0},
    "gemma3_text": {"model_type": "gemma3_text", "head_dim": 64, "query_pre_attn_scalar": 64, "rope_theta": 1000000.0,
                    "rope_local_base_freq": 10000.0, "sliding_window": 512, "sliding_window_pattern": 6},
    "lfm2": {"model_type": "lfm2", "num_heads": 9, "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
             "block_dim": 576, "block_ff_dim": 1536, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False, "rope_theta": 1000000.0,
             "full_attn_idxs": [2, 5, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28]},
    "mamba2": {"model_type": "mamba2", "num_heads": 18, "head_dim": 64, "state_size": 64, "num_hidden_layers": 24,
               "layer_norm_epsilon": 1e-5, "expand": 2, "conv_kernel": 4, "n_groups": 1, "use_bias": False,
               "use_conv_bias": True, "time_step_limit": [0.0, float("inf")], "time_step_rank": "auto"},
}


def build(kind: str, layers: int | None = None):
    cfg = {**COMMON, **CONFIGS[kind]}
    if layers is not None:   # fewer layers (tests): the same layout, cut short
        cfg["num_hidden_layers"] = layers
        if "full_attn_idxs" in cfg:
            cfg["full_attn_idxs"] = [i for i in cfg["full_attn_idxs"] if i < layers]
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    args = module.ModelArgs.from_dict(cfg)
    model = module.Model(args)
    mx.eval(model.parameters())
    return model


def prefilled(model, n: int, seed: int):
    cache = model.make_cache()
    toks = [(seed * 7919 + i * 31) % 40000 + 10 for i in range(n)]
    for s in range(0, n, 256):
        model(mx.array([toks[s:s + 256]]), cache=cache)
        mx.eval([a for c in cache for a in (c.state if isinstance(c.state, (list, tuple)) else [c.state])
                 if isinstance(a, mx.array)])
    return cache


def timed(fn, steps: int) -> float:
    fn()
    fn()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t) / steps


def run(kind: str, context: int, rows: int, steps: int, layers: int | None = None) -> dict:
    model = build(kind, layers)
    # one sequence alone: keep stepping it (the cache grows by one token per step, as in decode)
    solo = prefilled(model, context, 1)
    tok = mx.array([[5]], dtype=mx.int32)
    t1 = timed(lambda: mx.eval(model(tok, cache=solo)), steps)
    # parity: rows of different lengths stepped together == each stepped alone
    lengths = [context + 7 * r for r in range(rows)]
    alone_caches = [prefilled(model, n, r + 2) for r, n in enumerate(lengths)]
    alone = [model(tok, cache=c)[0, -1] for c in alone_caches]
    batch = stack_layers([prefilled(model, n, r + 2) for r, n in enumerate(lengths)])
    toks = mx.array([[5]] * rows, dtype=mx.int32)
    together = model(toks, cache=batch)[:, -1]
    err = max(mx.abs(together[r] - alone[r]).max().item() for r in range(rows))
    tb = timed(lambda: mx.eval(model(toks, cache=batch)), steps)
    return {"kind": kind, "context": context, "single_tok_s": 1 / t1, "batched_tok_s": rows / tb,
            "speedup": (rows / tb) * t1, "max_logit_diff": err}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kinds", nargs="+", default=list(CONFIGS))
    args = ap.parse_args()
    if sys.platform.startswith("linux"):   # OpenBLAS preloaded, as the server runs (re-exec once)
        from mlxstack.config.settings import load_settings
        from mlxstack.system.process_env import reexec_with

        reexec_with(load_settings(), [str(Path(__file__).resolve()), *sys.argv[1:]])
    print(f"| layout | context | 1 sequence tok/s | {args.rows} sequences tok/s | ratio | max logit diff |")
    print("|---|---|---|---|---|---|")
    for kind in args.kinds:
        r = run(kind, args.context, args.rows, args.steps)
        print(f"| {kind} | {r['context']} | {r['single_tok_s']:.1f} | {r['batched_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['max_logit_diff']:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
