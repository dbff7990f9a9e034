"""Building the native kernels (models/native/kernels.c: every kernel in one library, one helper
thread for all) with the system compiler.

    path = build(SOURCE, "native kernels")   # None without a compiler or on a failure

Built once per source text, flags, compiler and CPU (``cc -O3 -march=native``: a library runs only
on a CPU with the features of the one that built it -- a venv copied to another machine, a baked
image, a folder shared by ranks on other hosts would otherwise load AVX-512 code on an AVX2 CPU and
die of SIGILL at load, every restart) into ``<venv>/mlxstack-native/`` (MLXSTACK_NATIVE_DIR
overrides), written under a temporary name and renamed: several servers may build at once, and
nothing half-written is left. The folder is private (0700, this user's; the disk tier's rule): one
that another user owns or that group / others may write is refused, and so is a library there that
is not this user's own regular file, unwritable by others -- a predictable file name in a loose
folder would be anyone's code in the server.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from ..system.secrets import PRIVATE_DIR, make_private_dir

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")


def build_dir() -> Path:
    """Where built kernels live: beside the interpreter's environment (the installer owns it)."""
    return Path(os.environ.get("MLXSTACK_NATIVE_DIR") or Path(sys.prefix) / "mlxstack-native")


def cpu_features(cpuinfo: str | None = None) -> tuple[set[str], str]:
    """(feature flags, model) of the first CPU in ``cpuinfo`` (/proc/cpuinfo's text: x86 ``flags`` /
    ``model name``, Arm ``Features`` / ``CPU part``); pure over the text, empty where it says nothing."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    flags = fields.get("flags") or fields.get("Features") or ""
    return set(flags.split()), fields.get("model name") or fields.get("CPU part") or ""


def cpu_key(cpuinfo: str | None = None) -> str:
    """What this CPU can run, for the build key: its feature flags and model, or where the kernel
    does not say, the machine and processor names."""
    flags, model = cpu_features(cpuinfo)
    if not flags:
        return f"{platform.machine()}|{platform.processor()}|{platform.platform()}"
    return " ".join(sorted(flags)) + "|" + model


def library_path(source: Path, compiler: str, flags: tuple[str, ...] = FLAGS, cpu: str | None = None) -> Path:
    """One file per source text (``source`` and every C file / header beside it: what it
    includes), flags, compiler and CPU: an edit, another compiler or a CPU with other features
    builds anew."""
    h = hashlib.sha256(source.read_bytes())
    for other in sorted(source.parent.glob("*.[ch]")):
        h.update(other.name.encode() + b"\0" + other.read_bytes())
    h.update(" ".join((compiler,) + flags).encode())
    h.update(b"\0" + (cpu_key() if cpu is None else cpu).encode())
    return build_dir() / f"{source.stem}-{h.hexdigest()[:16]}.so"


def _own(st: os.stat_result) -> bool:
    """This user's, and nobody else may write it."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def private_build_dir(path: Path) -> bool:
    """``path`` created 0700, or an existing folder of this user's that group / others cannot
    write (tightened to 0700); False, logged, for anything else -- nothing is built or loaded there."""
    try:
        make_private_dir(path)
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode) or not _own(st):
            log.warning("native kernels: %s is not a private folder of this user's (owner uid %d, mode %o): "
                        "not used; the MLX path runs instead", path, st.st_uid, stat.S_IMODE(st.st_mode))
            return False
        if stat.S_IMODE(st.st_mode) != PRIVATE_DIR:
            os.chmod(path, PRIVATE_DIR)
        return True
    except OSError as exc:
        log.warning("native kernels: cannot use %s (%s)", path, exc)
        return False


def trusted_library(path: Path) -> bool:
    """A regular file (not a link) of this user's that group / others cannot write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and _own(st)


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
    if not private_build_dir(target.parent):
        return None
    if trusted_library(target):
        return target
    if os.path.lexists(target):
        log.warning("%s: %s is not this user's own file: built again over it", what, target)
    tmp = None
    try:
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
