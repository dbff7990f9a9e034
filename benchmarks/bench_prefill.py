#!/usr/bin/env python3
"""Prefill / decode throughput: our engine path vs plain mlx-lm, on the same model, in one run.

Sections (all by default; pick with --sections):
  compare    prefill tok/s and decode tok/s at each --lengths for (a) our engine path and
             (b) plain ``mlx_lm.stream_generate``, side by side with ratios.
  blas       quantized GGUF weights (4-bit, no BLAS preload = the unpatched wheel) vs float32
             with OpenBLAS preloaded; each runs in its own subprocess (LD_PRELOAD only acts at exec).
  breakdown  where the time goes past 1k tokens: one layer's attention
             (mx.fast.scaled_dot_product_attention) vs the MLP matmuls at 2048 tokens, and
             the effect of the prefill chunk size on a full 2048-token prefill.

On Linux the script re-executes itself once with the optimised-BLAS environment from
``mlxstack.system.blas`` (unless --no-blas or it is already active), so the main table measures
the configuration the server runs with.

Examples:
  python benchmarks/bench_prefill.py
  python benchmarks/bench_prefill.py --lengths 512 --decode-tokens 32 --sections compare
  python benchmarks/bench_prefill.py --model ~/models/Qwen3-0.6B-4bit --sections compare
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

_CHILD_FLAG = "MLXSTACK_BENCH_CHILD"
_FILLER = (
    "The quick brown fox jumps over the lazy dog 0123456789. Paris is the capital of France; "
    "def f(x): return x * 2  # code, numbers 3.14159 and unicode café, naïve, 東京.\n"
)


# ----------------------------------------------------------------------------- helpers


def _settings():
    from mlxstack.config.settings import load_settings

    return load_settings()


def resolve_model(model: Optional[str], float32: bool) -> str:
    if model:
        return str(Path(model).expanduser()) if Path(model).expanduser().exists() else model
    from mlxstack.models.embedded_model import ensure_embedded_model

    def progress(msg: str, frac: float) -> None:
        print(f"  [convert {frac * 100:5.1f}%] {msg}", file=sys.stderr, flush=True)

    return str(ensure_embedded_model(_settings().model_cache_path, float32=float32, progress=progress))


def make_prompt(tokenizer: Any, n_tokens: int) -> list[int]:
    ids: list[int] = []
    text = _FILLER
    while len(ids) < n_tokens:
        ids = tokenizer.encode(text, add_special_tokens=False)
        text += _FILLER
    return ids[:n_tokens]


def _no_eos_processor(tokenizer: Any) -> Callable:
    """Logits processor that forbids EOS so every run decodes exactly --decode-tokens."""
    import mlx.core as mx

    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])

    def proc(tokens: Any, logits: Any) -> Any:
        idx = mx.array(eos)
        return mx.put_along_axis(logits, mx.broadcast_to(idx[None], (logits.shape[0], len(eos))), mx.array(-1e9, logits.dtype), axis=-1)

    return proc


# ----------------------------------------------------------------------------- (a) our engine path
def engine_run(model: Any, tokenizer: Any, prompt: list[int], decode_tokens: int, prefill_step_size: int) -> tuple[float, int, float]:
    """The server's own path (mlxstack.runner.generate): prefill into a fresh cache, then decode
    greedily with no stop tokens, so every run decodes exactly ``decode_tokens``.

    Returns (time to first token, tokens decoded after the first, seconds for those).
    """
    from mlx_lm.models.cache import make_prompt_cache

    from mlxstack.runner.generate import SamplingParams, decode, prefill

    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    logits = prefill(model, cache, prompt, prefill_step_size)
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens)
    t_first = None
    n = 0
    for _tok in decode(model, cache, logits, prompt, params):
        n += 1
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    assert t_first is not None
    return t_first - t0, max(0, n - 1), t_end - t_first


# ----------------------------------------------------------------------------- (b) plain mlx-lm


def mlx_lm_run(model: Any, tokenizer: Any, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    """Plain ``mlx_lm.stream_generate`` with its defaults; returns its (prompt_tps, generation_tps)."""
    from mlx_lm import stream_generate

    last = None
    for resp in stream_generate(
        model, tokenizer, prompt, max_tokens=decode_tokens, logits_processors=[_no_eos_processor(tokenizer)]
    ):
        last = resp
    assert last is not None
    return float(last.prompt_tps), float(last.generation_tps)


# ----------------------------------------------------------------------------- sections


def section_compare(
    model_path: str, lengths: list[int], decode_tokens: int, step: int, repeat: int, with_mlx_lm: bool = True
) -> list[dict[str, Any]]:
    import mlx_lm

    model, tokenizer = mlx_lm.load(model_path)
    warm = make_prompt(tokenizer, 64)
    engine_run(model, tokenizer, warm, 4, step)
    if with_mlx_lm:
        mlx_lm_run(model, tokenizer, warm, 4)
    rows = []
    for n in lengths:
        prompt = make_prompt(tokenizer, n)
        best: dict[str, float] = {}
        for _ in range(repeat):
            pre_s, dn, ds = engine_run(model, tokenizer, prompt, decode_tokens, step)
            e_pre, e_dec = n / pre_s, (dn / ds if ds > 0 else 0.0)
            m_pre, m_dec = mlx_lm_run(model, tokenizer, prompt, decode_tokens) if with_mlx_lm else (float("nan"),) * 2
            for key, val in (("e_pre", e_pre), ("e_dec", e_dec), ("m_pre", m_pre), ("m_dec", m_dec)):
                best[key] = max(best.get(key, 0.0), val)
        rows.append({"tokens": n, **best})
        print(
            f"  {n:>6} tok: engine prefill {best['e_pre']:8.1f} tok/s decode {best['e_dec']:6.1f} tok/s | "
            f"mlx-lm prefill {best['m_pre']:8.1f} decode {best['m_dec']:6.1f}",
            file=sys.stderr,
            flush=True,
        )
    return rows


def print_compare(rows: list[dict[str, Any]], step: int, model_path: str) -> None:
    from mlxstack.system.blas import blas_status

    print(f"\nmodel: {model_path}")
    print(blas_status())
    print(f"engine = mlxstack.runner.generate (prefill + decode), prefill_step_size={step}; mlx-lm = stream_generate defaults (prefill_step_size=2048)")
    head = f"{'prompt':>7} | {'engine prefill':>14} {'mlx-lm prefill':>14} {'ratio':>6} | {'engine decode':>13} {'mlx-lm decode':>13} {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['tokens']:>7} | {r['e_pre']:>10.1f} t/s {r['m_pre']:>10.1f} t/s {r['e_pre'] / r['m_pre']:>5.2f}x | "
            f"{r['e_dec']:>9.1f} t/s {r['m_dec']:>9.1f} t/s {r['e_dec'] / r['m_dec']:>5.2f}x"
        )


def _child(args_list: list[str], env_extra: dict[str, str], drop_preload: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if drop_preload:
        env.pop("LD_PRELOAD", None)
    env.update(env_extra)
    env[_CHILD_FLAG] = "1"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--no-blas", *args_list]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def section_blas(args: argparse.Namespace, length: int) -> None:
    from mlxstack.system.blas import blas_preload_env

    blas_env = blas_preload_env(_settings().replace(blas_preload="auto"))
    common = ["--sections", "compare", "--engine-only", "--lengths", str(length), "--decode-tokens", str(args.blas_decode_tokens), "--repeat", "1"]
    if args.model:
        common += ["--model", args.model]
    print(f"\n[blas] {length}-token prompt: quantized GGUF weights, bundled BLAS (unpatched wheel) ...", file=sys.stderr, flush=True)
    slow = _child(common + ["--quantized"], {}, drop_preload=True)
    if blas_env:
        print("[blas] float32 weights + OpenBLAS preload ...", file=sys.stderr, flush=True)
        fast = _child(common, blas_env, drop_preload=True)
    else:
        print("[blas] no OpenBLAS found; float32 without preload ...", file=sys.stderr, flush=True)
        fast = _child(common, {}, drop_preload=True)
    s, f = slow["rows"][0], fast["rows"][0]
    print(f"\nquantized (4-bit GGUF) + bundled BLAS vs float32 + {'OpenBLAS' if blas_env else 'bundled BLAS (none found)'}, {length}-token prompt, engine path")
    print(f"{'config':<34} {'prefill t/s':>12} {'prefill s':>10} {'decode t/s':>11}")
    for name, r in (("4-bit GGUF, bundled BLAS", s), ("float32" + (", OpenBLAS" if blas_env else ""), f)):
        print(f"{name:<34} {r['e_pre']:>12.1f} {length / r['e_pre']:>10.2f} {r['e_dec']:>11.1f}")
    print(f"prefill speed-up: {f['e_pre'] / s['e_pre']:.1f}x   decode speed-up: {f['e_dec'] / max(s['e_dec'], 1e-9):.2f}x")


def _timeit(fn: Callable[[], Any], n: int = 3) -> float:
    import mlx.core as mx

    mx.eval(fn())
    t = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    return (time.perf_counter() - t) / n


def section_breakdown(model_path: str, length: int, steps: list[int]) -> None:
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = mlx_lm.load(model_path)
    args = model.args
    layer = model.model.layers[0]
    heads, kv, dim = args.num_attention_heads, args.num_key_value_heads, args.hidden_size
    hd = getattr(args, "head_dim", None) or dim // heads
    dtype = layer.input_layernorm.weight.dtype if not hasattr(layer.mlp.gate_proj, "scales") else mx.float16
    x = mx.random.normal((1, length, dim)).astype(dtype)
    q = mx.random.normal((1, heads, length, hd)).astype(dtype)
    k = mx.random.normal((1, kv, length, hd)).astype(dtype)
    v = mx.random.normal((1, kv, length, hd)).astype(dtype)
    mx.eval(x, q, k, v)
    scale = hd ** -0.5
    t_sdpa = _timeit(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"))
    t_gate = _timeit(lambda: layer.mlp.gate_proj(x))
    t_mlp = _timeit(lambda: layer.mlp(x))
    t_qkvo = _timeit(lambda: [layer.self_attn.q_proj(x), layer.self_attn.k_proj(x), layer.self_attn.v_proj(x), layer.self_attn.o_proj(x)])
    t_attn_block = _timeit(lambda: layer.self_attn(x, mask="causal"))
    scores = mx.random.normal((1, heads, length, length)).astype(dtype)
    mx.eval(scores)
    t_softmax = _timeit(lambda: mx.softmax(scores, axis=-1, precise=True))
    t_qk = _timeit(lambda: q.reshape(1, kv, heads // kv, length, hd) @ k[:, :, None].swapaxes(-1, -2))
    t_layer = _timeit(lambda: layer(x, mask="causal"))
    rows = [
        ("mx.fast.scaled_dot_product_attention (causal)", t_sdpa),
        ("  of which: Q@K^T matmul", t_qk),
        ("  of which: softmax over heads x L x L", t_softmax),
        ("one MLP matmul (gate_proj)", t_gate),
        ("whole MLP (gate, up, down)", t_mlp),
        ("q/k/v/o projections", t_qkvo),
        ("attention block (proj + rope + SDPA)", t_attn_block),
        ("whole decoder layer", t_layer),
    ]
    print(f"\nwhere the time goes: one decoder layer at {length} tokens in a single chunk ({dtype})")
    for name, t in rows:
        print(f"  {name:<48} {t:8.4f} s")
    print(f"  x {args.num_hidden_layers} layers ~ {t_layer * args.num_hidden_layers:.2f} s per {length}-token chunk; "
          f"attention share of a layer {t_sdpa / t_layer * 100:.0f}%")
    try:
        from mlxstack.backends.cpu import block_causal as cpu_attention
    except ImportError:
        cpu_attention = None  # type: ignore[assignment]
    if cpu_attention is not None:
        t_blk = _timeit(lambda: cpu_attention.block_causal_sdpa(q, k, v, scale=scale))
        print(f"  mlxstack.backends.cpu.block_causal.block_causal_sdpa (opt-in) {t_blk:8.4f} s  ({t_sdpa / t_blk:.2f}x vs mx.fast)")

    print(f"\nprefill chunk size (prefill_step_size) for a {length}-token prompt, engine path:")
    prompt = make_prompt(tokenizer, length)
    engine_run(model, tokenizer, prompt[:64], 2, 64)
    for st in steps:
        pre_s, _, _ = engine_run(model, tokenizer, prompt, 1, st)
        print(f"  step {st:>5}: {pre_s:7.2f} s  {length / pre_s:8.1f} tok/s")
        if cpu_attention is not None and type(model).__module__ == "mlx_lm.models.llama":
            with cpu_attention.patch_mlx_lm_attention(("mlx_lm.models.llama",)):
                pre_b, _, _ = engine_run(model, tokenizer, prompt, 1, st)
            print(f"  step {st:>5} + block_causal_sdpa (opt-in): {pre_b:7.2f} s  {length / pre_b:8.1f} tok/s")


# ----------------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or HF repo id (default: the embedded SmolLM2, converted once)")
    p.add_argument("--lengths", default="512,1024,2048", help="comma-separated prompt lengths in tokens (default 512,1024,2048)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens to decode after the prompt (default 64)")
    p.add_argument("--prefill-step-size", type=int, default=None, help="engine chunk size (default: PREFILL_STEP_SIZE setting)")
    p.add_argument("--sections", default="compare,blas,breakdown", help="comma list of compare, blas, breakdown")
    p.add_argument("--repeat", type=int, default=1, help="repeat each measurement, keep the best (default 1)")
    p.add_argument("--quantized", action="store_true", help="embedded model: keep the GGUF 4-bit weights (default float32)")
    p.add_argument("--no-blas", action="store_true", help="do not re-exec with the optimised BLAS preloaded")
    p.add_argument("--blas-length", type=int, default=512, help="prompt length for the blas section (default 512)")
    p.add_argument("--blas-decode-tokens", type=int, default=16, help="decode tokens for the blas section (default 16)")
    p.add_argument("--breakdown-length", type=int, default=2048, help="tokens for the breakdown section (default 2048)")
    p.add_argument("--breakdown-steps", default="2048,512,256", help="prefill chunk sizes to compare in breakdown")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if sys.platform.startswith("linux") and not args.no_blas and not os.environ.get(_CHILD_FLAG):
        from mlxstack.system.blas import blas_preload_env, optimized_blas_active

        if optimized_blas_active() is None:
            extra = blas_preload_env(_settings())
            if extra:
                env = dict(os.environ, **extra, **{_CHILD_FLAG: "1"})
                print(f"re-executing with {extra}", file=sys.stderr, flush=True)
                os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])], env)

    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    step = args.prefill_step_size or _settings().prefill_step_size
    model_path = resolve_model(args.model, float32=not args.quantized)

    if "compare" in sections:
        rows = section_compare(model_path, lengths, args.decode_tokens, step, args.repeat, not args.engine_only)
        if args.json:
            print(json.dumps({"rows": rows, "model": model_path}))
            return 0
        print_compare(rows, step, model_path)
    if "blas" in sections and sys.platform.startswith("linux"):
        section_blas(args, args.blas_length)
    if "breakdown" in sections:
        section_breakdown(model_path, args.breakdown_length, [int(s) for s in args.breakdown_steps.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
