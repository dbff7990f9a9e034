"""Session turn store (strict-append guard, canonical diff) and session index (lineage, anchors)."""
from __future__ import annotations

from mlxstack.cache.sessions import SessionIndex, SessionTurnStore, message_diff

SYS = {"role": "system", "content": "s"}


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_message_diff_counts_leading_equal_messages():
    assert message_diff([SYS, u("1"), a("x")], [SYS, u("1"), a("y")]) == 2
    assert message_diff([], [SYS]) == 0
    assert message_diff([{"content": "c", "role": "user"}], [u("c")]) == 1  # key order irrelevant


def test_only_strict_appends_advance_the_record():
    store = SessionTurnStore()
    assert store.update("orch", [SYS, u("1")])
    assert store.update("orch", [SYS, u("1"), a("r"), u("2")])
    # a sub-agent branch reusing the same session id diverges: refused, record intact
    assert not store.update("orch", [SYS, u("do subtask")])
    # an edited history: refused
    assert not store.update("orch", [SYS, u("1 edited"), a("r"), u("2"), a("q"), u("3")])
    # a resend of the same list is not an append: refused
    assert not store.update("orch", [SYS, u("1"), a("r"), u("2")])
    assert store.get("orch") == [SYS, u("1"), a("r"), u("2")]
    assert store.refused_writes == 3
    assert store.stable_prefix("orch", [SYS, u("1"), a("r"), u("2 changed")]) == 3


def test_turn_records_expire_when_idle():
    clock = Clock()
    store = SessionTurnStore(max_idle_seconds=10, clock=clock)
    store.update("s", [SYS])
    clock.t = 11
    assert store.stable_prefix("s", [SYS]) == 0 and len(store) == 0


def test_session_index_keeps_recent_entries_per_session():
    idx = SessionIndex(max_entries_per_session=2)
    for eid in (1, 2, 3):
        idx.record("s", eid, depth=100)
    assert idx.candidates("s") == [3, 2]


def test_branch_lineage_lets_a_sub_agent_reach_its_parent_entries():
    idx = SessionIndex(max_entries_per_session=2, anchor_stride=2048)
    idx.record("orch", 10, depth=5000)          # anchors at 2048 and 4096 -> entry 10
    idx.record("sub", 20, depth=300, parent="orch")
    assert idx.lineage("sub") == ["sub", "orch"]
    assert idx.candidates("sub") == [20, 10]
    assert idx.parent_of("orch") is None        # lineage is one-way
    idx.record("orch", 11, depth=6200)          # anchor 6144 -> 11; earlier anchors keep 10
    idx.record("orch", 12, depth=100)
    assert idx.candidates("orch") == [12, 11, 10]


def test_lineage_never_forms_a_cycle():
    idx = SessionIndex()
    idx.record("a", 1, 10)
    idx.record("b", 2, 10, parent="a")
    idx.record("a", 3, 10, parent="b")          # would close a cycle: ignored
    assert idx.lineage("a") == ["a"] and idx.lineage("b") == ["b", "a"]


def test_forgetting_an_evicted_entry_removes_it_everywhere():
    idx = SessionIndex(anchor_stride=10)
    idx.record("s", 7, depth=25)
    idx.forget_entry(7)
    assert idx.candidates("s") == []


def test_idle_sessions_expire():
    clock = Clock()
    idx = SessionIndex(max_idle_seconds=5, clock=clock)
    idx.record("s", 1, 10)
    clock.t = 6
    assert idx.candidates("s") == [] and len(idx) == 0
