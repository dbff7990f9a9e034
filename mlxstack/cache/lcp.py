"""Longest-common-prefix over token sequences (numpy, so 32k-token compares cost microseconds)."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int64:
        return tokens
    if isinstance(tokens, list):
        return np.fromiter(tokens, dtype=np.int64, count=len(tokens))  # ~2x faster than asarray
    return np.asarray(tokens, dtype=np.int64)


def lcp(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Number of leading positions where ``a`` and ``b`` hold the same token."""
    a, b = as_tokens(a), as_tokens(b)
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n
