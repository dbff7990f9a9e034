"""Agent-client request shapes (PI, OpenClaw, Claude Code) and history helpers."""
from __future__ import annotations


import json
import random
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


REPO_ROOT = Path(__file__).resolve().parents[2]   # scripts/probelib/x.py -> the repository
DEFAULT_PROXY_URL = "http://127.0.0.1:4000/v1"
DEFAULT_MLX_URL = "http://127.0.0.1:8080"
EMBEDDED_MODEL_DIR = "SmolLM2-135M-Instruct-f32"

from .client import ChatResult

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


