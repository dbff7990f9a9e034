"""Launcher: LiteLLM config, port ownership, stale-process decisions, supervision, and the whole
start → ready → SIGTERM cycle against a stand-in MLX server and the real LiteLLM proxy."""
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from io import StringIO
from pathlib import Path

import pytest
import yaml

from mlxstack.config.settings import load_settings
from mlxstack.launcher import litellm_config as lc
from mlxstack.launcher import ports
from mlxstack.launcher.stack import LaunchError, free_port
from mlxstack.launcher.supervisor import Supervisor, describe_exit

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

FAKE_MLX = r"""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
START = time.monotonic()
class H(BaseHTTPRequestHandler):
    def _send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code); self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(body))); self.send_header('Connection', 'close')
        self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        if self.path == '/health':
            self._send(200, {'status': 'ok', 'model': 'fake-model', 'ready': time.monotonic() - START > 1})
        elif self.path == '/v1/models':
            self._send(200, {'object': 'list', 'data': [{'id': 'fake-model', 'object': 'model'}]})
        else:
            self._send(404, {'error': {'message': 'no', 'type': 'not_found', 'param': None, 'code': 404}})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
        text = 'Paris. model=%s affinity=%s' % (req.get('model'), self.headers.get('x-session-affinity'))
        self._send(200, {'id': 'c1', 'object': 'chat.completion', 'created': 1, 'model': req.get('model'),
            'choices': [{'index': 0, 'message': {'role': 'assistant', 'content': text}, 'finish_reason': 'stop'}],
            'usage': {'prompt_tokens': 5, 'completion_tokens': 2, 'total_tokens': 7}})
ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
"""


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, str(port), *argv], stdout=subprocess.PIPE, cwd="/")
    assert proc.stdout.readline().strip() == b"listening"
    return proc


def test_free_port_stops_our_leftover_and_refuses_foreign(tmp_path):
    port = free_tcp_port()
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
    proc = _spawn_listener(free_tcp_port(), "ignore-term")
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
    port = free_tcp_port()
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


# --- whole cycle with the real LiteLLM ----------------------------------------------------------
def _request(url, body=None, key=None, headers=None):
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.timeout(180)
def test_stack_ready_serves_and_stops_on_sigterm(tmp_path):
    if importlib.util.find_spec("litellm") is None:  # not imported here: it would fetch a cost map
        pytest.skip("litellm not installed")
    mlx_port, proxy_port, key = free_tcp_port(), free_tcp_port(), "sk-test-launcher"
    (tmp_path / "fake_mlx.py").write_text(FAKE_MLX)
    env = {"MLX_PORT": str(mlx_port), "PROXY_PORT": str(proxy_port), "LITELLM_MASTER_KEY": key,
           "LOG_ROOT": str(tmp_path / "logs"), "PROXY_STARTUP_TIMEOUT_SECONDS": "120"}
    code = ("import sys; from mlxstack.config.settings import load_settings; from mlxstack.launcher.stack import run_stack; "
            f"sys.exit(run_stack(load_settings(env={env!r}), mlx_cmd=[sys.executable, {str(tmp_path / 'fake_mlx.py')!r}, '{mlx_port}']))")
    log = open(tmp_path / "launcher.log", "w+")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        while "READY" not in (tmp_path / "launcher.log").read_text():
            assert proc.poll() is None, (tmp_path / "launcher.log").read_text()
            assert time.monotonic() < deadline, "no READY line"
            time.sleep(0.5)
        base = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        for model in ("openai/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"):
            status, body = _request(base, {"model": model, "messages": msgs}, key, {"x-session-affinity": "s1"})
            assert status == 200, body
            text = body["choices"][0]["message"]["content"]
            assert "Paris" in text and "model=fake-model" in text and "affinity=s1" in text
            assert body["usage"]["total_tokens"] == 7
        assert _request(base, {"model": "SmolLM2-135M-Instruct", "messages": msgs})[0] == 401
        cfg = yaml.safe_load((tmp_path / "logs" / "litellm_config.yaml").read_text())
        assert cfg["model_list"][0]["litellm_params"]["model"] == "hosted_vllm/fake-model"
        assert (tmp_path / "logs" / ".litellm.pid").exists()
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert proc.wait(timeout=10) == 0
        while not (ports.port_is_free("127.0.0.1", mlx_port) and ports.port_is_free("127.0.0.1", proxy_port)):
            assert time.monotonic() - start < 5, "ports still busy 5 s after SIGTERM"
            time.sleep(0.1)
        assert not (tmp_path / "logs" / ".litellm.pid").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
