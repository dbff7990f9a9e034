"""Hostile and broken requests against a real MLX server on the embedded model (issue 10, items 3,
8 and 9): malformed numbers are 400 before any work reaches the inference worker, unsupported
fields are refused by name, an error after a stream started arrives as an SSE error event (never
as a status line inside the stream), and disconnect checks work with descriptors above 1024."""
from __future__ import annotations

import json
import resource
import socket

import pytest
from hypothesis import HealthCheck, given, settings as hyp_settings, strategies as st

from mlxstack.server.http.errors import APIError
from mlxstack.server.http.sse import ChunkEncoder, chunk_dict, encode_frame
from tests.conftest import http_json

pytestmark = pytest.mark.slow  # hostile HTTP against live servers on the embedded model (docs/testing.md#tiers)

Q = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"messages": Q, "max_tokens": 8, "temperature": 0}


def chat_raw(server, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    status, parsed, _ = http_json(server.base + "/v1/chat/completions", body, headers={"Content-Type": content_type})
    return status, parsed


def raw_stream(server, body: dict) -> bytes:
    """The full bytes of a streamed response, status line and headers included."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def events_of(raw: bytes) -> list:
    body = raw.split(b"\r\n\r\n", 1)[1].decode()
    frames = [f[len("data: "):] for f in body.split("\n\n") if f.startswith("data: ")]
    return [f if f == "[DONE]" else json.loads(f) for f in frames]


@pytest.fixture
def run_spy(embedded_server, monkeypatch):
    """Counts the jobs that reach the real engine (the spy calls it unchanged). ``start`` is where
    every request enters it, run alone or by the batching scheduler."""
    calls = []
    engine = embedded_server.app.engine
    real = engine.start
    monkeypatch.setattr(engine, "start", lambda job: calls.append(job) or real(job))
    return calls


# ---------------------------------------------------------------------------- item 8: numbers
@pytest.mark.parametrize("raw, fragment", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN is not a JSON number"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "min_p": NaN}', "NaN is not a JSON number"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1e999}', "out of range"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"1" * 4400 + b"}", "cannot be parsed"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551616}', "'seed' must be"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "seed": -1}', "'seed' must be"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_k": 49153}', "vocabulary size 49152"),
    (b'{"x": ' + b"[" * 50_000 + b"]" * 50_000 + b', "messages": []}', "deeper than 64"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 3}', "'n' = 3 is not supported"),
    (b'{"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}',
     "messages[0].content[0].type"),
])
def test_malformed_requests_are_400_and_never_reach_the_worker(embedded_server, run_spy, raw, fragment):
    _, before = chat_raw(embedded_server, json.dumps(GREEDY).encode())
    status, err = chat_raw(embedded_server, raw)
    assert status == 400 and fragment in err["error"]["message"], err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    status, after = chat_raw(embedded_server, json.dumps(GREEDY).encode())
    assert status == 200 and after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
    assert len(run_spy) == 2  # the two good requests only


def test_top_k_equal_to_vocabulary_means_off(embedded_server):
    assert embedded_server.app.vocab_size == 49152
    _, off = chat_raw(embedded_server, json.dumps({**GREEDY, "top_k": 0}).encode())
    status, full = chat_raw(embedded_server, json.dumps({**GREEDY, "top_k": 49152}).encode())
    assert status == 200 and full["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]


# ---------------------------------------------------------------------------- item 8: errors mid-stream
def test_error_after_stream_started_is_an_sse_event(embedded_server, monkeypatch):
    engine = embedded_server.app.engine
    real = engine.finish

    def fails_after_tokens(seq):
        real(seq)  # every token was emitted and streamed ...
        raise RuntimeError("simulated failure after generation")  # ... then the job fails

    monkeypatch.setattr(engine, "finish", fails_after_tokens)
    raw = raw_stream(embedded_server, {**GREEDY, "stream": True})
    assert raw.startswith(b"HTTP/1.1 200 ") and raw.count(b"HTTP/1.1") == 1  # no status line inside the stream
    events = events_of(raw)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "internal_error" and error["type"] == "server_error" and "request id" in error["message"]
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2] if e.get("choices"))
    assert content  # the tokens before the failure arrived
    monkeypatch.setattr(engine, "finish", real)
    status, body = chat_raw(embedded_server, json.dumps(GREEDY).encode())
    assert status == 200 and body["choices"][0]["message"]["content"]


@hyp_settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fail_after=st.integers(min_value=0, max_value=6))
def test_stream_always_ends_well_formed_whenever_it_fails(embedded_server, monkeypatch, fail_after):
    """Property: a failure after k streamed tokens (k = 0 .. 6) still gives one 200 status line, parseable
    events, an error event and [DONE], in that order."""
    engine = embedded_server.app.engine
    real = engine.start

    def fails_mid_generation(job):
        emitted = [0]
        emit = job.emit

        def counting(text):
            if emitted[0] >= fail_after:
                raise RuntimeError("simulated failure mid-generation")
            emitted[0] += 1
            emit(text)

        job.emit = counting
        return real(job)

    monkeypatch.setattr(engine, "start", fails_mid_generation)
    try:
        raw = raw_stream(embedded_server, {**GREEDY, "max_tokens": 8, "stream": True})
    finally:
        monkeypatch.setattr(engine, "start", real)
    assert raw.startswith(b"HTTP/1.1 200 ") and raw.count(b"HTTP/1.1") == 1
    events = events_of(raw)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "internal_error"
    assert all("choices" in e for e in events[:-2])
    assert chat_raw(embedded_server, json.dumps(GREEDY).encode())[0] == 200


@hyp_settings(max_examples=300, deadline=None)
@given(st.text(max_size=60), st.text(max_size=60))
def test_sse_frames_are_ascii_json_for_any_text(text, message):
    """Property over the stream path's encoders: any text (any Unicode, quotes, newlines, lone
    surrogates from a tokenizer's partial output) becomes one ASCII frame whose JSON decodes back."""
    enc = ChunkEncoder("chatcmpl-x", 1700000000, "m")
    frame = enc.content_frame(text)
    assert frame.isascii() and frame.startswith(b"data: ") and frame.endswith(b"\n\n") and frame.count(b"\n\n") == 1
    assert json.loads(frame[6:])["choices"][0]["delta"]["content"] == text
    assert frame == encode_frame(chunk_dict("chatcmpl-x", 1700000000, "m", {"content": text}))
    err = APIError(500, message).sse_frame()
    assert err.count(b"\n\n") == 1 and json.loads(err[6:])["error"]["message"] == message


# ---------------------------------------------------------------------------- item 3: fd >= 1024
def test_requests_complete_with_descriptors_above_1024(embedded_server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    counters = embedded_server.app.state.counters
    before = counters.get("disconnects")
    held = [socket.socketpair() for _ in range(560)]  # ~1,120 idle descriptors in this process
    try:
        probe = socket.socket()
        assert probe.fileno() >= 1024
        probe.close()
        _, plain = chat_raw(embedded_server, json.dumps(GREEDY).encode())
        assert plain["choices"][0]["message"]["content"]
        events = events_of(raw_stream(embedded_server, {**GREEDY, "stream": True}))
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e.get("choices"))
        assert text == plain["choices"][0]["message"]["content"]
        assert counters.get("disconnects") == before  # select() made every request look disconnected
    finally:
        for a, b in held:
            a.close()
            b.close()
