"""The real agent clients: how each is driven for one turn (pure parts first).

Each client gets its own HOME (config isolation) and working folder. The config builders are the
product's (mlxstack/launcher/clients.py: what ``mlxstack launch`` writes and passes);
``turn_command`` returns the argv, env and reply reader of one non-interactive turn, so the driver
(scripts/test_real_clients.py) only runs processes.

| client | turn 1 | later turns | reply |
|---|---|---|---|
| PI | ``pi -p --session FILE PROMPT`` | same session file | stdout |
| Claude Code | ``claude -p PROMPT --output-format json`` | ``--continue`` | JSON ``result`` |
| OpenClaw | ``openclaw agent --local --session-id ID --message PROMPT --json`` | same id | ``payloads[].text`` |
| Codex | ``codex exec --skip-git-repo-check -o FILE PROMPT`` | ``codex exec resume --last ...`` | the -o file |
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# the clients' configuration is the product's (mlxstack launch): one copy
from mlxstack.launcher.clients import (BINARIES, KEY_ENV, PACKAGES, PROVIDER, Target, claude_env,  # noqa: E402
                                       codex_config_toml, openclaw_config, pi_models_json, pi_settings_json)

CLIENTS = ("pi", "claude", "openclaw", "codex")     # the ones driven for several turns here
SESSION_ID = "mlxstack-real-clients"


@dataclass
class TurnSpec:
    argv: list[str]
    env: dict[str, str]
    read_reply: Callable[[str], str]          # stdout -> reply text
    files: dict[Path, str] = field(default_factory=dict)   # written before the turn


# ---------------------------------------------------------------------------- reply readers (pure)
def claude_reply(stdout: str) -> str:
    data = _last_json_object(stdout)
    return str(data.get("result", "")) if isinstance(data, dict) else ""


def openclaw_reply(stdout: str) -> str:
    data = _last_json_object(stdout)
    if not isinstance(data, dict):
        return ""
    return "".join(str(p.get("text") or "") for p in data.get("payloads") or [] if isinstance(p, dict))


def _last_json_object(stdout: str) -> object:
    """The JSON object a client printed last (clients print log lines before it)."""
    start = stdout.find("{")
    while start >= 0:
        try:
            return json.loads(stdout[start:])
        except ValueError:
            start = stdout.find("\n{", start + 1)
            start = start + 1 if start >= 0 else -1
    return None


# ---------------------------------------------------------------------------- one turn
def turn_command(client: str, t: Target, *, bin_dir: Path, home: Path, turn: int, prompt: str,
                 claude_bare: bool = False, claude_thinking: bool = False) -> TurnSpec:
    """argv / env / reply reader for turn ``turn`` (1-based) of ``client``, HOME=``home``."""
    if client not in BINARIES:
        raise ValueError(f"unknown client {client!r}; choose from {', '.join(CLIENTS)}")
    exe = str(bin_dir / BINARIES[client])
    env = {"HOME": str(home), "NO_COLOR": "1"}
    if client == "pi":
        files = {home / ".pi/agent/models.json": json.dumps(pi_models_json(t), indent=2),
                 home / ".pi/agent/settings.json": json.dumps(pi_settings_json(t), indent=2)}
        argv = [exe, "--offline", "--provider", PROVIDER, "--model", t.model, "--session", str(home / "session.jsonl"),
                "-p", prompt]
        return TurnSpec(argv, {**env, KEY_ENV: t.api_key}, lambda out: out.strip(), files)
    if client == "claude":
        argv = [exe, "-p", *(["--continue"] if turn > 1 else []), *(["--bare"] if claude_bare else []),
                prompt, "--output-format", "json"]
        return TurnSpec(argv, {**env, **claude_env(t, claude_thinking)}, claude_reply)
    if client == "openclaw":
        files = {home / ".openclaw/openclaw.json": json.dumps(openclaw_config(t), indent=2)}
        argv = [exe, "agent", "--local", "--session-id", SESSION_ID, "--message", prompt, "--json"]
        return TurnSpec(argv, env, openclaw_reply, files)
    if client == "codex":
        reply_file = home / f"codex-reply-{turn}.txt"
        files = {home / ".codex/config.toml": codex_config_toml(t)}
        opts = ["--skip-git-repo-check", "-o", str(reply_file), prompt]
        argv = [exe, "exec", *(["resume", "--last"] if turn > 1 else []), *opts]
        env = {**env, "CODEX_HOME": str(home / ".codex"), KEY_ENV: t.api_key}

        def read(_out: str, path: Path = reply_file) -> str:
            return path.read_text().strip() if path.exists() else ""
        return TurnSpec(argv, env, read, files)
    raise AssertionError(f"bug: no turn command for client {client!r}")


# ---------------------------------------------------------------------------- MLX stats rows (pure)
def new_rows(before: list[dict], after: list[dict]) -> list[dict]:
    """The /v1/cache/stats ``recent`` rows that appeared between two snapshots, oldest first."""
    seen = {r.get("request_id") for r in before}
    return [r for r in after if r.get("request_id") not in seen]


def main_row(rows: list[dict]) -> dict | None:
    """The turn's agent request: the one with the largest prompt (side calls such as title
    generation are small)."""
    return max(rows, key=lambda r: r.get("prompt_tokens", 0)) if rows else None


__all__ = ["BINARIES", "CLIENTS", "PACKAGES", "Target", "TurnSpec", "claude_env", "claude_reply", "codex_config_toml",
           "main_row", "new_rows", "openclaw_config", "openclaw_reply", "pi_models_json", "pi_settings_json",
           "turn_command"]
