#!/usr/bin/env python3
"""A session whose system prompt drifts, through LiteLLM with the Anthropic SDK, explained.

    .venv/bin/python scripts/demo_cache_drift.py --start     # its own stack on 4000 / 8080 (embedded model)
    .venv/bin/python scripts/demo_cache_drift.py             # a running stack (LITELLM_MASTER_KEY, LOG_ROOT)

Four turns of one session (``x-claude-code-session-id``) on the Anthropic Messages API through
the proxy; the system prompt carries a date line that changes at turn 3 and stays changed -- a
client that writes today's date into its system prompt, across midnight. Each turn asks for
Anthropic's cache diagnosis (beta ``cache-diagnosis-2026-04-07``, ``diagnostics.previous_message_id``)
and prints its usage (cache_read_input_tokens / cache_creation_input_tokens / input_tokens),
the diagnosis and the ``x-mlxstack-cache`` header; then scripts/explain_cache.py's lines for the
session, from the request log the MLX server wrote.

``--start`` launches start_llm's stack (MLX server on the embedded SmolLM2-135M + LiteLLM) with a
fresh key and LOG_ROOT in a temporary folder, greedy sampling, and stops it at the end.
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BETA = {"anthropic-beta": "cache-diagnosis-2026-04-07"}
SYSTEM = "You are a helpful assistant. Answer in one short sentence.\nToday is Friday, 2026-05-01."
DRIFTED = "You are a helpful assistant. Answer in one short sentence.\nToday is Saturday, 2026-05-02."
QUESTIONS = ("Name a fruit.", "Name another one.", "And a vegetable?", "Thanks. One more fruit?")
DRIFT_TURN = 3


def start_stack(proxy_port: int, mlx_port: int, log_root: Path, key: str, workdir: Path):
    from scripts.probelib.servers import launch_stack

    env = {"MLX_PORT": str(mlx_port), "PROXY_PORT": str(proxy_port), "LITELLM_MASTER_KEY": key,
           "LOG_ROOT": str(log_root), "ENABLE_REQUEST_LOGGING": "true", "DEFAULT_TEMPERATURE": "0",
           "PROXY_STARTUP_TIMEOUT_SECONDS": "180"}
    return launch_stack(env, workdir / "stack.log")


def session_records(log_root: Path, session: str) -> list[dict]:
    from mlxstack.observability.request_log import log_files, read_records

    return [r for p in log_files(log_root) for r in read_records(p) if r.get("session") == session[:16]]


def run_session(proxy_url: str, key: str, model: str, session: str, max_tokens: int) -> list[dict]:
    from anthropic import Anthropic

    client = Anthropic(base_url=proxy_url, api_key=key)
    messages: list[dict] = []
    previous = None
    turns = []
    for turn, question in enumerate(QUESTIONS, 1):
        messages.append({"role": "user", "content": question})
        raw = client.messages.with_raw_response.create(
            model=model, max_tokens=max_tokens, system=SYSTEM if turn < DRIFT_TURN else DRIFTED, messages=messages,
            diagnostics={"previous_message_id": previous},
            extra_headers={**BETA, "x-claude-code-session-id": session})
        m = raw.parse()
        reason = m.diagnostics.cache_miss_reason if m.diagnostics else None
        turns.append({"turn": turn, "usage": m.usage, "reason": reason,
                      "header": raw.headers.get("x-mlxstack-cache", "(no header)"),
                      "reply": "".join(b.text for b in m.content if b.type == "text")})
        messages.append({"role": "assistant", "content": turns[-1]["reply"]})
        previous = m.id
    return turns


def print_turns(turns: list[dict]) -> None:
    print(f"{'turn':>4} {'system':8} {'input':>5} {'cache_read':>10} {'cache_creation':>14} {'output':>6}  diagnostics")
    for t in turns:
        u, r = t["usage"], t["reason"]
        diag = "null" if r is None else (
            f"{r.type}" + (f", cache_missed_input_tokens={r.cache_missed_input_tokens}"
                           if getattr(r, "cache_missed_input_tokens", None) is not None else ""))
        system = "05-01" if t["turn"] < DRIFT_TURN else "05-02"
        print(f"{t['turn']:>4} {system:8} {u.input_tokens:>5} {u.cache_read_input_tokens:>10} "
              f"{u.cache_creation_input_tokens:>14} {u.output_tokens:>6}  {diag}")
    print()
    for t in turns:
        print(f"turn {t['turn']}  x-mlxstack-cache: {t['header']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", action="store_true", help="launch a stack for the demo and stop it afterwards")
    ap.add_argument("--proxy-port", type=int, default=4000, help="with --start")
    ap.add_argument("--mlx-port", type=int, default=8080, help="with --start")
    ap.add_argument("--proxy-url", default="http://127.0.0.1:4000", help="without --start")
    ap.add_argument("--api-key", help="without --start (default: LITELLM_MASTER_KEY from the environment or .env)")
    ap.add_argument("--log-root", type=Path, help="the MLX server's LOG_ROOT (default: the settings')")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--session", default=f"demo-drift-{int(time.time()) % 100000}")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)

    proc = log = None
    tmp = None
    if args.start:
        tmp = Path(tempfile.mkdtemp(prefix="demo-cache-drift-"))
        key = "sk-demo-" + secrets.token_hex(8)
        log_root = args.log_root or tmp / "logs"
        proxy_url = f"http://127.0.0.1:{args.proxy_port}"
        print(f"starting the stack: proxy {proxy_url}, MLX server :{args.mlx_port}, logs {log_root}", flush=True)
        proc, log = start_stack(args.proxy_port, args.mlx_port, log_root, key, tmp)
    else:
        from mlxstack.config.settings import load_settings

        settings = load_settings()
        key = args.api_key or os.environ.get("LITELLM_MASTER_KEY") or settings.litellm_master_key
        log_root = args.log_root or settings.log_root_path
        proxy_url = args.proxy_url
    try:
        turns = run_session(proxy_url, key, args.model, args.session, args.max_tokens)
        print(f"session {args.session} through {proxy_url} (Anthropic SDK, {args.model}); "
              f"the system prompt's date line changes at turn {DRIFT_TURN}\n")
        print_turns(turns)
        deadline = time.monotonic() + 30     # the request log is written by a background thread
        while len(session_records(log_root, args.session)) < len(turns) and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"\n$ scripts/explain_cache.py --session {args.session}")
        from scripts.explain_cache import main as explain

        return explain(["--log-root", str(log_root), "--session", args.session])
    finally:
        if proc is not None:
            import signal

            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a stack that will not stop is killed
                proc.kill()
            log.close()


if __name__ == "__main__":
    sys.exit(main())
