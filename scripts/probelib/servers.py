"""Server child processes (ours or mlx_lm.server) on free ports, with the BLAS preload."""
from __future__ import annotations


import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[2]   # scripts/probelib/x.py -> the repository
DEFAULT_PROXY_URL = "http://127.0.0.1:4000/v1"
DEFAULT_MLX_URL = "http://127.0.0.1:8080"
EMBEDDED_MODEL_DIR = "SmolLM2-135M-Instruct-f32"

from .client import ProbeError, free_port, setting

# ----------------------------------------------------------------------------- server processes
def blas_env() -> dict[str, str]:
    """LD_PRELOAD of OpenBLAS and huge pages for malloc, as the launcher gives the MLX server
    (system/process_env.py; fair for both servers)."""
    try:
        sys.path.insert(0, str(REPO_ROOT))
        from mlxstack.config.settings import load_settings
        from mlxstack.system.process_env import server_env

        return server_env(load_settings(env={}))
    except Exception:  # noqa: BLE001 - best effort
        return {}


def embedded_model_path() -> Path:
    base = Path(setting("MODEL_CACHE_DIR", "") or Path.home() / ".cache" / "mlxstack").expanduser()
    return base / EMBEDDED_MODEL_DIR


class ServerProcess:
    """A server child process on a free port; ``stop()`` ends it (and only it) by pid."""

    def __init__(self, kind: str, *, port: int | None = None, env: dict | None = None, model_path: str | None = None,
                 python: str | None = None, log_path: str | None = None, extra_args: Sequence[str] = ()) -> None:
        self.kind = kind  # "ours" | "mlx_lm"
        self.port = port or free_port()
        python = python or sys.executable
        child_env = dict(os.environ)
        child_env.update(blas_env())
        if kind == "ours":
            # MLX_API_KEY empty: the probes talk to this server directly (.env may hold a key for the stack)
            child_env.update({"MLX_PORT": str(self.port), "MLX_HOST": "127.0.0.1", "MLX_API_KEY": ""})
            cmd = [python, "-m", "mlxstack.serve"]
        elif kind == "mlx_lm":
            model_path = model_path or str(embedded_model_path())
            cmd = [python, "-m", "mlx_lm.server", "--model", model_path, "--port", str(self.port),
                   "--host", "127.0.0.1", *extra_args]
        else:
            raise ValueError(kind)
        child_env.update(env or {})
        self.cmd = cmd
        self.log_path = log_path or f"/tmp/probe-{kind}-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=child_env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.time() + timeout
        url = self.root + "/health"
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ProbeError(f"{self.kind} server exited with {self.proc.returncode}; log: {self.log_path}\n"
                                 + self.tail())
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    body = json.load(resp)
                if self.kind != "ours" or body.get("ready"):
                    self.warm_up(max(5.0, deadline - time.time()))
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.5)
        raise ProbeError(f"{self.kind} server not ready after {timeout:.0f}s; log: {self.log_path}\n" + self.tail())

    def warm_up(self, timeout: float) -> None:
        """One tiny request so model load / first-call compilation is not billed to the first turn."""
        body = {"model": "default_model" if self.kind == "mlx_lm" else self._model_id(),
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
        req = urllib.request.Request(self.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()

    def _model_id(self) -> str:
        with urllib.request.urlopen(self.base_url + "/models", timeout=10) as resp:
            data = json.load(resp).get("data") or [{}]
        return data[0].get("id", "default_model")

    def tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: only this child and its children
            except OSError:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ----------------------------------------------------------------------------- the whole stack
def launch_stack(env: dict, log_path: Path, timeout: float = 300.0, prelude: str = "") -> tuple[subprocess.Popen, object]:
    """Start the whole stack (the launcher: MLX server(s) + LiteLLM) in a child process with
    ``env`` as its settings, logging to ``log_path``; return (process, open log) once it printed
    READY. ``prelude``: Python run in that child before the launcher (a test's observer).
    Raises RuntimeError with the log's tail if it exits or times out first."""
    code = (prelude + "\n" if prelude else "") + ("import sys; from mlxstack.config.settings import load_settings; "
            "from mlxstack.launcher.stack import run_stack; "
            f"sys.exit(run_stack(load_settings(env={env!r}), repo=__import__('pathlib').Path({str(REPO_ROOT)!r})))")
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while "READY" not in log_path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
            log.close()
            raise RuntimeError("the stack did not print its READY line:\n" + log_path.read_text()[-3000:])
        time.sleep(0.5)
    return proc, log

