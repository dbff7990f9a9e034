"""Building the native kernels (models/native/kernels.c: every kernel in one library, one helper
thread for all) with the system compiler.

    path = build(SOURCE, "native kernels")   # None without a compiler or on a failure

Built once per source text, flags and compiler (``cc -O3 -march=native``: a library runs where it
was built) into ``<venv>/mlxstack-native/`` (MLXSTACK_NATIVE_DIR overrides), written under a
temporary name and renamed: several servers may build at once, and nothing half-written is left.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")


def build_dir() -> Path:
    """Where built kernels live: beside the interpreter's environment (the installer owns it)."""
    return Path(os.environ.get("MLXSTACK_NATIVE_DIR") or Path(sys.prefix) / "mlxstack-native")


def library_path(source: Path, compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """One file per source text (``source`` and every C file / header beside it: what it
    includes), flags and compiler: an edit or another compiler builds anew."""
    h = hashlib.sha256(source.read_bytes())
    for other in sorted(source.parent.glob("*.[ch]")):
        h.update(other.name.encode() + b"\0" + other.read_bytes())
    h.update(" ".join((compiler,) + flags).encode())
    return build_dir() / f"{source.stem}-{h.hexdigest()[:16]}.so"


SOURCE = Path(__file__).with_name("native") / "kernels.c"
LIBS = ("-lpthread",)


def build(source: Path = SOURCE, what: str = "native kernels", flags: tuple[str, ...] = FLAGS,
          libs: tuple[str, ...] = LIBS) -> Optional[Path]:
    """``source``'s shared library, built if missing; None (logged as ``what``) without a
    compiler or on a failure."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None
    target = library_path(source, compiler, flags + libs)
    if target.exists():
        return target
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        done = subprocess.run([compiler, *flags, "-o", tmp, str(source), *libs], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            log.warning("%s: build failed: %s", what, done.stderr.strip()[-500:])
            return None
        os.replace(tmp, target)
        tmp = None
        return target
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("%s: cannot build (%s)", what, exc)
        return None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def load_checked(bind: Callable[[Path], Any], agrees: Callable[[Any], bool], what: str) -> Any:
    """The library built if needed, bound (``bind(path)``) and checked once (``agrees``): the bound
    callable, or None on any failure (no compiler, a failed build or load, a disagreement)."""
    path = build()
    if path is None:
        return None
    try:
        fn = bind(path)
        return fn if agrees(fn) else None
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot load is simply not used
        log.warning("%s: not used (%s)", what, exc)
        return None
