"""Bring up MLX server → LiteLLM proxy, print the ready line, supervise, shut down cleanly.

Order matters: LiteLLM is started only after the MLX server's /health says ready, because its
config needs the model id the server actually serves, and a proxy that accepts requests before
its backend exists only produces confusing 500s.

Faults: a crashed MLX server (killed, OOM) is restarted with backoff while LiteLLM keeps
running; more than MLX_MAX_RESTARTS crashes within MLX_RESTART_WINDOW_SECONDS stop the stack.
A server that is up but cannot serve -- its /health answers 503 ``status: error`` (inference thread
dead or stalled) for MLX_UNHEALTHY_RESTART_SECONDS -- is stopped and counts as a crash.
A configuration error or a failed model load exits at once with the server's own error line,
never restarted (mlxstack/system/exit_codes.py).

Several backends (launcher/backends.py: a backends file, or MLX_REPLICAS): every local one is its
own MLX server process on its own launcher-held port, all loading at once and each restarted on
its own; LiteLLM starts once they are ready and lists each backend as a deployment of the model
its /v1/models names. With other backends still serving, one that cannot be restarted is left
down (said loudly) instead of stopping everything: the router moves its sessions.

Why one module of ~500 lines: start-up order, the supervision loop and shutdown share one set of
child processes and ports; backends, LiteLLM config, ports and restarts already live beside it.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from mlxstack.config.settings import REPO_ROOT, Settings, SettingsError
from mlxstack.config.tenants import TenantsError, read_tenants
from mlxstack.launcher import litellm_config as lc
from mlxstack.launcher import ports
from mlxstack.launcher.backends import Backend, ModelGroup, load_backends, model_groups
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


def get_json(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> tuple[int, object]:
    """(status, JSON body or None). A server that dies mid-answer (the body cut short, a bad status
    line) raises ConnectionError -- an OSError, like one that never answered: callers treat both
    as no answer (a supervisor thread once died of the IncompleteRead instead)."""
    try:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
                body = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            body, status = e.read(), e.code
    except http.client.HTTPException as exc:
        raise ConnectionError(f"{url}: answer cut short ({type(exc).__name__})") from exc
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
        from mlxstack.system.process_env import server_env
    except ImportError:
        return env
    # it keeps an existing LD_PRELOAD / GLIBC_TUNABLES from ``environ``, so its values replace ours
    return {**env, **server_env(settings, environ=env)}


def tenants_path(settings: Settings, repo: Path = REPO_ROOT) -> Path | None:
    """TENANT_KEYS_FILE as an absolute path (relative to the checkout), None when unset."""
    if not settings.tenant_keys_file:
        return None
    path = Path(settings.tenant_keys_file).expanduser()
    return path if path.is_absolute() else repo / path


def check_tenants(settings: Settings, repo: Path = REPO_ROOT) -> int:
    """How many tenants TENANT_KEYS_FILE names (0: unset); TenantsError for a file the front door
    could not use (missing, readable by others, malformed) -- refused before anything starts."""
    path = tenants_path(settings, repo)
    if path is None:
        return 0
    if not settings.mlx_api_key:
        raise TenantsError("TENANT_KEYS_FILE needs MLX_API_KEY: the MLX server believes the front door's tenant "
                           "header only from a request that carries the backend key (install_and_run.py writes "
                           "one into .env)")
    return len(set(read_tenants(path).values()))


def litellm_env(settings: Settings, backends: list[Backend] | None = None, repo: Path = REPO_ROOT) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "HOST", "PORT")}
    tenants = tenants_path(settings, repo)
    if tenants is not None:          # the front door reads it (and again whenever it changes)
        env["TENANT_KEYS_FILE"] = str(tenants)
    env.update(LITELLM_MASTER_KEY=settings.litellm_master_key, LITELLM_LOCAL_MODEL_COST_MAP="True",
               LITELLM_TELEMETRY="False", PYTHONUNBUFFERED="1")
    if settings.mlx_api_key:  # the generated config refers to it as os.environ/MLX_API_KEY
        env["MLX_API_KEY"] = settings.mlx_api_key
    if backends:  # several backends: LiteLLM imports our routing hook, which reads its settings here
        env.update(lc.backend_key_refs(settings, backends)[1])
        env["PYTHONPATH"] = os.pathsep.join([str(repo)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.update(ROUTING=settings.routing, ROUTING_AFFINITY_TTL_SECONDS=str(settings.routing_affinity_ttl_seconds),
                   CACHE_CANONICALIZE_TOOL_CONTEXT=str(settings.cache_canonicalize_tool_context).lower(),
                   STRIP_BILLING_HEADER=str(settings.strip_billing_header).lower())
    return env


def is_mlx(name: str) -> bool:
    """An MLX server child: ``mlx`` (one backend) or ``mlx:<port>`` (several)."""
    return name == "mlx" or name.startswith("mlx:")


def exit_message(child: Child) -> str:
    """Why a child exited, with the server's own error line for the statuses that carry one."""
    code = child.poll()
    if is_mlx(child.name) and code == EXIT_MODEL_LOAD_FAILED:
        line = child.last_line_with(LOAD_FAILED_MARKER) or ""
        detail = line.split(LOAD_FAILED_MARKER, 1)[1].strip() if LOAD_FAILED_MARKER in line else "see its output above"
        return f"the MLX server could not load the model: {detail}"
    if is_mlx(child.name) and code == EXIT_CONFIG_ERROR:
        line = child.last_line_with("configuration error") or "see its output above"
        return f"the MLX server refused to start: {line.strip()}"
    return f"{child.name} (pid {child.pid}) exited: {describe_exit(code)}; see its output above."


def litellm_command(python: str, config: Path, host: str, port: int) -> list[str]:
    script = Path(python).parent / "litellm"
    base = [python, str(script)] if script.exists() else [
        python, "-c", "import sys; from litellm import run_server; sys.argv[0] = 'litellm'; sys.exit(run_server())"]
    return base + ["--config", str(config), "--host", host, "--port", str(port)]


def wait_ready(child: Child, probe: Callable[[], dict | None], timeout: float, what: str, say,
               setting: str = "*_STARTUP_TIMEOUT_SECONDS") -> dict:
    """Poll ``probe`` until it returns a dict; show elapsed time so a long model preparation
    never looks like a hang. ``setting``: the variable that set ``timeout`` (named when it runs out).
    While the server reports a model download in progress (its /health ``fetch``, kept by the probe
    as ``probe.fetching``), the time does not count against ``timeout``: a download's length is the
    network's, not a hang; the notes say how far it is."""
    start, last_note = time.monotonic(), 0.0
    tty = sys.stdout.isatty()
    paused, last = 0.0, start
    while True:
        if child.poll() is not None:
            raise ChildExited(f"during start-up, {exit_message(child)}", child)
        result = probe()
        if result is not None:
            return result
        now = time.monotonic()
        fetching = getattr(probe, "fetching", None)
        if fetching:
            paused += now - last
        last = now
        elapsed = now - start - paused
        if elapsed > timeout:
            raise LaunchError(f"{what} not ready after {timeout:g}s (raise {setting} in .env?).")
        if now - start - last_note >= (5 if tty else 15):
            last_note = now - start
            if fetching:
                done, total = fetching.get("bytes_done") or 0, fetching.get("bytes_total") or 0
                say(f"waiting for {what}: downloading {fetching.get('repo')} ... {done / 2 ** 30:.2f} of "
                    f"{total / 2 ** 30:.2f} GiB, {last_note:.0f}s")
            else:
                say(f"waiting for {what} ... {elapsed:.0f}s")
        time.sleep(0.5)


def proxy_startup_limit(settings: Settings) -> tuple[float, str]:
    """(seconds LiteLLM may take to report ready, the variable that set them): the seed's
    PROXY_STARTUP_WAIT_SECONDS when that is what .env set (load_settings folded it in)."""
    name = "PROXY_STARTUP_WAIT_SECONDS" if settings.proxy_startup_wait_seconds else "PROXY_STARTUP_TIMEOUT_SECONDS"
    return settings.proxy_startup_timeout_seconds, name


def _mlx_probe(base: str) -> Callable[[], dict | None]:
    """/health's body once it says ready, else None; ``probe.fetching``: the body's ``fetch`` while
    a model download is in progress (None otherwise)."""
    def probe() -> dict | None:
        probe.fetching = None  # type: ignore[attr-defined]
        try:
            status, body = get_json(f"{base}/health")
        except OSError:
            return None
        fetch = body.get("fetch") if isinstance(body, dict) else None
        if isinstance(fetch, dict) and fetch.get("state") in ("checking", "downloading"):
            probe.fetching = fetch  # type: ignore[attr-defined]
        return body if status == 200 and isinstance(body, dict) and body.get("ready") else None
    probe.fetching = None  # type: ignore[attr-defined]
    return probe


def mlx_health_problem(base: str, timeout: float = 2.0) -> tuple[bool, str | None]:
    """(answered, the error a ready-then-broken server reports): a 503 ``status: error`` body is
    a problem; a 200 is none; no answer (timeout, refused) tells nothing -- a long step may hold
    a busy server's HTTP threads, and a dead process is seen by its exit instead."""
    try:
        status, body = get_json(f"{base}/health", timeout=timeout)
    except OSError:
        return False, None
    if status == 503 and isinstance(body, dict) and body.get("status") == "error":
        return True, str(body.get("error") or "unhealthy")
    return status == 200, None


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
        *([f"  one model over {ranks_text(settings)}: rank 0 answers on {mlx}, every rank follows its steps"]
          if settings.distributed != "off" else []),
        "  Ctrl-C stops both servers.",
    ])


def ranks_text(settings: Settings) -> str:
    """How the MLX server's ranks are laid out, in words (pure)."""
    where = (f"{settings.distributed_local_ranks} local ranks" if settings.distributed_local_ranks
             else f"the ranks of {settings.distributed_hosts}")
    return f"{where} ({settings.distributed} parallel)"


def stack_ready_text(settings: Settings, groups: list[ModelGroup]) -> str:
    """The READY line for several backends: every model name and where each backend answers."""
    proxy = lc.proxy_base_url(settings)
    lines = [f"READY  proxy {proxy}/v1  models {', '.join(g.names[1] if len(g.names) > 1 else g.names[0] for g in groups)}"
             f"  |  routing {settings.routing}"]
    for g in groups:
        lines.append(f"  model {' or '.join(g.names)}: {len(g.backends)} backend(s)")
        for b in g.backends:
            where = f"{b.url}/v1  dashboard {b.url}/dashboard" if b.local else f"{b.url}/v1 (remote)"
            lines.append(f"    {b.name:<22} {where}")
    lines += [
        "  curl:  KEY=$(sed -n 's/^LITELLM_MASTER_KEY=//p' .env)",
        f"         curl {proxy}/v1/models -H \"Authorization: Bearer $KEY\"",
        f"  keys (full values in .env): LITELLM_MASTER_KEY {mask_secret(settings.litellm_master_key)}"
        + (f"  |  MLX_API_KEY {mask_secret(settings.mlx_api_key)} (LiteLLM -> MLX servers)" if settings.mlx_api_key else ""),
        "  Ctrl-C stops every server.",
    ]
    return "\n".join(lines)


def _spawn_mlx(sup: Supervisor, name: str, settings: Settings, cmd: list[str], repo: Path, pidfile: Path,
               listen: socket.socket | None) -> Child:
    env = mlx_env(settings)
    if listen is not None:
        env[LISTEN_FD_ENV] = str(listen.fileno())
    mlx = sup.start(name, cmd, env, cwd=str(repo), pass_fds=(listen.fileno(),) if listen is not None else ())
    write_private_file(pidfile, f"{mlx.pid}\n")
    return mlx


def start_mlx(sup: Supervisor, settings: Settings, cmd: list[str], repo: Path, pidfile: Path, say,
              listen: socket.socket | None = None, name: str = "mlx") -> tuple[Child, dict]:
    """Start the MLX server (on ``listen``, the launcher's socket, when given) and wait for /health
    to say ready (ChildExited if it dies first)."""
    mlx = _spawn_mlx(sup, name, settings, cmd, repo, pidfile, listen)
    health = wait_ready(mlx, _mlx_probe(lc.mlx_base_url(settings)), settings.mlx_startup_timeout_seconds,
                        "MLX server (loading / preparing the model; the first run converts it)", say,
                        "MLX_STARTUP_TIMEOUT_SECONDS")
    return mlx, health


@dataclass
class LocalServer:
    """A local MLX backend the launcher keeps running: its settings, pid file, port and restart policy."""

    name: str
    settings: Settings
    pidfile: Path
    policy: RestartPolicy
    listen: socket.socket | None = None
    child: Child | None = None
    restart_at: float | None = None     # when a crashed server is started again
    starting: bool = False              # restarted, not ready yet
    given_up: bool = False
    unhealthy_since: float | None = None   # first /health error answer of the current run
    next_health: float = 0.0            # when /health is asked next
    stopped_for: str | None = None      # the launcher stopped it: why (its exit is then a crash)
    _probe: Callable[[], dict | None] | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        """'' for the single backend (the messages stay as they were), else ' mlx:<port>'."""
        return "" if self.name == "mlx" else f" {self.name}"


def supervise(sup: Supervisor, settings: Settings, cmd: list[str], repo: Path, pidfile: Path, say,
              policy: RestartPolicy | None = None, listen: socket.socket | None = None) -> None:
    """One MLX server: return when the stack must stop (LiteLLM died, the server cannot be
    restarted, or it crash-looped). A crashed server is restarted meanwhile; LiteLLM is left running."""
    policy = policy or RestartPolicy(settings.mlx_max_restarts, settings.mlx_restart_window_seconds)
    child = next((c for c in sup.children if c.name == "mlx"), None)
    supervise_all(sup, {"mlx": LocalServer("mlx", settings, pidfile, policy, listen, child)}, cmd, repo, say)


def supervise_all(sup: Supervisor, servers: dict[str, LocalServer], cmd: list[str], repo: Path, say,
                  others_serve: bool = False, interval: float = 0.2, health_interval: float = 2.0) -> None:
    """Return when the stack must stop: LiteLLM died, or no backend is left.

    Each crashed server is restarted on its own (backoff, crash-loop limit); the others keep
    serving meanwhile. One that cannot be restarted (a configuration error, a failed load, a crash
    loop) stops the stack when it was the only one; with other backends (``others_serve``: remote
    ones, or other local ones still up) it is left down and the stack goes on. A ready server whose
    /health reports an error (every ``health_interval`` s) for MLX_UNHEALTHY_RESTART_SECONDS is
    stopped, and its exit handled as a crash.
    """
    while True:
        now = time.monotonic()
        dead = sup.first_exited()
        if dead is not None and dead.name not in servers:
            say(f"{dead.name} (pid {dead.pid}) stopped unexpectedly: {describe_exit(dead.poll())}. Stopping the stack.")
            return
        if dead is not None:
            server = servers[dead.name]
            code = dead.poll()
            problem = None
            if code in NOT_RESTARTABLE:
                problem = f"{exit_message(dead)} (not restarted: restarting cannot fix it)"
            else:
                delay = server.policy.next_delay(now)
                if delay is None:
                    p = server.policy
                    problem = (f"the MLX server{server.label} crashed again ({describe_exit(code)}) after {p.max_restarts} "
                               f"restart(s) within {p.window:g}s: a crash loop (MLX_MAX_RESTARTS={p.max_restarts}, "
                               "MLX_RESTART_WINDOW_SECONDS)")
            sup.forget(dead)
            server.child, server.starting = None, False
            if problem is not None:
                server.given_up = True
                left = [s.name for s in servers.values() if not s.given_up]
                if not left and not others_serve:
                    say(f"ERROR: {problem}. Stopping the stack; see the MLX output above for the cause.")
                    return
                say(f"ERROR: {problem}. It stays down; still serving: {', '.join(left) or 'the remote backends'}.")
                continue
            say("!" * 78)
            if len(servers) == 1 and not others_serve:
                after = ("LiteLLM stays up; requests in flight are lost, new ones wait for the restarted server "
                         "(503 while it loads); its prompt cache restarts cold.")
                if server.settings.distributed != "off":
                    after += f" It serves over {ranks_text(server.settings)}: every rank restarts with it."
            else:
                after = ("LiteLLM stays up and moves its sessions to the other backends (one cold turn each); "
                         "requests in flight there are lost.")
            why = f"; stopped by the launcher: {server.stopped_for}" if server.stopped_for else ""
            server.stopped_for, server.unhealthy_since = None, None
            say(f"!! MLX SERVER{server.label} DIED (pid {dead.pid}, {describe_exit(code)}{why}). Restart "
                f"{len(server.policy.history)} of at most {server.policy.max_restarts} per {server.policy.window:g}s, "
                f"in {delay:g}s. {after}")
            say("!" * 78)
            server.restart_at = now + delay
            continue
        for server in servers.values():
            if server.restart_at is not None and now >= server.restart_at:
                server.restart_at = None
                server.child = _spawn_mlx(sup, server.name, server.settings, cmd, repo, server.pidfile, server.listen)
                server.starting = True
                server._probe = _mlx_probe(lc.mlx_base_url(server.settings))
            elif server.starting and server.child is not None and server._probe is not None:
                if server._probe() is not None:
                    server.starting = False
                    say(f"MLX server{server.label} restarted (pid {server.child.pid}) and ready after "
                        f"{time.monotonic() - server.child.started:.1f}s")
                elif time.monotonic() - server.child.started > server.settings.mlx_startup_timeout_seconds:
                    raise LaunchError(f"MLX server{server.label} not ready after "
                                      f"{server.settings.mlx_startup_timeout_seconds:g}s (raise MLX_STARTUP_TIMEOUT_SECONDS?).")
            elif server.child is not None and server.restart_at is None and now >= server.next_health:
                server.next_health = now + health_interval
                _check_health(sup, server, say)
        time.sleep(interval)


def _check_health(sup: Supervisor, server: LocalServer, say) -> None:
    """Ask a running, ready server's /health; stop it once it has reported an error for
    MLX_UNHEALTHY_RESTART_SECONDS (the next loop sees it exit and restarts it as a crash)."""
    limit = server.settings.mlx_unhealthy_restart_seconds
    if limit <= 0 or server.child is None or server.child.poll() is not None or server.stopped_for:
        return
    answered, problem = mlx_health_problem(lc.mlx_base_url(server.settings))
    if not answered:
        return
    now = time.monotonic()
    if problem is None:
        if server.unhealthy_since is not None:
            say(f"MLX server{server.label} (pid {server.child.pid}) is healthy again")
        server.unhealthy_since = None
        return
    if server.unhealthy_since is None:
        server.unhealthy_since = now
        say(f"MLX server{server.label} (pid {server.child.pid}) reports: {problem}. It is restarted if this "
            f"lasts {limit:g}s (MLX_UNHEALTHY_RESTART_SECONDS).")
    if now - server.unhealthy_since >= limit:
        server.stopped_for = f"/health reported \"{problem}\" for {now - server.unhealthy_since:.0f}s"
        say(f"MLX server{server.label} (pid {server.child.pid}) unhealthy for {now - server.unhealthy_since:.0f}s: "
            "stopping it to restart it")
        sup.terminate(server.child, grace=5.0)


def discover_model(backend: Backend, timeout: float = 5.0) -> tuple[str, int | None] | None:
    """(model id, context window) from a backend's /v1/models, None when it does not answer."""
    headers = {"Authorization": f"Bearer {backend.api_key}"} if backend.api_key else {}
    try:
        status, body = get_json(f"{backend.url}/v1/models", timeout=timeout, headers=headers)
        entry = body["data"][0] if status == 200 else None  # type: ignore[index]
    except (OSError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(entry, dict) or not entry.get("id"):
        return None
    window = entry.get("context_length")
    return str(entry["id"]), (window if isinstance(window, int) and window > 0 else None)


def _pidfile(logs: Path, name: str) -> Path:
    return logs / (".mlx.pid" if name == "mlx" else f".mlx-{name.split(':', 1)[1]}.pid")


def run_stack(settings: Settings, *, python: str = sys.executable, repo: Path = REPO_ROOT,
              mlx_cmd: list[str] | None = None, out: IO[str] | None = None) -> int:
    """Run until we are asked to stop (exit 0) or the stack cannot go on (exit 1: LiteLLM died, the MLX
    server failed to start, cannot be restarted, or crash-looped; exit 2: configuration error)."""
    sup = Supervisor(out)
    say = sup.say
    if not settings.litellm_master_key:
        say("LITELLM_MASTER_KEY is empty: LiteLLM refuses to start without one. "
            "Run python3 install_and_run.py (it writes one into .env) or set it yourself.")
        return 2
    try:
        backends = load_backends(settings, repo)
        tenants = check_tenants(settings, repo)
    except (SettingsError, TenantsError) as exc:
        say(f"ERROR: {exc}")
        return 2
    if tenants:
        say(f"tenants: {tenants} besides the master key's (TENANT_KEYS_FILE), each with a cache scope of its own")
    single = len(backends) == 1 and backends[0].local
    if settings.models_on_demand and not (single and settings.distributed == "off"):
        say("ERROR: MODELS_ON_DEMAND serves every installed model from one MLX port; it does not combine with a "
            "BACKENDS_FILE, MLX_REPLICAS > 1 or DISTRIBUTED (turn one of them off).")
        return 2
    logs = make_private_dir(settings.log_root_path)  # request logs hold prompts
    config_path, proxy_pid = logs / "litellm_config.yaml", logs / ".litellm.pid"
    servers = {b.name: LocalServer(b.name, settings if single else b.settings(), _pidfile(logs, b.name),
                                   RestartPolicy(settings.mlx_max_restarts, settings.mlx_restart_window_seconds))
               for b in backends if b.local}
    # SIGINT explicitly too: a launcher started in the background of a non-interactive shell
    # inherits SIGINT as ignored, and Ctrl-C / kill -INT must still stop the stack.
    old = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    code = 1
    try:
        for server in servers.values():
            free_port("mlx", server.settings.mlx_host, server.settings.mlx_port, repo, server.pidfile, (), say)
        free_port("litellm", settings.proxy_host, settings.proxy_port, repo, proxy_pid, (str(config_path),), say)
        cmd = mlx_cmd or [python, "-m", "mlxstack.residency.router" if settings.models_on_demand else "mlxstack.serve"]
        for server in servers.values():  # all load at once; each port held by us for its whole life
            s = server.settings
            say(f"starting MLX server{server.label} on {lc.mlx_base_url(s)} (model: {s.model_path or lc.EMBEDDED_MODEL_NAME})")
            try:
                server.listen = listen_socket(s.mlx_host, s.mlx_port)
            except OSError as exc:
                raise LaunchError(f"cannot listen on {s.mlx_host}:{s.mlx_port} ({exc}); "
                                  "choose another MLX_PORT / MLX_HOST in .env (or port in the backends file)") from None
            if s.mlx_port == 0:
                server.settings = s.replace(mlx_port=server.listen.getsockname()[1])
                settings = settings.replace(mlx_port=server.settings.mlx_port) if single else settings
            server.child = _spawn_mlx(sup, server.name, server.settings, cmd, repo, server.pidfile, server.listen)
        healths = {name: wait_ready(server.child, _mlx_probe(lc.mlx_base_url(server.settings)),
                                    server.settings.mlx_startup_timeout_seconds,
                                    f"MLX server{server.label} (loading / preparing the model; the first run converts it)", say,
                                    "MLX_STARTUP_TIMEOUT_SECONDS")
                   for name, server in servers.items()}
        if single:
            mlx, health = servers["mlx"].child, healths["mlx"]
            served = str(health.get("model") or lc.model_name(settings))
            say(f"MLX server ready after {time.monotonic() - mlx.started:.1f}s, serving {served}; starting LiteLLM")
            listed = lc.served_models(settings)        # one model, or MODELS_ON_DEMAND's router: every installed one
            window = dict(listed).get(served, listed[0][1] if listed else None)
            others = tuple(m for m in listed if m[0] != served) if settings.models_on_demand else ()
            _config_or_refuse(lambda: lc.write_config(settings, served, config_path, window, others))
            env = litellm_env(settings)
        else:
            groups = _model_groups(settings, backends, say)
            _config_or_refuse(lambda: lc.write_stack_config(settings, groups, config_path))
            env = litellm_env(settings, [b for g in groups for b in g.backends], repo)
        proxy = sup.start("litellm", litellm_command(python, config_path, settings.proxy_host, settings.proxy_port),
                          env, cwd=str(repo))
        write_private_file(proxy_pid, f"{proxy.pid}\n")
        limit, limit_name = proxy_startup_limit(settings)
        wait_ready(proxy, _proxy_probe(lc.proxy_base_url(settings)), limit, "LiteLLM proxy", say, limit_name)
        say(ready_text(settings, lc.proxy_model_names(settings)) if single else stack_ready_text(settings, groups))
        supervise_all(sup, servers, cmd, repo, say, others_serve=any(not b.local for b in backends))
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
        proxy_pid.unlink(missing_ok=True)
        for server in servers.values():
            server.pidfile.unlink(missing_ok=True)
            if server.listen is not None:
                server.listen.close()
    if code == 0:
        say("stopped; ports freed")
    return code


def _config_or_refuse(write: Callable[[], Path]) -> Path:
    """LiteLLM's config written, or a LaunchError saying which setting it cannot be made from
    (MODEL_ALIASES naming a model that is not here)."""
    try:
        return write()
    except SettingsError as exc:
        raise LaunchError(str(exc)) from None


def _model_groups(settings: Settings, backends: list[Backend], say) -> list[ModelGroup]:
    """Ask every backend what it serves; group them by model (LaunchError when none answers)."""
    discovered = {}
    for b in backends:
        discovered[b.url] = discover_model(b)
        if discovered[b.url] is None:
            say(f"WARNING: backend {b.name} ({b.url}) did not answer /v1/models"
                + (f"; listing it as {b.model} (from the backends file)" if b.model else
                   "; it is left out (start it, then restart start_llm.py, or give its model: in the backends file)"))
        else:
            say(f"backend {b.name} ({b.url}) serves {discovered[b.url][0]}")
    try:
        groups = model_groups(backends, discovered, settings.proxy_model_id)
    except SettingsError as exc:
        raise LaunchError(str(exc)) from None
    if not groups:
        raise LaunchError("no backend answered /v1/models; nothing to route to.")
    return groups
