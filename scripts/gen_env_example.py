#!/usr/bin/env python3
"""Regenerate .env.example from the Settings specs (tests/test_settings.py fails when stale)."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlxstack.config.settings import render_env_example  # noqa: E402

if __name__ == "__main__":
    (REPO / ".env.example").write_text(render_env_example())
    print(f"wrote {REPO / '.env.example'}")
