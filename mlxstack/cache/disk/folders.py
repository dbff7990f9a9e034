"""Where the disk tier lives on disk: private folders and files (every stored prompt's tokens are
in them: the owner only, whatever the umask), tightening a tier an older version left readable,
and pruning namespaces no model reads any more.

    private_dirs(root, namespace_dir, entries_dir)     # created or tightened to 0700
    tighten_tier(root, namespace_dir)                   # every namespace's folders 0700, files 0600
    with open_private(path / "lock") as f: ...          # a file created (or tightened to) 0600
    prune_namespaces(root, keep=ns, max_total_bytes=n)  # least recently written first
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
from pathlib import Path

log = logging.getLogger("mlxstack.cache.disk")

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def open_private(path: Path):
    """A lock file handle on ``path``, created (or tightened to) 0600."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
    try:
        os.fchmod(fd, PRIVATE_FILE)
        return os.fdopen(fd, "r+b")
    except BaseException:
        os.close(fd)
        raise


def private_dirs(root: Path, *below: Path) -> None:
    """Create ``root`` and ``below`` (each inside the previous) 0700, or tighten them to 0700.
    The root is the disk tier's own folder (DISK_CACHE_DIR); folders above it keep the umask's mode."""
    root.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    _chmod(root, PRIVATE_DIR, follow=True)   # DISK_CACHE_DIR may be a link to another disk
    for path in below:
        path.mkdir(exist_ok=True, mode=PRIVATE_DIR)
        _chmod(path, PRIVATE_DIR)


def _chmod(path: Path | str, mode: int, *, follow: bool = False, st: os.stat_result | None = None) -> None:
    """Set ``path``'s permission bits to ``mode`` if they differ; links are left alone unless
    ``follow``; a file that vanished or that another user owns is skipped (logged)."""
    try:
        st = st or (os.stat(path) if follow else os.lstat(path))
        if stat.S_ISLNK(st.st_mode) or stat.S_IMODE(st.st_mode) == mode:
            return
        os.chmod(path, mode)
    except FileNotFoundError:
        pass
    except PermissionError as exc:
        log.warning("disk tier: cannot make %s private (%s)", path, exc)


def tighten_tier(root: Path, *namespaces: Path) -> None:
    """Folders 0700 and files 0600 in every namespace under ``root`` (a folder named ``ns-*`` or
    holding an index.sqlite) and in ``namespaces``, down to their entries/ folder. Other folders
    under ``root`` and symbolic links are not touched. One lstat per file."""
    dirs = set(namespaces)
    try:
        with os.scandir(root) as it:
            for d in it:
                if d.is_dir(follow_symlinks=False) and (d.name.startswith("ns-") or os.path.exists(
                        os.path.join(d.path, "index.sqlite"))):
                    dirs.add(Path(d.path))
    except FileNotFoundError:
        return
    for ns in dirs:
        _tighten_folder(ns, depth=1)


def _tighten_folder(path: Path, depth: int) -> None:
    _chmod(path, PRIVATE_DIR)
    try:
        with os.scandir(path) as it:
            for d in it:
                try:
                    st = d.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    if depth > 0:
                        _tighten_folder(Path(d.path), depth - 1)
                elif stat.S_ISREG(st.st_mode):
                    _chmod(d.path, PRIVATE_FILE, st=st)
    except (FileNotFoundError, NotADirectoryError):
        pass


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune_namespaces(root: Path, keep: str, max_total_bytes: int) -> list[str]:
    """Delete whole namespace directories under ``root`` other than ``keep`` -- least recently
    written first -- until ``root`` fits ``max_total_bytes``. Old models and templates leave
    their namespaces behind; nothing else ever reads them. A namespace held by a live tier
    (its flock) is skipped. Returns the removed names."""
    from .config import directory_bytes

    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    candidates = []
    for path in root.iterdir():
        if path.name != keep and path.is_dir() and (path / "index.sqlite").exists():
            stamp = max(p.stat().st_mtime for p in path.iterdir())
            candidates.append((stamp, path))
    total = directory_bytes(root)
    removed = []
    for _stamp, path in sorted(candidates):
        if total <= max_total_bytes:
            break
        with open_private(path / "lock") as lock:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            size = directory_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
        total -= size
        removed.append(path.name)
    return removed
