"""The ``mlxstack`` command: one name for the entry points that already exist.

    mlxstack serve [--env-file PATH]     the stack: MLX server(s) behind LiteLLM (start_llm.py)
    mlxstack mlx-server                  one MLX server, no proxy (python -m mlxstack.serve)
    mlxstack test [--fast] [pytest args] the test suite with the optimised BLAS preloaded
                                         (mlxstack.launcher.test_runner; --fast: the fast tier)
    mlxstack bench [guard args]          the benchmark guard (benchmarks/bench_guard.py)
    mlxstack env-example                 regenerate .env.example and docs/configuration.md
    mlxstack build-native                build the CPU backend's native kernels now, not at the
                                         server's first load (install_and_run.py runs it)
    mlxstack pull REPO [--revision R]    download a Hugging Face model repo (the files MLX loads)
                                         into the hub cache
    mlxstack models                      the MLX models installed here (MODELS_DIR, the hub cache)
    mlxstack launch CLIENT [--model M] [--config] [-- ARGS]
                                         start the stack if it is not running, point an agent client
                                         (claude, codex, opencode, openclaw, pi) at it and run it

Run as ``.venv/bin/python -m mlxstack.cli`` or, after ``.venv/bin/pip install -e .``, as
``mlxstack``. Each subcommand hands its remaining arguments to the entry point unchanged (so
``mlxstack bench --help`` is the guard's own help). ``python3 install_and_run.py`` stays the
bootstrap that builds .venv; this module needs that .venv's Python 3.12 and a checkout (the
benchmarks/ and scripts/ folders live beside the package, not inside it).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COMMANDS = {
    "serve": "start the stack: MLX server(s) behind the LiteLLM proxy (start_llm.py)",
    "mlx-server": "start one MLX server without the proxy (python -m mlxstack.serve)",
    "test": "run the tests with the optimised BLAS preloaded; --fast: -m \"not e2e and not slow\"",
    "bench": "run the benchmark guard (benchmarks/bench_guard.py; ~10 min, not in CI)",
    "env-example": "regenerate .env.example and docs/configuration.md from the settings",
    "build-native": "build the CPU backend's native kernels with the system C compiler now (else at load)",
    "pull": "download a Hugging Face model repo (only the files MLX loads) into the hub cache: 'pull OWNER/NAME [--revision R]'",
    "models": "list the MLX models installed here (MODELS_DIR, the Hugging Face cache): family, size, window, quantisation, resident",
    "launch": "run an agent client on the stack: 'launch claude|codex|opencode|openclaw|pi [--model M] [--config] "
              "[-- CLIENT ARGS]' (starts the stack if it is not running; --config: write / print the client's configuration)",
    "tenant": "tenants of port 4000: 'tenant add NAME' gives NAME a key in TENANT_KEYS_FILE, 'tenant list' names them",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: mlxstack <command> [args...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in COMMANDS.items()]
    lines += ["", "Arguments after the command go to its entry point ('mlxstack bench --help' is the guard's help).",
              "Set-up and the first run: python3 install_and_run.py (README.md)."]
    return "\n".join(lines)


def _script(relative: str) -> str:
    path = REPO / relative
    if not path.is_file():
        raise SystemExit(f"mlxstack: {relative} not found beside the package (run from a checkout: {REPO})")
    return str(path)


def _exec_python(args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *args])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        _exec_python([_script("start_llm.py"), *rest])
    elif command == "mlx-server":
        _exec_python(["-m", "mlxstack.serve", *rest])
    elif command == "test":
        from .launcher import test_runner

        os.chdir(REPO)                           # pytest.ini and tests/ are found from the checkout
        test_runner.main(rest)
    elif command == "bench":
        _exec_python([_script("benchmarks/bench_guard.py"), *rest])
    elif command == "env-example":
        refused = _no_arguments("env-example", rest)
        if refused is not None:
            return refused
        _exec_python([_script("scripts/gen_env_example.py")])
    elif command == "build-native":
        return build_native(rest)
    elif command == "tenant":
        return tenant(rest)
    elif command == "pull":
        return pull(rest)
    elif command == "models":
        return models(rest)
    elif command == "launch":
        from .launcher import launch

        return launch.main(rest)
    else:
        print(f"mlxstack: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return 0


def _no_arguments(command: str, rest: list[str]) -> int | None:
    """For a subcommand that takes no arguments: its usage (0) on -h / --help, 2 on anything
    else, None when there is nothing to refuse."""
    if rest[:1] in (["-h"], ["--help"]):
        print(f"usage: mlxstack {command}\n\n{COMMANDS[command]}")
        return 0
    if rest:
        print(f"mlxstack {command}: takes no arguments (got {' '.join(rest)})", file=sys.stderr)
        return 2
    return None


def tenant(rest: list[str]) -> int:
    """``tenant add NAME [--file F]`` / ``tenant list [--file F]`` over TENANT_KEYS_FILE (or ``--file``):
    a new key is written to the file (created 0600) and shown masked -- its full value stays there."""
    import argparse

    from .config.settings import load_settings
    from .config.tenants import TenantsError, add_tenant, read_tenants

    ap = argparse.ArgumentParser(prog="mlxstack tenant", description=COMMANDS["tenant"])
    ap.add_argument("action", choices=["add", "list"])
    ap.add_argument("name", nargs="?")
    ap.add_argument("--file", help="the keys file (default: TENANT_KEYS_FILE from .env / the environment)")
    args = ap.parse_args(rest)
    path = args.file or load_settings().tenant_keys_file
    if not path:
        print("mlxstack tenant: no keys file: pass --file tenants.json, and set TENANT_KEYS_FILE=tenants.json in .env "
              "so the stack reads it", file=sys.stderr)
        return 2
    try:
        if args.action == "list":
            for name in sorted(set(read_tenants(Path(path).expanduser()).values())):
                print(name)
            return 0
        if not args.name:
            print("mlxstack tenant add: name the tenant (mlxstack tenant add alice)", file=sys.stderr)
            return 2
        key = add_tenant(path, args.name)
    except TenantsError as exc:
        print(f"mlxstack tenant: {exc}", file=sys.stderr)
        return 1
    print(f"tenant {args.name}: new key {key[:6]}…{key[-3:]} (full value in {path}; hand it to {args.name} "
          f"privately). The stack reads the file when it changes: no restart needed.")
    return 0


def pull(rest: list[str]) -> int:
    """``pull OWNER/NAME [--revision R]``: models/hub.py's fetch with its bar on the console; 0 done
    (or already there), 1 with one line saying why not."""
    import argparse

    from .models import hub

    ap = argparse.ArgumentParser(prog="mlxstack pull", description=COMMANDS["pull"])
    ap.add_argument("repo", help="a Hugging Face model repo id, e.g. mlx-community/Qwen3-4B-4bit")
    ap.add_argument("--revision", help="a branch, tag or commit (default: main)")
    args = ap.parse_args(rest)
    if not hub.looks_like_repo_id(args.repo):
        print(f"mlxstack pull: {args.repo!r} is not a repo id (owner/name)", file=sys.stderr)
        return 2
    try:
        path = hub.fetch(args.repo, args.revision, say=lambda msg: print(msg, file=sys.stderr, flush=True))
    except hub.FetchError as exc:
        print(f"mlxstack pull: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def models(rest: list[str]) -> int:
    """``models``: one row per installed MLX model; ``resident`` asks the server on MLX_HOST:MLX_PORT
    which model it serves (its /health), "no" where it does not answer."""
    refused = _no_arguments("models", rest)
    if refused is not None:
        return refused
    from .config.settings import load_settings
    from .models.catalog import human_size, installed_models

    settings = load_settings()
    served = served_models(settings.mlx_host, settings.mlx_port)
    rows = [("NAME", "FAMILY", "SIZE", "CONTEXT", "QUANT", "RESIDENT")]
    for entry in installed_models(settings):
        rows.append((entry.name, entry.family, human_size(entry.size_bytes),
                     str(entry.context) if entry.context else "?", entry.quantization,
                     "yes" if served & {entry.served_as, entry.name} else "no"))
    if len(rows) == 1:
        print("no MLX models installed here (mlxstack pull OWNER/NAME downloads one; MODELS_DIR names a folder of them)",
              file=sys.stderr)
        return 0
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def served_models(host: str, port: int, timeout: float = 1.0) -> set[str]:
    """The model ids the MLX port answers /health with: its one model, or under MODELS_ON_DEMAND
    every model the router holds ready (its name and the id its server serves); empty where
    nothing answers."""
    import json
    import urllib.request

    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=timeout) as resp:
            health = json.loads(resp.read())
    except Exception as exc:  # noqa: BLE001 - a 503 while loading still names the model
        body = getattr(exc, "read", None)
        try:
            health = json.loads(body()) if body else {}
        except Exception:  # noqa: BLE001
            return set()
    if not isinstance(health, dict):
        return set()
    if health.get("router"):
        return {n for m in health.get("models") or () if m.get("state") == "ready"
                for n in (m.get("model"), m.get("served")) if n}
    return {health["model"]} if health.get("model") else set()


def build_native(rest: list[str]) -> int:
    """Build (or find) the native kernels' library where a server of this environment looks for it
    (backends/cpu/native_build.py: per source, compiler and CPU, in ``<venv>/mlxstack-native/``), so
    no server compiles at load. 0: built or already there; 1: it cannot be built here (the server
    then runs the MLX path for those kernels, and says so in its backend report)."""
    refused = _no_arguments("build-native", rest)
    if refused is not None:
        return refused
    from .backends.cpu import native_build

    path, why = native_build.build_ahead()
    if path is None:
        print(f"mlxstack build-native: not built ({why}); servers run the MLX path for the native kernels",
              file=sys.stderr)
        return 1
    print(f"native kernels: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
