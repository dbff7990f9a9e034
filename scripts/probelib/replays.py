"""Recorded-shape replays: each request becomes a Turn (prompt, cached, TTFT, match type)."""
from __future__ import annotations


import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


REPO_ROOT = Path(__file__).resolve().parents[2]   # scripts/probelib/x.py -> the repository
DEFAULT_PROXY_URL = "http://127.0.0.1:4000/v1"
DEFAULT_MLX_URL = "http://127.0.0.1:8080"
EMBEDDED_MODEL_DIR = "SmolLM2-135M-Instruct-f32"

from .client import ChatResult, Client
from .shapes import (PI_TOOLS, assistant_echo, fake_file, fake_test_output, openclaw_subagent_report,
                     openclaw_system_prompt, openclaw_user, pi_system_prompt, strip_reasoning, tool_call, tool_result)

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
