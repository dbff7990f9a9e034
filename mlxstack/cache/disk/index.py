"""The disk tier's index: one sqlite3 table (WAL) of entries, read at start-up without touching
any tensor file.

A row is written only after its file is durable (temp + fsync + rename), and deleted before its
file is unlinked, so a crash leaves at worst a file without a row (removed at start-up) or a row
whose file is missing (dropped at start-up) -- never a row pointing at a torn file that looks
whole. Tokens are stored as little-endian int64 bytes.

    index = DiskIndex(path)
    index.insert(row); index.touch([(entry_id, last_used, use_seq)]); index.delete([entry_id])
    rows = index.rows()      # oldest use first
"""
from __future__ import annotations

import json
import os
import sqlite3
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .folders import PRIVATE_FILE

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id           INTEGER PRIMARY KEY,
    nbytes       INTEGER NOT NULL,
    checksum     TEXT    NOT NULL,
    created      REAL    NOT NULL,
    last_used    REAL    NOT NULL,
    use_seq      INTEGER NOT NULL,
    key_tokens   BLOB    NOT NULL,
    model_tokens BLOB    NOT NULL,
    meta         TEXT    NOT NULL
)
"""


@dataclass(frozen=True, slots=True)
class IndexRow:
    entry_id: int
    nbytes: int               # size of the entry's file
    checksum: str             # must equal the file's own checksum on load
    created: float
    last_used: float
    use_seq: int              # LRU order: a counter, so wall-clock jumps cannot reorder entries
    key_tokens: np.ndarray    # int64, read-only
    model_tokens: np.ndarray  # int64, read-only
    meta: dict


def _private_files(db: Path) -> None:
    """chmod 0600 the database and whichever of its companion files exist."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        try:
            if stat.S_IMODE(os.lstat(f"{db}{suffix}").st_mode) != PRIVATE_FILE:
                os.chmod(f"{db}{suffix}", PRIVATE_FILE)
        except FileNotFoundError:
            pass


def tokens_to_blob(tokens: np.ndarray) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


def blob_to_tokens(blob: bytes) -> np.ndarray:
    arr = np.frombuffer(blob, dtype="<i8").astype(np.int64)
    arr.flags.writeable = False
    return arr


class DiskIndex:
    """Not thread-safe by itself: the disk tier calls it from one thread at a time."""

    def __init__(self, path: Path) -> None:
        # The rows hold every stored prompt's tokens: the database is created 0600 before sqlite
        # opens it (sqlite gives its -wal / -shm / -journal the database file's mode), and files an
        # older version left 0644 are tightened.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
        os.close(fd)
        _private_files(Path(path))
        # isolation_level=None: explicit transactions, so each insert/delete commits at once.
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        _private_files(Path(path))
        # NORMAL under WAL: a process crash loses nothing; a power cut may lose the last rows,
        # whose files are then removed as orphans at start-up.
        self._db.execute("PRAGMA synchronous=NORMAL")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        self.reset = version not in (0, SCHEMA_VERSION)
        if self.reset:
            self._db.execute("DROP TABLE IF EXISTS entries")
        self._db.execute(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def rows(self) -> list[IndexRow]:
        cur = self._db.execute(
            "SELECT id, nbytes, checksum, created, last_used, use_seq, key_tokens, model_tokens, meta "
            "FROM entries ORDER BY use_seq, id")
        return [IndexRow(r[0], r[1], r[2], r[3], r[4], r[5], blob_to_tokens(r[6]), blob_to_tokens(r[7]),
                         json.loads(r[8])) for r in cur]

    def insert(self, row: IndexRow) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (row.entry_id, row.nbytes, row.checksum, row.created, row.last_used, row.use_seq,
             tokens_to_blob(row.key_tokens), tokens_to_blob(row.model_tokens),
             json.dumps(row.meta, sort_keys=True)))

    def touch(self, updates: Iterable[tuple[int, float, int]]) -> None:
        with self._db:  # one transaction for a batch of LRU bumps
            self._db.execute("BEGIN")
            self._db.executemany("UPDATE entries SET last_used = ?, use_seq = ? WHERE id = ?",
                                 [(last_used, seq, eid) for eid, last_used, seq in updates])

    def delete(self, entry_ids: Iterable[int]) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany("DELETE FROM entries WHERE id = ?", [(eid,) for eid in entry_ids])

    def close(self) -> None:
        self._db.close()
