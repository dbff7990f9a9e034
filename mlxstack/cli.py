"""The ``mlxstack`` command: one name for the entry points that already exist.

    mlxstack serve [--env-file PATH]     the stack: MLX server(s) behind LiteLLM (start_llm.py)
    mlxstack mlx-server                  one MLX server, no proxy (python -m mlxstack.serve)
    mlxstack test [--fast] [pytest args] the test suite with the optimised BLAS preloaded
                                         (mlxstack.launcher.test_runner; --fast: the fast tier)
    mlxstack bench [guard args]          the benchmark guard (benchmarks/bench_guard.py)
    mlxstack env-example                 regenerate .env.example and docs/configuration.md
    mlxstack build-native                build the CPU backend's native kernels now, not at the
                                         server's first load (install_and_run.py runs it)

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
