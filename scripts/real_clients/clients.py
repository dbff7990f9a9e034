"""The four real agent clients: how each is configured and driven for one turn (pure parts first).

Each client gets its own HOME (config isolation) and working folder. Config builders are pure and
unit-tested (tests/test_real_clients.py); ``turn_command`` returns the argv, env and reply reader
of one non-interactive turn, so the driver (scripts/test_real_clients.py) only runs processes.

| client | turn 1 | later turns | reply |
|---|---|---|---|
| PI | ``pi -p --session FILE PROMPT`` | same session file | stdout |
| Claude Code | ``claude -p PROMPT --output-format json`` | ``--continue`` | JSON ``result`` |
| OpenClaw | ``openclaw agent --local --session-id ID --message PROMPT --json`` | same id | ``payloads[].text`` |
| Codex | ``codex exec --skip-git-repo-check -o FILE PROMPT`` | ``codex exec resume --last ...`` | the -o file |
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

CLIENTS = ("pi", "claude", "openclaw", "codex")
PACKAGES = {"pi": "@mariozechner/pi-coding-agent", "claude": "@anthropic-ai/claude-code",
            "openclaw": "openclaw", "codex": "@openai/codex"}
BINARIES = {"pi": "pi", "claude": "claude", "openclaw": "openclaw", "codex": "codex"}
PROVIDER = "mlxstack"
SESSION_ID = "mlxstack-real-clients"


@dataclass(frozen=True)
class Target:
    """Where the clients point: the LiteLLM proxy, its key, the model name and its window."""
    proxy_url: str            # e.g. http://127.0.0.1:4000 (no /v1)
    api_key: str
    model: str
    context_window: int
    max_output: int           # output budget the clients reserve (DEFAULT_MAX_TOKENS, capped by the window)


@dataclass
class TurnSpec:
    argv: list[str]
    env: dict[str, str]
    read_reply: Callable[[str], str]          # stdout -> reply text
    files: dict[Path, str] = field(default_factory=dict)   # written before the turn


# ---------------------------------------------------------------------------- config builders (pure)
def pi_models_json(t: Target) -> dict:
    """~/.pi/agent/models.json: the proxy as an OpenAI-compatible provider."""
    return {"providers": {PROVIDER: {
        "baseUrl": f"{t.proxy_url}/v1", "api": "openai-completions", "apiKey": t.api_key,
        "models": [{"id": t.model, "reasoning": False, "contextWindow": t.context_window,
                    "maxTokens": t.max_output}]}}}


def pi_settings_json(t: Target) -> dict:
    """~/.pi/agent/settings.json: PI reserves 16384 tokens for the reply by default and compacts
    when ``context > window - reserve``, i.e. always on an 8k window; reserve the output budget."""
    return {"compaction": {"enabled": True, "reserveTokens": t.max_output,
                           "keepRecentTokens": max(1024, t.context_window // 2)}}


def openclaw_config(t: Target) -> dict:
    """~/.openclaw/openclaw.json: a custom provider with the real window (no guessing)."""
    return {"models": {"mode": "merge", "providers": {PROVIDER: {
                "baseUrl": f"{t.proxy_url}/v1", "apiKey": t.api_key, "api": "openai-completions",
                "models": [{"id": t.model, "name": t.model, "reasoning": False, "input": ["text"],
                            "contextWindow": t.context_window, "maxTokens": t.max_output}]}}},
            "agents": {"defaults": {"model": {"primary": f"{PROVIDER}/{t.model}"}}}}


def codex_config_toml(t: Target) -> str:
    """~/.codex/config.toml: Codex 0.169 speaks only the Responses API (wire_api = "responses")."""
    return "\n".join([
        f'model = "{t.model}"',
        f'model_provider = "{PROVIDER}"',
        f"model_context_window = {t.context_window}",
        "",
        f"[model_providers.{PROVIDER}]",
        f'name = "{PROVIDER}"',
        f'base_url = "{t.proxy_url}/v1"',
        'env_key = "MLXSTACK_API_KEY"',
        'wire_api = "responses"',
        "",
    ])


def claude_env(t: Target, thinking: bool) -> dict[str, str]:
    """Claude Code through LiteLLM's /v1/messages (passed through to the MLX server)."""
    env = {"ANTHROPIC_BASE_URL": t.proxy_url, "ANTHROPIC_AUTH_TOKEN": t.api_key,
           "ANTHROPIC_MODEL": t.model, "ANTHROPIC_SMALL_FAST_MODEL": t.model,
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model, "ANTHROPIC_DEFAULT_SONNET_MODEL": t.model,
           "ANTHROPIC_DEFAULT_OPUS_MODEL": t.model,
           # an unknown model is assumed to have a 1M window; this caps it at the real one
           "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(t.context_window),
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(t.max_output),
           "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    if not thinking:
        env["CLAUDE_CODE_DISABLE_THINKING"] = "1"
    return env


def claude_settings_json() -> dict:
    """~/.claude/settings.json: no per-request billing line (it would change the prompt every turn;
    the server strips it anyway, STRIP_BILLING_HEADER)."""
    return {"env": {"CLAUDE_CODE_ATTRIBUTION_HEADER": "0"}}


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
        return TurnSpec(argv, env, lambda out: out.strip(), files)
    if client == "claude":
        files = {home / ".claude/settings.json": json.dumps(claude_settings_json(), indent=2)}
        argv = [exe, "-p", *(["--continue"] if turn > 1 else []), *(["--bare"] if claude_bare else []),
                prompt, "--output-format", "json"]
        return TurnSpec(argv, {**env, **claude_env(t, claude_thinking)}, claude_reply, files)
    if client == "openclaw":
        files = {home / ".openclaw/openclaw.json": json.dumps(openclaw_config(t), indent=2)}
        argv = [exe, "agent", "--local", "--session-id", SESSION_ID, "--message", prompt, "--json"]
        return TurnSpec(argv, env, openclaw_reply, files)
    if client == "codex":
        reply_file = home / f"codex-reply-{turn}.txt"
        files = {home / ".codex/config.toml": codex_config_toml(t)}
        opts = ["--skip-git-repo-check", "-o", str(reply_file), prompt]
        argv = [exe, "exec", *(["resume", "--last"] if turn > 1 else []), *opts]
        env = {**env, "CODEX_HOME": str(home / ".codex"), "MLXSTACK_API_KEY": t.api_key}

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


__all__ = ["CLIENTS", "PACKAGES", "Target", "TurnSpec", "claude_env", "claude_reply", "codex_config_toml",
           "main_row", "new_rows", "openclaw_config", "openclaw_reply", "pi_models_json", "pi_settings_json",
           "turn_command"]
