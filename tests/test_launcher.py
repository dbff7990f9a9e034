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
    assert [m["model_name"] for m in cfg["model_list"]] == ["openai/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"]
    for entry in cfg["model_list"]:
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
