#!/usr/bin/env python3
"""Many agents at once (issue 12), measured side by side in one run on the embedded model:
ours with continuous batching vs ours with MAX_CONCURRENT_SEQUENCES=1 (FIFO) vs mlx_lm.server,
for 1 / 2 / 4 / 8 concurrent multi-turn agent sessions (streaming, greedy).

Per server and session count, over the warm turns: aggregate turn tok/s (all streamed tokens /
wall time of the turn, prefill included) and aggregate decode tok/s (tokens after each stream's
first / the time during which at least one stream was past its first token), p50 / p95 TTFT, p95 inter-token latency, warm-turn uncached tokens
(prompt - cached, from usage). Then the interleaving check: a short request sent while another
request's ~2k-token cold prefill is running -- its TTFT against the long prompt's.

    .venv/bin/python benchmarks/bench_concurrency.py [--sessions 1 2 4 8] [--turns 3] [--max-tokens 32]
    .venv/bin/python benchmarks/bench_concurrency.py --sessions 4 8 --system-repeat 12   # ~1.9k-token contexts
    .venv/bin/python benchmarks/bench_concurrency.py --sessions 8 --skip-fifo --rounds 5  # servers taking turns
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))         # probelib
sys.path.insert(0, str(REPO))

from probelib.servers import ServerProcess  # noqa: E402

SYSTEM = ("You are a coding agent in a large repository. Read files before editing, run the tests after "
          "each change, and report briefly. ") * 6
QUESTIONS = ["Look at module {i} and tell me what it does.", "What would you test first there?",
             "Name one risk in that code.", "Summarise in one line."]


def stream_chat(base: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps, text, usage = [], [], {}
    with urllib.request.urlopen(req, timeout=1800) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            frame = json.loads(line[6:])
            if frame.get("usage"):
                usage = frame["usage"]
            for ch in frame.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece:
                    stamps.append(time.perf_counter() - t0)
                    text.append(piece)
    return {"ttft": stamps[0] if stamps else time.perf_counter() - t0, "stamps": stamps, "text": "".join(text),
            "usage": usage, "wall": time.perf_counter() - t0, "t0": t0}


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals (pure): the time during which at least one
    sequence was decoding."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            total += (cur_e - cur_s) if cur_e is not None else 0.0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0.0)


def model_id(base: str) -> str:
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as resp:
            return (json.load(resp).get("data") or [{}])[0].get("id", "default_model")
    except ValueError:   # mlx_lm.server: any name serves its one model
        return "default_model"


def run_sessions(base: str, n: int, turns: int, max_tokens: int, system_repeat: int = 1, first: int = 0) -> dict:
    """``n`` sessions under one system prompt, ``turns`` turns each (all sessions' turn t sent at
    once); session i asks about module ``first + i`` (another ``first`` per round: no round finds
    an earlier round's turns in a prompt cache, only the system prompt)."""
    model = model_id(base)
    histories = [[{"role": "system", "content": SYSTEM * system_repeat}] for _ in range(n)]
    warm_results, turn_walls, decode_spans = [], [], []
    for t in range(turns):
        results: list[dict] = [{}] * n

        def one(i: int) -> None:
            msgs = histories[i] + [{"role": "user", "content": QUESTIONS[t % len(QUESTIONS)].format(i=first + i)}]
            results[i] = stream_chat(base, model, msgs, max_tokens)
            histories[i] = msgs + [{"role": "assistant", "content": results[i]["text"]}]

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        if t > 0:
            warm_results += results
            turn_walls.append((wall, sum(len(r["stamps"]) for r in results)))
            decode_spans.append((union_seconds([(r["t0"] + r["stamps"][0], r["t0"] + r["stamps"][-1])
                                                for r in results if len(r["stamps"]) > 1]),
                                 sum(len(r["stamps"]) - 1 for r in results if len(r["stamps"]) > 1)))
    ttfts = sorted(r["ttft"] for r in warm_results)
    gaps = sorted(b - a for r in warm_results for a, b in zip(r["stamps"], r["stamps"][1:]))
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0  # noqa: E731
    tokens = sum(k for _, k in turn_walls)
    wall = sum(w for w, _ in turn_walls)
    uncached = [r["usage"].get("prompt_tokens", 0) - (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for r in warm_results if r["usage"]]
    dec_wall = sum(w for w, _ in decode_spans)
    dec_tokens = sum(k for _, k in decode_spans)
    return {"sessions": n, "agg_turn_tok_s": tokens / wall if wall else 0.0,
            "agg_decode_tok_s": dec_tokens / dec_wall if dec_wall else 0.0,
            "ttft_p50": statistics.median(ttfts) if ttfts else 0.0, "ttft_p95": pct(ttfts, 0.95),
            "itl_p95": pct(gaps, 0.95), "uncached_per_warm_turn": statistics.mean(uncached) if uncached else 0.0,
            "texts": [r["text"] for r in warm_results]}


def interleave_check(base: str, chunk: int) -> dict:
    model = model_id(base)
    long_user = " ".join(f"entry {i}: the scheduler must keep other streams moving while this prefills."
                         for i in range(140))
    out: dict = {}

    def long_req() -> None:
        out["long"] = stream_chat(base, model, [{"role": "user", "content": long_user}], 4)

    th = threading.Thread(target=long_req)
    th.start()
    time.sleep(1.0)   # the long cold prefill is under way
    out["short"] = stream_chat(base, model, [{"role": "user", "content": "Say hi."}], 4)
    th.join()
    return {"long_prompt_tokens": out["long"]["usage"].get("prompt_tokens"), "long_ttft_s": out["long"]["ttft"],
            "short_ttft_s": out["short"]["ttft"], "short_done_before_long_first_token":
            out["short"]["wall"] + 1.0 < out["long"]["ttft"], "chunk_tokens": chunk}


def table(rows: list[dict]) -> str:
    cols = [c for r in rows for c in r if not c.startswith("_") and c != "texts"]
    cols = list(dict.fromkeys(cols))                      # every row's columns, in first-seen order
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    return "\n".join(lines + ["| " + " | ".join(fmt(r[c]) if c in r else "" for c in cols) + " |" for r in rows])


def interleaved(servers: list[tuple[str, str, dict]], args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Every server started at once (an idle one uses no CPU), then ``args.rounds`` rounds in which
    each takes its turn at every session count: a drift of the machine's speed hits every server
    alike. Rows: the median over the rounds of each figure, and per other server the median of the
    per-round ratios "ours batched" / it (``ratio_*`` columns on its rows)."""
    per: dict[tuple[str, int], list[dict]] = {}
    texts: dict = {}
    procs = [(label, ServerProcess(kind, env=env)) for label, kind, env in servers]
    try:
        for _, srv in procs:
            srv.wait_ready(300)
        for rnd in range(args.rounds):
            for label, srv in procs:
                for n in args.sessions:
                    r = run_sessions(srv.root, n, args.turns, args.max_tokens, args.system_repeat,
                                     first=100 * (rnd + 1))
                    texts.setdefault((label, n), r.pop("texts"))
                    per.setdefault((label, n), []).append(r)
                    print(f"round {rnd + 1} {label:14s} sessions={n}: turn {r['agg_turn_tok_s']:.1f} tok/s, "
                          f"decode {r['agg_decode_tok_s']:.1f} tok/s", flush=True)
    finally:
        for _, srv in procs:
            srv.stop()
    rows = []
    for (label, n), runs in per.items():
        row = {"server": label, "sessions": n, "rounds": len(runs)}
        for col in runs[0]:
            if col != "sessions":
                row[col] = statistics.median(r[col] for r in runs)
        mine = per.get(("ours batched", n))
        if label != "ours batched" and mine:
            for col in ("agg_turn_tok_s", "agg_decode_tok_s"):
                row["ratio_" + col] = statistics.median(a[col] / b[col] for a, b in zip(mine, runs) if b[col])
        rows.append(row)
    return rows, texts


# --compare-<flag>: ours batched with one setting changed (label, setting, value, what that means)
COMPARE = {
    "shared": ("ours unshared", "SHARED_PREFIX_MIN_TOKENS", "0", "every row its own copy of the prompt"),
    "kernels": ("ours kernels off", "CPU_KERNELS", "off", "MLX's own exp / attention / SiLU"),
    "native": ("ours native off", "NATIVE_ATTENTION", "off", "decode attention in MLX ops"),
    "host": ("ours host off", "HOST_FORWARD", "off", "decode-sized forwards through mlx-lm's forward"),
    "products": ("ours products off", "NATIVE_PRODUCTS", "off", "the host path's products through OpenBLAS's sgemm"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--skip-fifo", action="store_true", help="leave out ours with MAX_CONCURRENT_SEQUENCES=1")
    for flag, (_, setting, value, what) in COMPARE.items():
        ap.add_argument(f"--compare-{flag}", action="store_true", help=f"add ours batched with {setting}={value} ({what})")
    ap.add_argument("--rounds", type=int, default=1,
                    help="R > 1: every server up at once, R rounds taking turns (ours, mlx_lm.server, ours, ...); "
                         "medians over the rounds and the median of each round's ratio (this VM's speed drifts "
                         "by +-20%% between minutes; the interleave check is skipped)")
    ap.add_argument("--system-repeat", type=int, default=1,
                    help="repeat the ~150-token system prompt (10: ~1.6k-token agent contexts)")
    args = ap.parse_args()
    common = {"DEFAULT_TEMPERATURE": "0", "DEFAULT_REPETITION_PENALTY": "1.0", "ENABLE_REQUEST_LOGGING": "false",
              "DISK_CACHE_DIR": "off", "PREFILL_CHUNK_TOKENS": str(args.chunk), "MAX_QUEUED_REQUESTS": "64"}
    servers = [("ours batched", "ours", {**common, "MAX_CONCURRENT_SEQUENCES": str(max(args.sessions))})]
    for flag, (label, setting, value, _) in COMPARE.items():
        if getattr(args, "compare_" + flag):
            servers.append((label, "ours", {**common, "MAX_CONCURRENT_SEQUENCES": str(max(args.sessions)),
                                            setting: value}))
    if not args.skip_fifo:
        servers.append(("ours FIFO", "ours", {**common, "MAX_CONCURRENT_SEQUENCES": "1"}))
    if not args.skip_mlx_lm:
        servers.append(("mlx_lm.server", "mlx_lm", {}))
    rows, texts, rows_inter = [], {}, []
    if args.rounds > 1:
        rows, texts = interleaved(servers, args)
    else:
        for label, kind, env in servers:   # one server at a time: 2 cores, nothing else heavy
            with ServerProcess(kind, env=env) as srv:
                srv.wait_ready(300)
                for n in args.sessions:
                    r = run_sessions(srv.root, n, args.turns, args.max_tokens, args.system_repeat)
                    texts[(label, n)] = r.pop("texts")
                    rows.append({"server": label, **r})
                    print(f"{label:14s} sessions={n}: turn {r['agg_turn_tok_s']:.1f} tok/s, decode "
                          f"{r['agg_decode_tok_s']:.1f} tok/s", flush=True)
                if kind == "ours":
                    inter = interleave_check(srv.root, args.chunk)
                    print(f"{label}: interleave {inter}", flush=True)
                    rows_inter.append({"server": label, **inter})
    print("\n## concurrent agent sessions (embedded model, greedy, warm turns)\n")
    print(table(rows))
    labels = {r["server"] for r in rows}
    for col in ("agg_decode_tok_s", "agg_turn_tok_s"):
        batched = {r["sessions"]: r[col] for r in rows if r["server"] == "ours batched"}
        for other in ["ours FIFO", *(c[0] for c in COMPARE.values()), "mlx_lm.server"]:
            base = {r["sessions"]: r[col] for r in rows if r["server"] == other}
            if base:
                print(f"\n{col}, batched / {other}: " + ", ".join(
                    f"{n}: {batched[n] / base[n]:.2f}x" for n in sorted(base) if base[n]))
            ratios = {r["sessions"]: r["ratio_" + col] for r in rows if r["server"] == other and "ratio_" + col in r}
            if ratios:
                print(f"{col}, batched / {other}, median of the {args.rounds} rounds' ratios: " + ", ".join(
                    f"{n}: {ratios[n]:.2f}x" for n in sorted(ratios)))
    for other in ["ours FIFO", *(c[0] for c in COMPARE.values()), "mlx_lm.server"]:
        if other in labels:
            same = all(texts[("ours batched", n)] == texts[(other, n)] for n in args.sessions)
            print(f"batched replies identical to {other} replies (greedy): {same}")   # ours: same tokens; mlx_lm: rounding may differ
    if rows_inter:
        print("\n## a short request during a long cold prefill\n")
        print(table(rows_inter))
    return 0


if __name__ == "__main__":
    sys.exit(main())
