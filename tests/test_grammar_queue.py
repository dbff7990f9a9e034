"""Grammar compiles cannot be starved (issue 40 item 5, constraints/compiler.py): a failure is
cached by spec hash (a bad schema sent again is refused at once, without compiling or locating its
error again), the queue is bounded (503 when full, 429 for a client over its share, both with
Retry-After), and a queued compile whose every waiter timed out is dropped. On the embedded
model's real tokenizer and llguidance; a compile is held back by an event where a test needs one
to be slow (the bounds are about queueing, not about what llguidance does)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from mlxstack.server.http.errors import APIError
from mlxstack.server.common.structured import Structured, client_of
from mlxstack.constraints import CompilerBusy, GrammarCompiler, SchemaError, json_spec
from tests.test_constraints import Tok

BAD = {"type": "object", "properties": {"when": {"type": "string", "format": "weird"}}, "required": ["when"]}


def schema(i: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"}}, "required": [f"p{i}"]}


@pytest.fixture(scope="module")
def tok(embedded_model_path) -> Tok:
    return Tok(embedded_model_path, ["<|im_end|>"])


def compiler(tok: Tok, **kw) -> GrammarCompiler:
    return GrammarCompiler(tok.compiler.tokenizer, tok.compiler.specials, **kw)


def held(comp: GrammarCompiler) -> threading.Event:
    """Make every compile of ``comp`` wait for the returned event before it builds."""
    gate, build = threading.Event(), comp._build

    def slow(spec):
        gate.wait(30)
        return build(spec)
    comp._build = slow
    return gate


def test_a_failed_schema_is_refused_again_from_the_cache_without_compiling(tok):
    comp = compiler(tok)
    with pytest.raises(SchemaError) as first:
        comp.compile(json_spec(BAD, strict=True))
    assert comp.stats.errors == 1
    t0 = time.perf_counter()
    for _ in range(20):
        with pytest.raises(SchemaError) as again:
            comp.compile(json_spec(BAD, strict=True))
    assert time.perf_counter() - t0 < 0.05                   # no build, no locating: 20 lookups
    assert (again.value.param, again.value.reason) == (first.value.param, first.value.reason)
    assert type(again.value) is type(first.value) and again.value is not first.value
    assert (comp.stats.errors, comp.stats.failure_hits, comp.stats.compiles) == (1, 20, 0)
    assert comp.compile(json_spec(schema(1))) is comp.compile(json_spec(schema(1)))   # successes still cached


def test_the_queue_is_bounded_and_one_client_gets_half_of_it(tok):
    comp = compiler(tok, workers=1, max_pending=4, timeout_s=30)
    gate = held(comp)
    got: dict[str, object] = {}

    def ask(name, i, client):
        try:
            got[name] = comp.compile(json_spec(schema(i)), client=client)
        except Exception as exc:  # noqa: BLE001
            got[name] = exc
    threads = [threading.Thread(target=ask, args=(f"a{i}", i, "alice")) for i in range(2)]
    threads += [threading.Thread(target=ask, args=(f"b{i}", 10 + i, "bob")) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(comp._inflight) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(comp._inflight) == 4
    with pytest.raises(CompilerBusy) as mine:              # alice has her half (2 of 4) queued
        comp.compile(json_spec(schema(5)), client="alice")
    assert mine.value.mine and mine.value.retry_after == 30
    with pytest.raises(CompilerBusy) as full:              # carol has none, but the pool is full
        comp.compile(json_spec(schema(6)), client="carol")
    assert not full.value.mine
    assert comp.stats.refused == 2
    gate.set()
    for t in threads:
        t.join(30)
    assert all(not isinstance(v, Exception) for v in got.values()), got
    assert comp._inflight == {} and comp._owner == {} and comp._waiters == {}
    assert comp.compile(json_spec(schema(6)), client="carol") is not None    # room again


def test_a_queued_compile_nobody_waits_for_is_dropped(tok):
    comp = compiler(tok, workers=1, timeout_s=0.2)
    gate = held(comp)
    done = []
    runner = threading.Thread(target=lambda: done.append(pytest.raises(Exception, comp.compile, json_spec(schema(1)))))
    runner.start()
    time.sleep(0.05)                                       # schema 1 holds the only worker
    with pytest.raises(SchemaError, match="did not compile within"):
        comp.compile(json_spec(schema(2)))                 # queued behind it, then its waiter gives up
    assert comp.stats.dropped == 1 and json_spec(schema(2)).key not in comp._inflight
    gate.set()
    runner.join(10)
    deadline = time.monotonic() + 10
    while comp._inflight and time.monotonic() < deadline:  # schema 1 finishes on the worker
        time.sleep(0.01)
    assert comp.stats.compiles == 1 and comp._inflight == {}   # schema 2 was never built


def test_the_api_answers_429_or_503_with_retry_after_and_auto_tools_fall_back(tok):
    comp = compiler(tok, workers=1, max_pending=2, timeout_s=30)
    gate = held(comp)
    counters = SimpleNamespace(n=0, bump=lambda name, k=1: setattr(counters, "n", counters.n + k))
    st = Structured(comp, "hermes", counters)

    def req(i, user, **kw):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema(i), "strict": True}}
        return SimpleNamespace(response_format=kw.get("fmt", fmt), tools=kw.get("tools"),
                               tool_choice=kw.get("choice"), parallel_tool_calls=True, body={"user": user})
    def queued(i, user):
        """A compile of ``user``'s that waits at the gate, once it is in the queue."""
        waiting = len(comp._inflight) + 1
        t = threading.Thread(target=lambda: st.grammar_for(req(i, user)))
        t.start()
        deadline = time.monotonic() + 10
        while len(comp._inflight) < waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        return t
    t = queued(1, "u1")
    with pytest.raises(APIError) as share:
        st.grammar_for(req(2, "u1"))
    assert (share.value.status, share.value.code, share.value.headers) == (429, "grammar_queue_share", {"Retry-After": "30"})
    t2 = queued(3, "u2")
    with pytest.raises(APIError) as full:
        st.grammar_for(req(4, "u3"))
    assert (full.value.status, full.value.code, full.value.headers["Retry-After"]) == (503, "grammar_queue_full", "30")
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema(9)}}]
    assert st.grammar_for(req(5, "u3", fmt=None, tools=tools, choice="auto")) is None    # served without it
    assert counters.n == 1
    gate.set()
    t.join(30)
    t2.join(30)
    assert client_of(SimpleNamespace(body={"metadata": {"user_id": "claude-1"}})) == "claude-1"
    assert client_of(SimpleNamespace(body={})) == "-"
