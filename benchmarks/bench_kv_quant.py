#!/usr/bin/env python3
"""KV quantisation schemes side by side in one run: uniform (mlx-lm's QuantizedKVCache) and
TurboQuant (cache/turboquant.py) at 2 / 3 / 4 / 8 bits against full precision, on the embedded
model (and a tiny fixture model with head_dim 64 when given).

1. quality: a warm turn whose prompt sits in a quantised entry (QUANTIZED_KV_START=0: the prompt is
   fed into the quantised cache, captured as the prompt cache stores it, checked out again) -- the
   next-token distribution after the prompt vs full precision over 10 conversations: mean KL
   divergence (full vocabulary, nats) and top-1 agreement;
2. memory: bytes per cached token, and sessions of 4k tokens that fit in a 1 GiB
   PROMPT_CACHE_MAX_BYTES;
3. restart-warm: a ~4k-token session's next turn after a restart (disk tier) vs cold, TTFT;
4. decode: tok/s at 1 and 8 rows (8 requests at once through the real scheduler) vs full precision;
   prefill (not in the default parts): a cold prompt fed in the backend's exact-size calls (what makes
   a hit's codes a cold run's, byte for byte) vs its usual chunks -- what exactness costs;
5. recurrent (not in the default parts): RECURRENT_STATE_BITS -- recurrent states stored as codes vs
   exact on the tiny recurrent fixture models: next-token KL, top-1 and greedy agreement, bytes of
   a stored state, snapshots per GiB (benchmarks/recurrent_codes.py).

    .venv/bin/python benchmarks/bench_kv_quant.py [--parts quality memory restart decode prefill recurrent] [--tiny PATH]
        [--schemes full turboquant4 ...] [--rounds N]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))    # bench_disk

from bench_disk import engine, job, long_conversation, settings, table  # noqa: E402

SCHEMES = [("full", None)] + [(s, b) for s in ("uniform", "turboquant") for b in (2, 3, 4, 8)]
TOPICS = ["a Python web service's request handlers", "a Rust command-line parser", "the project's test suite",
          "a SQL migration for the users table", "a React component that lists orders", "the CI workflow file",
          "a Go HTTP client with retries", "the Dockerfile and its build stages", "a shell script that backs up logs",
          "the README's install section"]


def quant(scheme: str, bits: int | None, start: int = 0):
    from mlxstack.cache.layer_kinds import KVQuant
    from mlxstack.cache.turboquant import SEED

    if bits is None:
        return None
    return KVQuant(bits, 64, start, scheme, SEED if scheme == "turboquant" else 0)


def prompts(tokenizer, n: int = 10) -> list[list[int]]:
    """Ten chat prompts (~400-600 tokens): a system prompt, a file listing, a question."""
    out = []
    for i, topic in enumerate(TOPICS[:n]):
        lines = [f"line {j}: code for {topic}, step {j * (i + 3) % 17}, value {j * j % 23}" for j in range(28 + 2 * i)]
        msgs = [{"role": "system", "content": "You are a careful coding agent."},
                {"role": "user", "content": f"Here is {topic}:\n" + "\n".join(lines) + "\nWhat does it do?"}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append(list(tokenizer.encode(text)))
    return out


def quality(model, tokens: list[list[int]], label: str) -> list[dict]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxstack.cache.kv_ops import LiveCache, capture, checkout
    from mlxstack.runner.generate import feed

    def last_logprobs(q, prompt):
        live = LiveCache(make_prompt_cache(model), 0, q)
        feed(model, live, prompt[:-1], 256)
        warm = checkout(capture(live), len(prompt) - 1, q)      # the stored entry, as a hit gets it
        out = model(mx.array([prompt[-1:]], dtype=mx.int32), cache=warm.layers)[0, -1].astype(mx.float32)
        return out - mx.logsumexp(out)

    refs = [last_logprobs(None, p) for p in tokens]
    rows = []
    for scheme, bits in SCHEMES[1:]:
        try:
            got = [last_logprobs(quant(scheme, bits), p) for p in tokens]
        except Exception as exc:  # noqa: BLE001 - a width a scheme does not serve
            rows.append({"model": label, "scheme": scheme, "bits": bits, "kl_mean": float("nan"),
                         "kl_max": float("nan"), "top1_agree": f"n/a ({type(exc).__name__})"})
            continue
        kls = [float(mx.sum(mx.exp(r) * (r - g)).item()) for r, g in zip(refs, got)]
        agree = sum(int(mx.argmax(r).item() == mx.argmax(g).item()) for r, g in zip(refs, got))
        rows.append({"model": label, "scheme": scheme, "bits": bits, "kl_mean": statistics.mean(kls),
                     "kl_max": max(kls), "top1_agree": f"{agree}/{len(tokens)}"})
    return rows


def memory(model, label: str, budget: int = 1 << 30, session: int = 4000) -> list[dict]:
    from mlx_lm.models.cache import make_prompt_cache

    from mlxstack.cache.kv_ops import LiveCache, capture
    from mlxstack.runner.generate import feed

    prompt = list(range(1000, 3000))
    rows, base = [], None
    for scheme, bits in SCHEMES:
        try:
            live = LiveCache(make_prompt_cache(model), 0, quant(scheme, bits))
            feed(model, live, prompt, 512)
            st = capture(live)
        except Exception as exc:  # noqa: BLE001
            rows.append({"model": label, "scheme": scheme, "bits": bits or "-", "bytes_per_token": float("nan"),
                         "vs_full": float("nan"), "sessions_in_1GiB": f"n/a ({type(exc).__name__})"})
            continue
        per = st.nbytes / st.depth
        base = base or per
        rows.append({"model": label, "scheme": scheme, "bits": bits or "-", "bytes_per_token": per,
                     "vs_full": per / base, "sessions_in_1GiB": int(budget // (per * session))})
    return rows


RUN_SCHEMES = ["full", "uniform4", "turboquant4", "turboquant3"]


def chosen(names: list[str]) -> list[tuple[str, int | None]]:
    """("full", None) / ("uniform", 4) / ... from names like full, uniform4, turboquant3."""
    return [("full", None) if n == "full" else (n.rstrip("0123456789"), int(n[len(n.rstrip("0123456789")):]))
            for n in names]


def restart(loaded, workdir: Path, size: int = 4000, schemes: list[str] = RUN_SCHEMES) -> list[dict]:
    rows = []
    msgs = long_conversation(loaded.tokenizer, size)
    for scheme, bits in chosen(schemes):
        kv = {} if bits is None else {"kv_bits": bits, "kv_quant_scheme": scheme, "quantized_kv_start": 0}
        disk = workdir / f"kv-{scheme}-{bits}"
        first = engine(settings(disk_cache_dir=disk, disk_cache_min_tokens=256, **kv), loaded)
        o1 = first.run(job(msgs))
        first.state.close()
        on_disk = first.state.disk.tier.stats()["write_bytes"]
        follow = msgs + [{"role": "assistant", "content": o1.text}, {"role": "user", "content": "Which one first?"}]
        again = engine(settings(disk_cache_dir=disk, disk_cache_min_tokens=256, **kv), loaded)
        warm = again.run(job(follow))
        again.state.close()
        cold_engine = engine(settings(prompt_cache_max_entries_global=0, **kv), loaded)
        cold_engine.run(job(msgs))
        cold = cold_engine.run(job(follow))
        rows.append({"scheme": scheme, "bits": bits or "-", "tokens": warm.prompt_tokens, "cached": warm.cached_tokens,
                     "tier": warm.timings["cache_tier"], "disk_mb": on_disk / 2**20,
                     "cold_ttft_s": cold.timings["ttft_s"], "restart_ttft_s": warm.timings["ttft_s"],
                     "speedup": cold.timings["ttft_s"] / max(1e-9, warm.timings["ttft_s"]),
                     "same_output_as_cold": warm.raw_text == cold.raw_text})
        shutil.rmtree(disk, ignore_errors=True)
    return rows


def prefill(loaded, sizes: tuple[int, ...] = (1024, 4096), rounds: int = 2,
            schemes: list[str] = RUN_SCHEMES) -> list[dict]:
    """What exactness costs: a cold prompt's prefill (TTFT, max_tokens 1, QUANTIZED_KV_START=0) fed
    in the backend's batch-invariant calls (``exact_positions``: what makes a hit's codes a cold
    run's byte for byte) against the same engine fed in its usual chunks, side by side, rounds
    interleaved, medians. Full precision is never cut (it needs no exact calls): its row is the
    reference for both."""
    from mlxstack.runner import batch_prefill, generate

    exact_calls = generate.exact_positions
    rows = []
    for size in sizes:
        msgs = long_conversation(loaded.tokenizer, size)
        for scheme, bits in chosen(schemes):
            kv = {} if bits is None else {"kv_bits": bits, "kv_quant_scheme": scheme, "quantized_kv_start": 0}
            eng = engine(settings(prompt_cache_max_entries_global=0, **kv), loaded)
            times = {"exact": [], "chunks": []}
            for _ in range(rounds):
                for mode in times:
                    off = mode == "chunks"
                    generate.exact_positions = batch_prefill.exact_positions = \
                        (lambda *_a, **_k: None) if off else exact_calls
                    try:
                        out = eng.run(job(msgs, max_tokens=1, session=f"p{size}{scheme}{bits}{mode}"))
                    finally:
                        generate.exact_positions = batch_prefill.exact_positions = exact_calls
                    times[mode].append(out.timings["ttft_s"])
            ex, ch = statistics.median(times["exact"]), statistics.median(times["chunks"])
            rows.append({"scheme": scheme, "bits": bits or "-", "tokens": out.prompt_tokens,
                         "exact_calls_ttft_s": ex, "chunked_ttft_s": ch, "exact_vs_chunked": ex / max(1e-9, ch)})
    return rows


def decode(loaded, rounds: int = 3, schemes: list[str] = RUN_SCHEMES, equal_lengths: bool = True) -> list[dict]:
    """Aggregate decode tok/s of 1 and 8 requests at once through the real scheduler, the schemes
    interleaved round by round (a busy machine slows every scheme alike), medians of ``rounds``.
    With ``equal_lengths`` every reply runs its whole ``max_tokens`` (the stop tokens banned by
    logit_bias, as benchmarks' ignore-EOS does): quantised replies end at other steps than full
    precision's, and a batch whose rows left early decodes fewer tokens a step -- content, not speed.
    Speculation is off: how many drafts a reply accepts depends on its content too."""
    from dataclasses import replace

    from tests.test_batching import run_batched

    prompt = long_conversation(loaded.tokenizer, 800)
    picked = chosen(schemes)
    engines = {}
    for scheme, bits in picked:
        kv = {} if bits is None else {"kv_bits": bits, "kv_quant_scheme": scheme, "quantized_kv_start": 0}
        engines[(scheme, bits)] = engine(settings(prompt_cache_max_entries_global=0, speculative="off", **kv), loaded)
    speeds: dict[tuple, list[float]] = {}
    batched: dict[tuple, bool] = {}
    steps: dict[tuple, list[float]] = {}
    for r in range(rounds + 1):                  # round 0 warms every engine's graphs
        for rows_n in (1, 8):
            for key in picked:
                jobs = [job(prompt[:-1] + [{"role": "user", "content": prompt[-1]["content"] + f" ({i}, {r})"}],
                            max_tokens=48, session=f"d{i}-{r}") for i in range(rows_n)]
                if equal_lengths:
                    ban = {int(t): -1e9 for t in engines[key].stop_ids}
                    for j in jobs:
                        j.params = replace(j.params, logit_bias=ban)
                t0 = time.perf_counter()
                outs, _ = run_batched(engines[key], jobs, budget=256)
                first = max(t0 + o.timings["ttft_s"] for o in outs)
                batched[(*key, rows_n)] = getattr(run_batched, "sched").group.batching
                if r:
                    tps = sum(o.completion_tokens - 1 for o in outs) / max(1e-9, time.perf_counter() - first)
                    speeds.setdefault((*key, rows_n), []).append(tps)
                    # the clean plain steps of exactly this many rows (the scheduler's own timing:
                    # runner/spec/step_costs.py), free of prefills interleaved with the decode
                    step = engines[key].speculation.costs.plain.get(rows_n)
                    steps.setdefault((*key, rows_n), []).append(step * 1000 if step else float("nan"))
    rows = []
    for rows_n in (1, 8):
        base = statistics.median(speeds[(*picked[0], rows_n)])
        base_step = statistics.median(steps[(*picked[0], rows_n)])
        for key in picked:
            tps = statistics.median(speeds[(*key, rows_n)])
            step = statistics.median(steps[(*key, rows_n)])
            rows.append({"scheme": key[0], "bits": key[1] or "-", "rows": rows_n, "decode_tok_s": tps,
                         "vs_first": tps / base, "rounds": " ".join(f"{x:.1f}" for x in speeds[(*key, rows_n)]),
                         "plain_step_ms": step, "step_vs_first": base_step / step,
                         "batched": batched[(*key, rows_n)]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["quality", "memory", "restart", "decode"],
                    choices=["quality", "memory", "restart", "decode", "prefill", "recurrent"])
    ap.add_argument("--rounds", type=int, default=3, help="decode: interleaved rounds (medians; a noisy machine wants more)")
    ap.add_argument("--tiny", help="also a tiny model folder with head_dim 64 (quality and memory)")
    ap.add_argument("--schemes", nargs="+", default=RUN_SCHEMES,
                    help="restart and decode: full, uniformN, turboquantN (the first is the baseline)")
    ap.add_argument("--natural-lengths", action="store_true",
                    help="decode: replies end where the model ends them (default: every reply runs max_tokens)")
    args = ap.parse_args()
    from mlxstack.system.process_env import reexec_with

    reexec_with(settings(), [str(Path(__file__).resolve()), *sys.argv[1:]])
    from mlxstack.models.loader import hf_offline_env, load_model

    hf_offline_env()
    loaded = load_model(settings())
    models = [(loaded.model, loaded.tokenizer, "SmolLM2-135M")]
    if args.tiny:
        tiny = load_model(settings(model_path=args.tiny))
        models.append((tiny.model, loaded.tokenizer, Path(args.tiny).name))
    work = Path(tempfile.mkdtemp(prefix="bench-kvq-"))
    try:
        print(f"# KV quantisation schemes ({time.strftime('%Y-%m-%d')})\n")
        if "quality" in args.parts:
            print("## quality: next token after a prompt held in a quantised entry, vs full precision (10 prompts)\n")
            rows = []
            for model, tok, label in models:
                vocab = model.model.embed_tokens.weight.shape[0]
                toks = [[t % vocab for t in p] for p in prompts(tok)]
                rows += quality(model, toks, label)
            print(table(rows) + "\n")
        if "memory" in args.parts:
            print("## memory: bytes per cached token, 4k-token sessions in a 1 GiB budget\n")
            print(table([r for model, _, label in models for r in memory(model, label)]) + "\n")
        if "restart" in args.parts:
            print("## restart-warm at ~4k tokens (disk tier) vs cold, QUANTIZED_KV_START=0\n")
            print(table(restart(loaded, work, schemes=args.schemes)) + "\n")
        if "decode" in args.parts:
            print("## decode tok/s at 1 and 8 rows (~800-token prompts sharing ~790, 48 tokens each"
                  + (", every reply its whole 48" if not args.natural_lengths else "") + "; speculation off), vs full precision\n")
            print(table(decode(loaded, rounds=args.rounds, schemes=args.schemes,
                               equal_lengths=not args.natural_lengths)) + "\n")
        if "prefill" in args.parts:
            print("## prefill: a cold prompt fed in the backend's exact-size calls vs its usual chunks "
                  "(QUANTIZED_KV_START=0, TTFT medians)\n")
            print(table(prefill(loaded, rounds=args.rounds, schemes=args.schemes)) + "\n")
        if "recurrent" in args.parts:
            from recurrent_codes import recurrent

            print("## recurrent states stored as codes (RECURRENT_STATE_BITS) vs exact, tiny random-weight fixtures "
                  "(10 prompts)\n")
            print(table(recurrent(work, loaded.path, prompts, settings)) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
