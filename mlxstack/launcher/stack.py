"""Bring up MLX server → LiteLLM proxy, print the ready line, supervise, shut down cleanly.

Order matters: LiteLLM is started only after the MLX server's /health says ready, because its
config needs the model id the server actually serves, and a proxy that accepts requests before
its backend exists only produces confusing 500s.

Faults: a crashed MLX server (killed, OOM) is restarted with backoff while LiteLLM keeps
running; more than MLX_MAX_RESTARTS crashes within MLX_RESTART_WINDOW_SECONDS stop the stack.
A configuration error or a failed model load exits at once with the server's own error line,
never restarted (mlxstack/system/exit_codes.py).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Callable

from mlxstack.config.settings import REPO_ROOT, Settings
from mlxstack.launcher import litellm_config as lc
from mlxstack.launcher import ports
from mlxstack.launcher.restarts import RestartPolicy
from mlxstack.launcher.supervisor import Child, Supervisor, describe_exit
from mlxstack.system.exit_codes import EXIT_CONFIG_ERROR, EXIT_MODEL_LOAD_FAILED, LOAD_FAILED_MARKER, NOT_RESTARTABLE
from mlxstack.system.listen_socket import LISTEN_FD_ENV, listen_socket
from mlxstack.system.secrets import make_private_dir, mask_secret, write_private_file


class LaunchError(RuntimeError):
    """Start-up cannot continue; the message says why and what to do."""


class ChildExited(LaunchError):
    """A child process exited while we waited for it to become ready."""

    def __init__(self, message: str, child: Child) -> None:
        super().__init__(message)
        self.child = child


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):  # noqa: ARG001
    raise _Stop()


def get_json(url: str, timeout: float = 2.0) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        body, status = e.read(), e.code
    try:
        return status, json.loads(body or b"null")
    except ValueError:
        return status, None


def free_port(kind: str, host: str, port: int, repo: Path, pidfile: Path, extra: tuple[str, ...], say) -> None:
    """Stop our own leftover on ``port``; refuse (LaunchError) when anything else holds it."""
    if port == 0:
        return
    owners = ports.port_owners(port)
    action, who = ports.stale_decision(owners, kind, repo, extra, ports.read_pidfile(pidfile))
    if action == "refuse":
        desc = "; ".join(f"pid {o.pid}: {o.command}" for o in who)
        raise LaunchError(f"port {port} (needed for {kind}) is held by another program — {desc}. "
                          f"Stop it, or choose another port in .env.")
    for owner in who:
        say(f"stopping leftover {kind} from a previous run on port {port} (pid {owner.pid})")
        ports.terminate_pid(owner.pid)
    if action == "free" and not ports.port_is_free(host, port):
        raise LaunchError(f"port {port} on {host} is in use by a process we cannot identify "
                          "(another user's?). Free it or choose another port in .env.")
    if not ports.wait_port_free(host, port, 5.0):
        raise LaunchError(f"port {port} is still busy after stopping the leftover {kind}.")


def mlx_env(settings: Settings) -> dict[str, str]:
    env = {**os.environ, **settings.as_env(), "PYTHONUNBUFFERED": "1"}
    try:
        from mlxstack.system.blas import blas_preload_env
    except ImportError:
        return env
    # it keeps an existing LD_PRELOAD from ``environ`` (BLAS first), so its value replaces ours
    return {**env, **(blas_preload_env(settings, environ=env) or {})}


def litellm_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "HOST", "PORT")}
    env.update(LITELLM_MASTER_KEY=settings.litellm_master_key, LITELLM_LOCAL_MODEL_COST_MAP="True",
               LITELLM_TELEMETRY="False", PYTHONUNBUFFERED="1")
    if settings.mlx_api_key:  # the generated config refers to it as os.environ/MLX_API_KEY
        env["MLX_API_KEY"] = settings.mlx_api_key
    return env


def exit_message(child: Child) -> str:
    """Why a child exited, with the server's own error line for the statuses that carry one."""
    code = child.poll()
    if child.name == "mlx" and code == EXIT_MODEL_LOAD_FAILED:
        line = child.last_line_with(LOAD_FAILED_MARKER) or ""
        detail = line.split(LOAD_FAILED_MARKER, 1)[1].strip() if LOAD_FAILED_MARKER in line else "see its output above"
        return f"the MLX server could not load the model: {detail}"
    if child.name == "mlx" and code == EXIT_CONFIG_ERROR:
        line = child.last_line_with("configuration error") or "see its output above"
        return f"the MLX server refused to start: {line.strip()}"
    return f"{child.name} (pid {child.pid}) exited: {describe_exit(code)}; see its output above."


def litellm_command(python: str, config: Path, host: str, port: int) -> list[str]:
    script = Path(python).parent / "litellm"
    base = [python, str(script)] if script.exists() else [
        python, "-c", "import sys; from litellm import run_server; sys.argv[0] = 'litellm'; sys.exit(run_server())"]
    return base + ["--config", str(config), "--host", host, "--port", str(port)]


def wait_ready(child: Child, probe: Callable[[], dict | None], timeout: float, what: str, say) -> dict:
    """Poll ``probe`` until it returns a dict; show elapsed time so a long model preparation
    never looks like a hang."""
    start, last_note = time.monotonic(), 0.0
    tty = sys.stdout.isatty()
    while True:
        if child.poll() is not None:
            raise ChildExited(f"during start-up, {exit_message(child)}", child)
        result = probe()
        if result is not None:
            return result
        elapsed = time.monotonic() - start
        if elapsed > timeout:
            raise LaunchError(f"{what} not ready after {timeout:g}s (raise the *_STARTUP_TIMEOUT_SECONDS setting?).")
        if elapsed - last_note >= (5 if tty else 15):
            last_note = elapsed
            say(f"waiting for {what} ... {elapsed:.0f}s")
        time.sleep(0.5)


def _mlx_probe(base: str) -> Callable[[], dict | None]:
    def probe() -> dict | None:
        try:
            status, body = get_json(f"{base}/health")
        except OSError:
            return None
        return body if status == 200 and isinstance(body, dict) and body.get("ready") else None
    return probe


def _proxy_probe(base: str) -> Callable[[], dict | None]:
    def probe() -> dict | None:
        try:  # never /health: on LiteLLM it makes a real model call
            status, _ = get_json(f"{base}/health/liveliness")
        except OSError:
            return None
        return {} if status == 200 else None
    return probe


def ready_text(settings: Settings, names: list[str]) -> str:
    proxy, mlx = lc.proxy_base_url(settings), lc.mlx_base_url(settings)
    body = json.dumps({"model": names[0], "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    return "\n".join([
        f"READY  proxy {proxy}/v1  model {names[0]}  |  MLX server {mlx}/v1  dashboard {mlx}/dashboard",
        "  curl:  KEY=$(sed -n 's/^LITELLM_MASTER_KEY=//p' .env)",
        f"         curl {proxy}/v1/chat/completions -H \"Authorization: Bearer $KEY\" "
        f"-H 'Content-Type: application/json' -d '{body}'",
        f"  OpenClaw / PI / any OpenAI-compatible client: base URL {proxy}/v1, API key = LITELLM_MASTER_KEY "
        f"from .env, model {' or '.join(names)}",
        f"  keys (full values in .env): LITELLM_MASTER_KEY {mask_secret(settings.litellm_master_key)}"
        + (f"  |  MLX_API_KEY {mask_secret(settings.mlx_api_key)} (LiteLLM -> MLX server)" if settings.mlx_api_key else ""),
        "  Ctrl-C stops both servers.",
    ])


def start_mlx(sup: Supervisor, settings: Settings, cmd: list[str], repo: Path, pidfile: Path, say,
              listen: socket.socket | None = None) -> tuple[Child, dict]:
    """Start the MLX server (on ``listen``, the launcher's socket, when given) and wait for /health
    to say ready (ChildExited if it dies first)."""
    env = mlx_env(settings)
    if listen is not None:
        env[LISTEN_FD_ENV] = str(listen.fileno())
    mlx = sup.start("mlx", cmd, env, cwd=str(repo), pass_fds=(listen.fileno(),) if listen is not None else ())
    write_private_file(pidfile, f"{mlx.pid}\n")
    health = wait_ready(mlx, _mlx_probe(lc.mlx_base_url(settings)), settings.mlx_startup_timeout_seconds,
                        "MLX server (loading / preparing the model; the first run converts it)", say)
    return mlx, health


def supervise(sup: Supervisor, settings: Settings, cmd: list[str], repo: Path, pidfile: Path, say,
              policy: RestartPolicy | None = None, listen: socket.socket | None = None) -> None:
    """Return when the stack must stop: LiteLLM died, the MLX server cannot be restarted, or it
    crash-looped. A crashed MLX server is restarted meanwhile; LiteLLM is left running."""
    policy = policy or RestartPolicy(settings.mlx_max_restarts, settings.mlx_restart_window_seconds)
    dead = sup.wait_any()
    while True:
        if dead.name != "mlx":
            say(f"{dead.name} (pid {dead.pid}) stopped unexpectedly: {describe_exit(dead.poll())}. Stopping the stack.")
            return
        code = dead.poll()
        if code in NOT_RESTARTABLE:
            say(f"ERROR: {exit_message(dead)} (not restarted: restarting cannot fix it)")
            return
        delay = policy.next_delay(time.monotonic())
        if delay is None:
            say(f"ERROR: the MLX server crashed again ({describe_exit(code)}) after {policy.max_restarts} restart(s) "
                f"within {policy.window:g}s: a crash loop (MLX_MAX_RESTARTS={policy.max_restarts}, "
                "MLX_RESTART_WINDOW_SECONDS). Stopping the stack; see the MLX output above for the cause.")
            return
        say("!" * 78)
        say(f"!! MLX SERVER DIED (pid {dead.pid}, {describe_exit(code)}). Restart {len(policy.history)} of at most "
            f"{policy.max_restarts} per {policy.window:g}s, in {delay:g}s. LiteLLM stays up; requests in flight are "
            f"lost, new ones wait for the restarted server (503 while it loads); its prompt cache restarts cold.")
        say("!" * 78)
        sup.forget(dead)
        time.sleep(delay)
        try:
            mlx, _ = start_mlx(sup, settings, cmd, repo, pidfile, say, listen)
        except ChildExited as exc:
            dead = exc.child
            continue
        say(f"MLX server restarted (pid {mlx.pid}) and ready after {time.monotonic() - mlx.started:.1f}s")
        dead = sup.wait_any()


def run_stack(settings: Settings, *, python: str = sys.executable, repo: Path = REPO_ROOT,
              mlx_cmd: list[str] | None = None, out: IO[str] | None = None) -> int:
    """Run until we are asked to stop (exit 0) or the stack cannot go on (exit 1: LiteLLM died, the MLX
    server failed to start, cannot be restarted, or crash-looped)."""
    sup = Supervisor(out)
    say = sup.say
    if not settings.litellm_master_key:
        say("LITELLM_MASTER_KEY is empty: LiteLLM refuses to start without one. "
            "Run python3 install_and_run.py (it writes one into .env) or set it yourself.")
        return 2
    logs = make_private_dir(settings.log_root_path)  # request logs hold prompts
    config_path, mlx_pid, proxy_pid = logs / "litellm_config.yaml", logs / ".mlx.pid", logs / ".litellm.pid"
    # SIGINT explicitly too: a launcher started in the background of a non-interactive shell
    # inherits SIGINT as ignored, and Ctrl-C / kill -INT must still stop the stack.
    old = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    code = 1
    listen: socket.socket | None = None
    try:
        free_port("mlx", settings.mlx_host, settings.mlx_port, repo, mlx_pid, (), say)
        free_port("litellm", settings.proxy_host, settings.proxy_port, repo, proxy_pid, (str(config_path),), say)
        say(f"starting MLX server on {lc.mlx_base_url(settings)} (model: {settings.model_path or lc.EMBEDDED_MODEL_NAME})")
        cmd = mlx_cmd or [python, "-m", "mlxstack.serve"]
        try:  # held by the launcher for its whole life: a restart never closes the port
            listen = listen_socket(settings.mlx_host, settings.mlx_port)
        except OSError as exc:
            raise LaunchError(f"cannot listen on {settings.mlx_host}:{settings.mlx_port} ({exc}); "
                              "choose another MLX_PORT / MLX_HOST in .env") from None
        if settings.mlx_port == 0:
            settings = settings.replace(mlx_port=listen.getsockname()[1])
        mlx, health = start_mlx(sup, settings, cmd, repo, mlx_pid, say, listen)
        served = str(health.get("model") or lc.model_name(settings))
        say(f"MLX server ready after {time.monotonic() - mlx.started:.1f}s, serving {served}; starting LiteLLM")
        lc.write_config(settings, served, config_path, lc.served_context_window(settings))
        proxy = sup.start("litellm", litellm_command(python, config_path, settings.proxy_host, settings.proxy_port),
                          litellm_env(settings), cwd=str(repo))
        write_private_file(proxy_pid, f"{proxy.pid}\n")
        wait_ready(proxy, _proxy_probe(lc.proxy_base_url(settings)), settings.proxy_startup_timeout_seconds, "LiteLLM proxy", say)
        say(ready_text(settings, lc.proxy_model_names(settings)))
        supervise(sup, settings, cmd, repo, mlx_pid, say, listen=listen)
    except LaunchError as exc:
        say(f"ERROR: {exc}")
    except (KeyboardInterrupt, _Stop):
        say("stopping ...")
        code = 0
    finally:
        for sig in old:  # a second signal must not cut the clean stop short
            signal.signal(sig, signal.SIG_IGN)
        try:
            sup.stop_all(grace=3.0)
        except KeyboardInterrupt:
            sup.stop_all(grace=0.5)
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for f in (mlx_pid, proxy_pid):
            f.unlink(missing_ok=True)
        if listen is not None:
            listen.close()
    if code == 0:
        say("stopped; ports freed")
    return code
