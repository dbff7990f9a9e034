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
    from .system.blas import reexec_with_blas

    reexec_with_blas(settings, ["-m", "mlxstack.serve", *(argv if argv is not None else sys.argv[1:])])
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    hf_offline_env()
    from .api.app import App, make_server

    app = App(settings)
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

        logging.getLogger("mlxstack").info("%s", blas_status())
    except Exception:  # noqa: BLE001
        pass
    exit_code = 0

    def stop(*_a) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    def loaded(future) -> None:  # noqa: ANN001
        nonlocal exit_code
        exc = future.exception()
        if exc is not None:
            # No endless 503 "still loading": say why and exit, so the launcher can too.
            why = app.load_error or f"{type(exc).__name__}: {exc}"   # a BaseException records nothing
            print(f"{LOAD_FAILED_MARKER} {why}", file=sys.stderr, flush=True)
            exit_code = EXIT_MODEL_LOAD_FAILED
            stop()

    app.start_loading(lambda msg: logging.getLogger("mlxstack.model").info(msg)).add_done_callback(loaded)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        app.close()
        logging.getLogger("mlxstack").info("MLX server stopped")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip C++ static destructors: MLX's per-thread stream workers otherwise abort the
        # process at interpreter exit ("terminate called without an active exception").
        os._exit(exit_code)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
