"""Cache counters: hits by match type, misses, evictions, and the correctness counters.

Correctness counters are expected to stay 0 on clean traffic (see .context/LESSONS.md):
- ``exact_key_rejected_by_model_lcp``: the canonical key matched an entry fully but the model
  tokens diverged earlier (canonicalisation hid a real difference).
- ``hybrid_trim_miss``: a non-trimmable (hybrid/recurrent) entry would have needed a trim.
- ``vlm_retreat``: a reuse depth would have cut inside an image's token run.
"""
from __future__ import annotations

import threading
from collections import Counter

CORRECTNESS_COUNTERS = ("vlm_retreat", "hybrid_trim_miss", "exact_key_rejected_by_model_lcp")
MATCH_TYPES = ("exact", "prefix", "supersequence", "lcp", "session", "snapshot")


class CacheCounters:
    """Thread-safe counter bag; writers are the inference worker, readers any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()
        for name in CORRECTNESS_COUNTERS:
            self._c[name] = 0

    def bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._c[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)

    def correctness(self) -> dict[str, int]:
        with self._lock:
            return {k: self._c[k] for k in CORRECTNESS_COUNTERS}
