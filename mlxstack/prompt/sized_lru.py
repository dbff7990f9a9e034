"""A least-recently-used map bounded by entry count and by bytes (pure; not locked: its owner
holds its own lock). Each value's size is given when it is put, measured once by the owner.

    lru = SizedLRU(max_entries=256, max_bytes=64 << 20)
    lru.put(key, value, size)     # False (nothing changed) when the value alone is over max_bytes
    lru.get(key)                  # the value (now most recently used), or None
    lru.pop(key); lru.items()     # take one out; every (key, value), oldest first
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SizedLRU(Generic[K, V]):
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: "OrderedDict[K, tuple[V, int]]" = OrderedDict()

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: K, value: V, size: int) -> bool:
        """Store ``value`` as the most recently used, then drop the least recently used until both
        bounds hold. A value alone over ``max_bytes`` is not stored (and replaces nothing)."""
        if size > self.max_bytes:
            return False
        old = self._items.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        self._items[key] = (value, size)
        self.nbytes += size
        while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
            _, (_, n) = self._items.popitem(last=False)
            self.nbytes -= n
        return True

    def pop(self, key: K) -> V | None:
        """Remove and return the value under ``key`` (None when absent)."""
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.nbytes -= item[1]
        return item[0]

    def items(self) -> list[tuple[K, V]]:
        """(key, value) pairs, least recently used first (a copy: safe to pop while iterating)."""
        return [(k, v) for k, (v, _) in self._items.items()]

    def __len__(self) -> int:
        return len(self._items)
