#!/usr/bin/env python3
"""One model over 1, 2 and 3 ranks (DISTRIBUTED=tensor | pipeline, local ranks over the ring
backend), side by side in one run: real MLX servers on this machine, greedy, over HTTP.

Per layout: whether it serves (a split the model does not fit is refused at start, in one line),
prefill tok/s (a ~1k-token prompt), decode tok/s (one session), aggregate turn tok/s (4 sessions
at once), each rank's memory (MLX peak and the process's resident high-water mark), and the cost of
the per-step broadcast (rank 0 sending each worker turn's record: µs per turn and per generated
token). Replies are checked identical to the single process's.

On one box the ranks share its cores (and, here, two cores for three processes): tensor
parallelism cannot be faster than one process -- the figures to read are memory per rank and the
broadcast's cost; speed needs one machine per rank and a fast link (docs/distributed.md).

    .venv/bin/python benchmarks/bench_distributed.py                      # the embedded SmolLM2: 1 / 2 / 3 ranks tensor
    .venv/bin/python benchmarks/bench_distributed.py --model PATH --modes tensor pipeline --ranks 1 2
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))         # probelib

from probelib.servers import ServerProcess  # noqa: E402

SYSTEM = ("You are a coding agent in a large repository. Read files before editing, run the tests after each "
          "change, and report briefly. ")


def post(url: str, body: dict, timeout: float = 1800.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.load(resp)


def hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_layout(model: str, mode: str, ranks: int, args: argparse.Namespace, tag: str) -> dict:
    env = {"MODEL_PATH": model, "DISK_CACHE_DIR": "off", "DEFAULT_TEMPERATURE": "0", "ENABLE_REQUEST_LOGGING": "false",
           "DEFAULT_REPETITION_PENALTY": "1.0", "SPECULATIVE": "off", "PROMPT_CACHE_MAX_ENTRIES_GLOBAL": "0"}
    if ranks > 1:
        env.update({"DISTRIBUTED": mode, "DISTRIBUTED_LOCAL_RANKS": str(ranks)})
    server = ServerProcess("ours", env=env, log_path=f"/tmp/bench-distributed-{tag}.log")
    out: dict = {"layout": tag}
    try:
        try:
            server.wait_ready(900)
        except Exception:  # noqa: BLE001 - a refused split: report its line
            line = next((ln for ln in server.tail(20000).splitlines() if "MODEL LOAD FAILED" in ln), "did not start")
            out["refused"] = line.split("MODEL LOAD FAILED: ", 1)[-1]
            return out
        mid = server._model_id()
        url = server.base_url + "/chat/completions"
        long_prompt = [{"role": "system", "content": SYSTEM * args.system_repeat},
                       {"role": "user", "content": "Summarise the rules above in one line."}]
        t = time.perf_counter()
        r = post(url, {"model": mid, "messages": long_prompt, "max_tokens": 1})
        out["prefill_tok_s"] = r["usage"]["prompt_tokens"] / (time.perf_counter() - t)
        out["prompt_tokens"] = r["usage"]["prompt_tokens"]
        one = [{"role": "user", "content": "Explain what a regression test is, in detail."}]
        t = time.perf_counter()
        r = post(url, {"model": mid, "messages": one, "max_tokens": args.max_tokens})
        wall = time.perf_counter() - t
        out["decode_tok_s"] = r["usage"]["completion_tokens"] / wall
        out["reply"] = r["choices"][0]["message"]["content"]
        sessions = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Name risk {i} of a refactor."}]
                    for i in range(4)]
        t = time.perf_counter()
        with cf.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda m: post(url, {"model": mid, "messages": m, "max_tokens": args.max_tokens // 2}),
                                    sessions))
        out["four_tok_s"] = sum(x["usage"]["completion_tokens"] for x in replies) / (time.perf_counter() - t)
        out["four_replies"] = [x["choices"][0]["message"]["content"] for x in replies]
        stats = get(server.base_url + "/cache/stats")
        d = stats.get("distributed")
        if d:
            tokens = 1 + r["usage"]["completion_tokens"] + sum(x["usage"]["completion_tokens"] for x in replies)
            out["broadcast_us_turn"] = d["share_us_per_turn"]
            out["broadcast_us_token"] = d["share_seconds"] / max(1, tokens) * 1e6
            out["per_rank"] = [(p["rank"], p["peak_memory"], p["high_water_rss"]) for p in d["per_rank"]]
        else:
            out["per_rank"] = [(0, None, hwm(server.proc.pid))]
        return out
    finally:
        server.stop()


def mib(n) -> str:
    return "–" if not n else f"{n / 2**20:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="MODEL_PATH (empty: the embedded SmolLM2)")
    ap.add_argument("--modes", nargs="+", default=["tensor"], choices=["tensor", "pipeline"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--system-repeat", type=int, default=40, help="the prefill prompt: this many copies of a line")
    args = ap.parse_args()
    results = []
    for ranks in sorted(set(args.ranks)):
        for mode in (["one"] if ranks == 1 else args.modes):
            tag = "1 process" if ranks == 1 else f"{ranks} ranks {mode}"
            print(f"... {tag}", flush=True)
            results.append(run_layout(args.model, mode, ranks, args, tag))
    base = next((r for r in results if r["layout"] == "1 process" and "reply" in r), None)
    print()
    print("| layout | prefill tok/s | decode tok/s | 4 sessions tok/s | broadcast µs/turn | µs/token | "
          "memory per rank: MLX peak / RSS high-water (MiB) | replies = 1 process |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "refused" in r:
            print(f"| {r['layout']} | refused at start: {r['refused']} | | | | | | |")
            continue
        mem = "; ".join(f"r{k}: {mib(p)} / {mib(h)}" for k, p, h in r["per_rank"])
        same = "–" if base is None or r is base else str(r["reply"] == base["reply"]
                                                            and r["four_replies"] == base["four_replies"])
        turn = r.get("broadcast_us_turn")
        token = r.get("broadcast_us_token")
        print(f"| {r['layout']} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.2f} | {r['four_tok_s']:.2f} | "
              f"{'–' if turn is None else f'{turn:.0f}'} | {'–' if token is None else f'{token:.0f}'} | {mem} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
