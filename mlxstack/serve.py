"""MLX server entry point: ``python -m mlxstack.serve`` (start_llm.py runs it for you).

Reads the same settings as the launcher (.env + environment), binds MLX_HOST:MLX_PORT at once
(/health answers ready:false while the model loads), loads the model on the inference worker,
and serves until SIGTERM / Ctrl-C.

Exit statuses (mlxstack/system/exit_codes.py): 0 stopped, 2 configuration error (including a
non-loopback MLX_HOST without MLX_API_KEY, or a port that cannot be bound), 3 the model failed
to load -- at once, with a ``MODEL LOAD FAILED: ...`` line, instead of answering 503 "still
loading" forever. The launcher restarts crashes but never these.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from .config.settings import SettingsError, load_settings
from .models.loader import hf_offline_env
from .system.exit_codes import EXIT_CONFIG_ERROR, EXIT_MODEL_LOAD_FAILED, LOAD_FAILED_MARKER
from .system.listen_socket import inherited_listen_fd


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    from .system.process_env import reexec_with

    reexec_with(settings, ["-m", "mlxstack.serve", *(argv if argv is not None else sys.argv[1:])])
    rank = os.environ.get("MLX_RANK") if settings.distributed != "off" else None
    tag = f"[rank {rank}] " if rank not in (None, "0") else ""
    logging.basicConfig(level=settings.log_level, format=f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s")
    hf_offline_env()
    if settings.distributed != "off":    # local ranks share the cores: one OpenBLAS pool each, not one per core each
        from .system.blas import share_cores_between_ranks

        share_cores_between_ranks(settings)
    from .server.app import App, make_server

    if settings.distributed != "off" and rank is None and not settings.distributed_local_ranks:
        return _launch_hosts(settings, argv)
    if settings.distributed != "off":
        _default_stop_signals()
    if rank is not None:        # a rank mlx.launch started reads the secret from its host's copy
        from .system.control_channel import ControlSecretError, from_env

        try:
            from_env(os.environ)
        except (ControlSecretError, ValueError) as exc:
            print(f"configuration error: DISTRIBUTED: rank {rank}: {exc}", file=sys.stderr, flush=True)
            return EXIT_CONFIG_ERROR
    if rank not in (None, "0"):
        return _follow(App(settings.replace(enable_request_logging=False)), int(rank))   # rank 0 logs requests
    app = App(settings)
    ranks = _local_ranks(settings, app)
    try:
        server = make_server(app, settings.mlx_host, settings.mlx_port, listen_fd=inherited_listen_fd(os.environ))
    except SettingsError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except OSError as exc:
        print(f"configuration error: cannot listen on {settings.mlx_host}:{settings.mlx_port} ({exc}); "
              "free the port or choose another MLX_PORT / MLX_HOST", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    host, port = server.server_address[:2]
    logging.getLogger("mlxstack").info("MLX server listening on http://%s:%d (loading model)", host, port)
    try:
        from .system.blas import blas_status
        from .system.hugepages import hugepage_status

        logging.getLogger("mlxstack").info("%s", blas_status())
        logging.getLogger("mlxstack").info("%s", hugepage_status())
    except Exception:  # noqa: BLE001
        pass
    exit_code = 0

    def stop(*_a) -> None:
        if ranks is not None:
            ranks.stopping = True     # the other ranks get the same signal: their exit is not a crash
        threading.Thread(target=server.shutdown, daemon=True).start()

    def loaded(future) -> None:  # noqa: ANN001
        nonlocal exit_code
        exc = future.exception()
        if exc is not None:
            # No endless 503 "still loading": say why and exit, so the launcher can too.
            why = app.load_error or f"{type(exc).__name__}: {exc}"   # a BaseException records nothing
            if _group_not_formed(exc):       # a rank late or gone: the group is restarted
                print(f"DISTRIBUTED: {exc}; restarting the group", file=sys.stderr, flush=True)
                exit_code = 1
            else:
                print(f"{LOAD_FAILED_MARKER} {why}", file=sys.stderr, flush=True)
                exit_code = EXIT_MODEL_LOAD_FAILED
            stop()

    app.start_loading(lambda msg: logging.getLogger("mlxstack.model").info(msg)).add_done_callback(loaded)
    handled = False

    def handle_stops() -> None:   # on the main thread (signal.signal's rule), between the server's polls
        nonlocal handled
        if not handled and (settings.distributed == "off" or app.group_joined.is_set()):  # _default_stop_signals
            signal.signal(signal.SIGTERM, stop)
            signal.signal(signal.SIGINT, stop)
            handled = True

    handle_stops()
    server.service_actions = handle_stops
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        app.close()
        if ranks is not None:
            ranks.stop()
        logging.getLogger("mlxstack").info("MLX server stopped")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip C++ static destructors: MLX's per-thread stream workers otherwise abort the
        # process at interpreter exit ("terminate called without an active exception").
        os._exit(exit_code)
    return exit_code


def _group_not_formed(exc: BaseException) -> bool:
    """A load that failed because the ranks could not form their control channel (restartable),
    not because of the model (system/control_channel.py names that failure)."""
    from .system.control_channel import GroupNotFormed

    return isinstance(exc, GroupNotFormed)


def _rank_died(what: str, code: int = 1) -> None:
    """A rank of a distributed group cannot go on alone: exit now. The launcher restarts the group,
    unless another rank failed to load or was misconfigured (its status is passed on: no restart)."""
    from .system.exit_codes import NOT_RESTARTABLE

    restart = code not in NOT_RESTARTABLE
    logging.getLogger("mlxstack").critical("%s; this rank exits%s", what,
                                           " so the launcher restarts every rank" if restart else "")
    logging.shutdown()
    sys.stderr.flush()
    os._exit(1 if restart else code)


def _local_ranks(settings, app):  # noqa: ANN001, ANN202
    """DISTRIBUTED with local ranks: this process is rank 0; the others start once the model's
    files exist (launcher/ranks.py). None without DISTRIBUTED."""
    if settings.distributed == "off":
        return None
    app.worker.on_death = lambda exc: _rank_died(f"the inference thread died ({type(exc).__name__}: {exc})")
    if not settings.distributed_local_ranks:
        return None          # rank 0 of mlx.launch's group (DISTRIBUTED_HOSTS)
    from .launcher.ranks import LocalRanks, serve_command

    ranks = LocalRanks(settings.distributed_local_ranks, serve_command())
    ranks.claim()
    app.files_ready = lambda: ranks.start(lambda r, code: _rank_died(f"rank {r} exited with status {code}", code))
    return ranks


def _default_stop_signals() -> None:
    """SIGTERM / SIGINT end the process at once until its MLX group has formed: MLX's group init
    holds the GIL while it waits for the other ranks -- for ever, if one never comes -- so no
    Python handler (nor the thread watching the local ranks) could run, and a stop would wait
    for ever too. Nothing needs flushing before the group forms; serve.py installs the graceful
    handlers once ``App.group_joined`` is set."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _follow(app, rank: int) -> int:  # noqa: ANN001
    """A follower rank: no HTTP; load this rank's part, then run what rank 0 broadcasts until it
    says stop (engine/lockstep.py)."""
    log = logging.getLogger("mlxstack")
    def stop(*_a) -> None:                # the launcher stops the group: flush this rank's disk writes
        try:
            if app.state is not None:
                app.state.close()
        finally:
            os._exit(0)

    app.worker.on_death = lambda exc: _rank_died(f"rank {rank} stopped: {type(exc).__name__}: {exc}")
    loading = app.start_loading(lambda msg: logging.getLogger("mlxstack.model").info(msg))
    app.group_joined.wait()
    signal.signal(signal.SIGTERM, stop)
    exc = loading.exception()
    if exc is not None:
        if _group_not_formed(exc):
            print(f"DISTRIBUTED: rank {rank} could not join rank 0's control channel ({exc}); restarting the group",
                  file=sys.stderr, flush=True)
            os._exit(1)
        print(f"{LOAD_FAILED_MARKER} {app.load_error or exc}", file=sys.stderr, flush=True)
        os._exit(EXIT_MODEL_LOAD_FAILED)
    log.info("rank %d ready: following rank 0", rank)
    logging.getLogger("mlxstack.request").setLevel(logging.WARNING)   # rank 0 logs each request once
    app.worker._thread.join()
    log.info("rank %d stopped", rank)
    logging.shutdown()
    os._exit(0)


def _launch_hosts(settings, argv) -> int:  # noqa: ANN001
    """DISTRIBUTED_HOSTS: become mlx.launch over the hostfile's machines (rank 0 runs here)."""
    from pathlib import Path

    from .config.settings import REPO_ROOT
    from .launcher.ranks import control_for_hosts, launch_command
    from .models.sharding import backend_for
    from .system.control_channel import ADDR_ENV, SECRET_FILE_ENV, ControlSecretError, group_secret_file

    hostfile = Path(settings.distributed_hosts).expanduser()
    if not hostfile.is_absolute():
        hostfile = REPO_ROOT / hostfile
    if not hostfile.exists():
        print(f"configuration error: DISTRIBUTED_HOSTS={settings.distributed_hosts!r}: no such hostfile", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    # The secret stays in one 0600 file, made once and reused by every launch, and only its path
    # travels: mlx.launch puts what it forwards on command lines (its own, ssh's, the remote
    # shell's) that every local user can read. Every host needs a copy at the same path, made once.
    try:
        key_path, made = group_secret_file(settings.model_cache_path / "control")
    except (ControlSecretError, OSError) as exc:
        print(f"configuration error: DISTRIBUTED_HOSTS: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if made:
        logging.getLogger("mlxstack").warning(
            "DISTRIBUTED_HOSTS: made the control channel's secret file %s; copy it once to the same path on every "
            "other host of %s (docs/distributed.md)", key_path, hostfile)
    env = {ADDR_ENV: control_for_hosts(str(hostfile)), SECRET_FILE_ENV: key_path}
    env.update({k: v for k, v in settings.as_env().items() if k.startswith("DISTRIBUTED")})
    cmd = launch_command(sys.executable, str(hostfile), backend_for(settings),
                         ["-m", "mlxstack.serve", *(argv if argv is not None else sys.argv[1:])], env)
    logging.getLogger("mlxstack").info("starting the ranks: %s", " ".join(cmd))
    os.execv(cmd[0], cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
