"""Resolve the disk-tier settings (DISK_CACHE_DIR, DISK_CACHE_MAX_BYTES, DISK_CACHE_MIN_TOKENS)
into a directory and a byte budget.

    plan = plan_disk_cache(settings)     # None when the disk tier is off
    tier = DiskTier(plan.directory, namespace, plan.max_bytes)

The rules are pure functions (``resolve_disk_cache_dir``, ``auto_disk_budget``);
``plan_disk_cache`` adds the two measurements they need (free space, bytes already stored).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ...config.settings import REPO_ROOT

OFF_VALUES = frozenset({"", "off", "none", "false", "no", "0"})
AUTO = "auto"
AUTO_SHARE = 0.25              # of (free space + what the tier already holds)
AUTO_CAP_BYTES = 64 << 30      # 64 GiB


@dataclass(frozen=True, slots=True)
class DiskCachePlan:
    directory: Path
    max_bytes: int
    min_tokens: int


def resolve_disk_cache_dir(value: str, *, auto_base: Path, repo_root: Path) -> Path | None:
    """``auto`` -> ``auto_base/kv``; empty/off/none/false/no/0 -> None (tier off);
    ``~`` is expanded; a relative path is under the repository (like LOG_ROOT)."""
    text = value.strip()
    if text.lower() in OFF_VALUES:
        return None
    if text.lower() == AUTO:
        return auto_base / "kv"
    path = Path(text).expanduser()
    return path if path.is_absolute() else repo_root / path


def auto_disk_budget(free_bytes: int, used_bytes: int) -> int:
    """min(25% of (free + already used by the tier), 64 GiB). Counting the tier's own bytes
    keeps the budget stable across restarts instead of shrinking as the cache fills the disk."""
    return int(min(AUTO_SHARE * (max(free_bytes, 0) + max(used_bytes, 0)), AUTO_CAP_BYTES))


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def directory_bytes(path: Path) -> int:
    """Total size of the regular files under ``path`` (0 if it does not exist)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total


def plan_disk_cache(settings) -> DiskCachePlan | None:
    """The disk tier's directory and budget from Settings, or None when it is off (or when the
    auto budget is 0: no free disk)."""
    directory = resolve_disk_cache_dir(settings.disk_cache_dir, auto_base=settings.model_cache_path,
                                       repo_root=REPO_ROOT)
    if directory is None:
        return None
    budget = settings.disk_cache_max_bytes or auto_disk_budget(free_disk_bytes(directory),
                                                               directory_bytes(directory))
    if budget <= 0:
        return None
    return DiskCachePlan(directory, budget, settings.disk_cache_min_tokens)
