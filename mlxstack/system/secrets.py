"""Secrets on disk and on screen (stdlib only): private files and folders, masked keys.

    write_private_file(path, text)     # 0600 from creation: temp file in the same folder + rename
    make_private_dir(path)             # 0700 from creation (an existing folder is left as it is)
    mask_secret("sk-abcdefghijklmnop") # 'sk-abc…nop'

Files are created with their final mode (``os.open`` with ``O_CREAT`` and 0600), never chmodded
after the secret is written: between a write and a chmod, another local user can open the file.
install_and_run.py keeps its own copy of ``mask_secret`` (it must run on any python3 before the
venv exists); tests/test_bootstrap.py checks the two agree.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def mask_secret(value: str) -> str:
    """Enough of a key to recognise it, not enough to use it: 'sk-abc…xyz'."""
    if not value:
        return "(empty)"
    if len(value) <= 12:
        return value[:2] + "…"
    return value[:6] + "…" + value[-3:]


def make_private_dir(path: Path | str) -> Path:
    """Create ``path`` (and missing parents) as 0700; an existing folder keeps its mode."""
    p = Path(path)
    if not p.is_dir():
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(p, PRIVATE_DIR)
        except FileExistsError:
            pass
    return p


def write_private_file(path: Path | str, text: str) -> Path:
    """Atomically replace ``path`` with ``text``, the file being 0600 from its creation."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=str(p.parent))  # mkstemp creates 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return p


def open_private_append(path: Path | str):
    """A binary append handle on ``path``, created 0600 if it does not exist."""
    fd = os.open(str(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE)
    return os.fdopen(fd, "ab")
