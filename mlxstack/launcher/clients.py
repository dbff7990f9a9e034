"""The agent clients ``mlxstack launch`` points at the stack, and how each is configured (pure).

Every builder takes a :class:`Target` (the proxy, its key, the model and its window) and returns
the client's own configuration as data -- its documented files and variables. Nothing here reads
or writes a file: ``launch.py`` merges these into the user's files (after a backup) and execs the
client; ``scripts/real_clients`` drives the same clients for one turn in the tests.

| client | configured by | key |
|---|---|---|
| Claude Code | environment: ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_AUTH_TOKEN``, the model names, the window | ``ANTHROPIC_AUTH_TOKEN`` |
| Codex | ``-c`` overrides: a ``model_providers.mlxstack`` table, the model and its window | ``env_key`` names ``MLXSTACK_API_KEY`` |
| OpenCode | ``OPENCODE_CONFIG_CONTENT``: an ``@ai-sdk/openai-compatible`` provider | ``{env:MLXSTACK_API_KEY}`` |
| PI | ``~/.pi/agent/models.json`` (+ ``settings.json`` compaction on a small window); ``--provider --model`` | ``apiKey`` names ``MLXSTACK_API_KEY`` |
| OpenClaw | ``~/.openclaw/openclaw.json``: a provider and the primary model | the key itself (the file is 0600) |
"""
from __future__ import annotations

import json
from dataclasses import dataclass

CLIENTS = ("claude", "codex", "opencode", "openclaw", "pi")
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex", "opencode": "opencode-ai",
            "openclaw": "openclaw", "pi": "@mariozechner/pi-coding-agent"}
BINARIES = {"claude": "claude", "codex": "codex", "opencode": "opencode", "openclaw": "openclaw", "pi": "pi"}
PROVIDER = "mlxstack"
KEY_ENV = "MLXSTACK_API_KEY"
# The smallest window each client's own prompt (system prompt and tools) plus a reply fits in.
MIN_WINDOW = {"claude": 16384, "codex": 12288, "opencode": 12288, "openclaw": 20480, "pi": 4096}
PI_DEFAULT_RESERVE = 16384        # PI reserves this many tokens for the reply unless settings.json says less


@dataclass(frozen=True)
class Target:
    """Where the clients point: the LiteLLM proxy, its key, the model name and its window."""
    proxy_url: str            # e.g. http://127.0.0.1:4000 (no /v1)
    api_key: str
    model: str
    context_window: int
    max_output: int           # output budget the clients reserve (DEFAULT_MAX_TOKENS, capped by the window)


# ---------------------------------------------------------------------------- PI
def pi_provider(t: Target) -> dict:
    """The ``mlxstack`` entry of PI's models.json ``providers``: the proxy as an OpenAI-compatible
    provider; ``apiKey`` names the variable holding the key (PI resolves a variable name)."""
    return {"baseUrl": f"{t.proxy_url}/v1", "api": "openai-completions", "apiKey": KEY_ENV,
            "models": [{"id": t.model, "reasoning": False, "contextWindow": t.context_window,
                        "maxTokens": t.max_output}]}


def pi_models_json(t: Target, existing: dict | None = None) -> dict:
    """~/.pi/agent/models.json: ``existing`` with the ``mlxstack`` provider added (or replaced)."""
    out = dict(existing or {})
    out["providers"] = {**(out.get("providers") or {}), PROVIDER: pi_provider(t)}
    return out


def pi_needs_compaction_settings(t: Target) -> bool:
    """PI compacts when ``context > window - reserve``; its default reserve leaves less than half
    of a small window for the conversation, so such a window needs a smaller reserve."""
    return t.context_window - PI_DEFAULT_RESERVE < t.context_window // 2


def pi_settings_json(t: Target, existing: dict | None = None) -> dict:
    """~/.pi/agent/settings.json: ``existing`` with a compaction reserve of the output budget."""
    out = dict(existing or {})
    out["compaction"] = {**(out.get("compaction") or {}), "enabled": True, "reserveTokens": t.max_output,
                         "keepRecentTokens": max(1024, t.context_window // 2)}
    return out


def pi_args(t: Target) -> list[str]:
    return ["--provider", PROVIDER, "--model", t.model]


# ---------------------------------------------------------------------------- OpenClaw
def openclaw_provider(t: Target) -> dict:
    return {"baseUrl": f"{t.proxy_url}/v1", "apiKey": t.api_key, "api": "openai-completions",
            "models": [{"id": t.model, "name": t.model, "reasoning": False, "input": ["text"],
                        "contextWindow": t.context_window, "maxTokens": t.max_output}]}


def openclaw_config(t: Target, existing: dict | None = None) -> dict:
    """~/.openclaw/openclaw.json: ``existing`` with the ``mlxstack`` provider (the real window, no
    guessing) and ``mlxstack/<model>`` as the primary model; the rest of it kept."""
    out = dict(existing or {})
    models = dict(out.get("models") or {})
    models.setdefault("mode", "merge")
    models["providers"] = {**(models.get("providers") or {}), PROVIDER: openclaw_provider(t)}
    agents = dict(out.get("agents") or {})
    defaults = dict(agents.get("defaults") or {})
    defaults["model"] = {**(defaults.get("model") or {}), "primary": f"{PROVIDER}/{t.model}"}
    agents["defaults"] = defaults
    out["models"], out["agents"] = models, agents
    return out


# ---------------------------------------------------------------------------- Codex
def codex_settings(t: Target) -> list[tuple[str, str]]:
    """(dotted key, TOML value) pairs: the ``mlxstack`` provider on the Responses API (the only
    one Codex speaks), the model and its window; the key stays in ``env_key``'s variable."""
    provider = f"model_providers.{PROVIDER}"
    return [("model", json.dumps(t.model)), ("model_provider", json.dumps(PROVIDER)),
            ("model_context_window", str(t.context_window)),
            (f"{provider}.name", json.dumps(PROVIDER)), (f"{provider}.base_url", json.dumps(f"{t.proxy_url}/v1")),
            (f"{provider}.env_key", json.dumps(KEY_ENV)), (f"{provider}.wire_api", json.dumps("responses"))]


def codex_args(t: Target) -> list[str]:
    """Codex's ``-c key=value`` overrides for the settings above (nothing written to config.toml)."""
    return [arg for key, value in codex_settings(t) for arg in ("-c", f"{key}={value}")]


def codex_config_toml(t: Target) -> str:
    """The same settings as a ``config.toml`` of their own (a CODEX_HOME of the tests)."""
    top = [f"{k} = {v}" for k, v in codex_settings(t) if "." not in k]
    table = [f"{k.rsplit('.', 1)[1]} = {v}" for k, v in codex_settings(t) if "." in k]
    return "\n".join([*top, "", f"[model_providers.{PROVIDER}]", *table, ""])


# ---------------------------------------------------------------------------- OpenCode
def opencode_config(t: Target) -> dict:
    """OpenCode's config (``OPENCODE_CONFIG_CONTENT``, merged over the user's own): the proxy as an
    ``@ai-sdk/openai-compatible`` provider with the real window, as the model and the small model."""
    model = f"{PROVIDER}/{t.model}"
    return {"$schema": "https://opencode.ai/config.json",
            "provider": {PROVIDER: {"npm": "@ai-sdk/openai-compatible", "name": PROVIDER,
                                    "options": {"baseURL": f"{t.proxy_url}/v1", "apiKey": f"{{env:{KEY_ENV}}}"},
                                    "models": {t.model: {"name": t.model, "limit": {"context": t.context_window,
                                                                                     "output": t.max_output}}}}},
            "model": model, "small_model": model}


# ---------------------------------------------------------------------------- Claude Code
def claude_env(t: Target, thinking: bool) -> dict[str, str]:
    """Claude Code through LiteLLM's /v1/messages (passed through to the MLX server)."""
    env = {"ANTHROPIC_BASE_URL": t.proxy_url, "ANTHROPIC_AUTH_TOKEN": t.api_key,
           "ANTHROPIC_MODEL": t.model, "ANTHROPIC_SMALL_FAST_MODEL": t.model,
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model, "ANTHROPIC_DEFAULT_SONNET_MODEL": t.model,
           "ANTHROPIC_DEFAULT_OPUS_MODEL": t.model,
           # an unknown model is assumed to have a 1M window; this caps it at the real one
           "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(t.context_window),
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(t.max_output),
           # no per-request billing line: it would change the prompt on every turn
           "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
           "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    if not thinking:
        env["CLAUDE_CODE_DISABLE_THINKING"] = "1"
    return env


# ---------------------------------------------------------------------------- per client
def client_env(client: str, t: Target, thinking: bool) -> dict[str, str]:
    """The variables ``client`` is started with (the key only ever travels here)."""
    if client == "claude":
        return claude_env(t, thinking)
    if client == "opencode":
        return {KEY_ENV: t.api_key, "OPENCODE_CONFIG_CONTENT": json.dumps(opencode_config(t))}
    if client in ("codex", "pi"):
        return {KEY_ENV: t.api_key}
    if client == "openclaw":
        return {}
    raise ValueError(f"unknown client {client!r}; choose from {', '.join(CLIENTS)}")


def client_args(client: str, t: Target) -> list[str]:
    """Arguments put before the user's own (none of them secret)."""
    return {"codex": codex_args, "pi": pi_args}.get(client, lambda _t: [])(t)


__all__ = ["BINARIES", "CLIENTS", "KEY_ENV", "MIN_WINDOW", "PACKAGES", "PROVIDER", "Target", "claude_env",
           "client_args", "client_env", "codex_args", "codex_config_toml", "codex_settings", "openclaw_config",
           "opencode_config", "pi_args", "pi_models_json", "pi_needs_compaction_settings", "pi_settings_json"]
