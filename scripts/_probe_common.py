"""Shared code for the probe / bench scripts in ``scripts/`` (stdlib only; no MLX import needed).

    from _probe_common import Client, add_client_args, client_from_args, print_table
    client = client_from_args(args)                # --base-url / --api-key / --model / --stats-url
    r = client.chat(messages, tools=PI_TOOLS, max_tokens=16, session_id="s1")
    r.prompt_tokens, r.cached_tokens, r.ttft_s, r.text, client.stats_row(r)

What lives here:
- ``Client``: OpenAI chat completions over urllib, streaming by default (client-side TTFT = time
  to the first content / reasoning / tool-call delta), usage incl. ``prompt_tokens_details.cached_tokens``;
  ``cache_stats()`` reads the MLX server's ``GET /v1/cache/stats`` and ``stats_row()`` finds the
  request's row (by request id = tail of the response id, else by order).
- Request builders shaped like PI (developer prompt + read_file/bash/edit tools + tool loop),
  OpenClaw (cache boundary, inbound context, untrusted-metadata prefixes, sub-agent stats) and
  Claude Code (billing header, system reminders).
- ``ServerProcess``: start ``python -m mlxstack.serve`` or ``python -m mlx_lm.server`` on a free
  port (with the OpenBLAS preload the launcher would use), wait until ready, stop by pid.
- ``print_table`` (plain or markdown).
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROXY_URL = "http://127.0.0.1:4000/v1"
DEFAULT_MLX_URL = "http://127.0.0.1:8080"
EMBEDDED_MODEL_DIR = "SmolLM2-135M-Instruct-f32"


# ----------------------------------------------------------------------------- config helpers
def read_dotenv(path: Path | None = None) -> dict[str, str]:
    """Minimal .env reader (KEY=VALUE, optional quotes, # comments); missing file -> {}."""
    path = path or REPO_ROOT / ".env"
    out: dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        key = key.strip()
        if key.startswith("export "):
            key = key[7:].strip()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].strip()
        out[key] = value
    return out


def setting(name: str, default: str = "") -> str:
    """Environment first, then the repo's .env."""
    if os.environ.get(name):
        return os.environ[name]
    return read_dotenv().get(name, default)


def default_api_key() -> str:
    return setting("LITELLM_MASTER_KEY", "")


def default_mlx_url() -> str:
    host = setting("MLX_HOST", "127.0.0.1") or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://{host}:{setting('MLX_PORT', '8080') or '8080'}"


def add_client_args(parser: Any, *, default_base: str = DEFAULT_PROXY_URL, max_tokens: int = 16) -> None:
    parser.add_argument("--base-url", default=default_base,
                        help=f"OpenAI-compatible base URL ending in /v1 (default {default_base}; the MLX "
                             "server directly is http://127.0.0.1:8080/v1)")
    parser.add_argument("--api-key", default=None,
                        help="Bearer key (default: $LITELLM_MASTER_KEY or the repo's .env)")
    parser.add_argument("--model", default=None,
                        help="model name (default: the first id from GET <base-url>/models)")
    parser.add_argument("--stats-url", default=None,
                        help="MLX server /v1/cache/stats URL for match types (default: <base-url>/cache/stats, "
                             "falling back to http://MLX_HOST:MLX_PORT/v1/cache/stats)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=f"max_tokens per request (default {max_tokens})")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    parser.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT then = total time)")


def client_from_args(args: Any) -> Client:
    key = args.api_key if args.api_key is not None else default_api_key()
    return Client(args.base_url, key, model=args.model, stats_url=args.stats_url, timeout=args.timeout,
                  stream=not getattr(args, "no_stream", False))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nonce(n: int = 8) -> str:
    return "".join(random.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(n))


# ----------------------------------------------------------------------------- HTTP client
class ProbeError(RuntimeError):
    pass


@dataclass
class ChatResult:
    id: str = ""
    text: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    ttft_s: float = 0.0
    total_s: float = 0.0
    status: int = 200
    chunks: int = 0

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens") or 0)

    @property
    def cached_tokens(self) -> int:
        details = self.usage.get("prompt_tokens_details") or {}
        val = details.get("cached_tokens") if isinstance(details, dict) else None
        if val is None:
            val = self.usage.get("cached_tokens", 0)  # some proxies flatten it
        return int(val or 0)

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_id(self) -> str:
        # mlxstack ids are "chatcmpl-<20 hex>" whose last 12 hex are the server's request id.
        m = re.search(r"([0-9a-f]{12})$", self.id or "")
        return m.group(1) if m else ""


class Client:
    def __init__(self, base_url: str, api_key: str = "", *, model: str | None = None, stats_url: str | None = None,
                 timeout: float = 600.0, stream: bool = True) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key or ""
        self._model = model
        self._stats_url = stats_url
        self._stats_ok: bool | None = None if stats_url is None else True
        self.timeout = timeout
        self.stream = stream

    # -- plumbing
    def _headers(self, extra: dict | None = None) -> dict:
        h = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        h.update(extra or {})
        return h

    def get_json(self, url: str, timeout: float = 10.0) -> Any:
        req = urllib.request.Request(url, headers=self._headers())
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.load(resp)

    @property
    def model(self) -> str:
        if not self._model:
            try:
                data = self.get_json(self.base_url + "/models").get("data") or []
            except (urllib.error.URLError, OSError, ValueError) as exc:
                raise ProbeError(f"GET {self.base_url}/models failed ({exc}); pass --model") from exc
            ids = [d.get("id") for d in data if isinstance(d, dict) and d.get("id")]
            self._model = ids[0] if ids else "default_model"
        return self._model

    # -- stats
    def _stats_candidates(self) -> list[str]:
        root = re.sub(r"/v1$", "", self.base_url)
        cands = [root + "/v1/cache/stats"]
        mlx = default_mlx_url() + "/v1/cache/stats"
        if mlx not in cands:
            cands.append(mlx)
        return cands

    def cache_stats(self) -> dict | None:
        """The MLX server's /v1/cache/stats JSON, or None when no stats endpoint answers."""
        if self._stats_ok is False:
            return None
        urls = [self._stats_url] if self._stats_url else self._stats_candidates()
        for url in urls:
            try:
                data = self.get_json(url, timeout=10)
            except (urllib.error.URLError, OSError, ValueError):
                continue
            if isinstance(data, dict) and ("recent" in data or "entries" in data):
                self._stats_url, self._stats_ok = url, True
                return data
        self._stats_ok = False
        return None

    def recent_ids(self) -> set[str]:
        stats = self.cache_stats() or {}
        return {str(r.get("request_id")) for r in stats.get("recent") or [] if isinstance(r, dict)}

    def stats_row(self, result: ChatResult, before: set[str] | None = None) -> dict | None:
        """This request's row in /v1/cache/stats ``recent``: by request id, else the newest new row."""
        stats = self.cache_stats()
        if not stats:
            return None
        rows = [r for r in stats.get("recent") or [] if isinstance(r, dict)]
        rid = result.request_id
        for r in reversed(rows):
            if rid and str(r.get("request_id")) == rid:
                return r
        if before is not None:
            new = [r for r in rows if str(r.get("request_id")) not in before]
            if new:
                return new[-1]
        return None

    # -- chat
    def chat(self, messages: list[dict], *, tools: list | None = None, max_tokens: int = 16,
             temperature: float = 0.0, session_id: str | None = None, headers: dict | None = None,
             extra: dict | None = None, stream: bool | None = None, model: str | None = None) -> ChatResult:
        body: dict[str, Any] = {"model": model or self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": temperature}
        if tools:
            body["tools"] = tools
        if session_id:
            body["session_id"] = session_id
        body.update(extra or {})
        stream = self.stream if stream is None else stream
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + "/chat/completions", data=data, headers=self._headers(headers))
        out = ChatResult()
        t0 = time.perf_counter()
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")[:2000]
            raise ProbeError(f"HTTP {exc.code} from {self.base_url}/chat/completions: {detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ProbeError(f"request to {self.base_url}/chat/completions failed: {exc}") from exc
        with resp:
            out.status = resp.status
            if not stream:
                payload = json.load(resp)
                out.total_s = out.ttft_s = time.perf_counter() - t0
                out.id = payload.get("id", "")
                out.usage = payload.get("usage") or {}
                choice = (payload.get("choices") or [{}])[0]
                msg = choice.get("message") or {}
                out.text = msg.get("content") or ""
                out.reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
                out.tool_calls = msg.get("tool_calls") or []
                out.finish_reason = choice.get("finish_reason")
                return out
            calls: dict[int, dict] = {}
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                chunk = line[5:].strip()
                if chunk == "[DONE]":
                    break
                try:
                    obj = json.loads(chunk)
                except ValueError:
                    continue
                if "error" in obj and not obj.get("choices"):
                    raise ProbeError(f"stream error: {json.dumps(obj)[:1000]}")
                out.chunks += 1
                out.id = out.id or obj.get("id", "")
                if obj.get("usage"):
                    out.usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    delta = ch.get("delta") or {}
                    piece = delta.get("content") or ""
                    rpiece = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    if (piece or rpiece or delta.get("tool_calls")) and not out.ttft_s:
                        out.ttft_s = time.perf_counter() - t0
                    out.text += piece
                    out.reasoning += rpiece
                    for tc in delta.get("tool_calls") or []:
                        slot = calls.setdefault(int(tc.get("index", len(calls))),
                                                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                        slot["id"] = tc.get("id") or slot["id"]
                        fn = tc.get("function") or {}
                        slot["function"]["name"] += fn.get("name") or ""
                        slot["function"]["arguments"] += fn.get("arguments") or ""
                    if ch.get("finish_reason"):
                        out.finish_reason = ch["finish_reason"]
            out.tool_calls = [calls[i] for i in sorted(calls)]
        out.total_s = time.perf_counter() - t0
        if not out.ttft_s:
            out.ttft_s = out.total_s
        return out


# ----------------------------------------------------------------------------- history helpers
THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """What PI / OpenClaw echo back: ``<think>`` blocks removed (reasoning_content is dropped too)."""
    text = THINK_BLOCK.sub("", text or "")
    if "</think>" in text:  # orphan close (GLM style)
        text = text.split("</think>", 1)[1]
    return text.lstrip()


def assistant_echo(result: ChatResult, *, tool_calls: list | None = None) -> dict:
    """The assistant turn a client appends to its history: content with reasoning stripped, plus
    tool calls (the server's, or ones the harness supplies when the tiny model makes none)."""
    msg: dict[str, Any] = {"role": "assistant", "content": strip_reasoning(result.text)}
    calls = result.tool_calls or tool_calls
    if calls:
        msg["tool_calls"] = calls
    return msg


def tool_call(call_id: str, name: str, args: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def tool_result(call_id: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


# ----------------------------------------------------------------------------- request shapes
def _fn(name: str, desc: str, props: dict, required: Sequence[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": list(required)}}}


PI_TOOLS = [
    _fn("read_file", "Read a file from the workspace. Returns the file contents with line numbers.",
        {"path": {"type": "string", "description": "Path relative to the workspace root"},
         "offset": {"type": "integer", "description": "First line to read (1-based)"},
         "limit": {"type": "integer", "description": "Maximum number of lines"}}, ["path"]),
    _fn("bash", "Run a shell command in the workspace and return stdout and stderr.",
        {"command": {"type": "string", "description": "The command line to run"},
         "timeout": {"type": "integer", "description": "Seconds before the command is killed"}}, ["command"]),
    _fn("edit", "Replace an exact string in a file with a new string.",
        {"path": {"type": "string"}, "old_text": {"type": "string"}, "new_text": {"type": "string"}},
        ["path", "old_text", "new_text"]),
]

_GUIDELINES = [
    "Read the relevant files before changing them and keep edits minimal and focused.",
    "Prefer small, reviewable diffs; never rewrite a file when an edit will do.",
    "Run the test suite after every change and report failures verbatim.",
    "Use the bash tool for builds, tests and searches; use read_file to inspect code.",
    "When a command fails, read its output carefully before retrying with a fix.",
    "Never invent file contents; if something is unknown, look it up with a tool.",
    "Keep the user informed with one short sentence before each tool call.",
    "Respect the project's style: formatting, naming, imports and error handling.",
    "Do not commit, push or delete branches unless the user explicitly asks.",
    "Summarise what changed and why at the end of the task, with file paths.",
]


def filler_paragraphs(n_tokens: int, topic: str = "guideline", seed: int = 0) -> str:
    """Deterministic prose of roughly ``n_tokens`` tokens (about 4.2 characters per token)."""
    rnd = random.Random(seed)
    lines: list[str] = []
    chars = 0
    i = 0
    while chars < n_tokens * 4.2:
        g = _GUIDELINES[(i + seed) % len(_GUIDELINES)]
        line = f"{i + 1}. ({topic} {rnd.randint(100, 999)}) {g}"
        lines.append(line)
        chars += len(line) + 1
        i += 1
    return "\n".join(lines)


def pi_system_prompt(n_tokens: int = 1200, tag: str = "") -> str:
    head = (f"You are pi, a coding agent working inside the user's repository.{(' Run ' + tag + '.') if tag else ''}\n"
            "You have tools: read_file, bash and edit. Think step by step, then act with tools.\n\n"
            "# Guidelines\n")
    return head + filler_paragraphs(max(0, n_tokens - 60), "rule") + "\n\n# Environment\nWorking directory: /home/user/project\nOS: linux"


def fake_file(name: str, n_tokens: int = 250, seed: int = 1) -> str:
    rnd = random.Random(hash(name) & 0xFFFF ^ seed)
    out, chars, i = [], 0, 1
    while chars < n_tokens * 3.3:
        fname = f"handle_{rnd.choice(['user', 'order', 'item', 'cart', 'token'])}_{i}"
        line = f"{i:4d}  def {fname}(request, limit={rnd.randint(1, 99)}):\n      return process(request, limit)"
        out.append(line)
        chars += len(line) + 1
        i += 1
    return f"# {name}\n" + "\n".join(out)


def fake_test_output(n_tokens: int = 150, failing: bool = True) -> str:
    lines = ["============================= test session starts =============================",
             "platform linux -- Python 3.12.1, pytest-8.3.3", "collected 42 items", ""]
    i = 0
    while sum(len(x) for x in lines) < n_tokens * 3.8:
        lines.append(f"tests/test_app.py::test_case_{i} PASSED")
        i += 1
    if failing:
        lines += ["tests/test_app.py::test_parser FAILED", "E   AssertionError: expected 3, got 2",
                  "========================= 1 failed, 41 passed in 0.42s ========================="]
    else:
        lines.append("============================= 42 passed in 0.40s ==============================")
    return "\n".join(lines)


# OpenClaw --------------------------------------------------------------------------------------
OPENCLAW_BOUNDARY = "<!-- OPENCLAW_CACHE_BOUNDARY -->"


def openclaw_inbound_context(chat_id: str = "telegram:4242", msg_no: int = 1) -> str:
    ctx = {"schema": "openclaw.inbound_meta.v1", "channel": "telegram", "provider": "telegram",
           "surface": "direct", "chat_type": "direct", "chat_id": chat_id, "account_id": "default",
           "was_mentioned": False}
    return ("## Inbound Context (trusted metadata)\n"
            "The following JSON is generated by OpenClaw out-of-band. Treat it as authoritative metadata "
            "about the current message context.\n\n```json\n" + json.dumps(ctx, indent=2) + "\n```\n")


def openclaw_system_prompt(n_tokens: int = 1000, *, inbound: bool = True, date: str = "Monday, March 30, 2026",
                           tag: str = "", boundary: bool = True, time_line: str | None = None) -> str:
    stable = (f"You are a personal assistant running inside OpenClaw.{(' Deployment ' + tag + '.') if tag else ''}\n\n"
              "## Tooling\nTool availability (filtered by policy): read, write, exec, sessions_spawn, web_search.\n\n"
              "## Safety\n" + filler_paragraphs(max(0, n_tokens - 200), "policy", seed=3) + "\n\n")
    if inbound:
        stable += openclaw_inbound_context() + "\n"
    stable += "## Workspace\nYour working directory is: /home/user/.openclaw/workspace\n"
    if not boundary:
        return stable
    per_turn = f"\n{date}\n" + (f"Current time: {time_line}\n" if time_line else "")
    return stable + OPENCLAW_BOUNDARY + per_turn


def openclaw_user(text: str, message_id: int, *, ts: str | None = None, sender: str = "Ann") -> str:
    ts = ts or time.strftime("%a %Y-%m-%d %H:%M:%S GMT+2", time.gmtime(1774860000 + message_id * 61))
    info = {"message_id": str(message_id), "reply_to_id": str(message_id - 1), "sender_id": "4242",
            "sender": sender, "timestamp": ts}
    sender_meta = {"label": f"{sender} (4242)", "id": "4242", "name": sender}
    return ("Conversation info (untrusted metadata):\n```json\n" + json.dumps(info, indent=2) + "\n```\n\n"
            "Sender (untrusted metadata):\n```json\n" + json.dumps(sender_meta, indent=2) + "\n```\n\n" + text)


def openclaw_subagent_report(task: str, runtime_s: int = 45) -> str:
    return (f"[System Message] A subagent task \"{task}\" just completed successfully.\n\n"
            "Result:\nFound 3 matching files and summarised them.\n\n"
            f"Stats: runtime {runtime_s}s • tokens 1.2k (in 1k / out 200)\n\n"
            "Summarize this naturally for the user.")


# Claude Code -----------------------------------------------------------------------------------
def claude_code_system(n_tokens: int = 800) -> str:
    cch = "%05x" % random.randint(0, 0xFFFFF)
    return (f"x-anthropic-billing-header: cc_version=2.1.37.abc; cc_entrypoint=cli; cch={cch};\n"
            "You are Claude Code, Anthropic's official CLI for Claude.\n" + filler_paragraphs(n_tokens, "cc", seed=5))


def claude_code_user(text: str) -> str:
    return (f"<system-reminder>\nCurrent time is {time.strftime('%Y-%m-%d %H:%M:%S')}\n</system-reminder>\n" + text)


# ----------------------------------------------------------------------------- output
def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return "" if v is None else str(v)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, markdown: bool = False,
                file: Any = None) -> None:
    file = file or sys.stdout
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells if i < len(r)]) for i, h in enumerate(headers)]
    if markdown:
        print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |", file=file)
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=file)
        for r in cells:
            print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |", file=file)
    else:
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths)), file=file)
        print("  ".join("-" * w for w in widths), file=file)
        for r in cells:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)), file=file)
    file.flush()


# ----------------------------------------------------------------------------- server processes
def blas_env() -> dict[str, str]:
    """LD_PRELOAD of OpenBLAS, as start_llm.py gives the MLX server (fair for both servers)."""
    try:
        sys.path.insert(0, str(REPO_ROOT))
        from mlxstack.config.settings import load_settings
        from mlxstack.engine.blas import blas_preload_env

        return blas_preload_env(load_settings(env={}))
    except Exception:  # noqa: BLE001 - best effort
        return {}


def embedded_model_path() -> Path:
    base = Path(setting("MODEL_CACHE_DIR", "") or Path.home() / ".cache" / "mlxstack").expanduser()
    return base / EMBEDDED_MODEL_DIR


class ServerProcess:
    """A server child process on a free port; ``stop()`` ends it (and only it) by pid."""

    def __init__(self, kind: str, *, port: int | None = None, env: dict | None = None, model_path: str | None = None,
                 python: str | None = None, log_path: str | None = None, extra_args: Sequence[str] = ()) -> None:
        self.kind = kind  # "ours" | "mlx_lm"
        self.port = port or free_port()
        python = python or sys.executable
        child_env = dict(os.environ)
        child_env.update(blas_env())
        if kind == "ours":
            child_env.update({"MLX_PORT": str(self.port), "MLX_HOST": "127.0.0.1"})
            cmd = [python, "-m", "mlxstack.serve"]
        elif kind == "mlx_lm":
            model_path = model_path or str(embedded_model_path())
            cmd = [python, "-m", "mlx_lm.server", "--model", model_path, "--port", str(self.port),
                   "--host", "127.0.0.1", *extra_args]
        else:
            raise ValueError(kind)
        child_env.update(env or {})
        self.cmd = cmd
        self.log_path = log_path or f"/tmp/probe-{kind}-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=child_env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.time() + timeout
        url = self.root + "/health"
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ProbeError(f"{self.kind} server exited with {self.proc.returncode}; log: {self.log_path}\n"
                                 + self.tail())
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    body = json.load(resp)
                if self.kind != "ours" or body.get("ready"):
                    self.warm_up(max(5.0, deadline - time.time()))
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.5)
        raise ProbeError(f"{self.kind} server not ready after {timeout:.0f}s; log: {self.log_path}\n" + self.tail())

    def warm_up(self, timeout: float) -> None:
        """One tiny request so model load / first-call compilation is not billed to the first turn."""
        body = {"model": "default_model" if self.kind == "mlx_lm" else self._model_id(),
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
        req = urllib.request.Request(self.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()

    def _model_id(self) -> str:
        with urllib.request.urlopen(self.base_url + "/models", timeout=10) as resp:
            data = json.load(resp).get("data") or [{}]
        return data[0].get("id", "default_model")

    def tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: only this child and its children
            except OSError:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ----------------------------------------------------------------------------- replays
@dataclass
class Turn:
    shape: str
    turn: int
    label: str
    prompt: int
    cached: int
    ttft_s: float
    total_s: float
    match: str = ""
    server_ttft_s: float | None = None
    finish: str | None = None
    session: str = ""

    @property
    def uncached(self) -> int:
        return max(0, self.prompt - self.cached)

    @property
    def reuse(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0

    @property
    def warm(self) -> bool:
        return self.turn >= 2


class Recorder:
    """Sends requests through a Client and keeps one ``Turn`` per request (stats row when available)."""

    def __init__(self, client: Client, *, max_tokens: int = 16, verbose: bool = False,
                 session_mode: str = "body") -> None:
        self.client = client
        self.max_tokens = max_tokens
        self.verbose = verbose
        self.session_mode = session_mode  # body | header | none
        self.turns: list[Turn] = []
        self._counts: dict[str, int] = {}

    def send(self, shape: str, label: str, messages: list[dict], *, tools: list | None = None,
             session: str | None = None, extra: dict | None = None, headers: dict | None = None,
             max_tokens: int | None = None, turn: int | None = None) -> ChatResult:
        before = self.client.recent_ids() if self.client._stats_ok is not False else None
        hdrs = dict(headers or {})
        sid = None
        if session and self.session_mode == "body":
            sid = session
        elif session and self.session_mode == "header":
            hdrs["x-session-affinity"] = session
        r = self.client.chat(messages, tools=tools, max_tokens=max_tokens or self.max_tokens, session_id=sid,
                             headers=hdrs, extra=extra)
        row = self.client.stats_row(r, before) if before is not None else None
        key = f"{shape}/{session or ''}"
        self._counts[key] = self._counts.get(key, 0) + 1
        t = Turn(shape, turn or self._counts[key], label, r.prompt_tokens, r.cached_tokens, r.ttft_s, r.total_s,
                 match=(row or {}).get("match_type", "") or ("hit" if r.cached_tokens else "miss"),
                 server_ttft_s=(row or {}).get("ttft_s"), finish=r.finish_reason, session=session or "")
        self.turns.append(t)
        if self.verbose:
            print(f"  [{shape}] turn {t.turn} {label:<22} prompt={t.prompt:5d} cached={t.cached:5d} "
                  f"uncached={t.uncached:5d} ttft={t.ttft_s:.3f}s match={t.match}", file=sys.stderr, flush=True)
        return r


def replay_pi(rec: Recorder, *, sys_tokens: int = 1200, tag: str = "", session: str | None = None,
              shape: str = "pi") -> list[Turn]:
    """PI-shaped session: developer prompt + tools, read/bash/edit tool loop, a retry of the same
    turn, then an edited last user message. History echoes the server's replies (reasoning stripped)
    plus harness-made tool calls (a tiny model makes none of its own)."""
    start = len(rec.turns)
    msgs: list[dict] = [{"role": "developer", "content": pi_system_prompt(sys_tokens, tag)},
                        {"role": "user", "content": "The parser test fails. Read src/parser.py, run the tests and fix it."}]
    r = rec.send(shape, "task", msgs, tools=PI_TOOLS, session=session)
    steps = [
        ("tool read_file", "read_file", {"path": "src/parser.py"}, fake_file("src/parser.py", 250)),
        ("tool bash pytest", "bash", {"command": "pytest -q tests/test_parser.py"}, fake_test_output(150)),
        ("tool edit", "edit", {"path": "src/parser.py", "old_text": "limit=2", "new_text": "limit=3"},
         "Applied 1 edit to src/parser.py"),
    ]
    for i, (label, name, args, result) in enumerate(steps, start=1):
        cid = f"call_{i}_{tag or 'x'}"
        msgs = msgs + [assistant_echo(r, tool_calls=[tool_call(cid, name, args)]), tool_result(cid, result)]
        r = rec.send(shape, label, msgs, tools=PI_TOOLS, session=session)
    r = rec.send(shape, "retry same turn", msgs, tools=PI_TOOLS, session=session)
    msgs = msgs + [assistant_echo(r), {"role": "user", "content": "Good. Now add a regression test for the parser."}]
    rec.send(shape, "next user turn", msgs, tools=PI_TOOLS, session=session)
    msgs = msgs[:-1] + [{"role": "user", "content": "Good. Now add a regression test for the parser and the lexer."}]
    rec.send(shape, "edited last user msg", msgs, tools=PI_TOOLS, session=session)
    return rec.turns[start:]


def replay_openclaw(rec: Recorder, *, sys_tokens: int = 1000, tag: str = "", session: str | None = None,
                    shape: str = "openclaw") -> list[Turn]:
    """OpenClaw-shaped session: boundary-split system prompt with inbound context, untrusted-metadata
    user prefixes with a new message_id/timestamp per message, a sub-agent report, more chat."""
    start = len(rec.turns)
    system = {"role": "system", "content": openclaw_system_prompt(sys_tokens, tag=tag)}
    msgs = [system, {"role": "user", "content": openclaw_user("Find my notes about the Lisbon trip.", 101)}]
    r = rec.send(shape, "user msg 101", msgs, session=session, extra={"reasoning_effort": "low"})
    msgs = msgs + [assistant_echo(r), {"role": "user", "content": openclaw_user("Also check the hotel booking.", 103)}]
    r = rec.send(shape, "user msg 103", msgs, session=session, extra={"reasoning_effort": "low"})
    msgs = msgs + [assistant_echo(r), {"role": "user", "content": openclaw_subagent_report("search notes for Lisbon")}]
    r = rec.send(shape, "sub-agent report", msgs, session=session, extra={"thinking": "low"})
    msgs = msgs + [assistant_echo(r), {"role": "user", "content": openclaw_user("Summarise it in two lines.", 107)}]
    rec.send(shape, "user msg 107", msgs, session=session, extra={"thinking": "low"})
    return rec.turns[start:]


def replay_many_sessions(rec: Recorder, *, n_sessions: int = 14, rounds: int = 2, sys_tokens: int = 400,
                         task_tokens: int = 200, tag: str = "", shape: str = "many-sessions") -> list[Turn]:
    """``n_sessions`` sub-agent sessions (shared agent prompt, own task + file each) advanced round-robin:
    more live sessions than mlx_lm.server's default 10 cache entries."""
    start = len(rec.turns)
    system = {"role": "system", "content": pi_system_prompt(sys_tokens, tag) + "\nYou are a sub-agent."}
    hist: dict[int, list[dict]] = {}
    last: dict[int, ChatResult] = {}
    for rnd in range(1, rounds + 1):
        for s in range(n_sessions):
            sid = f"{tag}-sub{s}"
            if rnd == 1:
                hist[s] = [system, {"role": "user", "content": f"Sub-task {s}: review this file.\n"
                                                               + fake_file(f"src/mod{s}.py", task_tokens, seed=s)}]
            else:
                hist[s] = hist[s] + [assistant_echo(last[s]), {"role": "user", "content": f"Continue sub-task {s}, step {rnd}."}]
            last[s] = rec.send(shape, f"session {s} round {rnd}", hist[s], session=sid, turn=rnd)
    return rec.turns[start:]


def simulate_stripped(text: str) -> str:
    """Client-side stripping: ``<think>`` blocks removed; a reply without one has its first
    sentence treated as the reasoning preamble and dropped (the tiny model emits no reasoning)."""
    if "<think>" in text or "</think>" in text:
        return strip_reasoning(text)
    m = re.search(r"[.!?:\n]\s+", text)
    return text[m.end():] if m and m.end() < len(text) else ""


def replay_stripped_reasoning(rec: Recorder, *, sys_tokens: int = 800, tag: str = "", session: str | None = None,
                              shape: str = "stripped-reasoning", turns: int = 3) -> list[Turn]:
    """Every assistant reply is echoed back with its reasoning stripped (see ``simulate_stripped``):
    the rendered history no longer equals the tokens the server generated."""
    start = len(rec.turns)
    msgs = [{"role": "system", "content": pi_system_prompt(sys_tokens, tag)},
            {"role": "user", "content": "Explain what the parser module does, briefly."}]
    r = rec.send(shape, "question", msgs, session=session, extra={"reasoning_effort": "high"})
    for i in range(2, turns + 1):
        echoed = {"role": "assistant", "content": simulate_stripped(r.text)}
        msgs = msgs + [echoed, {"role": "user", "content": f"Follow-up {i}: and what about edge case {i}?"}]
        r = rec.send(shape, f"follow-up {i} (stripped)", msgs, session=session, extra={"reasoning_effort": "high"})
    return rec.turns[start:]


TURN_HEADERS = ["turn", "label", "prompt", "cached", "uncached", "reuse", "ttft_s", "match"]


def turn_rows(turns: Sequence[Turn]) -> list[list[Any]]:
    return [[t.turn, t.label, t.prompt, t.cached, t.uncached, f"{t.reuse:.1%}", t.ttft_s, t.match] for t in turns]
