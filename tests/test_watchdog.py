"""A watchdog that tells the truth (issue 23, item 3): the inference thread never dies of a request's
exception; when it does die (a fatal error) or stops making progress while work waits, nothing
hangs -- every request it held or that arrives later gets an error -- /health answers 503 with the
reason, and the launcher stops and restarts such a server as it restarts a crashed one.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from io import StringIO
from pathlib import Path

import pytest

from mlxstack.config import faults
from mlxstack.engine.core import EngineCore
from mlxstack.engine.worker import InferenceWorker, WorkerDied
from tests.conftest import LiveServer, build_engine, engine_settings, http_json, unused_port
from tests.test_faults import SHORT, fjob, msgs

REPO = Path(__file__).resolve().parents[1]


def chat(base: str, text: str, max_tokens: int = 6, timeout: float = 60) -> tuple[int, dict]:
    status, body, _ = http_json(base + "/v1/chat/completions",
                                {"messages": msgs(text), "max_tokens": max_tokens, "temperature": 0}, timeout=timeout)
    return status, body


def health(base: str) -> tuple[int, dict]:
    status, body, _ = http_json(base + "/health", timeout=10)
    return status, body


# ------------------------------------------------------------------------------ the worker
def test_an_exception_escaping_a_step_fails_the_requests_in_flight_and_the_thread_lives(tiny_dense_path):
    eng = build_engine(engine_settings(tiny_dense_path))
    worker = InferenceWorker(max_queued=16)
    worker.core = sched = EngineCore(eng, 8, 64, batching=True)
    worker.start()
    real_step = sched.group.step
    calls = {"n": 0}

    def broken_step():          # a bug outside every per-request guard, on the third decode step
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyError("bug")
        return real_step()

    sched.group.step = broken_step
    try:
        futures = [worker.submit_chat(fjob(f"r{i}", t, 10)) for i, t in enumerate(SHORT)]
        errors = [f.exception(60) for f in futures]
        assert all(e is not None and "KeyError" in str(e) for e in errors), errors
        assert worker.alive and worker.recoveries == 1 and worker.health_problem(1.0) is None
        assert sched.idle() and not sched.futures and sched.group.slab is None
        assert worker.submit_chat(fjob("next", SHORT[0], 4)).result(60).completion_tokens == 4
    finally:
        worker.stop()


def test_a_dying_thread_resolves_everything_and_refuses_new_work():
    worker = InferenceWorker(max_queued=16)
    worker.start()
    gate = threading.Event()
    blocker = worker.submit(gate.wait)
    queued = worker.submit(lambda: "never")

    def die():
        raise SystemExit("gone")

    dying = worker.submit(die)
    after = worker.submit(lambda: "never either")
    gate.set()
    assert blocker.result(10) is True
    assert isinstance(dying.exception(10), WorkerDied)
    assert queued.result(10) == "never"                     # ran before the fatal one
    assert isinstance(after.exception(10), WorkerDied)       # queued behind it: resolved, not hung
    late = worker.submit(lambda: 1)                           # submitted after the death
    assert isinstance(late.exception(1), WorkerDied)
    assert worker.health_problem(0) == "inference thread died: SystemExit: gone"


def test_stall_is_reported_only_while_work_waits():
    worker = InferenceWorker(max_queued=16)
    worker.start()
    try:
        time.sleep(0.3)
        assert worker.health_problem(0.1) is None            # idle for longer than the limit: fine
        gate = threading.Event()
        worker.submit(gate.wait)
        time.sleep(0.3)
        assert "stalled: no progress for" in worker.health_problem(0.1)
        assert worker.health_problem(0) is None              # 0 = stall check off
        gate.set()
        time.sleep(0.1)
        assert worker.health_problem(0.1) is None
    finally:
        worker.stop()


def test_the_runners_checks_between_forwards_are_progress():
    """A long prompt alone makes no step for a while: the runner's hang-up checks between its
    forwards (runner/rows.py ``halted``, data the worker reads) keep the stall check quiet; once
    they stop too, the stall is reported."""
    from types import SimpleNamespace

    from mlxstack.runner.rows import RunnerContext, halted

    ctx = RunnerContext(model=None, decode_model=None, layout=None, kv_quant=None, speculation=None, counters=None)
    row = SimpleNamespace(deadline=None, watchdog=False, job=SimpleNamespace(is_cancelled=lambda: False))
    worker = InferenceWorker(max_queued=16)
    worker.runner = ctx
    worker.start()
    checking, gate = threading.Event(), threading.Event()

    def long_prefill() -> None:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            assert halted(ctx, row) is False
            checking.set()
            time.sleep(0.01)
        gate.wait(30)

    try:
        worker.submit(long_prefill)
        assert checking.wait(10)
        time.sleep(1.0)                                       # twice the limit, checks every 10 ms
        assert worker.health_problem(0.5) is None
        time.sleep(1.5)                                       # the checks stopped a second ago
        assert "stalled: no progress for" in worker.health_problem(0.5)
        row.deadline = ctx.clock() - 1.0                      # a passed deadline: halted, and why
        assert halted(ctx, row) is True and row.watchdog is True
    finally:
        gate.set()
        worker.stop()


# ------------------------------------------------------------------------------ /health
def test_health_reports_a_dead_inference_thread_and_requests_never_hang(tiny_dense_path):
    server = LiveServer(engine_settings(tiny_dense_path, max_concurrent_sequences=4))
    try:
        assert health(server.base)[0] == 200
        with faults.injected("decode_forward:2:fatal"):
            status, body = chat(server.base, "This one kills the thread.")
        assert status == 503 and body["error"]["code"] == "inference_thread_died"
        status, body = health(server.base)
        assert status == 503 and body["status"] == "error" and body["ready"] is False
        assert body["error"].startswith("inference thread died: InjectedFatal: injected fault at decode_forward")
        start = time.monotonic()
        status, body = chat(server.base, SHORT[0])            # answered at once, never queued forever
        assert status == 503 and body["error"]["code"] == "inference_thread_died" and time.monotonic() - start < 5
    finally:
        server.close()


def test_health_reports_a_stall_and_recovers_when_progress_resumes(tiny_dense_path):
    server = LiveServer(engine_settings(tiny_dense_path, max_concurrent_sequences=4, inference_stall_seconds=0.5))
    try:
        with faults.injected("prefill_chunk:1:stall=60"):
            results = {}
            caller = threading.Thread(target=lambda: results.setdefault("r", chat(server.base, SHORT[1])))
            caller.start()
            deadline = time.monotonic() + 30
            while True:
                status, body = health(server.base)
                if status == 503:
                    break
                assert time.monotonic() < deadline, body
                time.sleep(0.1)
            assert body["status"] == "error" and body["ready"] is False
            assert body["error"].startswith("inference thread stalled: no progress for")
        caller.join(60)                                       # disarming woke the stalled step
        assert results["r"][0] == 200
        assert health(server.base)[0] == 200
    finally:
        server.close()


# ------------------------------------------------------------------------------ the launcher
FAKE_SERVER = r"""
import json, os, socket, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
marker = sys.argv[1]
first = not os.path.exists(marker)
open(marker, "a").write(f"{os.getpid()}\n")
born = time.monotonic()

class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        broken = first and time.monotonic() - born > 1.0
        body = ({"status": "error", "ready": False, "error": "inference thread died: InjectedFatal: x"}
                if broken else {"status": "ok", "ready": True, "model": "fake"})
        data = json.dumps(body).encode()
        self.send_response(503 if broken else 200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

srv = HTTPServer(("127.0.0.1", 0), H, bind_and_activate=False)
srv.socket.close()
srv.socket = socket.socket(fileno=int(os.environ["MLX_LISTEN_FD"]))
print("fake server up", flush=True)
srv.serve_forever()
"""


def _launcher_settings(tmp_path, **env):
    from mlxstack.config.settings import load_settings

    base = {"MLX_PORT": str(unused_port()), "ENABLE_REQUEST_LOGGING": "false", "LOG_ROOT": str(tmp_path),
            "MLX_UNHEALTHY_RESTART_SECONDS": "1", "MLX_MAX_RESTARTS": "2"}
    return load_settings(env={**base, **{k.upper(): str(v) for k, v in env.items()}})


def _supervise(sup, settings, cmd, tmp_path, **kw):
    from mlxstack.launcher.restarts import RestartPolicy
    from mlxstack.launcher.stack import LocalServer, _spawn_mlx, supervise_all, wait_ready, _mlx_probe
    from mlxstack.launcher import litellm_config as lc
    from mlxstack.system.listen_socket import listen_socket

    listen = listen_socket("127.0.0.1", settings.mlx_port)
    server = LocalServer("mlx", settings, tmp_path / ".mlx.pid",
                         RestartPolicy(settings.mlx_max_restarts, settings.mlx_restart_window_seconds, base=0.2), listen)
    server.child = _spawn_mlx(sup, "mlx", settings, cmd, REPO, server.pidfile, listen)
    wait_ready(server.child, _mlx_probe(lc.mlx_base_url(settings)), 300, "MLX server", sup.say)
    runner = threading.Thread(target=supervise_all, args=(sup, {"mlx": server}, cmd, REPO, sup.say),
                              kwargs={"health_interval": 0.3, **kw}, daemon=True)
    return server, listen, runner


def _wait_for(out: StringIO, text: str, runner, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in out.getvalue():
        assert runner.is_alive() and time.monotonic() < deadline, out.getvalue()[-3000:]
        time.sleep(0.1)


@pytest.mark.e2e
def test_launcher_restarts_a_server_whose_health_reports_it_dead(tmp_path):
    """A server that stays up but reports its inference thread dead is stopped after
    MLX_UNHEALTHY_RESTART_SECONDS and restarted with the crash banner; LiteLLM stays up."""
    from mlxstack.launcher.supervisor import Supervisor

    settings = _launcher_settings(tmp_path)
    out = StringIO()
    sup = Supervisor(out)
    marker = tmp_path / "incarnations"
    cmd = [sys.executable, "-c", FAKE_SERVER, str(marker)]
    server, listen, runner = _supervise(sup, settings, cmd, tmp_path)
    try:
        first = server.child
        other = sup.start("litellm", [sys.executable, "-c", "import time; time.sleep(600)"], os.environ)
        runner.start()
        _wait_for(out, "MLX server restarted", runner, 60)
        text = out.getvalue()
        assert "reports: inference thread died: InjectedFatal: x. It is restarted if this lasts 1s" in text
        assert (f'!! MLX SERVER DIED (pid {first.pid}, killed by SIGTERM; stopped by the launcher: /health '
                'reported "inference thread died: InjectedFatal: x"') in text
        assert "Restart 1 of at most 2" in text
        second = server.child
        assert second.pid != first.pid and second.poll() is None and other.poll() is None
        assert marker.read_text().split() == [str(first.pid), str(second.pid)]
        time.sleep(1.5)                                     # the new one stays healthy: no second restart
        assert "Restart 2" not in out.getvalue()
        other.proc.kill()
        runner.join(30)
        assert not runner.is_alive()
    finally:
        sup.stop_all(grace=2.0)
        listen.close()


@pytest.mark.e2e
def test_launcher_restarts_a_real_server_after_its_inference_thread_died(tmp_path, tiny_dense_path, monkeypatch):
    """The real MLX server with a fatal fault armed through MLXSTACK_FAULTS: the request that hits
    it gets a 503, /health says why, and the launcher replaces the process."""
    from mlxstack.launcher import litellm_config as lc
    from mlxstack.launcher.supervisor import Supervisor

    monkeypatch.setenv("MLXSTACK_FAULTS", "decode_forward:1:fatal")
    settings = _launcher_settings(tmp_path, model_path=tiny_dense_path, disk_cache_dir="off",
                                  default_temperature=0, mlx_unhealthy_restart_seconds=0.5)
    out = StringIO()
    sup = Supervisor(out)
    cmd = [sys.executable, "-m", "mlxstack.serve"]
    server, listen, runner = _supervise(sup, settings, cmd, tmp_path)
    base = lc.mlx_base_url(settings)
    try:
        first = server.child
        other = sup.start("litellm", [sys.executable, "-c", "import time; time.sleep(600)"], os.environ)
        status, body = chat(base, "Hello there.", timeout=120)
        assert status == 503 and body["error"]["code"] == "inference_thread_died", body
        status, body = health(base)
        assert status == 503 and body["error"].startswith("inference thread died: InjectedFatal")
        runner.start()
        _wait_for(out, "MLX server restarted", runner, 240)
        assert server.child.pid != first.pid and health(base)[0] == 200
        assert "[mlx] MLXSTACK_FAULTS='decode_forward:1:fatal': fault injection ARMED (tests only)" in out.getvalue()
        other.proc.kill()
        runner.join(30)
    finally:
        sup.stop_all(grace=3.0)
        listen.close()
