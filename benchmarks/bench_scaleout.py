#!/usr/bin/env python3
"""Scale-out benchmark: 1 backend vs 2 local replicas of the embedded model, all through LiteLLM.

    .venv/bin/python benchmarks/bench_scaleout.py                  # all four configurations (~10 min on 2 CPU cores)
    .venv/bin/python benchmarks/bench_scaleout.py --modes cache_aware --concurrency 1 --out /tmp/scaleout.json

Each configuration is a fresh stack (start_llm's run_stack on free ports, disk tier off so a
restarted replica is cold) running the same interleaved agent replay: 2 orchestrators, each
with 3 sub-agents sharing its system prompt (8 sessions; orchestrators 6 turns, sub-agents 4),
``--concurrency`` sessions in flight at once. In the two-replica configurations the replica
holding the most sessions is killed (SIGKILL) halfway; the launcher restarts it.

Configurations: ``1 backend``; 2 replicas with ROUTING=shuffle (a: no affinity), affinity
(b: LiteLLM's session_affinity on the id the mlxstack hook derives, least-busy for new sessions)
and cache_aware (c: the mlxstack hook: pins, longest-prefix placement, moves off dead replicas).

Reported per configuration: requests and failed requests, requests per replica (the
``x-litellm-model-api-base`` response header), uncached prompt tokens (prompt - cached) of first
turns (orchestrators / sub-agents) and of warm turns (turn >= 2) before and after the kill, the
sessions whose replica was killed and their next turn's uncached tokens, and the sessions the
hook reported moved.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))         # probelib
from probelib.client import free_ports  # noqa: E402
from probelib.servers import launch_stack  # noqa: E402

KEY, MLX_KEY = "sk-bench-scaleout", "sk-bench-scaleout-mlx"
MODEL = "SmolLM2-135M-Instruct"
CONFIGS = {"1 backend": (1, "cache_aware"), "shuffle": (2, "shuffle"), "affinity": (2, "affinity"),
           "cache_aware": (2, "cache_aware")}


# --- workload --------------------------------------------------------------------------------------
def _system(name: str, topic: str) -> str:
    rules = [f"Rule {i}: when working on {topic}, {verb} before you {act}, and report {what} in one line."
             for i, (verb, act, what) in enumerate(
                 [("read the file", "edit it", "the diff"), ("run the tests", "commit", "failures"),
                  ("check the types", "refactor", "the errors"), ("search the docs", "guess", "the source"),
                  ("list the callers", "rename", "each call site"), ("measure", "optimise", "the numbers"),
                  ("ask", "delete anything", "what you removed"), ("write a test", "fix a bug", "the test name")] * 4)]
    return f"You are {name}, an agent that works on {topic}.\n" + "\n".join(rules)


def _user(session: str, turn: int) -> str:
    lines = [f"[{session} turn {turn}] tool output line {j}: value={(turn * 37 + j * 11) % 97} status=ok"
             for j in range(6)]
    return "\n".join(lines) + f"\nWhat should {session} do next? Answer in one sentence."


def build_sessions() -> list[dict]:
    sessions = []
    for o, (name, topic) in enumerate([("Coder", "a Python web service"), ("Researcher", "a literature survey")]):
        system = _system(name, topic)
        sessions.append({"name": f"orch{o}", "system": system, "turns": 6, "after": None, "sub": False})
        for k in range(3):
            sessions.append({"name": f"orch{o}-sub{k}", "system": system, "turns": 4, "after": f"orch{o}", "sub": True})
    return sessions


# --- the stack -------------------------------------------------------------------------------------
def http(url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 600) -> tuple[int, dict, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status, hdrs = resp.read(), resp.status, dict(resp.headers)
    except urllib.error.HTTPError as err:
        raw, status, hdrs = err.read(), err.code, dict(err.headers)
    except OSError as err:
        return 599, {"error": str(err)}, {}
    try:
        return status, json.loads(raw), {k.lower(): v for k, v in hdrs.items()}
    except ValueError:
        return status, {"raw": raw[:200].decode("utf-8", "replace")}, hdrs


class Stack:
    def __init__(self, tmp: Path, replicas: int, routing: str, model_path: str = "") -> None:
        self.mlx_port, self.proxy_port = free_ports(2, first_run=2)   # replicas: mlx_port, mlx_port + 1
        self.logs = tmp / "logs"
        env = {"MLX_PORT": str(self.mlx_port), "MLX_REPLICAS": str(replicas), "ROUTING": routing, "MODEL_PATH": model_path,
               "PROXY_PORT": str(self.proxy_port), "LITELLM_MASTER_KEY": KEY, "MLX_API_KEY": MLX_KEY,
               "BACKENDS_FILE": str(tmp / "no-backends.yaml"), "LOG_ROOT": str(self.logs), "DISK_CACHE_DIR": "off",
               "DEFAULT_TEMPERATURE": "0", "ENABLE_REQUEST_LOGGING": "false", "PROXY_STARTUP_TIMEOUT_SECONDS": "300"}
        self.log_path = tmp / "stack.log"
        self.proc, self.log = launch_stack(env, self.log_path, timeout=600)
        self.base = f"http://127.0.0.1:{self.proxy_port}"
        self.replicas = [f"http://127.0.0.1:{self.mlx_port + i}" for i in range(replicas)]

    def kill(self, url: str) -> int:
        port = url.rsplit(":", 1)[1]
        pidfile = self.logs / (".mlx.pid" if len(self.replicas) == 1 else f".mlx-{port}.pid")
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# --- the replay ------------------------------------------------------------------------------------
def replay(stack: Stack, sessions: list[dict], concurrency: int, kill_halfway: bool, model: str = MODEL) -> dict:
    state = {s["name"]: {"spec": s, "messages": [{"role": "system", "content": s["system"]}], "done": 0, "busy": False,
                         "log": [], "fails": 0} for s in sessions}
    total = sum(s["turns"] for s in sessions)
    lock = threading.Condition()
    results: list[dict] = []
    killed: dict = {}
    order = [s["name"] for s in sessions]
    cursor = [0]

    def ready(name: str) -> bool:
        st = state[name]
        after = st["spec"]["after"]
        return not st["busy"] and st["done"] < st["spec"]["turns"] and (after is None or state[after]["done"] >= 1)

    def next_turn() -> str | None:
        with lock:
            while True:
                if all(st["done"] >= st["spec"]["turns"] for st in state.values()):
                    return None
                for i in range(len(order)):  # round robin over ready sessions: interleaved
                    name = order[(cursor[0] + i) % len(order)]
                    if ready(name):
                        cursor[0] = (cursor[0] + i + 1) % len(order)
                        state[name]["busy"] = True
                        return name
                lock.wait(timeout=1.0)

    def worker() -> None:
        while True:
            name = next_turn()
            if name is None:
                return
            st = state[name]
            turn = st["done"] + 1
            msgs = st["messages"] + [{"role": "user", "content": _user(name, turn)}]
            t0 = time.monotonic()
            status, body, hdrs = http(stack.base + "/v1/chat/completions",
                                      {"model": model, "messages": msgs, "max_tokens": 24},
                                      headers={"Authorization": f"Bearer {KEY}"})
            row = {"session": name, "turn": turn, "status": status, "seconds": round(time.monotonic() - t0, 3),
                   "replica": (hdrs.get("x-litellm-model-api-base") or "").rstrip("/").removesuffix("/v1"),
                   "after_kill": bool(killed)}
            if status == 200:
                usage = body["usage"]
                row.update(prompt=usage["prompt_tokens"], cached=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
                reply = body["choices"][0]["message"].get("content") or ""
            else:
                row["error"] = str(body)[:300]
            with lock:
                results.append(row)
                if status == 200:
                    st["messages"] = msgs + [{"role": "assistant", "content": reply}]
                    st["done"] += 1
                    st["log"].append(row)
                else:  # the turn is sent again; a session failing 3 times is abandoned
                    st["fails"] += 1
                    if st["fails"] >= 3:
                        st["done"] = st["spec"]["turns"]
                st["busy"] = False
                if kill_halfway and not killed and len(results) >= total // 2:
                    homes = [s["log"][-1]["replica"] for s in state.values() if s["log"]]
                    victim = max(stack.replicas, key=homes.count)
                    killed.update(url=victim, pid=stack.kill(victim), at=len(results),
                                  affected=sorted(n for n, s in state.items() if s["log"] and s["log"][-1]["replica"] == victim))
                lock.notify_all()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"rows": results, "killed": killed, "seconds": round(time.monotonic() - started, 1)}


def summarise(label: str, stack: Stack, run: dict, sessions: list[dict]) -> dict:
    rows, killed = run["rows"], run["killed"]
    ok = [r for r in rows if r["status"] == 200]
    sub = {s["name"]: s["sub"] for s in sessions}
    uncached = lambda r: r["prompt"] - r["cached"]  # noqa: E731
    affected = set(killed.get("affected", []))
    first_after = {}
    for r in ok:
        if r["after_kill"] and r["session"] in affected and r["session"] not in first_after:
            first_after[r["session"]] = r
    moved_turns = {id(r) for r in first_after.values()}
    warm_before = [uncached(r) for r in ok if r["turn"] > 1 and not r["after_kill"]]
    warm_after = [uncached(r) for r in ok if r["turn"] > 1 and r["after_kill"] and id(r) not in moved_turns]
    per_replica = {u: sum(1 for r in ok if r["replica"] == u) for u in stack.replicas}
    homes = {}
    for r in ok:
        homes.setdefault(r["session"], set()).add((r["replica"], r["after_kill"]))
    log = stack.log_path.read_text()
    mean = lambda xs: round(statistics.mean(xs), 1) if xs else None  # noqa: E731
    return {
        "config": label, "requests": len(rows), "failed": len(rows) - len(ok), "seconds": run["seconds"],
        "per_replica": list(per_replica.values()),
        "first_turn_uncached_orchestrators": mean([uncached(r) for r in ok if r["turn"] == 1 and not sub[r["session"]]]),
        "first_turn_uncached_subagents": mean([uncached(r) for r in ok if r["turn"] == 1 and sub[r["session"]]]),
        "warm_uncached_before_kill": mean(warm_before), "warm_uncached_after_kill": mean(warm_after),
        "warm_prompt_mean": mean([r["prompt"] for r in ok if r["turn"] > 1]),
        "sessions_on_one_replica_before_kill": sum(1 for s, h in homes.items() if len({u for u, a in h if not a}) == 1),
        "killed": killed.get("url"), "affected_sessions": len(affected),
        "affected_next_turn_uncached": [uncached(first_after[s]) for s in sorted(first_after)],
        "moves_logged": log.count("mlxstack routing: session "),
        "errors": sorted({r.get("error", "")[:160] for r in rows if r["status"] != 200}),
    }


def print_table(summaries: list[dict]) -> None:
    cols = [("config", "config"), ("requests", "req"), ("failed", "failed"), ("per_replica", "req/replica"),
            ("first_turn_uncached_orchestrators", "1st turn orch"), ("first_turn_uncached_subagents", "1st turn sub"),
            ("warm_uncached_before_kill", "warm before kill"), ("warm_uncached_after_kill", "warm after kill"),
            ("warm_prompt_mean", "warm prompt"), ("affected_sessions", "affected"),
            ("affected_next_turn_uncached", "their next turn"), ("moves_logged", "moves"), ("seconds", "s")]
    print("| " + " | ".join(h for _, h in cols) + " |")
    print("|" + "---|" * len(cols))
    for s in summaries:
        print("| " + " | ".join("-" if s.get(k) is None else str(s.get(k)) for k, _ in cols) + " |")
    print("\nuncached = prompt_tokens - cached_tokens (tokens prefilled); warm = turn >= 2; 'their next turn' = the first"
          " turn after the kill of each session whose last turn ran on the killed replica.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--concurrency", type=int, default=2, help="sessions in flight at once (default 2)")
    parser.add_argument("--no-kill", action="store_true", help="do not kill a replica halfway")
    parser.add_argument("--out", type=Path, help="write the summaries and every request row as JSON")
    parser.add_argument("--model-path", default="", help="MODEL_PATH for every replica (default: the embedded model)")
    args = parser.parse_args(argv)
    sessions = build_sessions()
    summaries, raw = [], {}
    for label in args.modes:
        replicas, routing = CONFIGS[label]
        with tempfile.TemporaryDirectory(prefix="bench-scaleout-") as tmp:
            print(f"== {label}: {replicas} replica(s), ROUTING={routing}", flush=True)
            stack = Stack(Path(tmp), replicas, routing, args.model_path)
            model = Path(args.model_path.rstrip("/")).name if args.model_path else MODEL
            try:
                run = replay(stack, sessions, args.concurrency, kill_halfway=replicas > 1 and not args.no_kill, model=model)
                summary = summarise(label, stack, run, sessions)
            finally:
                stack.stop()
            print(json.dumps(summary), flush=True)
            summaries.append(summary)
            raw[label] = run
    print()
    print_table(summaries)
    if args.out:
        args.out.write_text(json.dumps({"summaries": summaries, "runs": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
