#!/usr/bin/env python3
"""Start the stack: MLX server(s) (MLX_PORT, or a backends file / MLX_REPLICAS) behind a LiteLLM proxy (PROXY_PORT).

Normally run through ``python3 install_and_run.py``, which builds .venv and execs this file
with the venv's Python 3.12. All configuration comes from .env / the environment (.env.example
lists every variable); the flags below only cover what differs per invocation.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-file", type=Path, default=REPO / ".env",
                        help="settings file (default: .env in the repo); the process environment wins over it")
    args = parser.parse_args(argv)
    if sys.version_info[:2] != (3, 12):
        print(f"start_llm.py needs Python 3.12 (this is {sys.version.split()[0]}); "
              "run it through: python3 install_and_run.py", file=sys.stderr)
        return 2
    from mlxstack.config.settings import SettingsError, load_settings

    try:
        settings = load_settings(env_file=args.env_file)
    except SettingsError as exc:
        print(f"Configuration error: {exc}", file=sys.stderr)
        return 2
    from mlxstack.launcher.stack import run_stack

    return run_stack(settings, repo=REPO)


if __name__ == "__main__":
    sys.exit(main())
