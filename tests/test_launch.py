"""``mlxstack launch`` (mlxstack/launcher/launch.py, clients.py): each client's variables, arguments
and files exactly; backups byte-identical and merges that keep the user's entries; the key masked
in ``--config``; the missing-binary message; the model from a /v1/models payload; the stack found,
or started and awaited (a stand-in start_llm.py serving /v1/models over real HTTP).

Opt-in, ``-m real_clients``: the real npm clients (scripts/test_real_clients.py's install), each
run through ``mlxstack launch CLIENT -- <one turn>`` with an isolated HOME and no client variable
set, the first launch starting a real stack (the long-window model) on ports 46xx / 86xx:

    .venv/bin/python -m mlxstack.launcher.test_runner tests/test_launch.py -m real_clients -q -s
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mlxstack.launcher import clients as cl
from mlxstack.launcher import launch

REPO = Path(__file__).resolve().parents[1]
T = cl.Target(proxy_url="http://127.0.0.1:4000", api_key="sk-launch-secret-0123456789", model="tiny",
              context_window=8192, max_output=2048)
BIG = cl.Target(proxy_url="http://127.0.0.1:4000", api_key="sk-launch-secret-0123456789", model="tiny",
                context_window=131072, max_output=2048)
# what the stack's proxy answers on /v1/models (LiteLLM with the model_info the launcher writes)
MODELS = [{"id": "openai/tiny-long-window", "object": "model", "owned_by": "openai", "max_input_tokens": 131072,
           "max_output_tokens": 2048},
          {"id": "tiny-long-window", "object": "model", "owned_by": "openai", "max_input_tokens": 131072,
           "max_output_tokens": 2048}]


# ============================================================================ each client (pure)
def test_claude_is_configured_by_its_environment_only(tmp_path):
    plan = launch.plan_launch("claude", T, environ={}, home=tmp_path, user_args=["-p", "hi"], thinking=False)
    assert plan.env == {
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:4000", "ANTHROPIC_AUTH_TOKEN": "sk-launch-secret-0123456789",
        "ANTHROPIC_MODEL": "tiny", "ANTHROPIC_SMALL_FAST_MODEL": "tiny", "ANTHROPIC_DEFAULT_HAIKU_MODEL": "tiny",
        "ANTHROPIC_DEFAULT_SONNET_MODEL": "tiny", "ANTHROPIC_DEFAULT_OPUS_MODEL": "tiny",
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": "8192", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "2048",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0", "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_DISABLE_THINKING": "1"}
    assert (plan.binary, plan.args, plan.files) == ("claude", ["-p", "hi"], [])
    assert "CLAUDE_CODE_DISABLE_THINKING" not in cl.client_env("claude", T, thinking=True)


def test_codex_gets_overrides_on_its_command_line_and_the_key_in_its_env_key(tmp_path):
    plan = launch.plan_launch("codex", T, environ={}, home=tmp_path, user_args=["exec", "hi"], thinking=False)
    assert plan.args == ["-c", 'model="tiny"', "-c", 'model_provider="mlxstack"', "-c", "model_context_window=8192",
                         "-c", 'model_providers.mlxstack.name="mlxstack"',
                         "-c", 'model_providers.mlxstack.base_url="http://127.0.0.1:4000/v1"',
                         "-c", 'model_providers.mlxstack.env_key="MLXSTACK_API_KEY"',
                         "-c", 'model_providers.mlxstack.wire_api="responses"', "exec", "hi"]
    assert plan.env == {"MLXSTACK_API_KEY": "sk-launch-secret-0123456789"} and plan.files == []
    assert T.api_key not in " ".join(plan.args)
    import tomllib
    assert tomllib.loads(cl.codex_config_toml(T)) == {
        "model": "tiny", "model_provider": "mlxstack", "model_context_window": 8192,
        "model_providers": {"mlxstack": {"name": "mlxstack", "base_url": "http://127.0.0.1:4000/v1",
                                         "env_key": "MLXSTACK_API_KEY", "wire_api": "responses"}}}


def test_opencode_gets_its_inline_config_naming_the_key_variable(tmp_path):
    plan = launch.plan_launch("opencode", T, environ={}, home=tmp_path, user_args=["run", "hi"], thinking=False)
    assert set(plan.env) == {"MLXSTACK_API_KEY", "OPENCODE_CONFIG_CONTENT"} and plan.files == []
    assert plan.env["MLXSTACK_API_KEY"] == T.api_key and plan.args == ["run", "hi"]
    assert json.loads(plan.env["OPENCODE_CONFIG_CONTENT"]) == {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"mlxstack": {"npm": "@ai-sdk/openai-compatible", "name": "mlxstack",
                                  "options": {"baseURL": "http://127.0.0.1:4000/v1", "apiKey": "{env:MLXSTACK_API_KEY}"},
                                  "models": {"tiny": {"name": "tiny", "limit": {"context": 8192, "output": 2048}}}}},
        "model": "mlxstack/tiny", "small_model": "mlxstack/tiny"}
    assert T.api_key not in plan.env["OPENCODE_CONFIG_CONTENT"]


def test_pi_gets_its_provider_in_models_json_and_a_reserve_only_on_a_small_window(tmp_path):
    plan = launch.plan_launch("pi", T, environ={}, home=tmp_path, user_args=["-p", "hi"], thinking=False)
    assert plan.args == ["--provider", "mlxstack", "--model", "tiny", "-p", "hi"]
    assert plan.env == {"MLXSTACK_API_KEY": "sk-launch-secret-0123456789"}
    agent = tmp_path / ".pi" / "agent"
    assert [(f.path, json.loads(f.text), f.old) for f in plan.files] == [
        (agent / "models.json", {"providers": {"mlxstack": {
            "baseUrl": "http://127.0.0.1:4000/v1", "api": "openai-completions", "apiKey": "MLXSTACK_API_KEY",
            "models": [{"id": "tiny", "reasoning": False, "contextWindow": 8192, "maxTokens": 2048}]}}}, None),
        (agent / "settings.json", {"compaction": {"enabled": True, "reserveTokens": 2048, "keepRecentTokens": 4096}},
         None)]
    big = launch.plan_launch("pi", BIG, environ={"PI_CODING_AGENT_DIR": str(tmp_path / "pi")}, home=tmp_path,
                             user_args=[], thinking=False)
    assert [f.path for f in big.files] == [tmp_path / "pi" / "models.json"]     # PI's own default reserve fits
    assert T.api_key not in "".join(f.text for f in plan.files)


def test_openclaw_gets_its_provider_and_primary_model_merged_into_the_users_config(tmp_path):
    path = tmp_path / ".openclaw" / "openclaw.json"
    path.parent.mkdir()
    user = {"channels": {"telegram": {"enabled": True}}, "models": {"mode": "replace", "providers": {
        "other": {"baseUrl": "http://x/v1"}}}, "agents": {"defaults": {"model": {"primary": "other/m",
                                                                                  "fallbacks": ["other/n"]},
                                                                        "workspace": "~/w"}}}
    raw = json.dumps(user, indent=4).encode()
    path.write_bytes(raw)
    plan = launch.plan_launch("openclaw", T, environ={}, home=tmp_path, user_args=[], thinking=False)
    assert (plan.env, plan.args, len(plan.files), plan.files[0].old) == ({}, [], 1, raw)
    assert json.loads(plan.files[0].text) == {
        "channels": {"telegram": {"enabled": True}},
        "models": {"mode": "replace", "providers": {"other": {"baseUrl": "http://x/v1"}, "mlxstack": {
            "baseUrl": "http://127.0.0.1:4000/v1", "apiKey": "sk-launch-secret-0123456789", "api": "openai-completions",
            "models": [{"id": "tiny", "name": "tiny", "reasoning": False, "input": ["text"], "contextWindow": 8192,
                        "maxTokens": 2048}]}}},
        "agents": {"defaults": {"model": {"primary": "mlxstack/tiny", "fallbacks": ["other/n"]}, "workspace": "~/w"}}}
    moved = tmp_path / "elsewhere.json"
    assert launch.plan_launch("openclaw", T, environ={"OPENCLAW_CONFIG_PATH": str(moved)}, home=tmp_path,
                              user_args=[], thinking=False).files[0].path == moved


# ============================================================================ files: backups, merges, refusals
def test_a_users_file_is_backed_up_byte_identical_then_merged_and_a_rerun_changes_nothing(tmp_path):
    models = tmp_path / ".pi" / "agent" / "models.json"
    models.parent.mkdir(parents=True)
    raw = b'{"providers": {"ollama": {"baseUrl": "http://localhost:11434/v1", "apiKey": "ollama"}},\n "x": 1}\n'
    models.write_bytes(raw)
    os.chmod(models, 0o640)
    plan = launch.plan_launch("pi", BIG, environ={}, home=tmp_path, user_args=[], thinking=False)
    notes = launch.write_files(plan, stamp="20260102-030405")
    backup = models.with_name("models.json.mlxstack-backup-20260102-030405")
    assert notes == [f"wrote {models} (backup {backup})"]
    assert backup.read_bytes() == raw and backup.stat().st_mode & 0o777 == 0o640
    merged = json.loads(models.read_text())
    assert merged["x"] == 1 and merged["providers"]["ollama"] == {"baseUrl": "http://localhost:11434/v1",
                                                                 "apiKey": "ollama"}
    assert merged["providers"]["mlxstack"] == cl.pi_models_json(BIG)["providers"]["mlxstack"]
    assert models.stat().st_mode & 0o777 == 0o600
    again = launch.plan_launch("pi", BIG, environ={}, home=tmp_path, user_args=[], thinking=False)
    assert launch.write_files(again, stamp="20260102-030405") == [f"{models} already set"]
    assert sorted(p.name for p in models.parent.iterdir()) == ["models.json", "models.json.mlxstack-backup-20260102-030405"]
    # a later change never replaces an earlier backup
    other = launch.plan_launch("pi", T, environ={}, home=tmp_path, user_args=[], thinking=False)
    launch.write_files(other, stamp="20260102-030405")
    assert backup.read_bytes() == raw
    assert models.with_name("models.json.mlxstack-backup-20260102-030405-1").read_bytes() == merged_bytes(merged)


def merged_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def test_a_file_that_is_not_plain_json_is_refused_and_left_alone(tmp_path):
    path = tmp_path / ".openclaw" / "openclaw.json"
    path.parent.mkdir()
    text = '// my config\n{ agents: { defaults: { workspace: "~/w", }, }, }\n'
    path.write_text(text)
    with pytest.raises(launch.LaunchError, match=r"not a plain JSON object .*Move it aside"):
        launch.plan_launch("openclaw", T, environ={}, home=tmp_path, user_args=[], thinking=False)
    assert path.read_text() == text and list(path.parent.iterdir()) == [path]


def test_config_text_masks_the_key_everywhere(tmp_path):
    for client in cl.CLIENTS:
        plan = launch.plan_launch(client, T, environ={}, home=tmp_path, user_args=[], thinking=False)
        text = launch.describe(plan)
        assert T.api_key not in text
        assert text.splitlines()[0] == (f"# mlxstack launch {client}: proxy http://127.0.0.1:4000/v1, model tiny, "
                                        "window 8192, output 2048")
        assert text.splitlines()[-1].startswith(cl.BINARIES[client])
    claude = launch.describe(launch.plan_launch("claude", T, environ={}, home=tmp_path, user_args=[], thinking=False))
    assert "ANTHROPIC_AUTH_TOKEN=sk-lau…789" in claude
    openclaw = launch.describe(launch.plan_launch("openclaw", T, environ={}, home=tmp_path, user_args=[], thinking=False))
    assert '"apiKey": "sk-lau…789"' in openclaw


# ============================================================================ the model (pure)
def test_the_main_model_is_the_first_name_without_a_provider_prefix():
    assert launch.pick_model(MODELS, None, 2048) == ("tiny-long-window", 131072, 2048)
    assert launch.pick_model(MODELS, "openai/tiny-long-window", 2048) == ("openai/tiny-long-window", 131072, 2048)
    small = [{"id": "openai/m", "max_input_tokens": 4096, "max_output_tokens": 2048}, {"id": "claude-*haiku*"}]
    assert launch.pick_model(small, None, 2048) == ("openai/m", 4096, 1024)   # output capped at a quarter
    assert launch.pick_model([{"id": "m", "context_length": 8192}], None, 512) == ("m", 8192, 512)
    with pytest.raises(launch.LaunchError, match=r"does not serve 'gpt-4o'; it serves openai/tiny-long-window, "
                                                 r"tiny-long-window"):
        launch.pick_model(MODELS, "gpt-4o", 2048)
    with pytest.raises(launch.LaunchError, match="context window"):
        launch.pick_model([{"id": "m"}], None, 2048)
    with pytest.raises(launch.LaunchError, match="lists no model"):
        launch.pick_model([{"id": "gpt-*"}], None, 2048)


def test_a_window_below_what_the_client_needs_is_said():
    assert launch.window_warning("pi", T) is None and launch.window_warning("claude", BIG) is None
    assert launch.window_warning("claude", T) == (
        "WARNING: tiny's window (8192 tokens) is below the ~16384 that claude's own prompt and a reply need: serve a "
        "model with a larger window (MODEL_PATH) or pick one (--model); or run claude --bare "
        "(mlxstack launch claude -- --bare)")


def test_arguments_after_the_double_dash_go_to_the_client():
    assert launch.split_args(["pi", "--model", "m", "--", "-p", "--", "x"]) == (["pi", "--model", "m"], ["-p", "--", "x"])
    assert launch.split_args(["codex"]) == (["codex"], [])


# ============================================================================ the command
def env_file(tmp_path: Path, proxy_port: int, **extra: str) -> Path:
    path = tmp_path / "stack.env"
    values = {"PROXY_PORT": str(proxy_port), "MLX_PORT": str(free_port()), "LITELLM_MASTER_KEY": T.api_key,
              "LOG_ROOT": str(tmp_path / "logs"), **extra}
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_missing_client_names_its_npm_package(tmp_path, capsys):
    code = launch.main(["opencode", "--env-file", str(env_file(tmp_path, free_port()))],
                       environ={"PATH": str(tmp_path), "HOME": str(tmp_path)},
                       exec_=lambda *a: pytest.fail("nothing to exec"))
    assert code == 127
    assert capsys.readouterr().err == ("mlxstack launch: 'opencode' (opencode) is not on PATH; install it with: "
                                       "npm install -g opencode-ai\n")


STAND_IN = """
import http.server, json, os, sys, time
time.sleep({delay})
if {fail}:
    print("ERROR: port held by another program"); sys.exit(3)
body = json.dumps({{"data": {models}}}).encode()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.headers.get("Authorization") == "Bearer {key}"
        self.send_response(200 if ok else 401); self.end_headers(); self.wfile.write(body if ok else b"{{}}")
    def log_message(self, *a): pass
print("READY stand-in", flush=True)
http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
"""


def stand_in_repo(tmp_path: Path, port: int, delay: float = 0.0, fail: bool = False) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    (repo / "start_llm.py").write_text(STAND_IN.format(delay=delay, fail=fail, models=json.dumps(MODELS),
                                                       key=T.api_key, port=port))
    return repo


def stop_stand_in(logs: Path) -> None:
    pid = int((logs / launch.STACK_PIDFILE).read_text())
    os.kill(pid, signal.SIGTERM)


def test_the_stack_is_started_when_nothing_answers_then_reused(tmp_path, monkeypatch):
    from mlxstack.config.settings import load_settings

    port = free_port()
    settings = load_settings(env={"PROXY_PORT": str(port), "MLX_PORT": str(free_port()), "LITELLM_MASTER_KEY": T.api_key,
                                  "LOG_ROOT": str(tmp_path / "logs")})
    said: list[str] = []
    repo = stand_in_repo(tmp_path, port, delay=1.0)
    try:
        assert launch.ensure_stack(settings, None, said.append, repo=repo, poll=0.1) == MODELS
        log = tmp_path / "logs" / launch.STACK_LOG
        assert said[0] == f"the stack is not running on http://127.0.0.1:{port}: starting it (output in {log})"
        assert said[-1].startswith("the stack is ready after") and "READY stand-in" in log.read_text()
        said.clear()
        assert launch.ensure_stack(settings, None, said.append, repo=repo) == MODELS and said == []
        with pytest.raises(launch.LaunchError, match="refuses the key"):
            launch.proxy_models(f"http://127.0.0.1:{port}", "sk-wrong")
    finally:
        stop_stand_in(tmp_path / "logs")


def test_a_program_without_v1_models_on_the_proxy_port_is_not_taken_for_the_stack(tmp_path):
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(launch.LaunchError, match=r"answers /v1/models with 404: it is not the stack's proxy"):
            launch.proxy_models(f"http://127.0.0.1:{server.server_address[1]}", T.api_key)
    finally:
        server.shutdown()
        server.server_close()


def test_a_stack_that_exits_while_starting_is_reported_with_its_log(tmp_path):
    from mlxstack.config.settings import load_settings

    port = free_port()
    settings = load_settings(env={"PROXY_PORT": str(port), "MLX_PORT": str(free_port()), "LITELLM_MASTER_KEY": T.api_key,
                                  "LOG_ROOT": str(tmp_path / "logs")})
    with pytest.raises(launch.LaunchError, match=r"exited with status 3 while starting .*\nERROR: port held by another"):
        launch.ensure_stack(settings, None, lambda _m: None, repo=stand_in_repo(tmp_path, port, fail=True), poll=0.1)


def test_a_stack_still_starting_is_awaited_not_started_again(tmp_path):
    from mlxstack.config.settings import load_settings

    port, mlx = free_port(), socket.socket()
    mlx.bind(("127.0.0.1", 0))
    mlx.listen()                                   # the MLX server of a stack that is loading
    settings = load_settings(env={"PROXY_PORT": str(port), "MLX_PORT": str(mlx.getsockname()[1]),
                                  "LITELLM_MASTER_KEY": T.api_key, "LOG_ROOT": str(tmp_path / "logs")})
    other = subprocess.Popen([sys.executable, str(stand_in_repo(tmp_path, port, delay=1.0) / "start_llm.py")],
                             stdout=subprocess.DEVNULL)
    said: list[str] = []
    try:
        assert launch.ensure_stack(settings, None, said.append, repo=tmp_path / "nowhere", poll=0.1) == MODELS
    finally:
        other.terminate()
        other.wait()
        mlx.close()
    assert said == [f"127.0.0.1:{settings.mlx_port} held but the proxy on http://127.0.0.1:{port} does not answer "
                    "yet: waiting for the stack that is starting there"]
    assert not (tmp_path / "logs" / launch.STACK_PIDFILE).exists()


def test_launch_writes_the_files_and_execs_the_client_with_its_env(tmp_path, monkeypatch, capsys):
    port = free_port()
    repo = stand_in_repo(tmp_path, port)
    bins = tmp_path / "bin"
    bins.mkdir()
    (bins / "pi").write_text("#!/bin/sh\n")
    (bins / "pi").chmod(0o755)
    calls = []
    env = {"PATH": str(bins), "HOME": str(tmp_path / "home"), "LANG": "C"}
    real_ensure = launch.ensure_stack
    monkeypatch.setattr(launch, "ensure_stack", lambda s, f, say: real_ensure(s, f, say, repo=repo, poll=0.1))
    try:
        code = launch.main(["pi", "--env-file", str(env_file(tmp_path, port)), "--", "-p", "hi"], environ=env,
                           exec_=lambda exe, argv, e: calls.append((exe, argv, e)))
        assert code == 0
        (exe, argv, e), = calls
        assert exe == str(bins / "pi")
        assert argv == [exe, "--provider", "mlxstack", "--model", "tiny-long-window", "-p", "hi"]
        assert e == {**env, "MLXSTACK_API_KEY": T.api_key}
        models = tmp_path / "home" / ".pi" / "agent" / "models.json"
        assert json.loads(models.read_text())["providers"]["mlxstack"]["models"][0]["contextWindow"] == 131072
        err = capsys.readouterr().err
        assert err.splitlines()[-1] == (f"mlxstack launch: pi -> http://127.0.0.1:{port}/v1, model tiny-long-window "
                                        f"(window 131072, output 2048); wrote {models} (new)")
        assert T.api_key not in err
        code = launch.main(["pi", "--config", "--env-file", str(env_file(tmp_path, port))], environ=env,
                           exec_=lambda *a: pytest.fail("--config never execs"))
        out = capsys.readouterr().out
        assert code == 0 and T.api_key not in out and f"# {models} already set" in out
        assert "MLXSTACK_API_KEY=sk-lau…789" in out and out.splitlines()[-2] == \
            "pi --provider mlxstack --model tiny-long-window"
    finally:
        stop_stand_in(tmp_path / "logs")


# ============================================================================ opt-in: the real clients
PROMPT = "Say hello in one short sentence."


def launch_turns(work: Path) -> dict[str, tuple[list[str], object]]:
    """Per client: the arguments of one non-interactive turn and how its reply is read."""
    from scripts.real_clients.clients import claude_reply, openclaw_reply

    reply_file = work / "codex-reply.txt"
    return {
        "claude": (["-p", PROMPT, "--output-format", "json"], claude_reply),
        "codex": (["exec", "--skip-git-repo-check", "-o", str(reply_file), PROMPT],
                  lambda _out: reply_file.read_text().strip() if reply_file.exists() else ""),
        "opencode": (["run", PROMPT], lambda out: out.strip()),
        "openclaw": (["agent", "--local", "--session-id", "mlxstack-launch", "--message", PROMPT, "--json"],
                     openclaw_reply),
        "pi": (["--offline", "-p", PROMPT], lambda out: out.strip()),
    }


def free_in(first: int, last: int) -> int:
    for port in range(first, last + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip(f"no free port in {first}-{last}")


@pytest.mark.e2e
@pytest.mark.real_clients
def test_each_real_client_completes_a_turn_through_mlxstack_launch(request, tmp_path):
    if "real_clients" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in: installs the real clients from npm and runs them; run with -m real_clients")
    from scripts.real_clients.clients import main_row, new_rows
    from scripts.real_clients.long_window_model import build_long_window_model
    from scripts.test_real_clients import DEFAULT_CACHE, ensure_installed, node_bin, npm_reachable, recent_rows

    reason = npm_reachable()
    if reason:
        pytest.skip(f"cannot install the real clients: {reason}")
    bins = ensure_installed(DEFAULT_CACHE)
    proxy_port, mlx_port = free_in(4600, 4699), free_in(8600, 8699)
    settings = env_file(tmp_path, proxy_port, MLX_PORT=str(mlx_port), MODEL_PATH=str(build_long_window_model()),
                        DEFAULT_THINKING="false", DEFAULT_MAX_TOKENS="2048", PROXY_STARTUP_TIMEOUT_SECONDS="300")
    mlx = f"http://127.0.0.1:{mlx_port}"
    # nothing of the caller's environment but where programs are: no client variable set by hand
    base_env = {"PATH": f"{node_bin(DEFAULT_CACHE)}{os.pathsep}{bins}{os.pathsep}{os.environ.get('PATH', '')}",
                "HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO), "NO_COLOR": "1", "LANG": "C.UTF-8"}
    (tmp_path / "home").mkdir()
    results = {}
    try:
        for client in cl.CLIENTS:
            work = tmp_path / "work" / client
            work.mkdir(parents=True)
            args, read_reply = launch_turns(work)[client]
            try:
                before = recent_rows(mlx)
            except OSError:
                before = []                       # the first launch starts the stack
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "mlxstack.cli", "launch", client, "--env-file", str(settings),
                                   "--", *args], cwd=work, env=base_env, capture_output=True, text=True, timeout=900,
                                  stdin=subprocess.DEVNULL)
            rows = new_rows(before, recent_rows(mlx))
            main = main_row(rows) or {}
            results[client] = {"rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1),
                               "reply": read_reply(proc.stdout) if proc.returncode == 0 else "",
                               "requests": len(rows), "prompt_tokens": main.get("prompt_tokens"),
                               "started_stack": "starting it" in proc.stderr,
                               "stderr": proc.stderr[-1500:], "stdout": proc.stdout[-1500:]}
            print(f"{client}: rc {proc.returncode} in {results[client]['seconds']}s, {len(rows)} request(s), "
                  f"prompt {main.get('prompt_tokens')}, reply {' '.join(results[client]['reply'].split())[:60]!r}",
                  flush=True)
    finally:
        pidfile = tmp_path / "logs" / launch.STACK_PIDFILE
        if pidfile.exists():
            pid = int(pidfile.read_text())
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
    assert sorted(results) == sorted(cl.CLIENTS)
    assert [c for c, r in results.items() if r["started_stack"]] == [cl.CLIENTS[0]]
    for client, res in results.items():
        assert res["rc"] == 0 and res["reply"], (client, res)
        assert res["requests"] >= 1 and res["prompt_tokens"] > 500, (client, res)
    assert T.api_key not in "".join(r["stderr"] + r["stdout"] for r in results.values())
    assert not (tmp_path / "home" / ".codex" / "config.toml").exists()      # passed, never written
    print(textwrap.indent(json.dumps({c: {k: r[k] for k in ("rc", "seconds", "requests", "prompt_tokens")}
                                      for c, r in results.items()}, indent=1), "  "))
