"""Anthropic Messages API (/v1/messages, /v1/messages/count_tokens): pure translation both ways, the
LiteLLM pass-through config, the real MLX server on the tiny qwen3 fixture (same prompt and output
as /v1/chat/completions, system entries kept in place, count_tokens = the rendered prompt, cache
reads reported, Anthropic errors), then Claude Code's captured request shape through real LiteLLM."""
from __future__ import annotations

import json
import urllib.request

import pytest

from mlxstack.server.anthropic.messages import (ContentBlocks, anthropic_tools, chat_tool_choice, decode_signature,
                                                encode_signature, error_body, matched_stop_sequence, messages_to_chat,
                                                reply_blocks, stop_reason, to_chat_body, usage_object)
from mlxstack.server.http.errors import APIError
from mlxstack.server.common.job_adapter import Usage
from mlxstack.cache.lifetimes import Segment
from mlxstack.config.settings import load_settings
from mlxstack.launcher import litellm_config as lc
from mlxstack.parsing.reasoning import CONTENT, REASONING, TOOL_CALLS
from mlxstack.parsing.tool_calls import ToolCall
from tests.conftest import LiveServer, engine_settings, http_json, sse_events

ENV_BLOCK = "# Environment\nPrimary working directory: /work"


# ============================================================================ request side (pure)
def test_claude_code_conversation_keeps_every_entry_in_place():
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1;"},
              {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>r</system-reminder>"},
                                     {"type": "text", "text": "list files"}]},
        {"role": "system", "content": [{"type": "text", "text": ENV_BLOCK, "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "", "signature": encode_signature("plan it")},
            {"type": "text", "text": "Listing."},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.txt"}]},
            {"type": "text", "text": "and now?", "cache_control": {"type": "ephemeral"}}]},
    ]
    assert messages_to_chat(system, messages) == [
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1;You are Claude Code."},
        {"role": "user", "content": "<system-reminder>r</system-reminder>list files"},
        {"role": "system", "content": ENV_BLOCK},
        {"role": "assistant", "content": "Listing.", "reasoning_content": "plan it", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "Bash", "arguments": "{\"command\": \"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"},
        {"role": "user", "content": "and now?"},
    ]


def test_thinking_text_wins_over_signature_and_redacted_thinking_is_skipped():
    msg = messages_to_chat(None, [{"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "xyz"},
        {"type": "thinking", "thinking": "visible", "signature": encode_signature("other")},
        {"type": "tool_use", "id": "t", "name": "Read", "input": {}}]}])
    assert msg == [{"role": "assistant", "content": None, "reasoning_content": "visible", "tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "Read", "arguments": "{}"}}]}]
    assert decode_signature(encode_signature("ü\n")) == "ü\n"
    assert decode_signature("EqQBCkYIBxgCKkA-real-anthropic-signature") is None


def test_images_become_data_urls():
    chat = messages_to_chat(None, [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "QUJD"}},
        {"type": "text", "text": "what?"}]}])
    assert chat == [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}},
                                                 {"type": "text", "text": "what?"}]}]


def test_tools_skip_deferred_and_anthropic_defined_ones():
    tools = [{"name": "Bash", "description": "Run", "input_schema": {"type": "object", "properties": {}}},
             {"name": "DeferredToolPlaceholder", "defer_loading": True, "input_schema": {"type": "object"}},
             {"type": "web_search_20250305", "name": "web_search"},
             {"type": "custom", "name": "Read", "input_schema": {"type": "object"}}]
    assert anthropic_tools(tools) == [
        {"type": "function", "function": {"name": "Bash", "parameters": {"type": "object", "properties": {}},
                                          "description": "Run"}},
        {"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}}]
    assert anthropic_tools([{"defer_loading": True, "name": "x"}]) is None


def test_to_chat_body_thinking_and_sampling_fields():
    base = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stop_sequences": ["END"], "temperature": 0.2, "top_k": 5, "metadata": {"user_id": "u"},
            "output_config": {"effort": "high"}, "context_management": {"edits": []}}
    chat = to_chat_body(base)
    assert chat == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 64,
                    "temperature": 0.2, "top_k": 5, "stop": ["END"], "metadata": {"user_id": "u"},
                    "thinking": {"type": "disabled"}}
    assert to_chat_body({**base, "thinking": {"type": "adaptive", "display": "omitted"}})["thinking"] == \
        {"type": "adaptive", "display": "omitted"}
    tools = [{"name": "Bash", "input_schema": {"type": "object"}}]
    assert to_chat_body({**base, "tools": tools, "tool_choice": {"type": "any"}})["tool_choice"] == "required"
    assert chat_tool_choice({"type": "tool", "name": "Bash"}) == {"type": "function", "function": {"name": "Bash"}}
    assert chat_tool_choice({"type": "none"}) == "none"


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "document", "source": {}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "tool_result"}]}], "messages[0].content[0].tool_use_id"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": "ls"}]}],
     "messages[0].content[0].input"),
    ([{"role": "system", "content": [{"type": "image"}]}], "messages[0].content[0]"),
])
def test_bad_requests_name_the_field(messages, param):
    with pytest.raises(APIError) as err:
        to_chat_body({"max_tokens": 5, "messages": messages})
    assert err.value.status == 400 and err.value.param == param


def test_error_bodies_are_anthropic_shaped():
    assert error_body(APIError(404, "no such model", code="model_not_found")) == \
        {"type": "error", "error": {"type": "not_found_error", "message": "no such model"}}
    assert error_body(APIError(503, "busy"))["error"]["type"] == "overloaded_error"
    assert error_body(APIError(500, "bug"))["error"]["type"] == "api_error"
    long = error_body(APIError(400, "This model's maximum context length is 8192 tokens.", code="context_length_exceeded"))
    assert long["error"] == {"type": "invalid_request_error",
                             "message": "prompt is too long: This model's maximum context length is 8192 tokens."}


# ============================================================================ reply side (pure)
def test_content_block_events_in_anthropic_order():
    blocks = ContentBlocks()
    call = ToolCall(name="Bash", arguments="{\"command\":\"ls\"}", id="call_1")
    events = (blocks.push(REASONING, "pl") + blocks.push(REASONING, "an") + blocks.push(CONTENT, "Ok")
              + blocks.push(TOOL_CALLS, calls=(call,)) + blocks.close())
    assert events == [
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "pl"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "an"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": encode_signature("plan")}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Ok"}},
        {"type": "content_block_stop", "index": 1},
        {"type": "content_block_start", "index": 2,
         "content_block": {"type": "tool_use", "id": "call_1", "name": "Bash", "input": {}}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"command\":\"ls\"}"}},
        {"type": "content_block_stop", "index": 2},
    ]
    assert blocks.blocks == [{"type": "thinking", "thinking": "plan", "signature": encode_signature("plan")},
                             {"type": "text", "text": "Ok"},
                             {"type": "tool_use", "id": "call_1", "name": "Bash", "input": {"command": "ls"}}]
    assert blocks.has_tool_use


def test_omitted_thinking_streams_no_text_but_keeps_it_in_the_signature():
    blocks = ContentBlocks(omit_thinking=True)
    events = blocks.push(REASONING, "secret") + blocks.close()
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == ["signature_delta"]
    assert blocks.blocks == [{"type": "thinking", "thinking": "", "signature": encode_signature("secret")}]
    whole = reply_blocks("<think>\nwhy\n</think>\n\nBecause.", thinking_started=False, tools=None, family="qwen3",
                         salt="m", omit_thinking=False)
    assert whole.blocks == [{"type": "thinking", "thinking": "why", "signature": encode_signature("why")},
                            {"type": "text", "text": "Because."}]


def test_stop_reasons_and_usage():
    assert stop_reason("stop", False, None) == "end_turn"
    assert stop_reason("stop", True, None) == "tool_use"
    assert stop_reason("length", True, None) == "max_tokens"
    assert stop_reason("cancelled", False, None) == "max_tokens"
    assert stop_reason("stop", False, "END") == "stop_sequence"
    assert matched_stop_sequence("abc", "abcEND more", ["EN", "END", "X"]) == "END"
    assert matched_stop_sequence("abc", "abc", ["END"]) is None
    assert matched_stop_sequence("abc", "abcEND", []) is None
    assert usage_object(Usage(1000, 900, 7)) == {"input_tokens": 100, "output_tokens": 7,
                                                 "cache_read_input_tokens": 900, "cache_creation_input_tokens": 0,
                                                 "cache_creation": {"ephemeral_5m_input_tokens": 0,
                                                                    "ephemeral_1h_input_tokens": 0}}
    written = Usage(1000, 900, 7, 100, (Segment(900, 1000, 1800.0, False),))
    assert usage_object(written) == {"input_tokens": 0, "output_tokens": 7,
                                     "cache_read_input_tokens": 900, "cache_creation_input_tokens": 100,
                                     "cache_creation": {"ephemeral_5m_input_tokens": 100,
                                                        "ephemeral_1h_input_tokens": 0}}


# ============================================================================ LiteLLM config (pure)
def test_litellm_passes_messages_through_and_advertises_the_window():
    s = load_settings(env={"MLX_PORT": "8181", "DEFAULT_MAX_TOKENS": "4096", "MODEL_ALIASES": "off"})
    cfg = lc.build_config(s, "SmolLM2-135M-Instruct", context_window=8192)
    assert cfg["general_settings"]["pass_through_endpoints"] == [
        {"path": "/v1/messages", "target": "http://127.0.0.1:8181/v1/messages", "forward_headers": True, "auth": True},
        {"path": "/v1/messages/count_tokens", "target": "http://127.0.0.1:8181/v1/messages/count_tokens",
         "forward_headers": True, "auth": True}]
    assert [m["model_info"] for m in cfg["model_list"]] == [
        {"supports_reasoning": False, "max_input_tokens": 8192, "max_output_tokens": 4096, "max_tokens": 4096}] * 2
    assert cfg["router_settings"] == {"disable_cooldowns": True}
    small = lc.build_config(s, "m", context_window=2048)["model_list"][0]["model_info"]
    assert (small["max_input_tokens"], small["max_output_tokens"]) == (2048, 2048)
    assert lc.build_config(s, "m")["model_list"][0]["model_info"] == {"supports_reasoning": False}
    assert lc.served_context_window(load_settings(env={"MLX_PORT": "1"}), timeout=0.5) is None
    keyed = lc.build_config(load_settings(env={"MLX_API_KEY": "sk-mlx"}), "m")["general_settings"]
    assert [e["headers"] for e in keyed["pass_through_endpoints"]] == \
        [{"Authorization": "Bearer os.environ/MLX_API_KEY"}] * 2
    assert "sk-mlx" not in lc.render_yaml(lc.build_config(load_settings(env={"MLX_API_KEY": "sk-mlx"}), "m"))


def test_served_context_window_asks_the_live_server_with_its_key(tiny_dense_path, tmp_path):
    srv = LiveServer(engine_settings(tiny_dense_path, log_root=str(tmp_path), mlx_api_key="sk-mlx-test"))
    try:
        port = str(srv.port)
        assert lc.served_context_window(load_settings(env={"MLX_PORT": port, "MLX_API_KEY": "sk-mlx-test"})) == 4096
        assert lc.served_context_window(load_settings(env={"MLX_PORT": port, "MLX_API_KEY": "sk-wrong"})) is None
    finally:
        srv.close()


# ============================================================================ the real MLX server
@pytest.fixture(scope="module")
def server(tiny_dense_path, tmp_path_factory):
    srv = LiveServer(engine_settings(tiny_dense_path, log_root=str(tmp_path_factory.mktemp("logs"))))
    yield srv
    srv.close()


def text_of(message: dict) -> str:
    return "".join(b["text"] for b in message["content"] if b["type"] == "text")


CONV = {"max_tokens": 8, "system": "You are terse.",
        "messages": [{"role": "user", "content": "Name a fruit."}, {"role": "system", "content": ENV_BLOCK}]}
CHAT = {"max_tokens": 8, "messages": [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "Name a fruit."},
                                      {"role": "system", "content": ENV_BLOCK}]}


def test_same_prompt_and_output_as_chat_completions_with_the_system_entry_in_place(server):
    s1, c, _ = http_json(server.base + "/v1/chat/completions", {**CHAT, "enable_thinking": False})
    s2, m, _ = http_json(server.base + "/v1/messages", CONV)
    assert (s1, s2) == (200, 200)
    assert m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
    u = m["usage"]
    # the chat request's entry serves all but the last token, which this request computes and stores
    assert (u["input_tokens"], u["cache_read_input_tokens"], u["cache_creation_input_tokens"]) == \
        (0, c["usage"]["prompt_tokens"] - 1, 1)
    assert u["cache_creation"] == {"ephemeral_5m_input_tokens": 1, "ephemeral_1h_input_tokens": 0}
    assert (u["output_tokens"], m["stop_reason"]) == (8, "max_tokens")
    assert text_of(m) == c["choices"][0]["message"]["content"]
    s3, n, _ = http_json(server.base + "/v1/messages/count_tokens", {k: CONV[k] for k in ("system", "messages")})
    assert (s3, n) == (200, {"input_tokens": c["usage"]["prompt_tokens"]})
    # without the system entry the prompt is shorter: it was rendered, not dropped
    _, fewer, _ = http_json(server.base + "/v1/messages/count_tokens",
                            {"system": CONV["system"], "messages": CONV["messages"][:1]})
    assert fewer["input_tokens"] < n["input_tokens"]


def test_stream_events_and_text_match_non_stream(server):
    body = {**CONV, "messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 10}
    _, whole, _ = http_json(server.base + "/v1/messages", body)
    req = urllib.request.Request(server.base + "/v1/messages?beta=true", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = sse_events(resp.read().decode())
    names = [e for e, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(e == d["type"] for e, d in events)
    deltas = "".join(d["delta"]["text"] for e, d in events if e == "content_block_delta")
    assert deltas == text_of(whole)
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    w = whole["usage"]
    total = w["input_tokens"] + w["cache_read_input_tokens"] + w["cache_creation_input_tokens"]
    input_side = {"input_tokens": 0, "cache_read_input_tokens": total - 1, "cache_creation_input_tokens": 1,
                  "cache_creation": {"ephemeral_5m_input_tokens": 1, "ephemeral_1h_input_tokens": 0}}
    assert final["usage"] == {**input_side, "output_tokens": 10}
    # the input side is on message_start already (Claude Code reads it there)
    assert events[0][1]["message"]["usage"] == {**input_side, "output_tokens": 0}


def test_second_turn_reads_the_cache_and_the_session_comes_from_claude_code(server):
    headers = {"x-claude-code-session-id": "cc-session-7"}
    first = {"max_tokens": 6, "system": "Be brief.", "messages": [{"role": "user", "content": "Say hi."}]}
    _, a, _ = http_json(server.base + "/v1/messages", first, headers=headers)
    second = {**first, "messages": [*first["messages"], {"role": "assistant", "content": a["content"]},
                                    {"role": "user", "content": "Again."}]}
    _, b, _ = http_json(server.base + "/v1/messages", second, headers=headers)
    first_total = a["usage"]["input_tokens"] + a["usage"]["cache_read_input_tokens"] + \
        a["usage"]["cache_creation_input_tokens"]
    assert b["usage"]["cache_read_input_tokens"] >= first_total - 1   # the tokenizer re-splits the newline after it
    rows = http_json(server.base + "/v1/cache/stats")[1]["recent"][-2:]
    assert [r["session"] for r in rows] == ["cc-session-7", "cc-session-7"]
    meta = {**first, "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "from-metadata"})}}
    http_json(server.base + "/v1/messages", meta)
    assert http_json(server.base + "/v1/cache/stats")[1]["recent"][-1]["session"] == "from-metadata"


def test_thinking_adaptive_gives_a_thinking_block_and_disabled_none(server):
    body = {"max_tokens": 10, "messages": [{"role": "user", "content": "Why?"}]}
    _, on, _ = http_json(server.base + "/v1/messages", {**body, "thinking": {"type": "adaptive"}})
    _, off, _ = http_json(server.base + "/v1/messages", {**body, "output_config": {"effort": "high"}})
    assert on["content"][0]["type"] == "thinking"
    assert decode_signature(on["content"][0]["signature"]) == on["content"][0]["thinking"]
    assert [b["type"] for b in off["content"]] == ["text"]


@pytest.mark.parametrize("path, body, status, kind", [
    ("/v1/messages", {"model": "llama-9", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
     404, "not_found_error"),                     # claude-* names are MODEL_ALIASES of the served model
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
     400, "invalid_request_error"),
    ("/v1/messages", {"max_tokens": -1, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),
    ("/v1/messages/count_tokens", {"messages": "x"}, 400, "invalid_request_error"),
    ("/v1/messages", b"{not json", 400, "invalid_request_error"),
])
def test_bad_input_gets_anthropic_error_and_server_keeps_serving(server, path, body, status, kind):
    s, err, _ = http_json(server.base + path, body)
    assert s == status and err["type"] == "error" and err["error"]["type"] == kind
    assert isinstance(err["error"]["message"], str) and err["error"]["message"]
    s, ok, _ = http_json(server.base + "/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "ok"}]})
    assert s == 200 and ok["usage"]["output_tokens"] == 2


TTL_ORDER = ("a ttl='1h' cache_control block must not come after a ttl='5m' cache_control block. Note that blocks "
             "are processed in the following order: `tools`, `system`, `messages`.")
BUDGET = ("`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our documentation at "
          "https://docs.claude.com/en/docs/build-with-claude/extended-thinking#max-tokens-and-context-window-size")
H1, M5 = {"type": "ephemeral", "ttl": "1h"}, {"type": "ephemeral"}     # no ttl: 5m


def _marked(system: dict | None, user: dict | None, tool: dict | None = None, top: dict | None = None) -> dict:
    """A request whose tool, system block and user block carry these cache_control marks."""
    body = {"max_tokens": 2, "system": [{"type": "text", "text": "You are terse.",
                                         **({"cache_control": system} if system else {})}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi.",
                                                       **({"cache_control": user} if user else {})}]}],
            "tools": [{"name": "ls", "input_schema": {"type": "object"}, **({"cache_control": tool} if tool else {})}]}
    return {**body, "cache_control": top} if top else body


@pytest.mark.parametrize("body, where", [
    (_marked(M5, H1), "messages.0.content.0"),
    (_marked(H1, H1, tool=M5), "system.0"),                # tools come first, whatever their place in the body
    (_marked(None, H1, tool=M5), "messages.0.content.0"),
    (_marked(M5, None, top=H1), ""),                        # the top-level mark is the last block's
])
def test_a_1h_cache_control_after_a_5m_one_is_anthropics_400(server, body, where):
    s, err, _ = http_json(server.base + "/v1/messages", body)
    assert s == 400 and err == {"type": "error", "error": {
        "type": "invalid_request_error", "message": f"{where + '.' if where else ''}cache_control.ttl: {TTL_ORDER}"}}


@pytest.mark.parametrize("body", [_marked(H1, M5), _marked(H1, H1, tool=H1), _marked(M5, M5, tool=M5, top=M5),
                                  _marked(None, M5, tool=H1, top=M5), _marked(None, None)])
def test_cache_control_ttls_that_never_grow_are_accepted(server, body):
    s, ok, _ = http_json(server.base + "/v1/messages", body)
    assert s == 200 and ok["type"] == "message", ok


def test_a_thinking_budget_not_below_max_tokens_is_anthropics_400_unless_thinking_is_interleaved(server):
    ask = {"messages": [{"role": "user", "content": "Why?"}]}
    for budget, max_tokens in ((4, 4), (5, 4)):
        s, err, _ = http_json(server.base + "/v1/messages", {**ask, "max_tokens": max_tokens,
                                                             "thinking": {"type": "enabled", "budget_tokens": budget}})
        assert s == 400 and err == {"type": "error", "error": {"type": "invalid_request_error", "message": BUDGET}}
    s, ok, _ = http_json(server.base + "/v1/messages", {**ask, "max_tokens": 4,
                                                        "thinking": {"type": "enabled", "budget_tokens": 3}})
    assert s == 200 and ok["usage"]["output_tokens"] == 4
    # interleaved thinking: the budget covers every thinking block of the turn and may exceed max_tokens
    # (Claude Code sends this beta with budget 1024 on small max_tokens: tests/fixtures/agent_shapes.py)
    s, ok, _ = http_json(server.base + "/v1/messages", {**ask, "max_tokens": 4,
                                                        "thinking": {"type": "enabled", "budget_tokens": 1024}},
                         headers={"anthropic-beta": "fine-grained-tool-streaming-2025-05-14,interleaved-thinking-2025-05-14"})
    assert s == 200 and ok["usage"]["output_tokens"] == 4


# ============================================================================ through the real LiteLLM proxy
@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_path):
    from tests.test_e2e_stack import Stack

    s = Stack(tmp_path_factory.mktemp("stack"), str(embedded_model_path.parent), ENABLE_REQUEST_LOGGING="true")
    yield s
    if s.proc.poll() is None:
        s.stop()


def last_log_record(root, session16: str, timeout: float = 10.0) -> dict:
    """The newest request-log line of a session (lines are written by a background thread)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        files = sorted(root.glob(f"*/cache-session-{session16}.log"))
        lines = files[-1].read_text().splitlines() if files else []
        if lines:
            return json.loads(lines[-1])
        assert time.monotonic() < deadline, f"no request log for session {session16} under {root}"
        time.sleep(0.2)


def test_claude_code_request_shape_reaches_the_model_whole_through_litellm(stack):
    from tests.test_e2e_stack import KEY, MODEL

    body = {"model": MODEL, "max_tokens": 12, "stream": True,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.330.572; cc_entrypoint=cli;"},
                       {"type": "text", "text": "You are a helpful assistant.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
                         {"role": "system", "content": [{"type": "text", "text": ENV_BLOCK,
                                                         "cache_control": {"type": "ephemeral"}}]}],
            "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "cc-through-litellm"})},
            "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
               "x-claude-code-session-id": "cc-through-litellm", "anthropic-version": "2023-06-01"}
    req = urllib.request.Request(stack.base + "/v1/messages?beta=true", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=180) as resp:
        events = sse_events(resp.read().decode())
    assert [e for e, _ in events][0] == "message_start" and events[-1][0] == "message_stop"
    usage = events[-2][1]["usage"]
    row = stack.recent()[-1]
    assert row["session"] == "cc-through-litellm"[:16]   # stats rows show 16 characters
    assert row["prompt_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"] + \
        usage["cache_creation_input_tokens"]
    # cache_control breakpoints (Anthropic's rule): creation up to the last one -- the end of the
    # trailing system turn -- and input_tokens after it: the generation prompt (4 tokens:
    # <|im_start|>assistant\n)
    assert usage["input_tokens"] == 4
    assert usage["cache_creation_input_tokens"] == row["prompt_tokens"] - row["cached_tokens"] - 4
    # the request log shows the roles the model saw: the trailing system entry is still a system turn
    record = last_log_record(stack.log_path.parent / "logs", "cc-through-litel")
    assert record["message_roles"] == ["system", "user", "system"]
    assert ENV_BLOCK in record["model_text"] and "Operator note" not in record["model_text"]
    s, counted, _ = stack.post("/v1/messages/count_tokens", {k: body[k] for k in ("model", "system", "messages")})
    assert (s, counted) == (200, {"input_tokens": row["prompt_tokens"]})
    s, err, _ = stack.post("/v1/messages", {**body, "stream": False, "model": "llama-9"})   # claude-*: MODEL_ALIASES
    assert s == 404 and err["error"]["type"] == "not_found_error"
    s, ok, _ = stack.post("/v1/messages", {**body, "stream": False})
    assert s == 200 and ok["usage"]["cache_read_input_tokens"] == row["prompt_tokens"] - 1
