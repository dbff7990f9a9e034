#!/usr/bin/env python3
"""NORMALIZE_WRITE_TOOL_CONTENT_FOR_PROMPT on a real client's session: Claude Code writes ten files.

The client is the real Claude Code (the npm package the real-clients tests install: its own system
prompt, its own tools, its own message shapes and cache marks); its model is a scripted Anthropic
endpoint in this file that answers every agent turn with one ``Write`` call -- the contents are ten
real modules of this repository -- and a short text once all are written (any other call, a title
or a side question, gets a one-line text). Every request Claude Code sends with its tools is
recorded; each is then converted as the server converts it (server/anthropic/messages.py
``to_chat_body``) and prepared by the real engine (heal -> normalise -> canonicalise -> one render
-> tokens) with the setting off and on, on the embedded model's tokenizer and template.

Printed per agent request: prompt tokens (what the model attends to and the KV holds) and the
tokens the request prefills when the previous request's prompt plus its reply are cached (the
healing store's job: the reply as the next request renders it) -- all of that while the previous
prompt is a prefix of this one, else up to where the two part.

    .venv/bin/python scripts/real_clients/write_session.py [--claude PATH] [--json] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.measure_write_content import FILES, print_rows  # noqa: E402  (the same ten files)
from scripts.real_clients.clients import Target, turn_command  # noqa: E402

CLAUDE = Path.home() / ".cache/mlxstack-clients/clients/node_modules/.bin/claude"
TASK = "Write the ten modules from the design notes into this folder, one file per step, with the Write tool."


# ---------------------------------------------------------------------------- the scripted model
def script_reply(body: dict, workdir: Path) -> list[dict]:
    """The content blocks the scripted model answers ``body`` with: the next Write while fewer than
    ten tool results are in the conversation, then a closing text; a call without the Write tool
    (a side request) gets one line."""
    tools = {t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
    if "Write" not in tools:
        return [{"type": "text", "text": "Writing modules."}]
    done = sum(1 for m in body.get("messages") or [] if m.get("role") == "user" and isinstance(m.get("content"), list)
               for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_result")
    if done >= len(FILES):
        return [{"type": "text", "text": "All ten modules are written."}]
    rel = FILES[done]
    return [{"type": "text", "text": f"Writing {Path(rel).name}."},
            {"type": "tool_use", "id": f"toolu_{done:02d}", "name": "Write",
             "input": {"file_path": str(workdir / Path(rel).name), "content": (REPO / rel).read_text()}}]


def sse_events(blocks: list[dict], model: str, message_id: str) -> list[tuple[str, dict]]:
    """The Messages API's stream for a reply of ``blocks`` (text and tool_use)."""
    stop = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"
    out = [("message_start", {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}})]
    for i, b in enumerate(blocks):
        if b["type"] == "text":
            out.append(("content_block_start", {"type": "content_block_start", "index": i,
                                                "content_block": {"type": "text", "text": ""}}))
            delta = {"type": "text_delta", "text": b["text"]}
        else:
            out.append(("content_block_start", {"type": "content_block_start", "index": i, "content_block": {
                "type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}}))
            delta = {"type": "input_json_delta", "partial_json": json.dumps(b["input"])}
        out.append(("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    out.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                  "usage": {"output_tokens": 10}}))
    out.append(("message_stop", {"type": "message_stop"}))
    return out


class ScriptedModel(ThreadingHTTPServer):
    """An Anthropic Messages endpoint answering by ``script_reply``; ``recorded``: every request
    body that carried the Write tool, in order."""

    daemon_threads = True

    def __init__(self, workdir: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.workdir = workdir
        self.recorded: list[dict] = []
        self.calls = 0
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: ScriptedModel

    def log_message(self, *_args: Any) -> None:
        pass

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        path = self.path.split("?")[0]
        if path.endswith("/count_tokens"):
            return self._json(200, {"input_tokens": 1000})
        if not path.endswith("/v1/messages"):
            return self._json(404, {"type": "error", "error": {"type": "not_found_error", "message": path}})
        with self.server.lock:
            self.server.calls += 1
            n = self.server.calls
            if any(t.get("name") == "Write" for t in body.get("tools") or [] if isinstance(t, dict)):
                self.server.recorded.append(body)
        blocks = script_reply(body, self.server.workdir)
        model = str(body.get("model") or "scripted")
        if not body.get("stream"):
            stop = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"
            return self._json(200, {"id": f"msg_{n}", "type": "message", "role": "assistant", "model": model,
                                    "content": blocks, "stop_reason": stop, "stop_sequence": None,
                                    "usage": {"input_tokens": 1, "output_tokens": 10}})
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for event, data in sse_events(blocks, model, f"msg_{n}"):
            self.wfile.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()


def record_session(claude: Path, work: Path) -> list[dict]:
    """Claude Code's agent requests of one ten-write session against the scripted model."""
    project, home = work / "project", work / "home"
    project.mkdir(parents=True)
    server = ScriptedModel(project)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t = Target(proxy_url=f"http://127.0.0.1:{server.server_address[1]}", api_key="sk-scripted",
                   model="claude-sonnet-4-5", context_window=200_000, max_output=32_000)
        spec = turn_command("claude", t, bin_dir=claude.parent, home=home, turn=1, prompt=TASK)
        for path, text in spec.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        argv = spec.argv + ["--allowedTools", "Write", "--permission-mode", "acceptEdits", "--max-turns", "14"]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC")}, **spec.env}
        done = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=600)
        written = sorted(p.name for p in project.iterdir())
        if done.returncode != 0 or len(written) != len(FILES):
            raise RuntimeError(f"claude exited {done.returncode} with {len(written)} files written: "
                               f"{done.stdout[-800:]} {done.stderr[-800:]}")
        return list(server.recorded)
    finally:
        server.shutdown()


# ---------------------------------------------------------------------------- the measurement
def measure(requests: list[dict]) -> dict:
    from mlxstack.server.anthropic.messages import to_chat_body
    from scripts.measure_write_content import load, prefill_rows, totals

    loaded, base = load()
    chats = [to_chat_body(body) for body in requests]
    rows = prefill_rows(loaded, base, [(c["messages"], c.get("tools")) for c in chats])
    for i, (row, chat) in enumerate(zip(rows, chats)):
        row.update({"request": i + 1, "messages": len(chat["messages"])})
    return {"client": "Claude Code", "requests": len(rows), "rows": rows, "total": totals(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--claude", default=str(CLAUDE), help="the Claude Code binary (default: the real-clients install)")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    ap.add_argument("--keep", help="also write the recorded request bodies here (requests.jsonl)")
    args = ap.parse_args()
    claude = Path(args.claude)
    if not claude.exists():
        raise SystemExit(f"no Claude Code at {claude}: run the real-clients tests once (-m real_clients) to install it")
    with tempfile.TemporaryDirectory(prefix="write-session-") as tmp:
        requests = record_session(claude, Path(tmp))
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        with open(Path(args.keep) / "requests.jsonl", "w") as f:
            for body in requests:
                f.write(json.dumps(body) + "\n")
    version = subprocess.run([str(claude), "--version"], capture_output=True, text=True).stdout.strip()
    result = measure(requests)
    result["client"] = f"Claude Code {version}"
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"client: {result['client']}, {result['requests']} agent requests")
    print_rows(result["rows"], ("request", "req"), ("messages", "msgs"))


if __name__ == "__main__":
    main()
