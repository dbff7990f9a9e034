"""A small append-only JSON-lines journal next to the disk tier (the healing store's memory
across restarts): one line per record, the last record for a key wins, a torn last line (a
crash mid-write) is skipped.

Bounded in bytes while running, not only at start-up: the file never grows past ``max_bytes``.
The journal keeps the live records it would rewrite (newest last, at most ``max_bytes`` of lines,
the oldest dropped first) and, when an append would push the file past the cap, rewrites it
compacted to the newest half of the cap (temp + fsync + rename), then appends -- amortised O(1)
per append. Start-up reads it once and rewrites it compacted the same way.

    j = Journal(path, max_bytes=64 << 20)
    for key, value in j.load(): ...          # oldest first, compacted
    j.append(key, value)
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("mlxstack.cache.journal")


def _line(key: str, value: Any) -> str:
    return json.dumps([key, value], ensure_ascii=False) + "\n"


def _size(line: str) -> int:
    return len(line.encode("utf-8", "surrogatepass"))


def newest_within(lines: "OrderedDict[str, str]", budget: int) -> "OrderedDict[str, str]":
    """The newest records whose lines fit ``budget`` bytes, oldest first (pure)."""
    kept: list[tuple[str, str]] = []
    total = 0
    for key in reversed(lines):
        n = _size(lines[key])
        if total + n > budget:
            break
        total += n
        kept.append((key, lines[key]))
    return OrderedDict(reversed(kept))


class Journal:
    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._fh: Any = None
        self._lines: "OrderedDict[str, str]" = OrderedDict()   # live records: key -> its line
        self._live_bytes = 0
        self.file_bytes = 0
        self.compactions = 0

    def load(self) -> list[tuple[str, Any]]:
        """Every live record, oldest first; rewrites the file compacted to fit ``max_bytes``."""
        records: dict[str, Any] = {}
        try:
            with open(self.path, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        key, value = json.loads(line)
                    except (ValueError, TypeError):
                        continue  # a torn line from a crash mid-append
                    records.pop(key, None)
                    records[key] = value
        except FileNotFoundError:
            pass
        lines = newest_within(OrderedDict((k, _line(k, v)) for k, v in records.items()), self.max_bytes)
        with self._lock:
            self._set_live(lines)
            self._rewrite()
        return [(k, records[k]) for k in lines]

    def _set_live(self, lines: "OrderedDict[str, str]") -> None:
        self._lines = lines
        self._live_bytes = sum(_size(x) for x in lines.values())

    def _rewrite(self) -> None:
        """Write the live records as the whole file (lock held)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as fh:
            fh.writelines(self._lines.values())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self.file_bytes = self._live_bytes

    def append(self, key: str, value: Any) -> None:
        line = _line(key, value)
        n = _size(line)
        with self._lock:
            try:
                if n > self.max_bytes // 2:
                    log.warning("journal %s: a %d-byte record is over half the cap; not kept", self.path, n)
                    return
                old = self._lines.pop(key, None)
                self._live_bytes -= _size(old) if old is not None else 0
                self._lines[key] = line
                self._live_bytes += n
                while self._live_bytes > self.max_bytes:
                    _, dropped = self._lines.popitem(last=False)
                    self._live_bytes -= _size(dropped)
                if self._fh is None:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                    self._fh = os.fdopen(fd, "a", encoding="utf-8", errors="surrogatepass")
                    self.file_bytes = os.fstat(fd).st_size
                if self.file_bytes + n > self.max_bytes:
                    self._set_live(newest_within(self._lines, self.max_bytes // 2))
                    self._rewrite()             # the new record is in it already
                    self.compactions += 1
                    return
                self._fh.write(line)
                self._fh.flush()
                self.file_bytes += n
            except OSError as exc:  # a full disk must not fail a request
                log.warning("journal %s: append failed (%s)", self.path, exc)

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def iter_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        yield from fh
