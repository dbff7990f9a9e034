"""Default KV-cache byte budget: a fraction of what the device can hold."""
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
