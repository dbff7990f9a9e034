"""Launcher: LiteLLM config, port ownership, stale-process decisions, supervision. The whole
start → ready → SIGTERM cycle with the real servers is in tests/test_e2e_stack.py."""
import os
import signal
import socket
import subprocess
import sys
import time
from io import StringIO
from pathlib import Path

import pytest
import yaml

from mlxstack.config.settings import load_settings
from mlxstack.launcher import litellm_config as lc
from mlxstack.launcher import ports
from mlxstack.launcher.stack import LaunchError, free_port
from mlxstack.launcher.supervisor import Supervisor, describe_exit
from tests.conftest import unused_port

REPO = Path(__file__).resolve().parents[1]

LISTENER = """
import socket, sys, time, signal
if len(sys.argv) > 2 and sys.argv[2] == 'ignore-term':
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()
print('listening', flush=True)
time.sleep(600)
"""

def wait_listening(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not ports.port_is_free("127.0.0.1", port):
            return
        time.sleep(0.05)
    raise AssertionError(f"nothing listening on {port}")


# --- config -------------------------------------------------------------------------------------
def test_config_yaml_content():
    s = load_settings(env={"MLX_PORT": "8181", "PROXY_REQUEST_TIMEOUT_SECONDS": "1234"})
    cfg = yaml.safe_load(lc.render_yaml(lc.build_config(s, "SmolLM2-135M-Instruct")))
    assert [m["model_name"] for m in cfg["model_list"]] == ["openai/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct",
                                                          "claude-*opus*", "claude-*sonnet*", "claude-*haiku*", "gpt-*"]
    for entry in cfg["model_list"]:     # the MODEL_ALIASES patterns route to the same deployment
        p = entry["litellm_params"]
        assert p["model"] == "hosted_vllm/SmolLM2-135M-Instruct"
        assert p["api_base"] == "http://127.0.0.1:8181/v1" and p["timeout"] == p["stream_timeout"] == 1234
    assert cfg["litellm_settings"]["num_retries"] == 0 and cfg["litellm_settings"]["drop_params"] is True
    assert cfg["general_settings"]["forward_client_headers_to_llm_api"] is True
    assert cfg["general_settings"]["master_key"] == "os.environ/LITELLM_MASTER_KEY"


def test_model_names():
    assert lc.proxy_model_names(load_settings(env={"MODEL_PATH": "mlx-community/Qwen3-4B-4bit"})) == [
        "openai/Qwen3-4B-4bit", "Qwen3-4B-4bit"]
    assert lc.proxy_model_names(load_settings(env={"MODEL_PATH": "/models/glm/", "PROXY_MODEL_ID": "local/glm"})) == [
        "local/glm", "glm"]
    assert lc.proxy_model_names(load_settings(env={"PROXY_MODEL_ID": "SmolLM2-135M-Instruct"})) == ["SmolLM2-135M-Instruct"]
    s = load_settings(env={"MLX_HOST": "0.0.0.0", "PROXY_HOST": "::"})
    assert lc.mlx_base_url(s) == "http://127.0.0.1:8080" and lc.proxy_base_url(s) == "http://[::1]:4000"


# --- ports --------------------------------------------------------------------------------------
def test_port_owner_is_this_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        owners = ports.port_owners(port)
        assert os.getpid() in [o.pid for o in owners]
        assert any("pytest" in a for a in owners[0].cmdline)
        assert not ports.port_is_free("127.0.0.1", port)
    assert ports.port_owners(port) == [] and ports.port_is_free("127.0.0.1", port)


def _owner(pid, *cmd, cwd=None):
    return ports.PortOwner(pid, tuple(cmd), cwd)


def test_stale_decision():
    repo = Path("/home/u/stack")
    ours = _owner(10, "/home/u/stack/.venv/bin/python", "/home/u/stack/.venv/bin/litellm", "--config", "x.yaml")
    by_config = _owner(11, "python", "/usr/bin/litellm", "--config", "/tmp/cfg/litellm_config.yaml")
    by_pidfile = _owner(12, "python", "litellm", "--port", "4000", cwd="/")
    other_litellm = _owner(13, "/opt/other/bin/python", "/opt/other/bin/litellm", cwd="/opt/other")
    nginx = _owner(14, "nginx: master process")
    assert ports.stale_decision([], "litellm", repo) == ("free", [])
    assert ports.stale_decision([ours], "litellm", repo) == ("kill", [ours])
    assert ports.stale_decision([by_config], "litellm", repo, ("/tmp/cfg/litellm_config.yaml",))[0] == "kill"
    assert ports.stale_decision([by_pidfile], "litellm", repo, pidfile_pid=12)[0] == "kill"
    assert ports.stale_decision([by_pidfile], "litellm", repo, pidfile_pid=99)[0] == "refuse"
    assert ports.stale_decision([other_litellm], "litellm", repo) == ("refuse", [other_litellm])
    assert ports.stale_decision([ours, nginx], "litellm", repo) == ("refuse", [nginx])
    # a pidfile match alone is not enough: the pid may have been reused by something else
    assert ports.stale_decision([_owner(15, "nginx")], "litellm", repo, pidfile_pid=15)[0] == "refuse"
    mlx = _owner(16, "python", "-m", "mlxstack.serve", cwd="/home/u/stack")
    assert ports.stale_decision([mlx], "mlx", repo)[0] == "kill"
    assert ports.stale_decision([mlx], "litellm", repo)[0] == "refuse"
    assert ports.stale_decision([_owner(17, "x")], "mlx", repo, self_pid=17) == ("free", [])


def _spawn_listener(port: int, *argv: str) -> subprocess.Popen:
    # cwd outside the repo: a process whose cwd is the repo counts as ours
    # and the base interpreter: the repo's own .venv/bin/python in a command line also ties it to us
    python = getattr(sys, "_base_executable", None) or sys.executable
    proc = subprocess.Popen([python, "-c", LISTENER, str(port), *argv], stdout=subprocess.PIPE, cwd="/")
    assert proc.stdout.readline().strip() == b"listening"
    return proc


def test_free_port_stops_our_leftover_and_refuses_foreign(tmp_path):
    port = unused_port()
    procs = [_spawn_listener(port, "litellm", str(REPO))]
    notes = []
    try:
        free_port("litellm", "127.0.0.1", port, REPO, tmp_path / "pid", (), notes.append)
        assert procs[0].wait(timeout=5) is not None and ports.port_is_free("127.0.0.1", port)
        assert f"pid {procs[0].pid}" in notes[0]
        procs.append(_spawn_listener(port, "litellm", "/somewhere/else"))
        with pytest.raises(LaunchError, match=f"port {port} .*pid {procs[1].pid}: .*python"):
            free_port("litellm", "127.0.0.1", port, REPO, tmp_path / "pid", (), notes.append)
        assert procs[1].poll() is None
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_terminate_pid_escalates_to_sigkill():
    proc = _spawn_listener(unused_port(), "ignore-term")
    try:
        start = time.monotonic()
        assert ports.terminate_pid(proc.pid, grace=0.5)
        assert proc.wait(timeout=5) == -signal.SIGKILL and time.monotonic() - start < 3
    finally:
        proc.kill()


# --- supervision --------------------------------------------------------------------------------
def test_supervisor_reports_death_and_stops_the_other():
    out = StringIO()
    sup = Supervisor(out)
    port = unused_port()
    stubborn = sup.start("a", [sys.executable, "-c", LISTENER, str(port), "ignore-term"], os.environ)
    dying = sup.start("b", [sys.executable, "-c", "print('bye'); raise SystemExit(3)"], os.environ)
    wait_listening(port)
    dead = sup.wait_any(timeout=10)
    assert dead is dying and describe_exit(dead.poll()) == "exit code 3"
    start = time.monotonic()
    sup.stop_all(grace=1.0)
    assert stubborn.poll() == -signal.SIGKILL and time.monotonic() - start < 5
    assert ports.port_is_free("127.0.0.1", port)
    assert "[b] bye" in out.getvalue() and "[a] listening" in out.getvalue()


# --- port ownership by real paths (issue 10, item 10) ---------------------------------------------
def test_checkout_paths_compare_by_component_and_symlinks(tmp_path):
    main, main2 = tmp_path / "main", tmp_path / "main2"
    main.mkdir(), main2.mkdir()
    (tmp_path / "link").symlink_to(main)
    assert ports.path_within(str(main / ".venv/bin/python"), main)
    assert ports.path_within(str(main), main)
    assert not ports.path_within(str(main2 / ".venv/bin/python"), main)       # was a substring match
    assert not ports.path_within(str(main) + "-old/x", main)
    assert ports.path_within(str(tmp_path / "link" / "x.yaml"), main)          # a symlinked checkout
    assert ports.path_within(str(main / "x"), tmp_path / "link")
    assert not ports.path_within("relative/path", main)
    assert ports.same_path(str(tmp_path / "link" / "c.yaml"), str(main / "c.yaml"))
    sibling = _owner(20, f"{main2}/.venv/bin/python", "-m", "mlxstack.serve", cwd=str(main2))
    assert ports.stale_decision([sibling], "mlx", main) == ("refuse", [sibling])
    by_flag = _owner(21, "python", "litellm", f"--config={main}/logs/litellm_config.yaml", cwd="/")
    assert ports.stale_decision([by_flag], "litellm", main)[0] == "kill"


# --- restarts (issue 10, item 14) -------------------------------------------------------------------
def test_restart_policy_backoff_and_crash_loop_limit():
    from mlxstack.launcher.restarts import RestartPolicy

    policy = RestartPolicy(max_restarts=3, window=100.0, base=1.0, cap=3.0)
    assert [policy.next_delay(t) for t in (0.0, 1.0, 2.0)] == [1.0, 2.0, 3.0]  # 1, 2, 4 capped at 3
    assert policy.next_delay(3.0) is None                                       # 4th crash inside 100 s
    assert policy.next_delay(100.5) == 3.0        # the crash at t=0 has left the window: 2 recent -> 2**2 capped
    assert policy.recent(100.5) == 3
    assert RestartPolicy(max_restarts=0, window=10).next_delay(0.0) is None


def _settings(**env):
    base = {"MLX_PORT": str(unused_port()), "ENABLE_REQUEST_LOGGING": "false", "DEFAULT_TEMPERATURE": "0",
            "MODEL_CACHE_DIR": os.environ.get("MLXSTACK_TEST_MODEL_CACHE", str(Path.home() / ".cache" / "mlxstack"))}
    return load_settings(env={**base, **{k.upper(): str(v) for k, v in env.items()}})


def _health(settings):
    from mlxstack.launcher.stack import get_json

    try:
        return get_json(lc.mlx_base_url(settings) + "/health", timeout=2)
    except OSError:
        return None, None


@pytest.mark.e2e
def test_failed_model_load_exits_at_once_with_its_error(tmp_path, embedded_model_path):
    from mlxstack.launcher.stack import run_stack

    bad = tmp_path / "broken-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama"}')
    out = StringIO()
    settings = _settings(model_path=bad, litellm_master_key="sk-x", log_root=tmp_path / "logs",
                         mlx_startup_timeout_seconds=600)
    start = time.monotonic()
    code = run_stack(settings, repo=REPO, out=out)
    elapsed = time.monotonic() - start
    text = out.getvalue()
    assert code == 1 and elapsed < 60, (elapsed, text[-2000:])           # not MLX_STARTUP_TIMEOUT_SECONDS
    assert f"ERROR: during start-up, the MLX server could not load the model: FileNotFoundError: No safetensors found in {bad}" in text
    assert "[mlx] MODEL LOAD FAILED: FileNotFoundError" in text
    assert "starting LiteLLM" not in text and ports.port_is_free("127.0.0.1", settings.mlx_port)


@pytest.mark.e2e
def test_serve_exits_3_on_load_failure_and_2_on_exposed_bind(tmp_path):
    env = {**os.environ, "MODEL_PATH": str(tmp_path), "MLX_PORT": str(unused_port()), "ENABLE_REQUEST_LOGGING": "false"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mlxstack.serve"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and "MODEL LOAD FAILED: " in done.stderr and "has no config.json" in done.stderr
    assert time.monotonic() - start < 60
    env.update(MLX_HOST="0.0.0.0", MLX_API_KEY="")
    done = subprocess.run([sys.executable, "-m", "mlxstack.serve"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "MLX_API_KEY is empty" in done.stderr


@pytest.mark.e2e
def test_dead_mlx_server_is_restarted_then_crash_loop_stops(tmp_path, embedded_model_path):
    """kill -9 of a real MLX server: restarted (new pid, ready again) while the other child keeps
    running, and a request sent while it is down waits on the launcher's socket instead of being
    refused; the next crash beyond MLX_MAX_RESTARTS=1 ends supervision with a crash-loop error."""
    import threading

    from mlxstack.launcher.restarts import RestartPolicy
    from mlxstack.launcher.stack import start_mlx, supervise
    from mlxstack.system.listen_socket import listen_socket
    from tests.conftest import http_json

    settings = _settings(mlx_max_restarts=1, mlx_restart_window_seconds=600, log_root=tmp_path)
    out = StringIO()
    sup = Supervisor(out)
    cmd = [sys.executable, "-m", "mlxstack.serve"]
    pidfile = tmp_path / ".mlx.pid"
    listen = listen_socket("127.0.0.1", settings.mlx_port)
    try:
        first, health = start_mlx(sup, settings, cmd, REPO, pidfile, sup.say, listen)
        assert health["ready"] is True and oct(pidfile.stat().st_mode & 0o777) == "0o600"
        other = sup.start("litellm", [sys.executable, "-c", "import time; time.sleep(600)"], os.environ)
        policy = RestartPolicy(settings.mlx_max_restarts, settings.mlx_restart_window_seconds, base=0.2)
        runner = threading.Thread(target=supervise, args=(sup, settings, cmd, REPO, pidfile, sup.say, policy, listen))
        runner.start()
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait(timeout=10)
        status, body, _ = http_json(lc.mlx_base_url(settings) + "/health", timeout=120)  # not ECONNREFUSED
        assert (status, body["ready"]) in ((503, False), (200, True)), (status, body)
        deadline = time.monotonic() + 180
        while "MLX server restarted" not in out.getvalue():
            assert runner.is_alive() and time.monotonic() < deadline, out.getvalue()[-3000:]
            time.sleep(0.2)
        second = next(c for c in sup.children if c.name == "mlx")
        assert second.pid != first.pid and int(pidfile.read_text()) == second.pid
        assert _health(settings)[0] == 200 and other.poll() is None
        assert "!! MLX SERVER DIED (pid %d, killed by SIGKILL). Restart 1 of at most 1" % first.pid in out.getvalue()
        os.kill(second.pid, signal.SIGKILL)
        runner.join(timeout=30)
        assert not runner.is_alive()
        assert "ERROR: the MLX server crashed again (killed by SIGKILL) after 1 restart(s) within 600s" in out.getvalue()
        assert other.poll() is None  # supervision ended; stopping is run_stack's job
    finally:
        sup.stop_all(grace=2.0)
        listen.close()


# --- secrets (issue 10, items 11 and 12) ------------------------------------------------------------
def test_mlx_api_key_is_referenced_in_the_config_never_written(tmp_path):
    from mlxstack.launcher.stack import litellm_env, ready_text

    key = "sk-mlx-0123456789abcdefXYZ"
    s = load_settings(env={"MLX_API_KEY": key, "LITELLM_MASTER_KEY": "sk-master-abcdefghijklmnop"})
    path = lc.write_config(s, "SmolLM2-135M-Instruct", tmp_path / "cfg.yaml")
    text = path.read_text()
    assert key not in text and "sk-master" not in text
    cfg = yaml.safe_load(text)
    assert {e["litellm_params"]["api_key"] for e in cfg["model_list"]} == {"os.environ/MLX_API_KEY"}
    assert litellm_env(s)["MLX_API_KEY"] == key
    unkeyed = load_settings(env={})
    assert {e["litellm_params"]["api_key"] for e in lc.build_config(unkeyed, "m")["model_list"]} == {"none"}
    assert "MLX_API_KEY" not in litellm_env(unkeyed) or litellm_env(unkeyed)["MLX_API_KEY"] == os.environ.get("MLX_API_KEY")
    ready = ready_text(s, ["m"])
    assert "sk-mas…nop" in ready and "sk-mlx…XYZ" in ready
    assert "sk-master-abcdefghijklmnop" not in ready and key not in ready


def test_private_files_and_dirs(tmp_path):
    from mlxstack.system.secrets import make_private_dir, mask_secret, open_private_append, write_private_file

    old = os.umask(0o022)
    try:
        d = make_private_dir(tmp_path / "a" / "logs")
        assert oct(d.stat().st_mode & 0o777) == "0o700"
        f = write_private_file(d / ".pid", "123\n")
        assert f.read_text() == "123\n" and oct(f.stat().st_mode & 0o777) == "0o600"
        write_private_file(f, "456\n")  # replacing keeps 0600 and leaves no temp file behind
        assert f.read_text() == "456\n" and sorted(p.name for p in d.iterdir()) == [".pid"]
        with open_private_append(d / "x.log") as fh:
            fh.write(b"line\n")
        assert oct((d / "x.log").stat().st_mode & 0o777) == "0o600"
    finally:
        os.umask(old)
    assert mask_secret("sk-abcdefghijklmnopqrstuvwxyz") == "sk-abc…xyz"
    assert mask_secret("short") == "sh…" and mask_secret("") == "(empty)"


def test_get_json_treats_an_answer_cut_short_as_no_answer():
    """A server killed while answering /health leaves a body shorter than its Content-Length: the
    supervisor must see no answer (OSError), not die of http.client.IncompleteRead."""
    import socket
    import threading

    from mlxstack.launcher.stack import get_json

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def answer_half():
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 97\r\n\r\n{\"st")
        conn.close()

    t = threading.Thread(target=answer_half)
    t.start()
    try:
        with pytest.raises(OSError, match="cut short"):
            get_json(f"http://127.0.0.1:{srv.getsockname()[1]}/health", timeout=10)
    finally:
        t.join(timeout=10)
        srv.close()


# --- the LiteLLM start-up limit under its seed name (issue 44) ----------------------------------------
FAKE_MLX = """
import json, os, socket
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/health": {"ready": True, "model": "fake"},
                "/v1/models": {"data": [{"id": "fake", "context_length": 4096}]}}.get(self.path.split("?")[0])
        data = json.dumps(body or {}).encode()
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a):
        pass
srv = HTTPServer(("127.0.0.1", 0), H, bind_and_activate=False)
srv.socket.close()
srv.socket = socket.socket(fileno=int(os.environ["MLX_LISTEN_FD"]))
srv.serve_forever()
"""


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["PROXY_STARTUP_WAIT_SECONDS", "PROXY_STARTUP_TIMEOUT_SECONDS"])
def test_the_launcher_waits_for_litellm_as_long_as_the_setting_given_and_names_it(tmp_path, monkeypatch, name):
    """A LiteLLM that never answers: the launcher gives up after the limit set under either name
    (the seed's PROXY_STARTUP_WAIT_SECONDS alone is the limit) and its error names that variable."""
    from mlxstack.launcher import stack

    monkeypatch.setattr(stack, "litellm_command", lambda *a: [sys.executable, "-c", "import time; time.sleep(120)"])
    settings = _settings(**{name: "2", "proxy_port": unused_port(), "litellm_master_key": "sk-x",
                            "log_root": tmp_path / "logs", "backends_file": tmp_path / "none.yaml"})
    assert stack.proxy_startup_limit(settings) == (2.0, name)
    out = StringIO()
    start = time.monotonic()
    code = stack.run_stack(settings, repo=REPO, mlx_cmd=[sys.executable, "-c", FAKE_MLX], out=out)
    elapsed = time.monotonic() - start
    text = out.getvalue()
    assert code == 1, text[-2000:]
    assert f"ERROR: LiteLLM proxy not ready after 2s (raise {name} in .env?)." in text, text[-2000:]
    assert "MLX server ready after" in text and 2.0 < elapsed < 30, (elapsed, text[-2000:])
