"""Building the native kernels (backends/cpu/native/kernels.c: every kernel in one library, one helper
thread for all) with the system compiler.

    path = build(SOURCE, "native kernels")   # None without a compiler or on a failure
    path, why = build_ahead()                # `mlxstack build-native` / install_and_run.py: before any server

Built ahead by ``mlxstack build-native`` (install_and_run.py runs it after installing the
requirements), so a server finds the library and only binds and checks it; a server that finds
none (a new source, compiler or CPU, or never built ahead) compiles it at load as a fallback
(~1 s, logged). ``problem(what)`` says why a kernel is not in use, for the backend's report.

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

from ...system.secrets import PRIVATE_DIR, make_private_dir

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


_problems: dict[str, str] = {}     # what -> why it is not in use (``problem``)
compiled_here = False             # whether this process compiled the library (it was not built ahead)


def problem(what: str = "native kernels") -> str:
    """Why ``what`` (a kernel's name, or "native kernels" for the library) is not in use in this
    process: '' when nothing went wrong (or nothing was tried)."""
    return _problems.get(what, "")


def compiler() -> Optional[str]:
    """The system C compiler the kernels are built with (``CC``, else ``cc``, else ``gcc``)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(source: Path = SOURCE, what: str = "native kernels", flags: tuple[str, ...] = FLAGS,
          libs: tuple[str, ...] = LIBS) -> Optional[Path]:
    """``source``'s shared library, built if missing; None (logged as ``what``) without a
    compiler or on a failure."""
    global compiled_here
    cc = compiler()
    if not cc:
        _problems[what] = "no C compiler (cc / gcc / CC)"
        return None
    target = library_path(source, cc, flags + libs)
    if not private_build_dir(target.parent):
        _problems[what] = f"{target.parent} is not a private folder of this user's"
        return None
    if trusted_library(target):
        _problems.pop(what, None)
        return target
    if os.path.lexists(target):
        log.warning("%s: %s is not this user's own file: built again over it", what, target)
    else:
        log.info("%s: not built ahead for this source, compiler and CPU (mlxstack build-native): "
                 "compiling %s now", what, target.name)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        done = subprocess.run([cc, *flags, "-o", tmp, str(source), *libs], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            log.warning("%s: build failed: %s", what, done.stderr.strip()[-500:])
            _problems[what] = "the build failed (see the log)"
            return None
        os.replace(tmp, target)
        tmp = None
        compiled_here = True
        _problems.pop(what, None)
        return target
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("%s: cannot build (%s)", what, exc)
        _problems[what] = f"cannot build ({exc})"
        return None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def build_ahead() -> tuple[Optional[Path], str]:
    """(the library, '') built or found now -- before any server starts, so none compiles at load
    -- or (None, why not). ``mlxstack build-native``; install_and_run.py runs it."""
    path = build()
    return path, "" if path is not None else problem()


def load_checked(bind: Callable[[Path], Any], agrees: Callable[[Any], bool], what: str) -> Any:
    """The library built if needed, bound (``bind(path)``) and checked once (``agrees``): the bound
    callable, or None on any failure (no compiler, a failed build or load, a disagreement), with
    the reason kept for ``problem(what)``."""
    path = build()
    if path is None:
        _problems[what] = problem() or "no library"
        return None
    try:
        fn = bind(path)
        if agrees(fn):
            _problems.pop(what, None)
            return fn
        _problems[what] = "disagrees with its reference at load (see the log)"
        return None
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot load is simply not used
        log.warning("%s: not used (%s)", what, exc)
        _problems[what] = f"cannot load ({type(exc).__name__}: {exc})"
        return None
