#!/usr/bin/env python3
"""An interactive turn behind its sub-agents, through LiteLLM on real ports (embedded model).

N background sub-agents (Claude Code's Task-agent system prompt: priority 1, derived by
prompt/urgency.py, nothing set by the client) decode long replies; once every one of them streams,
one interactive question arrives (a plain user turn: priority 0). Side by side in one run, ours
with PRIORITY_SCHEDULING on and off (first come, first served), MAX_CONCURRENT_SEQUENCES=8:

- the interactive turn's TTFT and decode tok/s, against the same turn alone on the same stack;
- the background's aggregate decode tok/s with the interactive turn, against without it.

    .venv/bin/python benchmarks/bench_priority.py [--background 4 8 16] [--max-tokens 200]
    .venv/bin/python benchmarks/bench_priority.py --background 8 --only on    # one stack

Targets (issue's): interactive TTFT <= 1.5x alone and decode >= 0.7x alone at 8 and 16 rows;
background aggregate >= 0.85x.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from bench_guard import AGENTS_OURS_ENV, _release, start_stacks, stream  # noqa: E402

SUBAGENT_SYSTEM = ("You are an agent for Claude Code, Anthropic's official CLI for Claude. Given the user's "
                   "message, you should use the tools available to complete the task. Do what has been asked; "
                   "nothing more, nothing less.")
TASKS = ["Survey module {i} of the repository and write a long, detailed report on every function in it.",
         "Read the tests for component {i} and describe, step by step and at length, what each one checks.",
         "Write a thorough design review of subsystem {i}: its data flow, its failure modes, its tests."]
QUESTION = "Quick question: which command runs the tests here?"


def decode_rate(r: dict) -> float:
    span = (r["last"] or 0) - (r["first"] or 0)
    return (r["tokens"] - 1) / span if span > 0 and r["tokens"] > 1 else float("nan")


def interactive(base: str, model: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    r = stream(base, model, QUESTION, max_tokens)
    return {"ttft": r["first"] - t0, "decode": decode_rate(r), "tokens": r["tokens"], "text": r["text"]}


def background_load(base: str, mlx: str, model: str, n: int, max_tokens: int, with_interactive: bool,
                    ask_tokens: int) -> dict:
    """``n`` sub-agents at once; with ``with_interactive`` the question once every one streams.
    Aggregate decode tok/s of the background: tokens after each stream's first / the span from the
    first stream's first token to the last one's last."""
    results: list[dict] = [{} for _ in range(n)]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            task = TASKS[i % len(TASKS)].format(i=i)
            results[i] = stream(base, model, task, max_tokens, system=SUBAGENT_SYSTEM)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    ask = None
    if with_interactive:   # mid-way: once min(n, 8) rows decode (the MLX server's /stats), a second later
        deadline = time.perf_counter() + 120
        while _decoding(mlx) < min(n, 8):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{min(n, 8)} rows never decoded at once ({mlx}/v1/cache/stats)")
            time.sleep(0.1)
        time.sleep(1.0)
        ask = interactive(base, model, ask_tokens)
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    timed = [r for r in results if r.get("first") is not None and r["tokens"] > 1]
    span = max(r["last"] for r in timed) - min(r["first"] for r in timed)
    agg = sum(r["tokens"] - 1 for r in timed) / span if span > 0 else float("nan")
    return {"agg": agg, "ask": ask, "texts": [r["text"] for r in results]}


def _decoding(mlx: str) -> int:
    """Rows the MLX server at ``mlx`` decodes now (its /v1/cache/stats, straight from the MLX port)."""
    import urllib.request

    from bench_guard import STACK_MLX_KEY

    req = urllib.request.Request(mlx + "/v1/cache/stats", headers={"Authorization": f"Bearer {STACK_MLX_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int((json.load(resp).get("scheduler") or {}).get("decoding") or 0)
    except Exception:  # noqa: BLE001 - not yet
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--background", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--max-tokens", type=int, default=200, help="each sub-agent's reply")
    ap.add_argument("--ask-tokens", type=int, default=48, help="the interactive reply")
    ap.add_argument("--alone-runs", type=int, default=3)
    ap.add_argument("--only", choices=("on", "off"))
    ap.add_argument("--decode-rows", type=int, help="PRIORITY_DECODE_ROWS (default: the setting's)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--workdir", type=Path, help="keep the stacks' files (their logs) here, not in a temporary folder")
    args = ap.parse_args()
    env = {**AGENTS_OURS_ENV, "MAX_CONCURRENT_SEQUENCES": "8", "MAX_QUEUED_REQUESTS": "64"}
    if args.decode_rows is not None:
        env["PRIORITY_DECODE_ROWS"] = str(args.decode_rows)
    specs = [(label, {**env, "PRIORITY_SCHEDULING": "true" if label == "on" else "false"})
             for label in ("on", "off") if args.only in (None, label)]
    rows = []
    with (contextlib.nullcontext(str(args.workdir)) if args.workdir else
          tempfile.TemporaryDirectory(prefix="bench-priority-")) as tmp:
        for label, spec_env in specs:            # one stack at a time: 2 cores
            stack = start_stacks([(label, spec_env)], Path(tmp))[label]
            try:
                model = stack.get(stack.base + "/v1/models", "sk-bench-guard")["data"][0]["id"]
                interactive(stack.base, model, args.ask_tokens)          # warm: the question's prefix cached
                for n in args.background:
                    # alone right before: this machine's speed drifts between minutes
                    alone = [interactive(stack.base, model, args.ask_tokens) for _ in range(args.alone_runs)]
                    a_ttft = statistics.median(a["ttft"] for a in alone)
                    a_dec = statistics.median(a["decode"] for a in alone)
                    # the sub-agents' prompts cached first: the runs compared below then both start warm (the
                    # first background run would otherwise pay their cold prefills and the second not)
                    background_load(stack.base, stack.mlx, model, n, 8, False, args.ask_tokens)
                    base = background_load(stack.base, stack.mlx, model, n, args.max_tokens, False, args.ask_tokens)
                    mixed = background_load(stack.base, stack.mlx, model, n, args.max_tokens, True, args.ask_tokens)
                    ask = mixed["ask"]
                    row = {"priority": label, "background": n, "alone_ttft_s": round(a_ttft, 3),
                           "ttft_s": round(ask["ttft"], 3), "ttft_x": round(ask["ttft"] / a_ttft, 2),
                           "alone_decode_tok_s": round(a_dec, 1), "decode_tok_s": round(ask["decode"], 1),
                           "decode_x": round(ask["decode"] / a_dec, 2),
                           "bg_alone_tok_s": round(base["agg"], 1), "bg_tok_s": round(mixed["agg"], 1),
                           "bg_x": round(mixed["agg"] / base["agg"], 2),
                           "same_replies": mixed["texts"] == base["texts"] and ask["text"] == alone[0]["text"]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                every = stack.get(stack.mlx + "/v1/cache/stats", "sk-bench-guard-mlx")
                stats = every.get("scheduler", {})
                print(f"{label}: preemptions {stats.get('preemptions_total')}, resumed {stats.get('resumed_total')}, "
                      f"plain decode step ms by rows {(every.get('speculation') or {}).get('plain_step_ms')}",
                      flush=True)
            finally:
                _release(stack)
    print("\n| priority | background | TTFT alone s | TTFT s | x alone | decode alone | decode | x alone "
          "| bg alone tok/s | bg tok/s | x | replies equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['priority']} | {r['background']} | {r['alone_ttft_s']} | {r['ttft_s']} | {r['ttft_x']} | "
              f"{r['alone_decode_tok_s']} | {r['decode_tok_s']} | {r['decode_x']} | {r['bg_alone_tok_s']} | "
              f"{r['bg_tok_s']} | {r['bg_x']} | {r['same_replies']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
