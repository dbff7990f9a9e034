"""Issue 23 #2, through the real engine: an entry bigger than PROMPT_CACHE_MAX_BYTES, and
snapshots on disk that a restart with SNAPSHOT_MAX_ENTRIES=0 cannot hold in RAM. Both used to
empty the RAM tier and then fail every later turn (a promoted entry that was spilled again at
once, counted as a hit with no payload). Now the entry stays on disk, the turn is served from what
was loaded, and the reply equals a cold run.
"""
from __future__ import annotations

from tests.conftest import build_engine
from tests.test_disk_cache import disk_settings, run_turns
from tests.test_engine import job
from tests.test_model_families import TURNS


def test_an_entry_over_the_byte_budget_is_served_from_disk_every_turn(tiny_dense_path, tmp_path):
    probe = build_engine(disk_settings(tiny_dense_path, tmp_path / "probe"))
    run_turns(probe, TURNS[:1])
    one_turn = max(e.nbytes for e in probe.state.kv.index.entries())
    probe.state.close()

    # A small side entry fits; every entry of the conversation is over the budget.
    eng = build_engine(disk_settings(tiny_dense_path, tmp_path / "tier", prompt_cache_max_bytes=one_turn - 1))
    pc = eng.state.kv.index
    side, _ = run_turns(eng, ["Hi"], session="side")
    side_ids = [e.entry_id for e in pc.entries()]
    assert side_ids and pc.nbytes < one_turn - 1
    outs, messages = run_turns(eng, TURNS[:3], session="disk")
    refs, _ = run_turns(build_engine(disk_settings(tiny_dense_path, tmp_path / "cold",
                                                   prompt_cache_max_entries_global=0)), TURNS[:3], session="disk")
    assert [o.raw_text for o in outs] == [r.raw_text for r in refs]
    assert [o.timings["cache_tier"] for o in outs[1:]] == ["disk", "disk"]
    assert all(o.cached_tokens >= p.prompt_tokens - 8 for o, p in zip(outs[1:], outs))
    assert [e.entry_id for e in pc.entries()] == side_ids          # the side entry was never evicted
    assert pc.counters.get("disk_load_failures") == 0
    eng.state.close()


def test_snapshots_on_disk_after_a_restart_with_no_snapshot_room(tiny_kind_paths, tmp_path):
    path = tiny_kind_paths("hybrid")
    first = build_engine(disk_settings(path, tmp_path))
    _, messages = run_turns(first, TURNS[:2])
    first.state.close()
    assert any(i.meta.get("pool") == "snapshot" for i in first.state.disk.tier.entries())
    cold, _ = run_turns(build_engine(disk_settings(path, tmp_path / "cold", prompt_cache_max_entries_global=0)),
                        TURNS[:2])

    # Regenerating turn 2 needs the prompt[:-1] snapshot (a recurrent entry serves its exact
    # depth only); the restarted engine has no RAM room for snapshots.
    restarted = build_engine(disk_settings(path, tmp_path, snapshot_max_entries=0))
    for _ in range(2):                                 # the retry must not fail either
        out = restarted.run(job(messages[:-1], max_tokens=8, session="disk")[0])
        assert out.raw_text == cold[1].raw_text
        assert out.cached_tokens == out.prompt_tokens - 1 and out.timings["cache_tier"] == "disk"
    pc = restarted.state.kv.index
    assert pc.counters.get("disk_load_failures") == 0 and pc.entries("snapshot") == []
    restarted.state.close()
