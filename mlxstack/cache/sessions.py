"""Session layers: the turn store (strict-append guard) and the session index (lineage).

Turn store: per session, the canonical message list of its longest linear history. Only a
strict append in canonical space advances the record, so a sub-agent branch or an edited
history never clobbers the orchestrator's record. ``stable_prefix`` says how many leading
messages of a new request equal the record (the secondary lookup's estimate).

Session index: per session, its most recent cache entry ids (bounded), the parent session it
branched from, and anchor entries every ``anchor_stride`` tokens, so a branch returning to its
parent finds the parent's KV.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


def _message_key(message: Any) -> str:
    return json.dumps(message, sort_keys=True, ensure_ascii=False, default=str)


def message_diff(stored: Sequence[Any], incoming: Sequence[Any]) -> int:
    """Number of leading messages equal in both lists (canonical form)."""
    n = 0
    for a, b in zip(stored, incoming):
        if _message_key(a) != _message_key(b):
            break
        n += 1
    return n


def expire_idle(items: dict[str, Any], max_idle: float, now: float) -> None:
    """Drop values whose ``touched`` time is more than ``max_idle`` seconds old (0 = never)."""
    if max_idle > 0:
        for key in [k for k, v in items.items() if now - v.touched > max_idle]:
            del items[key]


@dataclass
class _TurnRecord:
    messages: list[Any]
    touched: float
    nbytes: int = 0
    history: int | None = None   # tokens the messages took, rendered without a generation prompt


class SessionTurnStore:
    def __init__(self, max_idle_seconds: float = 1800.0, clock: Callable[[], float] = time.monotonic,
                 max_sessions: int = 4096, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.max_idle = max_idle_seconds
        self.clock = clock
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self._records: "OrderedDict[str, _TurnRecord]" = OrderedDict()
        self._bytes = 0
        self.refused_writes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _expire(self) -> None:
        before = set(self._records)
        expire_idle(self._records, self.max_idle, self.clock())
        if len(self._records) != len(before):
            self._bytes = sum(r.nbytes for r in self._records.values())

    def stable_prefix(self, session_id: str, canonical_messages: Sequence[Any]) -> int:
        self._expire()
        rec = self._records.get(session_id)
        return message_diff(rec.messages, canonical_messages) if rec else 0

    def recorded_history(self, session_id: str, stable: int) -> int | None:
        """Tokens the recorded messages took as the model saw them rendered, when the ``stable``
        leading messages of a new request are the whole record: a growing conversation's stable
        prefix is the previous request's history, so its token boundary needs no render. (An
        estimate where the template renders the same messages differently now -- a per-turn date
        in the system prompt: it only decides whether the secondary lookup runs, which verifies
        every candidate on model tokens.)"""
        rec = self._records.get(session_id)
        if rec is None or rec.history is None or stable != len(rec.messages):
            return None
        return rec.history

    def update(self, session_id: str, canonical_messages: Sequence[Any],
               history: int | None = None) -> bool:
        """Record ``canonical_messages`` if it strictly extends (or first creates) the record;
        ``history``: the tokens those messages took, rendered without a generation prompt."""
        self._expire()
        rec = self._records.get(session_id)
        now = self.clock()
        if rec is not None:
            common = message_diff(rec.messages, canonical_messages)
            if common < len(rec.messages) or len(canonical_messages) <= len(rec.messages):
                rec.touched = now
                self.refused_writes += 1
                return False
        blobs = [_message_key(m) for m in canonical_messages]
        size = sum(len(b) for b in blobs)
        if size > self.max_bytes:
            self.refused_writes += 1
            return False
        old = self._records.pop(session_id, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._records[session_id] = _TurnRecord([json.loads(b) for b in blobs], now, size, history)
        self._bytes += size
        while len(self._records) > self.max_sessions or self._bytes > self.max_bytes:
            _, dropped = self._records.popitem(last=False)
            self._bytes -= dropped.nbytes
        return True

    def get(self, session_id: str) -> list[Any] | None:
        rec = self._records.get(session_id)
        return None if rec is None else rec.messages

    def __len__(self) -> int:
        return len(self._records)


@dataclass
class _SessionInfo:
    recent: list[int] = field(default_factory=list)      # entry ids, newest last
    anchors: dict[int, int] = field(default_factory=dict)  # token depth -> entry id
    parent: str | None = None
    touched: float = 0.0


class SessionIndex:
    def __init__(self, max_entries_per_session: int = 2, anchor_stride: int = 2048,
                 max_idle_seconds: float = 1800.0, clock: Callable[[], float] = time.monotonic,
                 max_sessions: int = 8192) -> None:
        self.max_per_session = max_entries_per_session
        self.anchor_stride = anchor_stride
        self.max_idle = max_idle_seconds
        self.clock = clock
        self.max_sessions = max_sessions
        self._sessions: "OrderedDict[str, _SessionInfo]" = OrderedDict()

    def _expire(self) -> None:
        expire_idle(self._sessions, self.max_idle, self.clock())

    def record(self, session_id: str, entry_id: int, depth: int, parent: str | None = None) -> None:
        self._expire()
        info = self._sessions.setdefault(session_id, _SessionInfo())
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.max_sessions:  # least recently recorded session goes first
            self._sessions.popitem(last=False)
        info.touched = self.clock()
        if parent and parent != session_id and info.parent is None and not self._is_ancestor(session_id, parent):
            info.parent = parent
        if entry_id in info.recent:
            info.recent.remove(entry_id)
        info.recent.append(entry_id)
        del info.recent[:-self.max_per_session]
        for anchor in range(self.anchor_stride, depth + 1, self.anchor_stride):
            info.anchors.setdefault(anchor, entry_id)

    def _is_ancestor(self, candidate: str, of: str) -> bool:
        seen = set()
        cur: str | None = of
        while cur is not None and cur not in seen:
            if cur == candidate:
                return True
            seen.add(cur)
            cur = self._sessions.get(cur).parent if cur in self._sessions else None
        return False

    def lineage(self, session_id: str) -> list[str]:
        """The session and its ancestors, nearest first."""
        out, cur = [], session_id
        while cur is not None and cur not in out:
            out.append(cur)
            info = self._sessions.get(cur)
            cur = info.parent if info else None
        return out

    def candidates(self, session_id: str) -> list[int]:
        """Entry ids worth verifying for this session: its own, then its ancestors' and anchors."""
        self._expire()
        ids: list[int] = []
        for sid in self.lineage(session_id):
            info = self._sessions.get(sid)
            if info is None:
                continue
            ids += list(reversed(info.recent)) + sorted(info.anchors.values(), reverse=True)
        return list(dict.fromkeys(ids))

    def forget_entry(self, entry_id: int) -> None:
        for info in self._sessions.values():
            if entry_id in info.recent:
                info.recent.remove(entry_id)
            for k in [k for k, v in info.anchors.items() if v == entry_id]:
                del info.anchors[k]

    def parent_of(self, session_id: str) -> str | None:
        info = self._sessions.get(session_id)
        return info.parent if info else None

    def __len__(self) -> int:
        return len(self._sessions)
