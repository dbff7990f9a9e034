"""Memory facts: the default KV-cache byte budget (a fraction of what the device can hold), and a
process's resident memory."""
from __future__ import annotations

import os

import mlx.core as mx

BUDGET_FRACTION = 0.4


def total_memory_bytes() -> int:
    try:
        if mx.metal.is_available():
            return int(mx.metal.device_info().get("max_recommended_working_set_size", 0))
    except Exception:  # noqa: BLE001
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


def default_cache_budget() -> int:
    """40% of RAM (Linux/CPU) or of Metal's recommended working set (Apple Silicon)."""
    return int(total_memory_bytes() * BUDGET_FRACTION)


def process_rss_bytes(pid: int | str = "self", field: str = "VmRSS") -> int:
    """A process's resident memory (``field``: VmRSS, or VmHWM its high-water mark) from Linux
    /proc; 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
