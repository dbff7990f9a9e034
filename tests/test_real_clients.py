"""The real agent clients (PI, Claude Code, OpenClaw, Codex) against the real stack.

The pure parts of scripts/real_clients (configs, argv, reply readers, stats rows) always run. The
end-to-end session is opt-in, ``-m real_clients`` (npm installs and ~2 minutes of CPU):

    .venv/bin/python -m mlxstack.launcher.test_runner tests/test_real_clients.py -m real_clients -q
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.real_clients.clients import (Target, claude_env, claude_reply, codex_config_toml, main_row, new_rows,
                                          openclaw_config, openclaw_reply, pi_models_json, pi_settings_json,
                                          turn_command)

REPO = Path(__file__).resolve().parents[1]
T = Target(proxy_url="http://127.0.0.1:4000", api_key="sk-test", model="tiny", context_window=8192, max_output=2048)


# ============================================================================ pure parts
def test_client_configs_carry_the_real_window():
    assert pi_models_json(T) == {"providers": {"mlxstack": {
        "baseUrl": "http://127.0.0.1:4000/v1", "api": "openai-completions", "apiKey": "MLXSTACK_API_KEY",
        "models": [{"id": "tiny", "reasoning": False, "contextWindow": 8192, "maxTokens": 2048}]}}}
    assert pi_settings_json(T) == {"compaction": {"enabled": True, "reserveTokens": 2048, "keepRecentTokens": 4096}}
    oc = openclaw_config(T)["models"]["providers"]["mlxstack"]
    assert (oc["baseUrl"], oc["api"], oc["models"][0]["contextWindow"], oc["models"][0]["maxTokens"]) == \
        ("http://127.0.0.1:4000/v1", "openai-completions", 8192, 2048)
    assert openclaw_config(T)["agents"]["defaults"]["model"]["primary"] == "mlxstack/tiny"
    assert codex_config_toml(T).splitlines() == [
        'model = "tiny"', 'model_provider = "mlxstack"', "model_context_window = 8192", "",
        "[model_providers.mlxstack]", 'name = "mlxstack"', 'base_url = "http://127.0.0.1:4000/v1"',
        'env_key = "MLXSTACK_API_KEY"', 'wire_api = "responses"']
    env = claude_env(T, thinking=False)
    assert (env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_AUTH_TOKEN"], env["ANTHROPIC_MODEL"]) == \
        ("http://127.0.0.1:4000", "sk-test", "tiny")
    assert (env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"], env["CLAUDE_CODE_DISABLE_THINKING"]) == ("8192", "1")
    assert "CLAUDE_CODE_DISABLE_THINKING" not in claude_env(T, thinking=True)


def test_turn_commands(tmp_path):
    bins, home = tmp_path / "bin", tmp_path / "home"
    pi1 = turn_command("pi", T, bin_dir=bins, home=home, turn=1, prompt="hi")
    assert pi1.argv == [str(bins / "pi"), "--offline", "--provider", "mlxstack", "--model", "tiny", "--session",
                        str(home / "session.jsonl"), "-p", "hi"]
    assert sorted(p.name for p in pi1.files) == ["models.json", "settings.json"]
    assert turn_command("claude", T, bin_dir=bins, home=home, turn=1, prompt="hi").argv == \
        [str(bins / "claude"), "-p", "hi", "--output-format", "json"]
    assert turn_command("claude", T, bin_dir=bins, home=home, turn=2, prompt="hi", claude_bare=True).argv == \
        [str(bins / "claude"), "-p", "--continue", "--bare", "hi", "--output-format", "json"]
    assert turn_command("openclaw", T, bin_dir=bins, home=home, turn=3, prompt="hi").argv == \
        [str(bins / "openclaw"), "agent", "--local", "--session-id", "mlxstack-real-clients", "--message", "hi", "--json"]
    c1 = turn_command("codex", T, bin_dir=bins, home=home, turn=1, prompt="hi")
    c2 = turn_command("codex", T, bin_dir=bins, home=home, turn=2, prompt="again")
    assert c1.argv == [str(bins / "codex"), "exec", "--skip-git-repo-check", "-o", str(home / "codex-reply-1.txt"), "hi"]
    assert c2.argv == [str(bins / "codex"), "exec", "resume", "--last", "--skip-git-repo-check", "-o",
                       str(home / "codex-reply-2.txt"), "again"]
    assert (c2.env["CODEX_HOME"], c2.env["MLXSTACK_API_KEY"], c2.env["HOME"]) == (str(home / ".codex"), "sk-test",
                                                                                  str(home))
    (home / "codex-reply-2.txt").parent.mkdir(parents=True)
    (home / "codex-reply-2.txt").write_text("answer\n")
    assert c2.read_reply("ignored stdout") == "answer"
    with pytest.raises(ValueError, match="unknown client"):
        turn_command("cursor", T, bin_dir=bins, home=home, turn=1, prompt="hi")


def test_reply_readers_skip_log_lines():
    assert claude_reply('warn: something {odd}\n{"type": "result", "result": "Hello!"}\n') == "Hello!"
    assert claude_reply("no json at all") == ""
    out = '[agent] log line\n{"payloads": [{"text": "Hi"}, {"text": " there"}], "meta": {}}'
    assert openclaw_reply(out) == "Hi there"


def test_stats_rows_of_one_turn():
    before = [{"request_id": "a", "prompt_tokens": 10}]
    after = before + [{"request_id": "b", "prompt_tokens": 900}, {"request_id": "c", "prompt_tokens": 30}]
    rows = new_rows(before, after)
    assert [r["request_id"] for r in rows] == ["b", "c"]
    assert main_row(rows)["request_id"] == "b" and main_row([]) is None


def test_warm_summary():
    from scripts.test_real_clients import warm_summary

    turns = [{"turn": 1, "prompt_tokens": 1000, "cached_tokens": 0, "uncached_tokens": 1000},
             {"turn": 2, "prompt_tokens": 1040, "cached_tokens": 1020, "uncached_tokens": 20},
             {"turn": 3, "prompt_tokens": None, "cached_tokens": None, "uncached_tokens": None}]
    assert warm_summary(turns) == {"warm_turns": [{"turn": 2, "prompt_tokens": 1040, "cached_tokens": 1020,
                                                   "uncached_tokens": 20, "grew_by": 40, "reuse": 0.9808}]}


# ============================================================================ opt-in: the real clients
def run_real_clients(tmp_path, embedded_model_path, args: list[str], **env) -> dict:
    """scripts/test_real_clients.py with ``args`` through a stack on the long-window model (``env``:
    more of its settings); the script's results (skips when npm's registry cannot be reached)."""
    from scripts.test_real_clients import npm_reachable

    reason = npm_reachable()
    if reason:
        pytest.skip(f"cannot install the real clients: {reason}")
    from scripts.real_clients.long_window_model import build_long_window_model
    from tests.test_e2e_stack import KEY, Stack

    stack = Stack(tmp_path, str(embedded_model_path.parent), MODEL_PATH=str(build_long_window_model()),
                  DEFAULT_THINKING="false", DEFAULT_MAX_TOKENS="2048", PROXY_STARTUP_TIMEOUT_SECONDS="300", **env)
    out = tmp_path / "results.json"
    try:
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "test_real_clients.py"), "--proxy-url", stack.base,
                               "--mlx-url", stack.mlx, "--api-key", KEY, *args, "--json", str(out)],
                              capture_output=True, text=True, timeout=840, cwd=REPO)
    finally:
        stack.stop()
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())["results"]


# ---------------------------------------------------------------------------- the scripted model (write_session)
def test_the_scripted_model_writes_each_file_once_then_closes(tmp_path):
    from scripts.real_clients.write_session import FILES, REPO as ROOT, script_reply

    tools = [{"name": "Read", "input_schema": {}}, {"name": "Write", "input_schema": {}}]
    first = script_reply({"tools": tools, "messages": [{"role": "user", "content": "go"}]}, tmp_path)
    assert [b["type"] for b in first] == ["text", "tool_use"] and first[1]["name"] == "Write"
    assert first[1]["input"] == {"file_path": str(tmp_path / "healing.py"), "content": (ROOT / FILES[0]).read_text()}
    results = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "ok"}]}
               for i in range(3)]
    assert script_reply({"tools": tools, "messages": results}, tmp_path)[1]["input"]["file_path"].endswith("sized_lru.py")
    done = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}] * len(FILES)
    assert script_reply({"tools": tools, "messages": done}, tmp_path) == [
        {"type": "text", "text": "All ten modules are written."}]
    assert script_reply({"tools": tools[:1], "messages": []}, tmp_path) == [{"type": "text", "text": "Writing modules."}]


def test_the_scripted_models_stream_reads_as_a_tool_call_with_the_official_sdk(tmp_path):
    """The endpoint's SSE, read by the official anthropic SDK: one text block, one Write call whose
    input is the whole file, stop reason tool_use -- so Claude Code (the same wire format) gets it."""
    import threading

    from anthropic import Anthropic

    from scripts.real_clients.write_session import FILES, REPO as ROOT, ScriptedModel

    server = ScriptedModel(tmp_path)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = Anthropic(base_url=f"http://127.0.0.1:{server.server_address[1]}", api_key="sk-scripted")
        with client.messages.stream(model="m", max_tokens=10, messages=[{"role": "user", "content": "go"}],
                                    tools=[{"name": "Write", "description": "w", "input_schema": {"type": "object"}}]) as s:
            msg = s.get_final_message()
        assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["text", "tool_use"]
        assert msg.content[1].input["content"] == (ROOT / FILES[0]).read_text()
        assert len(server.recorded) == 1 and server.recorded[0]["messages"][0]["content"] == "go"
    finally:
        server.shutdown()


@pytest.mark.e2e
@pytest.mark.real_clients
def test_four_real_clients_complete_three_turn_sessions_with_warm_reuse(request, tmp_path, embedded_model_path):
    if "real_clients" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in: installs the real clients from npm and runs them for minutes; "
                    "run with -m real_clients")
    results = run_real_clients(tmp_path, embedded_model_path, [])
    assert sorted(results) == ["claude", "codex", "openclaw", "pi"]
    for client, res in results.items():
        assert [t["rc"] for t in res["turns"]] == [0, 0, 0], client
        assert all(t["reply"] for t in res["turns"]), client
        assert len(res["warm_turns"]) == 2, client
        for warm in res["warm_turns"]:
            # warm turns prefill only what changed: the client's new turn and the echoed reply
            # (OpenClaw also moves its ~90-token inbound-context block behind the new turn)
            assert warm["uncached_tokens"] <= warm["grew_by"] + 150, (client, warm)
            assert warm["reuse"] >= 0.95, (client, warm)


def test_cache_problems_from_the_request_log():
    from scripts.test_real_clients import cache_problems

    def turn(n, prompt, read, written, usage=None):
        return {"turn": n, "requests": 1, "client_usage": usage,
                "log": {"prompt_tokens": prompt, "cache_read": read, "cache_creation": written}}

    good = [turn(1, 1000, 0, 1000, {"cache_read_input_tokens": 0, "cache_creation_input_tokens": 990,
                                    "input_tokens": 10}),
            turn(2, 1040, 1020, 20), turn(3, 1100, 1040, 60)]
    assert cache_problems(good) == []
    bad = [turn(1, 1000, 0, 999, {"cache_read_input_tokens": 0, "cache_creation_input_tokens": 1000, "input_tokens": 0}),
           turn(2, 1040, 900, 140), {"turn": 3, "requests": 1, "log": None}]
    assert cache_problems(bad) == [
        "turns without a request-log record: [3]",
        "turn 1: creation 999 != prompt 1000 - read 0",
        "turn 1: the client was told read 0, creation + input 1000; the log says 0, 999",
        "turn 2: read 900 < the previous turn's prompt 1000"]


@pytest.mark.e2e
@pytest.mark.real_clients
def test_claude_code_and_codex_cache_figures_turn_by_turn(request, tmp_path, embedded_model_path):
    """Claude Code (Anthropic Messages) and Codex (Responses), 3 turns each through LiteLLM: each
    turn's agent request in the MLX server's request log reads at least the whole previous prompt
    and stores the rest; Claude Code's own JSON result reports the same read and creation + input."""
    if "real_clients" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in: installs the real clients from npm and runs them; run with -m real_clients")
    # no disk tier: the first turn starts cold, whatever an earlier run of the clients stored
    results = run_real_clients(tmp_path, embedded_model_path,
                               ["--clients", "claude,codex", "--log-root", str(tmp_path / "logs")], DISK_CACHE_DIR="off")
    assert sorted(results) == ["claude", "codex"]
    for client, api in (("claude", "messages"), ("codex", "responses")):
        turns = results[client]["turns"]
        assert results[client]["cache_problems"] == [], client
        logs = [t["log"] for t in turns]
        assert [lg["api"] for lg in logs] == [api] * 3
        assert len({lg["session"] for lg in logs}) == 1, client          # one session, turn after turn
        assert (logs[0]["cache_read"], logs[0]["cache_creation"]) == (0, logs[0]["prompt_tokens"])
        for prev, cur in zip(logs, logs[1:]):
            assert prev["prompt_tokens"] <= cur["cache_read"] < cur["prompt_tokens"], (client, cur)
            assert cur["cache_creation"] == cur["prompt_tokens"] - cur["cache_read"], (client, cur)
            assert cur["cache_tier"] == "ram"
    assert all(t["client_usage"] is not None for t in results["claude"]["turns"])
