"""Lockstep records as plain data (engine/record_codec.py, LESSONS 66): a real chat item with its
sampling parameters and grammar spec survives the trip exactly, a client's JSON cannot pass for a
tag, and bytes that are not a record -- a pickle whose unpickling would run code above all -- stop
the follower (LockstepBroken) without anything in them running."""
from __future__ import annotations

import json
import pickle

import pytest

from mlxstack.constraints import spec_for_request
from mlxstack.engine import record_codec as rc
from mlxstack.engine.lockstep import Lockstep, LockstepBroken, Record, portable_job
from mlxstack.runner.sampling import SamplingParams
from tests.test_engine import job


def chat_record() -> tuple[Record, dict, object]:
    j, _ = job([{"role": "user", "content": "hi", "extra": {"$t": [1, 2], "$dc": "os.system"}}], max_tokens=7)
    j.params = SamplingParams(temperature=0.7, seed=2**63 + 5, max_tokens=7, logit_bias={42: -3.5, 7: 1.0},
                              stop_token_ids=frozenset({2, 0, 11}), repetition_scope="all")
    j.headers = {"Authorization": "Bearer sk-secret", "x-request-id": "r1"}
    j.body = {"session_id": "s", "metadata": {"$weird": ["a", {"b": None}]}, "n": 1.5}
    spec = spec_for_request(response_format={"type": "json_object"})
    values, no_grammar = portable_job(j)
    assert no_grammar is None
    record = Record(items=[("chat", 0, values, spec), ("call", ("warm", 3)), ("stop",)],
                    cancelled=[4, 9], now=1234.5, digest=(17, ((0, 12, 3), (1, 40, 0))))
    return record, values, spec


def test_a_chat_record_round_trips_exactly():
    record, values, spec = chat_record()
    data = rc.encode(record)
    json.loads(data)                                  # JSON, nothing else
    back = rc.decode(data, Record)
    assert back == record
    assert back.items[0][2]["params"] == values["params"] and type(back.items[0][2]["params"]) is SamplingParams
    assert back.items[0][2]["params"].logit_bias == {42: -3.5, 7: 1.0}          # int keys stay ints
    assert back.items[0][2]["params"].stop_token_ids == frozenset({0, 2, 11})
    assert back.items[0][3] == spec and back.items[0][3].key == spec.key
    assert back.digest == (17, ((0, 12, 3), (1, 40, 0)))                         # tuples, compared as tuples
    # the client's own "$..." keys came back as the client's data, not as tags
    assert back.items[0][2]["messages"][0]["extra"] == {"$t": [1, 2], "$dc": "os.system"}
    assert back.items[0][2]["body"]["metadata"] == {"$weird": ["a", {"b": None}]}
    assert "sk-secret" not in data.decode() and back.items[0][2]["headers"] == {"x-request-id": "r1"}
    assert rc.decode(rc.encode(Record()), Record) == Record()
    assert rc.from_plain(rc.to_plain({b"k": b"\x00\xff"})) == {b"k": b"\x00\xff"}


@pytest.mark.parametrize("value", [print, object(), lambda: 1, {1, 2}, pickle])
def test_what_a_record_cannot_carry_is_refused_when_written(value):
    with pytest.raises(TypeError, match="cannot carry"):
        rc.to_plain({"x": [value]})


@pytest.mark.parametrize("plain", [
    {"$dc": "Popen", "f": {}},                              # no such class here
    {"$dc": "SamplingParams", "f": {"temperature": 0, "__class__": 1}},   # a field it does not have
    {"$dc": "SamplingParams", "f": {}, "x": 1},             # a tag with company
    {"$eval": "1"},                                         # a tag it never wrote
    {"$d": [[[1], 2]]},                                     # a list as a key
    {"$b": "not base64!"},
    {"$t": 5},
])
def test_what_the_codec_did_not_write_is_refused(plain):
    with pytest.raises(rc.RecordError):
        rc.from_plain(plain)


class _Group:
    """A rank number and a group size: all Lockstep asks of its MLX group outside collectives."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2


def channel_pair():
    """Rank 0's and rank 1's ends of a real control channel over 127.0.0.1."""
    import os as _os
    import threading

    from mlxstack.system.control_channel import ControlChannel, parse_address, reserve

    address, secret, box = parse_address(reserve()), _os.urandom(32), {}
    t = threading.Thread(target=lambda: box.update(f=ControlChannel.follow(address, secret, rank=1, timeout=10)))
    t.start()
    lead = ControlChannel.lead(address, secret, followers=1, timeout=10)
    t.join(10)
    return lead, box["f"]


class _Boom:
    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(MARKER),))


MARKER = ""


@pytest.mark.parametrize("kind", ["pickle", "garbage", "wrong fields", "unknown item", "forged class"])
def test_a_follower_stops_on_a_record_it_cannot_read_and_runs_nothing_in_it(tmp_path, kind):
    global MARKER
    MARKER = str(tmp_path / "ran")
    record, values, _ = chat_record()
    data = {
        "pickle": pickle.dumps(Record(items=[("chat", 0, {"x": _Boom()}, None)])),
        "garbage": b"\x80\x05garbage",
        "wrong fields": json.dumps({"items": [], "now": 1}).encode(),
        "unknown item": rc.encode(Record(items=[("exec", "rm -rf /")])),
        "forged class": rc.encode(record).replace(b'"$dc":"SamplingParams"', b'"$dc":"ChatJob"'),
    }[kind]
    lead, follow = channel_pair()
    try:
        lead.send(data)                                  # rank 0's end: the bytes as they would arrive
        follower = Lockstep(_Group(1), follow)
        with pytest.raises(LockstepBroken):
            follower.exchange([], None)
        assert not (tmp_path / "ran").exists()
        # the leader's own encoding of a chat item is what a follower rebuilds
        lead.send(rc.encode(Record(items=[record.items[0]], digest=())))
        items = Lockstep(_Group(1), follow, compile_grammar=lambda spec: ("compiled", spec.key)).exchange([], None)
    finally:
        lead.close()
        follow.close()
    assert len(items) == 1 and items[0][0].job.messages == values["messages"]
    assert items[0][0].job.params.grammar == ("compiled", record.items[0][3].key)
    assert items[0][0].job.params.logit_bias == values["params"].logit_bias
