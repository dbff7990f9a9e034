"""The MLX server over real HTTP with the embedded model: API shape, errors, streaming,
cache reuse in usage, disconnects, and that every error leaves the server serving."""
from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest

from tests.conftest import http_json

pytestmark = pytest.mark.slow  # a live server on the embedded model, multi-turn parity over HTTP (docs/testing.md#tiers)

Q = [{"role": "user", "content": "What is the capital of France?"}]


def chat(server, body, **kw):
    return http_json(server.base + "/v1/chat/completions", body, **kw)


def sse_events(server, body):
    req = urllib.request.Request(server.base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        raw = resp.read().decode()
    frames = [f[len("data: "):] for f in raw.split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def test_health_and_models(embedded_server):
    status, body, headers = http_json(embedded_server.base + "/health")
    assert status == 200 and body["ready"] is True and body["model"] == "SmolLM2-135M-Instruct"
    assert headers["Connection"] == "close"
    status, models, _ = http_json(embedded_server.base + "/v1/models")
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct" and models["data"][0]["context_length"] > 0


def test_capital_of_france_non_streaming(embedded_server):
    status, body, _ = chat(embedded_server, {"messages": Q, "max_tokens": 24, "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_streaming_matches_non_streaming_and_reports_usage(embedded_server):
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 20, "temperature": 0}
    _, plain, _ = chat(embedded_server, body)
    events = sse_events(embedded_server, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    # the second identical prompt is served from cache
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= plain["usage"]["prompt_tokens"] - 1


def test_warm_turn_reuses_prefix(embedded_server):
    system = {"role": "system", "content": "You are a terse assistant. " * 20}
    msgs = [system, {"role": "user", "content": "Say hello."}]
    _, first, _ = chat(embedded_server, {"messages": msgs, "max_tokens": 8, "session_id": "warm-1"})
    msgs += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "Say goodbye."}]
    _, second, _ = chat(embedded_server, {"messages": msgs, "max_tokens": 8, "session_id": "warm-1"})
    usage, u1 = second["usage"], first["usage"]
    # Everything the first turn put in the KV (prompt + reply, minus the last sampled token) is reused.
    assert usage["prompt_tokens_details"]["cached_tokens"] >= u1["prompt_tokens"] + u1["completion_tokens"] - 2


@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1,2]", 400, "JSON object"),
    ({"messages": []}, 400, "non-empty"),
    ({"messages": "hi"}, 400, "non-empty"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ({"messages": Q, "max_tokens": 0}, 400, "positive"),
    ({"messages": Q, "max_tokens": "ten"}, 400, "integer"),
    ({"messages": Q, "temperature": "hot"}, 400, "number"),
    ({"messages": Q, "stream": "yes"}, 400, "boolean"),
    ({"messages": Q, "stop": 3}, 400, "stop"),
    ({"messages": Q, "thinking": "sideways"}, 400, "thinking"),
    ({"messages": Q, "model": "no-such-model"}, 404, "not served"),
])
def test_bad_input_gets_openai_error_and_server_keeps_serving(embedded_server, body, status, fragment):
    got, err, _ = chat(embedded_server, body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert fragment.lower() in err["error"]["message"].lower()
    ok, body2, _ = chat(embedded_server, {"messages": Q, "max_tokens": 2})
    assert ok == 200 and body2["choices"]


def test_unknown_path_and_oversized_body(embedded_server):
    status, err, _ = http_json(embedded_server.base + "/v1/nope")
    assert status == 404 and err["error"]["code"] == "not_found"
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (embedded_server.app.settings.max_request_bytes + 10)}]})
    status, err, _ = chat(embedded_server, big.encode())
    assert status == 413 and "MAX_REQUEST_BYTES" in err["error"]["message"]


def test_cache_stats_counters_zero_on_clean_traffic(embedded_server):
    status, stats, _ = http_json(embedded_server.base + "/v1/cache/stats")
    assert status == 200
    assert stats["correctness"] == {"vlm_retreat": 0, "hybrid_trim_miss": 0, "exact_key_rejected_by_model_lcp": 0}
    assert stats["entries"] >= 1 and stats["recent"]


def test_client_disconnect_mid_stream_frees_the_worker(embedded_server):
    before = embedded_server.app.state.counters.get("disconnects")
    body = json.dumps({"messages": [{"role": "user", "content": "Write a long story about a dragon."}],
                       "max_tokens": 400, "stream": True, "temperature": 0.7, "seed": 1}).encode()
    sock = socket.create_connection(("127.0.0.1", embedded_server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 3:
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    sock.close()
    t0 = time.perf_counter()
    status, reply, _ = chat(embedded_server, {"messages": Q, "max_tokens": 4})
    elapsed = time.perf_counter() - t0
    assert status == 200 and elapsed < 10, elapsed
    deadline = time.time() + 5
    while embedded_server.app.state.counters.get("disconnects") == before and time.time() < deadline:
        time.sleep(0.05)
    assert embedded_server.app.state.counters.get("disconnects") == before + 1


def test_queue_full_answers_503_with_retry_after(embedded_model_path):
    from tests.conftest import LiveServer, engine_settings

    server = LiveServer(engine_settings(None, max_queued_requests=1))
    try:
        gate = __import__("threading").Event()
        server.app.worker.submit(gate.wait)           # occupies the worker
        while not server.app.worker.busy:
            time.sleep(0.01)
        server.app.worker.submit(lambda: None)        # fills the single queue slot
        status, err, headers = chat(server, {"messages": Q, "max_tokens": 2})
        assert status == 503 and headers.get("Retry-After") and err["error"]["code"] == "queue_full"
        gate.set()
        time.sleep(0.2)
        assert chat(server, {"messages": Q, "max_tokens": 2})[0] == 200
    finally:
        server.close()


def test_multi_turn_parity_cache_on_vs_off_over_http(embedded_server):
    from tests.conftest import LiveServer, engine_settings

    cold = LiveServer(engine_settings(None, prompt_cache_max_entries_global=0))
    try:
        transcripts = {}
        for name, server in (("warm", embedded_server), ("cold", cold)):
            msgs = [{"role": "system", "content": "You are a helpful assistant. " * 10}]
            replies, cached = [], []
            for turn in ("What is a cache?", "Give an example.", "Thanks, and in one word?"):
                msgs.append({"role": "user", "content": turn})
                status, body, _ = chat(server, {"messages": msgs, "max_tokens": 16, "session_id": f"parity-{name}"})
                assert status == 200, body
                replies.append(body["choices"][0]["message"]["content"])
                cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
                msgs.append({"role": "assistant", "content": replies[-1]})
            transcripts[name] = (replies, cached)
        assert transcripts["warm"][0] == transcripts["cold"][0]
        assert transcripts["cold"][1] == [0, 0, 0]
        assert all(c > 0 for c in transcripts["warm"][1][1:])
    finally:
        cold.close()
