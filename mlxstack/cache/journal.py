"""A small append-only JSON-lines journal next to the disk tier (the healing store's memory
across restarts): one line per record, the last record for a key wins, a torn last line (a
crash mid-write) is skipped, and start-up rewrites it compacted (temp + rename).

    j = Journal(path, max_bytes=64 << 20)
    for key, value in j.load(): ...          # oldest first, compacted
    j.append(key, value)
"""
from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("mlxstack.cache.journal")


class Journal:
    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._fh: Any = None

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
        items = list(records.items())
        lines = [json.dumps([k, v], ensure_ascii=False) + "\n" for k, v in items]
        total, keep = 0, len(lines)
        for i in range(len(lines) - 1, -1, -1):   # newest first until the budget is spent
            total += len(lines[i].encode("utf-8", "surrogatepass"))
            if total > self.max_bytes:
                keep = len(lines) - 1 - i
                break
        items, lines = items[len(items) - keep:], lines[len(lines) - keep:]
        self._rewrite(lines)
        return items

    def _rewrite(self, lines: list[str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as fh:
            fh.writelines(lines)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)

    def append(self, key: str, value: Any) -> None:
        line = json.dumps([key, value], ensure_ascii=False) + "\n"
        with self._lock:
            try:
                if self._fh is None:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                    self._fh = os.fdopen(fd, "a", encoding="utf-8", errors="surrogatepass")
                self._fh.write(line)
                self._fh.flush()
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
