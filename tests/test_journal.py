"""The healing journal (cache/disk/journal.py) is bounded in bytes while running (issue 23 #6): it used
to apply its cap only when loading at start-up, so the file grew with every reply and was read
whole into memory at the next start."""
from __future__ import annotations

import json
from collections import OrderedDict

from mlxstack.cache.disk.journal import Journal, newest_within


def test_the_file_never_grows_past_its_cap_while_running(tmp_path):
    path = tmp_path / "healing.jsonl"
    j = Journal(path, max_bytes=4096)
    j.load()
    sizes = []
    for i in range(1000):                       # ~100 KB appended in all
        j.append(f"key-{i}", {"reasoning": "x" * 60, "i": i})
        sizes.append(path.stat().st_size)
    j.close()
    assert max(sizes) <= 4096 and j.compactions >= 40
    assert j._live_bytes <= 4096 and len(j._lines) >= 20
    got = Journal(path, max_bytes=4096).load()
    assert [k for k, _ in got] == [f"key-{i}" for i in range(1000 - len(got), 1000)]    # the newest, in order
    assert got[-1][1] == {"reasoning": "x" * 60, "i": 999}


def test_a_rewritten_key_counts_once_and_the_last_value_wins(tmp_path):
    path = tmp_path / "j.jsonl"
    j = Journal(path, max_bytes=10_000)
    j.load()
    for v in range(50):
        j.append("same", v)
    j.append("other", "x")
    assert list(j._lines) == ["same", "other"]
    j.close()
    assert Journal(path, max_bytes=10_000).load() == [("same", 49), ("other", "x")]


def test_a_record_over_half_the_cap_is_not_kept_and_breaks_nothing(tmp_path):
    path = tmp_path / "j.jsonl"
    j = Journal(path, max_bytes=1000)
    j.load()
    j.append("small", 1)
    j.append("huge", "y" * 800)
    j.append("after", 2)
    j.close()
    assert Journal(path, max_bytes=1000).load() == [("small", 1), ("after", 2)]


def test_a_torn_line_and_an_oversized_file_from_before_are_compacted_at_load(tmp_path):
    path = tmp_path / "j.jsonl"
    lines = [json.dumps([f"k{i}", "v" * 40]) + "\n" for i in range(200)]
    path.write_text("".join(lines) + '["torn", "no end')
    got = Journal(path, max_bytes=2000).load()
    assert path.stat().st_size <= 2000 and [k for k, _ in got] == [f"k{i}" for i in range(200 - len(got), 200)]


def test_newest_within_keeps_the_newest_records_that_fit():
    lines = OrderedDict((k, "x" * n) for k, n in (("a", 5), ("b", 4), ("c", 3)))
    assert list(newest_within(lines, 7)) == ["b", "c"]
    assert list(newest_within(lines, 12)) == ["a", "b", "c"]
    assert list(newest_within(lines, 2)) == []
