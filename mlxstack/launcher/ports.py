"""Who is listening on a port, and whether it is a leftover of this project we may stop.

Stopping is always by pid, after checking the process's command line: killing by name pattern
could take down an unrelated LiteLLM or Python server the user is running.
Linux reads /proc (no extra tools needed in containers); elsewhere ``lsof`` and ``ps``.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PortOwner:
    pid: int
    cmdline: tuple[str, ...]
    cwd: str | None = None

    @property
    def command(self) -> str:
        text = " ".join(" ".join(self.cmdline).split())  # inline scripts: collapse newlines
        return (text[:300] + " ...") if len(text) > 300 else (text or "<unknown command>")


# --- discovery ---------------------------------------------------------------------------------
def _listening_inodes(port: int, proc_root: Path) -> set[str]:
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc_root / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != "0A":  # 0A = LISTEN
                continue
            if int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def _proc_owners(port: int, proc_root: Path = Path("/proc")) -> list[PortOwner]:
    inodes = _listening_inodes(port, proc_root)
    if not inodes:
        return []
    targets = {f"socket:[{i}]" for i in inodes}
    owners = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue  # another user's process, or it just exited
        for fd in fds:
            try:
                if os.readlink(fd) in targets:
                    owners.append(read_owner(int(entry.name), proc_root))
                    break
            except OSError:
                continue
    return owners


def read_owner(pid: int, proc_root: Path = Path("/proc")) -> PortOwner:
    if sys.platform.startswith("linux"):
        try:
            raw = (proc_root / str(pid) / "cmdline").read_bytes()
            cmd = tuple(p.decode("utf-8", "replace") for p in raw.split(b"\0") if p)
        except OSError:
            cmd = ()
        try:
            cwd = os.readlink(proc_root / str(pid) / "cwd")
        except OSError:
            cwd = None
        return PortOwner(pid, cmd, cwd)
    try:
        out = subprocess.run(["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True, timeout=5)
        cmd = tuple(out.stdout.strip().split())
    except (OSError, subprocess.SubprocessError):
        cmd = ()
    return PortOwner(pid, cmd, None)


def _lsof_owners(port: int) -> list[PortOwner]:
    if not shutil.which("lsof"):
        return []
    try:
        out = subprocess.run(["lsof", "-nP", f"-iTCP:{port}", "-sTCP:LISTEN", "-t"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    pids = sorted({int(p) for p in out.stdout.split() if p.isdigit()})
    return [read_owner(p) for p in pids]


def port_owners(port: int) -> list[PortOwner]:
    """Processes listening on TCP ``port`` (any address)."""
    if sys.platform.startswith("linux") and Path("/proc/net/tcp").exists():
        return _proc_owners(port)
    return _lsof_owners(port)


def port_is_free(host: str, port: int) -> bool:
    """True when we could bind ``host:port`` right now (what the child server will do)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# --- decision (pure) ---------------------------------------------------------------------------
MARKERS = {"litellm": ("litellm",), "mlx": ("mlxstack.serve", "mlxstack/serve.py")}


def is_our_process(owner: PortOwner, kind: str, repo_root: Path, extra_paths: tuple[str, ...] = (),
                   pidfile_pid: int | None = None) -> bool:
    """A leftover ``kind`` ('litellm' | 'mlx') started from this project.

    Both must hold: the command line names the program, and the process is tied to this
    checkout (an argument or its cwd under the repo, our generated config path, or our pidfile).
    """
    if not any(m in arg for arg in owner.cmdline for m in MARKERS[kind]):
        return False
    paths = [a.split("=", 1)[1] if a.startswith("--") and "=" in a else a for a in owner.cmdline]
    if any(path_within(p, repo_root) for p in paths) or (owner.cwd and path_within(owner.cwd, repo_root)):
        return True
    if any(same_path(p, extra) for p in paths for extra in extra_paths if extra):
        return True
    return pidfile_pid is not None and owner.pid == pidfile_pid


def _forms(path: str) -> set[tuple[str, ...]]:
    """The path's components as written (normalised) and with symlinks resolved."""
    if not os.path.isabs(path):
        return set()
    return {Path(os.path.normpath(path)).parts, Path(os.path.realpath(path)).parts}


def path_within(path: str, root: Path | str) -> bool:
    """``path`` is ``root`` or inside it, compared by components (``/work/main2`` is not inside
    ``/work/main``), as written or with symlinks resolved on either side."""
    return any(p[:len(r)] == r for p in _forms(str(path)) for r in _forms(str(root)))


def same_path(a: str, b: str) -> bool:
    return bool(_forms(a) & _forms(b))


def stale_decision(owners: list[PortOwner], kind: str, repo_root: Path, extra_paths: tuple[str, ...] = (),
                   pidfile_pid: int | None = None, self_pid: int | None = None) -> tuple[str, list[PortOwner]]:
    """-> ("free", []) | ("kill", ours) | ("refuse", foreign). Refuse wins over kill: we never
    stop our leftover if something foreign also holds the port, since the port would stay busy."""
    owners = [o for o in owners if o.pid != (os.getpid() if self_pid is None else self_pid)]
    if not owners:
        return "free", []
    foreign = [o for o in owners if not is_our_process(o, kind, repo_root, extra_paths, pidfile_pid)]
    return ("refuse", foreign) if foreign else ("kill", owners)


def read_pidfile(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


# --- acting ------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True


def terminate_pid(pid: int, grace: float = 3.0) -> bool:
    """SIGTERM, wait ``grace`` s, then SIGKILL. True when the process is gone."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _alive(pid):
                return True
            time.sleep(0.05)
    return not _alive(pid)


def wait_port_free(host: str, port: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_is_free(host, port):
            return True
        time.sleep(0.1)
    return port_is_free(host, port)
