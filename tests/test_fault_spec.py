"""The fault-injection switch itself (mlxstack/config/faults.py): spec parsing, which hit fires,
what it records, and that it is inert when disarmed."""
from __future__ import annotations

import threading
import time

import pytest

from mlxstack.config import faults


def test_parse_reads_point_key_nth_and_action():
    rules = faults.parse("sampler@req-b:3, disk_write, detokenizer:*:fatal, decode_forward:stall=0.5")
    assert [(r.point, r.key, r.nth, r.action, r.seconds) for r in rules] == [
        ("sampler", "req-b", 3, "raise", 0.0), ("disk_write", "", 1, "raise", 0.0),
        ("detokenizer", "", None, "fatal", 0.0), ("decode_forward", "", 1, "stall", 0.5)]


@pytest.mark.parametrize("spec,words", [("samplr", "unknown fault point 'samplr'"), ("sampler:0", "not a hit number"),
                                        ("sampler:2:explode", "not raise, fatal or stall"),
                                        ("sampler:2:raise:x", "too many fields")])
def test_a_bad_spec_says_what_is_wrong(spec, words):
    with pytest.raises(ValueError, match=words):
        faults.parse(spec)


def test_the_nth_matching_hit_fires_and_records_whom_it_touched():
    assert faults.hit("sampler", "a") is None and not faults.active()     # disarmed: nothing
    with faults.injected("sampler@b:2"):
        faults.hit("sampler", "a")                     # another key: not counted
        faults.hit("sampler", "b1")
        with pytest.raises(faults.InjectedFault, match=r"injected fault at sampler \(b2,b3\)"):
            faults.hit("sampler", "b2,b3")
        faults.hit("sampler", "b4")                    # fired once: nth=2 only
        assert faults.fired() == 1 and faults.touched("sampler") == ["b2,b3"] and faults.touched("store") == []
    assert faults.fired() == 0 and faults.touched() == []


def test_fatal_is_no_exception_and_disarm_wakes_a_stall():
    with faults.injected("store:fatal"):
        with pytest.raises(faults.InjectedFatal):
            try:
                faults.hit("store")
            except Exception:  # noqa: BLE001 - a fatal must pass every request-level handler
                pytest.fail("InjectedFatal was caught as an Exception")
    faults.arm("store:stall=30")
    t0 = time.monotonic()
    t = threading.Thread(target=faults.hit, args=("store",))
    t.start()
    time.sleep(0.1)
    faults.disarm()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - t0 < 5
