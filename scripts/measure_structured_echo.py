#!/usr/bin/env python3
"""Does turn 2 of a structured-output conversation reuse turn 1's prompt and its whole reply, when
a popular framework drives it? Measured from outside, on the MLX server's own rows.

A reply sampled under a grammar (a JSON schema, a forced tool call) is a token sequence the
tokenizer would not produce for the same text, so the engine closes each turn with the tokens the
echoed reply renders to (engine/finish.py ``echo_ids``). Whether that pays depends on the client
echoing the reply the way the engine expects: this script asks each framework, in its own
structured-output mode, for the same Person{name: str, age: int, city: str} twice -- turn 2 sending
the conversation with turn 1's reply as the framework itself echoes it -- and reads each turn's
``prompt_tokens`` / ``cached_tokens`` / ``completion_tokens`` from ``GET <mlx>/v1/cache/stats``
``recent`` (frameworks often hide usage). A case passes when

    turn-2 cached >= turn-1 prompt + turn-1 reply - 2

(the reply's last token is never fed back, and the prompt's last token is always computed).

Each case runs in a child process under ``--framework-python`` (a throwaway virtualenv holding the
frameworks; the project's .venv stays clean), one child script per framework in
scripts/structured_echo/; the Vercel AI SDK's runs under node with ``--node-dir`` (a folder where
``npm install ai @ai-sdk/openai`` was run). A framework that does not import is listed as skipped.

    python3.12 -m venv /tmp/fwvenv && /tmp/fwvenv/bin/pip install openai-agents pydantic-ai-slim[openai] \\
        langchain-openai instructor openai anthropic
    mkdir /tmp/fwnode && (cd /tmp/fwnode && npm init -y && npm install ai @ai-sdk/openai)
    .venv/bin/python scripts/measure_structured_echo.py --framework-python /tmp/fwvenv/bin/python \\
        --node-dir /tmp/fwnode                      # its own stack on free ports (embedded SmolLM2, greedy)
    .venv/bin/python scripts/measure_structured_echo.py --proxy-url http://127.0.0.1:4000 --key sk-... \\
        --mlx-url http://127.0.0.1:8080            # a running stack
    ... --only langchain --json                    # some cases; machine output

Exit code: 0 when every case that ran passed, 1 when one missed or failed, 2 when none could run.
"""
from __future__ import annotations

import argparse
import json
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CHILDREN = Path(__file__).resolve().parent / "structured_echo"
SYSTEM = "You answer with one JSON object describing a person."
MODEL = "SmolLM2-135M-Instruct"

# (child script, the modes it runs); a mode is one row of the table
CASES: list[tuple[str, list[str]]] = [
    ("fw_openai.py", ["chat.parse", "responses.text.format"]),
    ("fw_anthropic.py", ["forced_tool"]),
    ("fw_agents.py", ["output_type/responses", "output_type/chat"]),
    ("fw_pydantic_ai.py", ["NativeOutput", "ToolOutput"]),
    ("fw_langchain.py", ["json_schema", "function_calling"]),
    ("fw_instructor.py", ["JSON_SCHEMA", "TOOLS"]),
    ("fw_vercel_ai.mjs", ["Output.object/chat", "Output.object/responses", "generateObject/chat"]),
]


# ----------------------------------------------------------------------------- pure parts
def target(prompt_tokens: int, reply_tokens: int) -> int:
    """What turn 2 must reuse: turn 1's prompt and its reply, less the reply's last token (never fed
    back) and the prompt's last token (always computed)."""
    return prompt_tokens + reply_tokens - 2


def parse_result(stdout: str) -> dict | None:
    """The child's last ``RESULT {json}`` line, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            try:
                value = json.loads(line[len("RESULT "):])
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def slice_turns(rows: list[dict], marks: list[str | None]) -> list[list[dict]]:
    """The server rows each turn made: those after mark i up to and including mark i+1 (a mark is
    the last request id the server showed at a turn boundary; None: it showed none yet). Raises
    ValueError when a mark is not among ``rows`` (pushed out of ``recent``, or another server)."""
    ids = [r.get("request_id") for r in rows]

    def position(mark: str | None) -> int:       # index just after the marked row
        if mark is None:
            return 0
        if mark not in ids:
            raise ValueError(f"request {mark} is not among the server's recent rows")
        return len(ids) - ids[::-1].index(mark)

    cuts = [position(m) for m in marks]
    return [rows[a:b] for a, b in zip(cuts, cuts[1:])]


@dataclass
class Measure:
    framework: str
    version: str
    api: str                       # what the client speaks
    mode: str
    server_api: str = ""           # what the MLX server was asked (LiteLLM may translate)
    t1_prompt: int | None = None
    t1_reply: int | None = None
    t2_prompt: int | None = None
    t2_cached: int | None = None
    target: int | None = None
    requests: list[int] = field(default_factory=list)   # server requests per turn
    status: str = "fail"           # pass | miss | fail | skipped
    note: str = ""
    echo: str = ""
    t1_request: str = ""
    t2_request: str = ""
    t2_explain: str = ""
    t2_diagnosis: dict | None = None
    evidence: dict | None = None


def measure(result: dict, rows: list[dict]) -> Measure:
    """One case's measure from its child's RESULT and the server's recent rows. Turn 1 is the last
    request of turn 1 (the reply the framework echoed, after any retry); turn 2 its first request."""
    m = Measure(framework=str(result.get("framework", "?")), version=str(result.get("version", "")),
                api=str(result.get("api", "")), mode=str(result.get("mode", "")), echo=str(result.get("echo", "")))
    if result.get("skipped"):
        m.status, m.note = "skipped", str(result["skipped"])
        return m
    marks = result.get("marks") or []
    turns: list[list[dict]] = []
    if len(marks) >= 2:
        try:
            turns = slice_turns(rows, marks)
        except ValueError as err:
            m.note = str(err)
    m.requests = [len(t) for t in turns]
    if result.get("error"):
        m.note = str(result["error"])[:300]
    if len(turns) < 2 or not turns[0] or not turns[1]:
        m.note = m.note or f"turn rows: {m.requests}"
        return m
    first, second = turns[0][-1], turns[1][0]
    m.server_api = str(second.get("api") or first.get("api") or "")
    m.t1_request, m.t2_request = str(first.get("request_id", "")), str(second.get("request_id", ""))
    m.t1_prompt, m.t1_reply = int(first.get("prompt_tokens") or 0), int(first.get("completion_tokens") or 0)
    m.t2_prompt, m.t2_cached = int(second.get("prompt_tokens") or 0), int(second.get("cached_tokens") or 0)
    m.target = target(m.t1_prompt, m.t1_reply)
    m.t2_explain = str(second.get("cache_explain") or "")
    m.t2_diagnosis = second.get("cache_diagnosis")
    if result.get("error"):
        return m
    m.status = "pass" if m.t2_cached >= m.target else "miss"
    if any(n != 1 for n in m.requests):
        m.note = f"server requests per turn: {m.requests}"
    return m


COLUMNS = ["framework", "version", "API", "mode", "t1 prompt", "t1 reply", "t2 cached", "target", "result"]


def table_rows(measures: list[Measure]) -> list[list[str]]:
    def num(v: int | None) -> str:
        return "-" if v is None else str(v)

    out = []
    for m in measures:
        api = m.api if not m.server_api or m.server_api == m.api else f"{m.api}->{m.server_api}"
        result = m.status if m.status in ("pass", "skipped") else (
            f"{m.status} ({m.t2_cached - m.target:+d})" if m.status == "miss" and m.target is not None else m.status)
        out.append([m.framework, m.version, api, m.mode, num(m.t1_prompt), num(m.t1_reply), num(m.t2_cached),
                    num(m.target), result])
    return out


def render_table(measures: list[Measure]) -> str:
    rows = [COLUMNS] + table_rows(measures)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    numeric = {4, 5, 6, 7}
    lines = []
    for k, r in enumerate(rows):
        cells = [c.rjust(widths[i]) if i in numeric else c.ljust(widths[i]) for i, c in enumerate(r)]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def exit_code(measures: list[Measure]) -> int:
    ran = [m for m in measures if m.status != "skipped"]
    if not ran:
        return 2
    return 0 if all(m.status == "pass" for m in ran) else 1


# ----------------------------------------------------------------------------- request-log evidence
def find_records(log_root: Path, request_ids: set[str]) -> dict[str, dict]:
    """The request-log records (observability/request_log.py) of these requests, by request id."""
    found: dict[str, dict] = {}
    if not log_root.is_dir():
        return found
    for path in sorted(log_root.glob("*/cache-session-*.log")):
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("request_id") in request_ids:
                found[rec["request_id"]] = rec
    return found


def first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def evidence(first: dict, second: dict, context: int = 160) -> dict:
    """Where turn 2's rendered prompt leaves turn 1's prompt followed by its reply as generated:
    the text of turn 2 there (how the framework's echo rendered) beside the reply's text."""
    t1, t2 = first.get("model_text") or "", second.get("model_text") or ""
    reply = (first.get("output") or {}).get("text_head") or ""
    t1_tokens, t2_tokens = first.get("model_tokens") or [], second.get("model_tokens") or []
    common_tokens = 0
    for x, y in zip(t1_tokens, t2_tokens):
        if x != y:
            break
        common_tokens += 1
    out: dict[str, Any] = {"t1_prompt_chars": len(t1), "t1_prompt_is_prefix_of_t2": t2.startswith(t1),
                           "common_prompt_tokens": common_tokens, "t1_reply_text": reply}
    if t2.startswith(t1):
        out["t2_after_t1_prompt"] = t2[len(t1):len(t1) + context]
        at = first_difference(reply, t2[len(t1):])
        out["reply_echo_parts_at_char"] = at
        out["reply_at"] = reply[at:at + 60]
        out["echo_at"] = t2[len(t1) + at:len(t1) + at + 60]
    else:
        at = first_difference(t1, t2)
        out["prompts_part_at_char"] = at
        out["t1_at"] = t1[max(0, at - 40):at + context]
        out["t2_at"] = t2[max(0, at - 40):at + context]
    return out


# ----------------------------------------------------------------------------- the stack
def http_get(url: str, key: str = "", timeout: float = 60) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


class OwnStack:
    """The whole stack (launcher: MLX server + LiteLLM) on free ports, the embedded model, greedy,
    request logs in a temporary folder; ``stop()`` ends it (and only it)."""

    def __init__(self, tmp: Path) -> None:
        sys.path.insert(0, str(REPO))
        from mlxstack.models.embedded_model import ensure_embedded_model
        from scripts.probelib.client import free_ports, setting
        from scripts.probelib.servers import launch_stack

        cache = Path(setting("MODEL_CACHE_DIR", "") or Path.home() / ".cache" / "mlxstack").expanduser()
        model_dir = Path(ensure_embedded_model(cache))
        self.mlx_port, self.proxy_port = free_ports(2)
        self.key = "sk-measure-" + secrets.token_hex(8)
        self.log_root = tmp / "logs"
        env = {"MLX_PORT": str(self.mlx_port), "PROXY_PORT": str(self.proxy_port), "LITELLM_MASTER_KEY": self.key,
               "MODEL_PATH": "", "MODEL_CACHE_DIR": str(model_dir.parent), "LOG_ROOT": str(self.log_root),
               "DEFAULT_TEMPERATURE": "0", "DISK_CACHE_DIR": "off", "PROXY_STARTUP_TIMEOUT_SECONDS": "180"}
        self.log_path = tmp / "stack.log"
        self.proc, self.log = launch_stack(env, self.log_path)
        self.proxy_url = f"http://127.0.0.1:{self.proxy_port}"
        self.mlx_url = f"http://127.0.0.1:{self.mlx_port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


# ----------------------------------------------------------------------------- running the cases
def child_command(script: str, mode: str, args: argparse.Namespace, conn: dict) -> list[str] | str:
    """The command of one case, or why it cannot run."""
    common = ["--base-url", conn["proxy"], "--key", conn["key"], "--model", conn["model"], "--mlx-url", conn["mlx"],
              "--mlx-key", conn["mlx_key"], "--mode", mode, "--system", f"{SYSTEM} ({script[3:].split('.')[0]} {mode})",
              "--max-tokens", str(args.max_tokens)]
    if script.endswith(".mjs"):
        node = shutil.which(args.node) if args.node else None
        if not node:
            return "node not found"
        if not args.node_dir:
            return "no --node-dir (a folder where `npm install ai @ai-sdk/openai` ran)"
        return [node, str(CHILDREN / script), *common, "--node-dir", str(Path(args.node_dir).resolve())]
    return [args.framework_python, str(CHILDREN / script), *common]


def skipped(script: str, mode: str, why: str) -> dict:
    name = {"fw_vercel_ai.mjs": "vercel ai-sdk"}.get(script, script[3:].split(".")[0])
    return {"framework": name, "version": "", "api": "", "mode": mode, "skipped": why}


def run_case(script: str, mode: str, args: argparse.Namespace, conn: dict) -> Measure:
    cmd = child_command(script, mode, args, conn)
    if isinstance(cmd, str):
        return measure(skipped(script, mode, cmd), [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout, cwd=str(CHILDREN))
        result = parse_result(proc.stdout) or {**skipped(script, mode, ""), "skipped": None,
                                               "error": f"no RESULT line (exit {proc.returncode}): "
                                                        + (proc.stderr or proc.stdout)[-300:]}
    except subprocess.TimeoutExpired:
        result = {**skipped(script, mode, ""), "skipped": None, "error": f"timed out after {args.case_timeout}s"}
    if args.verbose and result.get("traceback"):
        print(result["traceback"], file=sys.stderr)
    rows = http_get(conn["mlx"] + "/v1/cache/stats", conn["mlx_key"]).get("recent") or []
    m = measure(result, rows)
    if m.status == "miss" and conn.get("log_root"):
        time.sleep(1.0)                      # the request log is written by a background thread
        recs = find_records(Path(conn["log_root"]), {m.t1_request, m.t2_request})
        if m.t1_request in recs and m.t2_request in recs:
            m.evidence = evidence(recs[m.t1_request], recs[m.t2_request])
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxy-url", default="", help="a running stack's proxy root (default: start one)")
    ap.add_argument("--key", default="", help="its LITELLM_MASTER_KEY (default: .env's)")
    ap.add_argument("--mlx-url", default="", help="its MLX server's root (default: MLX_HOST / MLX_PORT)")
    ap.add_argument("--mlx-key", default="", help="MLX_API_KEY, for /v1/cache/stats off loopback")
    ap.add_argument("--log-root", default="", help="the MLX server's LOG_ROOT, for evidence on a miss")
    ap.add_argument("--model", default="", help="default: the proxy's first model")
    ap.add_argument("--framework-python", default=sys.executable, help="the interpreter holding the frameworks")
    ap.add_argument("--node", default="node")
    ap.add_argument("--node-dir", default="", help="a folder whose node_modules holds ai and @ai-sdk/openai")
    ap.add_argument("--only", default="", help="comma-separated substrings of 'script mode' to run")
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--case-timeout", type=float, default=600)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--verbose", action="store_true", help="children's tracebacks on stderr")
    args = ap.parse_args(argv)

    stack = tmp = None
    if args.proxy_url:
        sys.path.insert(0, str(REPO))
        from scripts.probelib.client import default_api_key, default_mlx_url, setting

        log_root = args.log_root or setting("LOG_ROOT", "logs")
        conn = {"proxy": args.proxy_url.rstrip("/").removesuffix("/v1"), "key": args.key or default_api_key(),
                "mlx": (args.mlx_url or default_mlx_url()).rstrip("/"), "mlx_key": args.mlx_key,
                "log_root": str(Path(log_root) if Path(log_root).is_absolute() else REPO / log_root)}
    else:
        tmp = Path(tempfile.mkdtemp(prefix="measure-echo-"))
        print(f"starting a stack (log: {tmp / 'stack.log'}) ...", file=sys.stderr, flush=True)
        stack = OwnStack(tmp)
        conn = {"proxy": stack.proxy_url, "key": stack.key, "mlx": stack.mlx_url, "mlx_key": "",
                "log_root": str(stack.log_root)}
    try:
        ids = [m.get("id") for m in http_get(conn["proxy"] + "/v1/models", conn["key"]).get("data") or []]
        conn["model"] = args.model or (MODEL if MODEL in ids or not ids else ids[0])
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        measures = []
        for script, modes in CASES:
            for mode in modes:
                if wanted and not any(w in f"{script} {mode}" for w in wanted):
                    continue
                print(f"  {script} {mode} ...", file=sys.stderr, flush=True)
                measures.append(run_case(script, mode, args, conn))
    finally:
        if stack is not None:
            stack.stop()
    if args.json:
        print(json.dumps({"model": conn["model"], "max_tokens": args.max_tokens,
                          "cases": [asdict(m) for m in measures]}, indent=2))
    else:
        print(f"model {conn['model']}, max_tokens {args.max_tokens}; pass: turn-2 cached >= target "
              f"(turn-1 prompt + reply - 2)\n")
        print(render_table(measures))
        for m in measures:
            if m.status in ("miss", "fail") or m.note:
                print(f"\n{m.framework} {m.mode}: {m.status}" + (f" -- {m.note}" if m.note else ""))
                if m.t2_explain:
                    print(f"  turn 2 cache: {m.t2_explain}")
                if m.evidence:
                    for k, v in m.evidence.items():
                        print(f"  {k}: {v!r}")
    return exit_code(measures)


if __name__ == "__main__":
    sys.exit(main())
