"""One model over several ranks (DISTRIBUTED=tensor | pipeline): MLX's ring backend between local
ranks, real servers, real models.

Pure parts: which splits a model allows and the one-line refusal, the launcher's hostfile /
environment / mlx.launch command, the records' job form and scheduler digest, the control
channel (authenticated; a stranger is refused). Real servers: a tiny random qwen2 (a family with
both splits) served by one process, by 2 ranks tensor parallel and by 2 ranks pipeline parallel,
compared reply for reply -- greedy, sampled with a seed, structured output, warm turns (the same
tokens reused), 4 concurrent sessions, grammar-forced drafts, the disk tier per rank; a hybrid
(qwen3_next: recurrent + attention layers) over pipeline ranks; split logits within the measured
tolerance; a client that hangs up mid-stream, a 4xx raised inside the
engine, and the next request answers the same; a model the split does not fit is refused at
start in one line; a killed rank ends the group (the launcher restarts it) and a stop leaves no
rank running. The embedded SmolLM2 over 3 ranks through the whole stack is in
tests/test_e2e_distributed.py.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from mlxstack.config.settings import SettingsError, load_settings
from mlxstack.engine import record_codec
from mlxstack.engine.lockstep import portable_job, scheduler_digest
from mlxstack.engine.request import ChatJob
from mlxstack.launcher.ranks import launch_command, rank_env, ring_hostfile
from mlxstack.models.sharding import ShardFacts, facts_from_config, pipeline_counts, refusal, tensor_counts
from mlxstack.runner.sampling import SamplingParams
from mlxstack.system.control_channel import ControlChannel, parse_address
from scripts.probelib.servers import ServerProcess
from tests.conftest import http_json

SMOL = ShardFacts(name="SmolLM2-135M-Instruct", heads=9, kv_heads=3, layers=30, intermediate=1536,
                  tensor=True, pipeline=False)


# ----------------------------------------------------------------------------- pure parts
def test_split_counts_and_refusals():
    assert tensor_counts(SMOL) == [3] and pipeline_counts(SMOL) == []
    assert refusal("tensor", 3, SMOL) is None
    assert refusal("tensor", 2, SMOL) == (
        "DISTRIBUTED=tensor over 2 ranks cannot serve SmolLM2-135M-Instruct: its 9 attention heads / 3 KV heads "
        "/ 1536 MLP columns do not divide by 2. Works: DISTRIBUTED=tensor with 3 ranks.")
    assert refusal("pipeline", 3, SMOL) == (
        "DISTRIBUTED=pipeline over 3 ranks cannot serve SmolLM2-135M-Instruct: its family has no pipeline split "
        "in mlx-lm (model.model.pipeline). Works: DISTRIBUTED=tensor with 3 ranks.")
    both = ShardFacts("m", heads=8, kv_heads=4, layers=5, intermediate=96, tensor=True, pipeline=True)
    assert tensor_counts(both) == [2, 4] and pipeline_counts(both) == [2, 3, 4, 5]
    assert refusal("pipeline", 6, both) == ("DISTRIBUTED=pipeline over 6 ranks cannot serve m: it has 5 layers for "
                                            "6 ranks. Works: DISTRIBUTED=tensor with 2, 4 ranks; DISTRIBUTED=pipeline "
                                            "with 2-5 ranks.")
    neither = ShardFacts("x", 4, 4, 2, 0, tensor=False, pipeline=False)
    assert refusal("tensor", 2, neither) == ("DISTRIBUTED=tensor over 2 ranks cannot serve x: its family has no "
                                             "tensor-parallel split in mlx-lm (model.shard). Works: nothing: its family "
                                             "has neither model.shard nor model.model.pipeline in mlx-lm.")


def test_facts_read_nested_text_config():
    f = facts_from_config({"text_config": {"num_attention_heads": 16, "num_hidden_layers": 4, "intermediate_size": 64}},
                          "vlm")
    assert (f.heads, f.kv_heads, f.layers, f.intermediate, f.tensor, f.pipeline) == (16, 16, 4, 64, False, False)


def test_distributed_settings_need_ranks():
    with pytest.raises(SettingsError, match="DISTRIBUTED=tensor needs its ranks"):
        load_settings(env={"DISTRIBUTED": "tensor"})
    with pytest.raises(SettingsError, match="DISTRIBUTED_LOCAL_RANKS=1 is one process"):
        load_settings(env={"DISTRIBUTED": "pipeline", "DISTRIBUTED_LOCAL_RANKS": "1"})
    s = load_settings(env={"DISTRIBUTED": "tensor", "DISTRIBUTED_LOCAL_RANKS": "3"})
    assert (s.distributed, s.distributed_local_ranks, s.distributed_backend) == ("tensor", 3, "any")


def test_launcher_pieces():
    assert ring_hostfile([5001, 5002]) == [["127.0.0.1:5001"], ["127.0.0.1:5002"]]
    env = rank_env({"A": "1", "MLX_LISTEN_FD": "7"}, 2, "/tmp/h.json")
    assert env == {"A": "1", "MLX_RANK": "2", "MLX_HOSTFILE": "/tmp/h.json"}
    assert launch_command("/v/bin/python", "/h.json", "ring", ["-m", "mlxstack.serve"], {"K": "v"}) == [
        "/v/bin/mlx.launch", "--hostfile", "/h.json", "--python", "/v/bin/python", "--backend", "ring",
        "--env", "K=v", "--", "-m", "mlxstack.serve"]      # mlx.launch runs "<--python> -m mlxstack.serve"
    assert launch_command("/v/bin/python", "/h.json", "any", ["x"])[-4:] == ["--python", "/v/bin/python", "--", "x"]
    assert parse_address("10.0.0.2:5999") == ("10.0.0.2", 5999) and parse_address("[::1]:80") == ("::1", 80)


def test_portable_job_drops_callbacks_and_grammar():
    class Grammar:
        spec = ("json", {"type": "object"})

    job = ChatJob(request_id="r1", messages=[{"role": "user", "content": "hi"}], tools=None, enable_thinking=False,
                  params=SamplingParams(temperature=0.5, max_tokens=9, seed=3, grammar=Grammar()), stop=["x"],
                  body={"a": 1}, headers={"h": "v", "authorization": "Bearer sk-1", "X-Api-Key": "k", "cookie": "c"},
                  emit=lambda t: None, is_cancelled=lambda: True)
    values, spec = portable_job(job)
    assert values["headers"] == {"h": "v"}                   # credentials never leave rank 0
    assert spec == Grammar.spec
    assert set(values) == {"request_id", "messages", "tools", "enable_thinking", "params", "stop", "body", "headers",
                           "tool_choice", "parallel_tool_calls", "prefill_only", "response_format", "sampling_origin",
                           "response_id", "diagnose", "compare_to", "breakpoints", "cache_ttl", "api", "scope",
                           "raw_prompt", "priority", "priority_source"}
    again = record_codec.from_plain(json.loads(json.dumps(record_codec.to_plain(values))))   # as a record carries it
    assert again["params"] == SamplingParams(temperature=0.5, max_tokens=9, seed=3)
    assert job.params.grammar is not None        # the job itself is untouched


def test_scheduler_digest():
    class Seq:
        def __init__(self, rid, pos, n):
            self.job = type("J", (), {"lockstep_id": rid})()
            self.pos, self.generated = pos, [0] * n

    sched = type("S", (), {"steps": 7, "prefilling": [Seq(3, 40, 0)],
                           "group": type("G", (), {"seqs": [Seq(1, 90, 5), Seq(2, 91, 4)]})()})()
    assert scheduler_digest(sched) == (7, ((3, 40, 0), (1, 90, 5), (2, 91, 4)))
    assert scheduler_digest(None) == ()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_control_channel_delivers_in_order_and_refuses_strangers():
    port, secret = _free_port(), os.urandom(32)
    addr = ("127.0.0.1", port)
    box: dict = {}
    lead = threading.Thread(target=lambda: box.update(lead=ControlChannel.lead(addr, secret, followers=2, timeout=20)))
    lead.start()
    time.sleep(0.2)
    stranger = socket.create_connection(addr)              # not a hello: closed, not counted
    stranger.sendall(b"\0" * 7 + b"\1" + b"\0" * 36)
    assert stranger.recv(1) == b""
    stranger.close()
    followers = {}
    for rank in (2, 1):
        followers[rank] = ControlChannel.follow(addr, secret, rank=rank, timeout=20)
    lead.join(20)
    chan = box["lead"]
    for i in range(3):
        chan.send(json.dumps({"turn": i}).encode())
    for rank in (1, 2):
        assert [json.loads(followers[rank].recv()) for _ in range(3)] == [{"turn": 0}, {"turn": 1}, {"turn": 2}]
    followers[1].report(b"mem 1")
    time.sleep(0.1)
    assert chan.reports() == [(0, b"mem 1")]
    # a frame that is not sealed with this link's key and sequence: refused
    chan.socks[0].sendall(b"\0" * 7 + b"\x13" + b"\0" * 19)
    with pytest.raises(ConnectionError, match="authentication"):
        followers[1].recv()
    chan.close()
    with pytest.raises(EOFError):
        followers[2].recv()


def test_strangers_at_the_control_port_cannot_join_listen_or_hold_it():
    """While 3 ranks form (issue 40): garbage, a forged hello (the right shape, no secret), a replay
    of a real follower's recorded hello, and a client trickling one byte a second all lose; the
    followers join at once (hellos are concurrent, each under one deadline), and what crosses the
    wire is sealed: a record's text is nowhere in the bytes."""
    from mlxstack.system import control_channel as cc

    port, secret = _free_port(), os.urandom(32)
    addr = ("127.0.0.1", port)
    box: dict = {}
    t0 = time.monotonic()
    lead = threading.Thread(target=lambda: box.update(lead=ControlChannel.lead(addr, secret, followers=2, timeout=30)))
    lead.start()
    time.sleep(0.2)
    stop = threading.Event()

    def trickle():
        s = socket.create_connection(addr)
        try:
            while not stop.is_set():
                s.sendall(b"M")
                time.sleep(1.0)
        except OSError:
            pass
        finally:
            s.close()
    threading.Thread(target=trickle, daemon=True).start()
    garbage = socket.create_connection(addr)
    garbage.sendall(os.urandom(64))
    forged = socket.create_connection(addr)
    forged.sendall(cc._MAGIC + struct.pack("!Q", 1) + os.urandom(32))
    reply = forged.recv(64)
    assert len(reply) == 64                             # rank 0's challenge ...
    forged.sendall(os.urandom(32))                      # ... a guess at the proof
    assert forged.recv(1) == b""                        # closed
    with pytest.raises(ConnectionError, match="not rank 0"):     # a follower with the wrong secret learns
        ControlChannel.follow(addr, os.urandom(32), rank=1, timeout=5)   # nothing and is refused
    followers = {r: ControlChannel.follow(addr, secret, rank=r, timeout=20) for r in (1, 2)}
    lead.join(20)
    assert "lead" in box and time.monotonic() - t0 < 8   # the trickle held nothing
    stop.set()
    chan = box["lead"]
    record = b'{"messages": [{"content": "the secret plan"}], "headers": {}}'
    chan.send(record)
    time.sleep(0.1)
    frame = followers[1].socks[0].recv(4096, socket.MSG_PEEK)        # the bytes on the wire
    assert len(frame) == 8 + len(record) + 16 and b"secret plan" not in frame
    assert followers[1].recv() == record and followers[2].recv() == record
    # a follower's link cannot be spoken for by replaying one of its frames
    chan.links[1].sock.sendall(frame)                   # rank 1's frame to rank 2: another key
    with pytest.raises(ConnectionError, match="authentication"):
        followers[2].recv()
    garbage.close()
    forged.close()
    chan.close()


def test_a_group_that_cannot_form_says_which_ranks_are_missing_and_is_restarted():
    from mlxstack.serve import _group_not_formed
    from mlxstack.system.control_channel import GroupNotFormed

    port, secret = _free_port(), os.urandom(32)
    with pytest.raises(GroupNotFormed, match=r"formed 0 of 2 follower ranks .*missing: \[1, 2\]") as err:
        ControlChannel.lead(("127.0.0.1", port), secret, followers=2, timeout=0.5)
    assert _group_not_formed(err.value) and not _group_not_formed(ValueError("bad weights"))


def test_the_control_port_is_bound_before_it_is_published():
    """LocalRanks used to pick a free port, release it and let rank 0 bind it later (a local user
    could take it in between: a group that never forms). Now the port is reserved bound and
    listening, and rank 0's lead takes that very socket."""
    from mlxstack.system.control_channel import _RESERVED, reserve

    address = parse_address(reserve())
    taker = socket.socket()
    with pytest.raises(OSError):                       # nobody else can bind it now
        taker.bind(address)
    taker.close()
    secret = os.urandom(32)
    box: dict = {}
    follower = threading.Thread(target=lambda: box.update(f=ControlChannel.follow(address, secret, rank=1, timeout=10)))
    follower.start()                                   # connects before rank 0 even leads: queued
    chan = ControlChannel.lead(address, secret, followers=1, timeout=10)
    follower.join(10)
    assert address not in _RESERVED
    chan.send(b"turn")
    assert box["f"].recv() == b"turn"
    chan.close()


# ----------------------------------------------------------------------------- real servers
@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory, embedded_model_path) -> Path:
    from tests.fixtures.tiny_models import build_tiny_qwen2

    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), embedded_model_path)


@pytest.mark.e2e
@pytest.mark.parametrize("mode,tolerance", [("tensor", 1e-4), ("pipeline", 0.0)])
def test_split_logits_within_the_measured_tolerance(tiny_qwen2_path, mode, tolerance):
    """scripts/shard_logits.py over 2 local ranks: pipeline parallel is bit for bit one process's
    logits; tensor parallel sums partial products in another order (measured: 8e-6 here, 5.4e-5 for
    the embedded SmolLM2 over 3 ranks, ~1e-6 of the logits' spread); greedy tokens equal."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "scripts/shard_logits.py", "--ranks", "2", "--mode", mode,
                          "--model", str(tiny_qwen2_path), "--tokens", "12"], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    assert got["greedy_tokens_equal"] and got["tokens"] == 12
    assert got["prefill_max_abs"] <= tolerance and got["decode_max_abs"] <= tolerance


BASE_ENV = {"DISK_CACHE_DIR": "off", "DEFAULT_TEMPERATURE": "0", "ENABLE_REQUEST_LOGGING": "false", "DEFAULT_THINKING": "false",
            "MLX_UNHEALTHY_RESTART_SECONDS": "0"}


def _server(model: Path, tmp: Path, name: str, **env: str) -> ServerProcess:
    server = ServerProcess("ours", env={"MODEL_PATH": str(model), "LOG_ROOT": str(tmp / name), **BASE_ENV, **env},
                           log_path=str(tmp / f"{name}.log"))
    server.model_id = model.name  # type: ignore[attr-defined]   # what it serves: its folder's name
    try:
        server.wait_ready(240)
    except Exception:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def servers(tiny_qwen2_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distributed")
    started = {}
    try:
        started["one"] = _server(tiny_qwen2_path, tmp, "one")
        started["tensor"] = _server(tiny_qwen2_path, tmp, "tensor", DISTRIBUTED="tensor", DISTRIBUTED_LOCAL_RANKS="2")
        started["pipeline"] = _server(tiny_qwen2_path, tmp, "pipeline", DISTRIBUTED="pipeline",
                                      DISTRIBUTED_LOCAL_RANKS="2")
        yield started
    finally:
        for s in started.values():
            s.stop()


def _chat(server: ServerProcess, messages, **extra):
    body = {"model": server.model_id, "messages": messages, "max_tokens": extra.pop("max_tokens", 20), **extra}
    status, reply, _ = http_json(server.base_url + "/chat/completions", body, timeout=240)
    assert status == 200, reply
    choice = reply["choices"][0]
    return choice["message"], choice["finish_reason"], reply["usage"]


SYSTEM = "You are a careful coding agent. Read the files first, then answer briefly. " * 12


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_replies_and_warm_turns_match_one_process(servers, mode):
    for i in range(2):
        turn1 = [{"role": "system", "content": f"[{mode}] {SYSTEM}"}, {"role": "user", "content": f"Question {i} ({mode}): what is in file {i}?"}]
        one, ranks = _chat(servers["one"], turn1), _chat(servers[mode], turn1)
        assert ranks == one
        turn2 = turn1 + [{"role": "assistant", "content": one[0].get("content") or ""},
                         {"role": "user", "content": "And the next file?"}]
        one2, ranks2 = _chat(servers["one"], turn2), _chat(servers[mode], turn2)
        assert ranks2 == one2
        assert ranks2[2]["prompt_tokens_details"]["cached_tokens"] > 150    # the warm turn reused its history


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_sampled_structured_and_concurrent_match(servers, mode):
    msgs = [{"role": "user", "content": f"Pick a number and a colour ({mode})."}]
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    assert _chat(servers[mode], msgs, **seeded) == _chat(servers["one"], msgs, **seeded)
    schema = {"type": "json_schema", "json_schema": {"name": "pick", "strict": True, "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "colour": {"type": "string", "maxLength": 8}},
        "required": ["n", "colour"], "additionalProperties": False}}}
    one = _chat(servers["one"], msgs, response_format=schema, max_tokens=80)
    assert _chat(servers[mode], msgs, response_format=schema, max_tokens=80) == one
    assert one[1] == "stop" and set(json.loads(one[0]["content"])) == {"n", "colour"}
    sessions = [[{"role": "system", "content": f"({mode}) {SYSTEM}"}, {"role": "user", "content": f"Sub-agent {i} ({mode}): list risks."}]
                for i in range(4)]
    with cf.ThreadPoolExecutor(4) as pool:
        ranks = list(pool.map(lambda m: _chat(servers[mode], m, max_tokens=12), sessions))
    alone = [_chat(servers["one"], m, max_tokens=12) for m in sessions]
    assert [r[:2] for r in ranks] == [a[:2] for a in alone]    # what was cached depends on arrival: not compared
    assert [r[2]["prompt_tokens"] for r in ranks] == [a[2]["prompt_tokens"] for a in alone]


def _stream_and_hang_up(server: ServerProcess, chunks: int) -> int:
    body = json.dumps({"model": server.model_id, "stream": True, "max_tokens": 2000, "seed": 7, "temperature": 0.8,
                       "messages": [{"role": "user", "content": "Write a very long story."}]}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    seen = b""
    while seen.count(b"data: ") < chunks:
        got = sock.recv(4096)
        assert got, seen
        seen += got
    sock.close()                                   # the client leaves mid-stream
    return seen.count(b"data: ")


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_hang_up_and_4xx_keep_the_ranks_in_step(servers, mode):
    assert _stream_and_hang_up(servers[mode], 5) >= 5
    too_long = [{"role": "user", "content": "word " * 5000}]    # over the 4096-token window: 400 from the engine
    status, reply, _ = http_json(servers[mode].base_url + "/chat/completions",
                                 {"model": servers[mode].model_id, "messages": too_long, "max_tokens": 5}, timeout=120)
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    count = {"model": servers[mode].model_id, "max_tokens": 5, "system": "Be brief.",
             "messages": [{"role": "user", "content": f"Count me ({mode})."}]}   # rank 0 renders it: every rank does
    counted = [http_json(s.base_url + "/messages/count_tokens", count)[1] for s in (servers[mode], servers["one"])]
    assert counted[0] == counted[1] and counted[0]["input_tokens"] > 5
    msgs = [{"role": "user", "content": f"After the hang-up ({mode}): one line."}]
    assert _chat(servers[mode], msgs) == _chat(servers["one"], msgs)
    status, health, _ = http_json(servers[mode].root + "/health")
    assert status == 200 and health["status"] == "ok"


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_speculation_in_step(servers, mode):
    """Drafts (here the text a grammar forces: no drafter guesswork) are verified for the batch in
    one forward on every rank; each rank derives the same drafts and accepted lengths from the same
    tokens. Replies as one process's, and the drafts were really there."""
    forced = {"type": "json_schema", "json_schema": {"name": "k", "strict": True, "schema": {
        "type": "object", "properties": {"kind": {"const": "a-long-constant-value-the-grammar-writes-for-the-model"},
                                         "n": {"type": "integer"}},
        "required": ["kind", "n"], "additionalProperties": False}}}
    msgs = [{"role": "user", "content": f"Fill the form ({mode})."}]
    ranks = _chat(servers[mode], msgs, response_format=forced, max_tokens=60)
    assert ranks == _chat(servers["one"], msgs, response_format=forced, max_tokens=60)
    row = http_json(servers[mode].base_url + "/cache/stats")[1]["recent"][-1]
    assert row["spec_proposed"] >= 10 and row["spec_accepted"] >= 10


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_stats_and_metrics_show_the_ranks(servers, mode):
    _chat(servers[mode], [{"role": "user", "content": f"Count to twenty ({mode})."}], max_tokens=30)
    time.sleep(1.1)                                  # a follower reports at most once a second, at a turn
    _chat(servers[mode], [{"role": "user", "content": f"And back ({mode})."}], max_tokens=30)
    status, stats, _ = http_json(servers[mode].base_url + "/cache/stats")
    d = stats["distributed"]
    assert status == 200 and (d["ranks"], d["mode"]) == (2, mode) and d["turns"] > 40
    assert [r["rank"] for r in d["per_rank"]] == [0, 1]
    assert all(r["active_memory"] > 0 and r["rss"] > r["active_memory"] for r in d["per_rank"])
    assert 0 < d["share_us_per_turn"] < 50_000
    status, text, _ = http_json(servers[mode].root + "/metrics")
    assert "mlxstack_ranks 2.0" in text and 'mlxstack_rank_rss_bytes{rank="1"}' in text
    assert "distributed" not in http_json(servers["one"].base_url + "/cache/stats")[1]


@pytest.mark.e2e
def test_disk_tier_per_rank_restart_warm(servers, tiny_qwen2_path, tmp_path):
    """Each rank writes its own part of every entry under its own namespace; a restarted group
    answers the next turn from disk, as one process answers it from RAM. A rank whose tier lost
    its files makes every rank start with an empty tier (the ranks must hold the same entries)."""
    disk = {"DISK_CACHE_DIR": str(tmp_path / "kv"), "DISK_CACHE_MIN_TOKENS": "32"}
    turn1 = [{"role": "system", "content": f"[disk] {SYSTEM}"}, {"role": "user", "content": "Which file first?"}]

    def group(name: str) -> ServerProcess:
        return _server(tiny_qwen2_path, tmp_path, name, DISTRIBUTED="tensor", DISTRIBUTED_LOCAL_RANKS="2", **disk)

    first = group("disk1")
    try:
        reply1 = _chat(first, turn1)
        assert reply1 == _chat(servers["one"], turn1)
    finally:
        first.stop()                                 # SIGTERM: queued writes are flushed at close
    spaces = sorted(p for p in (tmp_path / "kv").rglob("ns-*") if p.is_dir())
    assert len(spaces) == 2 and all(any(p.rglob("*.safetensors")) for p in spaces)
    turn2 = turn1 + [{"role": "assistant", "content": reply1[0]["content"]}, {"role": "user", "content": "Then?"}]
    second = group("disk2")
    try:
        warm = _chat(second, turn2)
        one = _chat(servers["one"], turn2)
        assert warm[:2] == one[:2]
        assert warm[2]["prompt_tokens_details"]["cached_tokens"] > reply1[2]["prompt_tokens"] - 8   # from disk
        assert http_json(second.base_url + "/cache/stats")[1]["recent"][-1]["cache_tier"] == "disk"
    finally:
        second.stop()
    for f in spaces[1].rglob("*.safetensors"):      # one rank's tier loses its files
        f.unlink()
    third = group("disk3")
    try:
        cold = _chat(third, turn2)
        assert "disk tiers restored different entries: every rank starts with its tier empty" in third.tail(20000)
    finally:
        third.stop()
    fresh = _server(tiny_qwen2_path, tmp_path, "fresh")     # one process, cold: the same whole prefill
    try:
        assert cold == _chat(fresh, turn2) and cold[2]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        fresh.stop()


@pytest.mark.e2e
def test_hybrid_model_over_pipeline_ranks(tiny_hybrid_path, tmp_path):
    """qwen3_next (gated-delta recurrent layers between attention layers; mlx-lm splits it by
    pipeline only): each rank holds its layers' KV and recurrent state, and the snapshots a warm
    turn needs; replies and reuse as one process's, alone and 4 at once."""
    one = _server(tiny_hybrid_path, tmp_path, "hybrid-one")
    ranks = _server(tiny_hybrid_path, tmp_path, "hybrid-pp", DISTRIBUTED="pipeline", DISTRIBUTED_LOCAL_RANKS="2")
    try:
        turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which module first?"}]
        a, b = _chat(ranks, turn1), _chat(one, turn1)
        assert a == b
        turn2 = turn1 + [{"role": "assistant", "content": a[0]["content"]}, {"role": "user", "content": "Why?"}]
        a2, b2 = _chat(ranks, turn2), _chat(one, turn2)
        assert a2 == b2 and a2[2]["prompt_tokens_details"]["cached_tokens"] > a[2]["prompt_tokens"] - 8
        sessions = [[{"role": "user", "content": f"Hybrid sub-agent {i}: one risk."}] for i in range(4)]
        with cf.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda m: _chat(ranks, m, max_tokens=10)[:2], sessions))
        assert together == [_chat(one, m, max_tokens=10)[:2] for m in sessions]
    finally:
        ranks.stop()
        one.stop()


def _children(pid: int) -> list[int]:
    """Child processes of ``pid``, whichever of its threads started them."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return sorted(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[1][0] != "Z"


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.e2e
def test_split_that_does_not_fit_is_refused_in_one_line(tiny_dense_path, tmp_path):
    server = ServerProcess("ours", env={"MODEL_PATH": str(tiny_dense_path), **BASE_ENV, "DISTRIBUTED": "tensor",
                                        "DISTRIBUTED_LOCAL_RANKS": "3"}, log_path=str(tmp_path / "refused.log"))
    try:
        assert server.proc.wait(timeout=120) == 3
    finally:
        server.stop()
    log = Path(server.log_path).read_text()
    assert (f"MODEL LOAD FAILED: ModelLoadError: DISTRIBUTED=tensor over 3 ranks cannot serve {tiny_dense_path.name}: its 4 attention "
            "heads / 2 KV heads / 128 MLP columns do not divide by 3. Works: DISTRIBUTED=tensor with 2 ranks.") in log
    assert "[rank 1]" not in log                  # refused before any other rank started


@pytest.mark.e2e
def test_killed_rank_ends_the_group_and_stop_leaves_none(tiny_qwen2_path, tmp_path):
    server = _server(tiny_qwen2_path, tmp_path, "kill", DISTRIBUTED="tensor", DISTRIBUTED_LOCAL_RANKS="2")
    try:
        followers = _children(server.proc.pid)
        assert len(followers) == 1
        os.kill(followers[0], signal.SIGKILL)
        assert server.proc.wait(timeout=30) == 1   # rank 0 does not serve on alone: the launcher restarts both
        assert "rank 1 exited with status -9; this rank exits so the launcher restarts every rank" in server.tail()
    finally:
        server.stop()
    again = _server(tiny_qwen2_path, tmp_path, "stop", DISTRIBUTED="pipeline", DISTRIBUTED_LOCAL_RANKS="2",
                    GENERATION_WATCHDOG_SECONDS="2")
    ranks = [again.proc.pid] + _children(again.proc.pid)
    assert len(ranks) == 2
    never_end = {"temperature": 0.8, "seed": 5, "logit_bias": {"0": -100, "1": -100, "2": -100}}
    t0 = time.monotonic()
    message, finish, usage = _chat(again, [{"role": "user", "content": "Go on forever."}], max_tokens=3000,
                                   **never_end)
    assert finish == "length" and 0 < usage["completion_tokens"] < 3000 and time.monotonic() - t0 < 30
    assert _chat(again, [{"role": "user", "content": "Short one."}], max_tokens=5)[1] == "length"   # still in step
    os.kill(again.proc.pid, signal.SIGTERM)        # a clean stop: rank 0 tells the others, none is left
    try:
        assert again.proc.wait(timeout=30) == 0
        assert _gone(ranks, 15)
    finally:
        again.stop()
    third = _server(tiny_qwen2_path, tmp_path, "kill0", DISTRIBUTED="tensor", DISTRIBUTED_LOCAL_RANKS="2")
    ranks = [third.proc.pid] + _children(third.proc.pid)
    os.kill(third.proc.pid, signal.SIGKILL)        # rank 0 killed outright: the others die with it
    try:
        assert _gone(ranks, 15)
    finally:
        third.stop()



@pytest.mark.e2e
def test_a_stop_ends_a_rank_whose_group_never_forms(tiny_qwen2_path, tmp_path):
    """Rank 0 of an mlx.launch group whose rank 1 never comes (it was refused, or died first)
    waits inside MLX's group init, which holds the GIL: a Python SIGTERM handler never runs there,
    so the stop mlx.launch (or the launcher) sends must end the process by itself."""
    from scripts.probelib.servers import free_port

    ring = tmp_path / "ring.json"
    ring.write_text(json.dumps(ring_hostfile([free_port(), free_port()])))
    key = tmp_path / "control.key"
    key.write_text("ab" * 32)
    key.chmod(0o600)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["127.0.0.1"]}]))
    server = ServerProcess("ours", env={"MODEL_PATH": str(tiny_qwen2_path), "LOG_ROOT": str(tmp_path / "alone"),
                                        **BASE_ENV, "DISTRIBUTED": "pipeline", "DISTRIBUTED_HOSTS": str(hosts),
                                        "MLX_RANK": "0", "MLX_HOSTFILE": str(ring), "MLXSTACK_CONTROL": "127.0.0.1:0",
                                        "MLXSTACK_CONTROL_SECRET_FILE": str(key)},
                           log_path=str(tmp_path / "alone.log"))
    try:
        deadline = time.monotonic() + 180
        while f"loading {tiny_qwen2_path.name}" not in server.tail():
            assert server.proc.poll() is None and time.monotonic() < deadline, server.tail()
            time.sleep(0.5)
        time.sleep(2.0)                           # inside the group's init now, waiting for rank 1
        assert server.proc.poll() is None, server.tail()
        server.proc.send_signal(signal.SIGTERM)
        try:
            assert server.proc.wait(timeout=20) == -signal.SIGTERM
        except subprocess.TimeoutExpired:
            pytest.fail("a rank waiting for its group ignored SIGTERM:\n" + server.tail())
    finally:
        server.stop()


def _launch_hosts_command(settings, monkeypatch) -> list[str]:
    """The mlx.launch command ``serve._launch_hosts`` would exec (DISTRIBUTED_HOSTS)."""
    from mlxstack import serve

    seen = {}

    def execv(path, cmd):
        seen["cmd"] = cmd
        raise SystemExit(0)
    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(SystemExit):
        serve._launch_hosts(settings, [])
    return seen["cmd"]


def _forwarded(cmd: list[str]) -> dict[str, str]:
    return dict(cmd[i + 1].split("=", 1) for i, a in enumerate(cmd) if a == "--env")


def test_the_control_secret_never_reaches_a_command_line_or_the_log(tmp_path, monkeypatch, caplog):
    """DISTRIBUTED_HOSTS: mlx.launch forwards the path of a 0600 file, never the secret (its
    command line -- and the ssh commands it runs -- are readable by every local user, and the whole
    command is logged); every rank reads the secret from the file. The file is made once and
    every later launch reuses it (it is copied to every host once): several launches leave one
    file, and the files an older version made per launch are removed."""
    import logging
    import stat

    from mlxstack.config.settings import load_settings
    from mlxstack.system.control_channel import SECRET_FILE_ENV, from_env

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["127.0.0.2"]}]))
    settings = load_settings(env={"DISTRIBUTED": "tensor", "DISTRIBUTED_HOSTS": str(hostfile),
                                  "MODEL_CACHE_DIR": str(tmp_path / "cache")})
    folder = tmp_path / "cache" / "control"
    folder.mkdir(parents=True, mode=0o700)
    (folder / "control-123-0a1b2c3d.key").write_text("ab" * 32)     # one an older version left behind
    paths, secrets = set(), set()
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            cmd = _launch_hosts_command(settings, monkeypatch)
            env = _forwarded(cmd)
            key_path = env[SECRET_FILE_ENV]
            secret = open(key_path).read().strip()
            assert len(secret) == 64 and not any(secret in arg for arg in cmd) and secret not in caplog.text
            assert from_env({"MLXSTACK_CONTROL": env["MLXSTACK_CONTROL"], SECRET_FILE_ENV: key_path})[1] == \
                bytes.fromhex(secret)
            paths.add(key_path)
            secrets.add(secret)
    assert paths == {str(folder / "control.key")} and len(secrets) == 1
    assert sorted(os.listdir(folder)) == ["control.key"]
    assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert caplog.text.count("made the control channel's secret file") == 1 and key_path in caplog.text


def test_a_control_secret_file_open_to_others_or_missing_is_refused_and_never_replaced(tmp_path, monkeypatch, capsys):
    """A copy another user can read is refused with the fix (chmod 600) and left as it is (a new
    secret would no longer match the other hosts' copies); a host without its copy is told to copy
    it; neither message holds the secret."""
    from mlxstack import serve
    from mlxstack.config.settings import load_settings
    from mlxstack.system.control_channel import SECRET_FILE_ENV, ControlSecretError, from_env
    from mlxstack.system.exit_codes import EXIT_CONFIG_ERROR

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]))
    folder = tmp_path / "cache" / "control"
    folder.mkdir(parents=True, mode=0o700)
    key = folder / "control.key"
    key.write_text("cd" * 32 + "\n")
    key.chmod(0o644)
    settings = load_settings(env={"DISTRIBUTED": "pipeline", "DISTRIBUTED_HOSTS": str(hostfile),
                                  "MODEL_CACHE_DIR": str(tmp_path / "cache")})
    monkeypatch.setattr(os, "execv", lambda *_a: pytest.fail("mlx.launch started with a readable secret file"))
    assert serve._launch_hosts(settings, []) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert f"chmod 600 {key}" in err and "cd" * 32 not in err and key.read_text() == "cd" * 32 + "\n"
    addr = {"MLXSTACK_CONTROL": "10.0.0.1:0"}
    with pytest.raises(ControlSecretError, match="is open to other users"):
        from_env({**addr, SECRET_FILE_ENV: str(key)})
    key.chmod(0o600)
    assert from_env({**addr, SECRET_FILE_ENV: str(key)})[1] == bytes.fromhex("cd" * 32)
    with pytest.raises(ControlSecretError, match="is not on this host: copy it once from rank 0's host"):
        from_env({**addr, SECRET_FILE_ENV: str(tmp_path / "elsewhere" / "control.key")})
    key.write_text("not a secret")
    with pytest.raises(ControlSecretError, match="holds no control secret") as refused:
        from_env({**addr, SECRET_FILE_ENV: str(key)})
    assert "not a secret" not in str(refused.value)


def _control_address_of_ranks(server: ServerProcess, wait: float = 120.0) -> tuple[str, int]:
    """The control channel's address, read from a follower rank's environment (rank 0 starts them
    with it) as a local user could: what a stranger needs to reach the port."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.proc.pid)], capture_output=True, text=True)
        for pid in out.stdout.split():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"MLXSTACK_CONTROL="):
                    return parse_address(item.split(b"=", 1)[1].decode())
        time.sleep(0.2)
    raise AssertionError("no follower rank with a control address")


@pytest.mark.e2e
def test_a_three_rank_group_forms_and_serves_with_strangers_at_its_control_port(servers, tiny_qwen2_path, tmp_path):
    """Issue 40's done-when: mlxstack.serve with 3 local ranks (pipeline over the 4-layer model) while
    strangers hold connections to the control port -- garbage, a forged hello answered with a
    guess, one byte every second, silence -- forms its group, serves the reply one process gives,
    and no secret is on any rank's command line."""
    from mlxstack.system import control_channel as cc

    server = ServerProcess("ours", env={"MODEL_PATH": str(tiny_qwen2_path), "LOG_ROOT": str(tmp_path / "three"),
                                        **BASE_ENV, "DISTRIBUTED": "pipeline", "DISTRIBUTED_LOCAL_RANKS": "3"},
                           log_path=str(tmp_path / "three.log"))
    server.model_id = tiny_qwen2_path.name  # type: ignore[attr-defined]
    stop = threading.Event()
    held: list[socket.socket] = []
    try:
        addr = _control_address_of_ranks(server)
        garbage = socket.create_connection(addr)
        garbage.sendall(os.urandom(64))
        forged = socket.create_connection(addr)
        forged.sendall(cc._MAGIC + struct.pack("!Q", 1) + os.urandom(32))
        silent = socket.create_connection(addr)
        held += [garbage, forged, silent]

        def trickle():
            try:
                with socket.create_connection(addr) as s:
                    while not stop.is_set():
                        s.sendall(b"M")
                        time.sleep(1.0)
            except OSError:
                pass
        threading.Thread(target=trickle, daemon=True).start()
        server.wait_ready(240)
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert "MLXSTACK_CONTROL_SECRET" not in ps
        question = [{"role": "user", "content": "Which file holds the control channel's code?"}]
        assert _chat(server, question) == _chat(servers["one"], question)
        log_text = Path(tmp_path / "three.log").read_text()
        assert "model load failed" not in log_text.lower()
    finally:
        stop.set()
        for s in held:
            s.close()
        server.stop()


def test_ranks_join_with_the_caches_own_collectives(tmp_path, embedded_model_path):
    """Under lockstep the KV tiers agree through cache/ranks.py (imports and calls point down):
    every hook the bind leaves in the KV manager, its index, the disk tier and the session stores
    is a RankGroup method, and each collective answers for a group of one."""
    import mlx.core as mx

    from mlxstack.cache.ranks import RankGroup
    from mlxstack.engine.lockstep import Lockstep
    from tests.conftest import build_engine, engine_settings

    engine = build_engine(engine_settings(embedded_model_path, disk_cache_dir=str(tmp_path), disk_cache_min_tokens=32))
    lock = Lockstep(mx.distributed.init(), channel=None)
    lock.bind(engine, 1)
    state, kv = engine.state, engine.state.kv
    assert kv.disk is not None and state.replicated and engine.runner.replicated
    hooks = [kv.group_bytes, kv.index.clock, kv.disk.agree, kv.disk.agree_union, state.sessions.clock,
             state.turns.clock]
    for hook in hooks:
        assert isinstance(hook.__self__, RankGroup) and hook.__self__ is lock.ranks
        assert hook.__func__.__module__ == "mlxstack.cache.ranks"
    ranks = lock.ranks
    assert ranks.sum_bytes(7) == 7 and ranks.agree_min(9) == 9
    assert ranks.union([5, 2, 5]) == [2, 5] and ranks.union([]) == []
    assert ranks.all_ok(True) is True and ranks.all_ok(False) is False
    assert ranks.digest_agrees("entries") is True
    ranks.now = 123.5                       # what a turn's record sets: rank 0's clock everywhere
    assert kv.index.clock() == state.sessions.clock() == engine.clock() == 123.5
