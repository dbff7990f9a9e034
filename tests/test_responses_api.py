"""OpenAI Responses API (/v1/responses): pure translation both ways, then the real MLX server on the
tiny qwen3 fixture (same prompt and output as /v1/chat/completions, stream == non-stream,
previous_response_id, reasoning items), then through the real LiteLLM proxy on the embedded model."""
from __future__ import annotations

import json
import urllib.request

import pytest

from mlxstack.engine.request import CacheBreakpoint
from mlxstack.server.http.errors import APIError
from mlxstack.server.openai.responses import (OutputItems, ResponseStore, ToolNames, chat_tool_choice,
                                              decode_reasoning_blob, encode_reasoning_blob, input_to_messages,
                                              reply_items, responses_tools, to_chat_body, usage_object)
from mlxstack.server.common.job_adapter import Usage
from mlxstack.parsing.reasoning import CONTENT, REASONING, TOOL_CALLS
from mlxstack.parsing.tool_calls import ToolCall
from tests.conftest import LiveServer, engine_settings, http_json, sse_events


# ============================================================================ request side (pure)
def test_string_input_is_one_user_message():
    assert input_to_messages("hello") == [{"role": "user", "content": "hello"}]


def test_items_become_chat_messages_with_one_assistant_turn_per_reply():
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."},
                                                             {"type": "input_text", "text": " Use tools."}]},
        {"role": "user", "content": "list files"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{\"path\":\".\"}"},
        {"type": "function_call", "call_id": "c2", "name": "ls", "arguments": "{\"path\":\"/\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "etc"}]},
        {"type": "function_call", "call_id": "c3", "name": "cat", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "x"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks"}]},
    ]
    assert input_to_messages(items) == [
        {"role": "developer", "content": "Be brief. Use tools."},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "Sure.", "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{\"path\":\".\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "ls", "arguments": "{\"path\":\"/\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "etc"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "cat", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c3", "content": "x"},
        {"role": "user", "content": "thanks"},
    ]


def test_codex_echo_of_reasoning_keeps_the_text_through_encrypted_content():
    # Codex never sends raw reasoning content back, only summary + encrypted_content.
    blob = encode_reasoning_blob("step one\nstep two ✓")
    items = [{"role": "user", "content": "q"},
             {"type": "reasoning", "summary": [], "encrypted_content": blob},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}]
    assert input_to_messages(items)[1] == {"role": "assistant", "content": "a", "reasoning_content": "step one\nstep two ✓"}
    assert decode_reasoning_blob(blob) == "step one\nstep two ✓"
    assert decode_reasoning_blob("gAAAAABfernet-from-openai") is None
    assert decode_reasoning_blob(None) is None


def test_a_reasoning_only_reply_stays_in_its_place():
    items = [{"role": "user", "content": "q"}, {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]},
             {"role": "user", "content": "and?"}]
    assert input_to_messages(items) == [{"role": "user", "content": "q"},
                                        {"role": "assistant", "content": "", "reasoning_content": "r"},
                                        {"role": "user", "content": "and?"}]


def test_image_parts_are_kept_as_image_url_parts():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                          {"type": "input_image", "image_url": "data:image/png;base64,AAAA",
                                           "detail": "low"}]}]
    assert input_to_messages(items) == [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}]}]


def test_namespace_tools_are_flattened_and_hosted_tools_not_offered():
    tools = [
        {"type": "function", "name": "exec_command", "description": "Run", "parameters": {"type": "object"}},
        {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
         "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}},
                   {"type": "function", "name": "close_agent"}]},
        {"type": "namespace", "name": "goals", "tools": [{"type": "function", "name": "close_agent"}]},
        {"type": "web_search", "external_web_access": False},
    ]
    chat, names = responses_tools(tools)
    assert chat == [
        {"type": "function", "function": {"name": "exec_command", "parameters": {"type": "object"}, "description": "Run"}},
        {"type": "function", "function": {"name": "spawn_agent", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "multi_agent_v1.close_agent",
                                          "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "goals.close_agent", "parameters": {"type": "object", "properties": {}}}},
    ]
    assert names.source("spawn_agent") == ("multi_agent_v1", "spawn_agent")
    assert names.source("goals.close_agent") == ("goals", "close_agent")
    assert names.source("exec_command") == (None, "exec_command")
    assert names.flat("close_agent", "goals") == "goals.close_agent"
    # an echoed namespaced call maps back to the flat name the model saw
    msgs = input_to_messages([{"type": "function_call", "call_id": "c", "name": "close_agent", "namespace": "goals",
                               "arguments": "{}"}], names)
    assert msgs[0]["tool_calls"][0]["function"]["name"] == "goals.close_agent"


def test_tool_choice_mapping():
    names = ToolNames({"spawn_agent": ("multi_agent_v1", "spawn_agent")})
    assert chat_tool_choice("auto", names) == "auto"
    assert chat_tool_choice(None, names) is None
    assert chat_tool_choice({"type": "function", "name": "spawn_agent"}, names) == \
        {"type": "function", "function": {"name": "spawn_agent"}}
    assert chat_tool_choice({"type": "web_search"}, names) == "auto"
    assert chat_tool_choice({"type": "allowed_tools", "mode": "required", "tools": []}, names) == "required"


def test_to_chat_body_maps_every_field():
    body = {"model": "m", "instructions": "Be brief.", "input": "hi", "max_output_tokens": 7, "temperature": 0.5,
            "top_p": 0.9, "reasoning": {"effort": "none", "summary": "auto"}, "prompt_cache_key": "conv-1",
            "text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "object"}, "strict": True}},
            "tool_choice": "auto", "stream": True, "store": False, "include": ["reasoning.encrypted_content"]}
    call = to_chat_body(body)
    assert call.chat_body == {
        "model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "stream": True, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "reasoning_effort": "none",
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"},
                                                                   "strict": True}},
        "session_id": "conv-1", "prompt_cache_key": "conv-1"}
    assert call.conversation == [{"role": "user", "content": "hi"}]   # instructions are not carried over
    assert (call.stream, call.store, call.reasoning_blob) == (True, False, True)
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "ok"}]
    again = to_chat_body({"input": "next", "instructions": "New rules."}, history)
    assert again.chat_body["messages"] == [{"role": "system", "content": "New rules."}, *history,
                                           {"role": "user", "content": "next"}]


def test_a_breakpoint_on_an_assistant_message_marks_that_message_not_an_equal_earlier_one():
    # two assistant turns with the same text: the mark is on the second (chat index 4 after the
    # instructions' system message), never on the first equal one (index 2)
    mark = {"prompt_cache_breakpoint": {"mode": "explicit"}}
    body = {"instructions": "Be brief.", "input": [
        {"role": "user", "content": "one?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"role": "user", "content": "two?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok", **mark}]},
        {"role": "user", "content": "three?"}]}
    call = to_chat_body(body)
    assert [m["role"] for m in call.chat_body["messages"]] == ["system", "user", "assistant", "user", "assistant",
                                                              "user"]
    assert call.breakpoints == (CacheBreakpoint(4, None, None),)
    # after a previous_response_id history (with an equal assistant message) the index counts it
    history = [{"role": "user", "content": "zero?"}, {"role": "assistant", "content": "ok"}]
    again = to_chat_body({"input": body["input"][2:]}, history)
    assert again.breakpoints == (CacheBreakpoint(3, None, None),)


@pytest.mark.parametrize("body, param, fragment", [
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "item_reference"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "'robot'"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]", "call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type",
     "input_file"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "instructions": 3}, "instructions", "string"),
    ({"input": "x", "reasoning": "high"}, "reasoning", "object"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
])
def test_bad_requests_name_the_field(body, param, fragment):
    with pytest.raises(APIError) as err:
        to_chat_body(body)
    assert err.value.status == 400 and err.value.param == param and fragment in err.value.message


# ============================================================================ output side (pure)
def test_output_items_stream_events_in_responses_order():
    call = ToolCall(name="spawn_agent", arguments="{\"task\":\"x\"}", id="call_9")
    items = OutputItems("resp_abc", ToolNames({"spawn_agent": ("multi_agent_v1", "spawn_agent")}), reasoning_blob=True)
    events = (items.push(REASONING, "th") + items.push(REASONING, "ink") + items.push(CONTENT, "Hi")
              + items.push(CONTENT, "!") + items.push(TOOL_CALLS, calls=(call,)) + items.finish())
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [e.get("output_index") for e in events] == [0] * 5 + [1] * 7 + [2] * 4
    assert items.items == [
        {"id": "rs_abc000", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}],
         "encrypted_content": encode_reasoning_blob("think"), "status": "completed"},
        {"id": "msg_abc001", "type": "message", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hi!", "annotations": [], "logprobs": []}]},
        {"id": "fc_abc002", "type": "function_call", "status": "completed", "call_id": "call_9", "name": "spawn_agent",
         "arguments": "{\"task\":\"x\"}", "namespace": "multi_agent_v1"},
    ]
    assert events[13] == {"type": "response.function_call_arguments.delta", "item_id": "fc_abc002",
                          "output_index": 2, "delta": "{\"task\":\"x\"}"}


def test_an_empty_reply_still_has_one_message_and_no_blob_unless_asked():
    items = OutputItems("resp_e", ToolNames(), reasoning_blob=False)
    assert [e["type"] for e in items.finish()] == ["response.output_item.added", "response.content_part.added",
                                                   "response.output_text.done", "response.content_part.done",
                                                   "response.output_item.done"]
    assert items.items[0]["content"][0]["text"] == ""
    built = reply_items("<think>\nhm\n</think>\n\nYes", thinking_started=False, tools=None, family="qwen3",
                        response_id="resp_q", tool_names=ToolNames(), reasoning_blob=False)
    assert [(i["type"], i.get("encrypted_content", "-")) for i in built] == [("reasoning", None), ("message", "-")]
    assert built[0]["content"][0]["text"] == "hm" and built[1]["content"][0]["text"] == "Yes"


def test_usage_object():
    assert usage_object(Usage(100, 80, 12), reasoning_tokens=30) == {
        "input_tokens": 100, "input_tokens_details": {"cached_tokens": 80, "cache_write_tokens": 0,
                                                      "cache_write_tokens_details": {"ttl_30m_tokens": 0,
                                                                                     "ttl_12h_tokens": 0}},
        "output_tokens": 12, "output_tokens_details": {"reasoning_tokens": 12}, "total_tokens": 112}


def test_response_store_is_a_bounded_lru_of_copies():
    store = ResponseStore(max_entries=2)
    store.put("a", [{"role": "user", "content": "1"}])
    store.put("b", [{"role": "user", "content": "2"}])
    assert store.get("a") == [{"role": "user", "content": "1"}]    # a is now the most recent
    store.put("c", [{"role": "user", "content": "3"}])
    assert (store.get("b"), len(store)) == (None, 2)
    got = store.get("a")
    got[0]["content"] = "changed"
    assert store.get("a") == [{"role": "user", "content": "1"}]


# ============================================================================ the real MLX server
@pytest.fixture(scope="module")
def server(tiny_dense_path, tmp_path_factory):
    srv = LiveServer(engine_settings(tiny_dense_path, log_root=str(tmp_path_factory.mktemp("logs"))))
    yield srv
    srv.close()


def post_stream(url: str, body: dict) -> str:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        return resp.read().decode()


def output_text(resp: dict) -> str:
    return "".join(c["text"] for it in resp["output"] if it["type"] == "message" for c in it["content"])


def test_same_prompt_and_output_as_chat_completions(server):
    chat = {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}],
            "max_tokens": 8}
    s1, c, _ = http_json(server.base + "/v1/chat/completions", chat)
    s2, r, _ = http_json(server.base + "/v1/responses", {"instructions": "You are terse.", "input": "Name a fruit.",
                                                         "max_output_tokens": 8})
    assert (s1, s2) == (200, 200)
    assert r["object"] == "response" and r["id"].startswith("resp_")
    assert r["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]
    assert r["usage"]["output_tokens"] == c["usage"]["completion_tokens"] == 8
    assert output_text(r) == c["choices"][0]["message"]["content"]
    assert (r["status"], r["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert r["usage"]["input_tokens_details"]["cached_tokens"] == r["usage"]["input_tokens"] - 1  # chat's entry


def test_stream_events_build_the_same_response_as_non_stream(server):
    body = {"input": [{"role": "user", "content": "Count to three."}], "max_output_tokens": 10}
    _, whole, _ = http_json(server.base + "/v1/responses", body)
    events = sse_events(post_stream(server.base + "/v1/responses", body))
    names = [e for e, _ in events]
    assert names[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(e == d["type"] for e, d in events)
    deltas = "".join(d["delta"] for e, d in events if e == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert deltas == output_text(final) == output_text(whole)
    assert final["output"][0]["content"] == whole["output"][0]["content"]
    assert final["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == whole["usage"]["input_tokens"] - 1
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["usage"] is None


def test_previous_response_id_continues_the_stored_conversation(server):
    first_body = {"instructions": "Answer briefly.", "input": "Say hi.", "max_output_tokens": 6}
    _, first, _ = http_json(server.base + "/v1/responses", first_body)
    s, chained, _ = http_json(server.base + "/v1/responses", {"instructions": "Answer briefly.",
                                                              "previous_response_id": first["id"],
                                                              "input": "Again.", "max_output_tokens": 6})
    assert s == 200 and chained["previous_response_id"] == first["id"]
    explicit = {"instructions": "Answer briefly.", "max_output_tokens": 6, "input": [
        {"role": "user", "content": "Say hi."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": output_text(first)}]},
        {"role": "user", "content": "Again."}]}
    _, direct, _ = http_json(server.base + "/v1/responses", explicit)
    assert chained["usage"]["input_tokens"] == direct["usage"]["input_tokens"]
    assert output_text(chained) == output_text(direct)
    # the first turn's whole prompt was reused (the tokenizer re-splits the newline after it)
    assert chained["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] - 1
    # streamed: stored before response.completed is written, so a client can chain at once
    raw = post_stream(server.base + "/v1/responses", {"input": "Stream me.", "max_output_tokens": 3})
    streamed_id = sse_events(raw)[-1][1]["response"]["id"]
    s, again, _ = http_json(server.base + "/v1/responses", {"previous_response_id": streamed_id, "input": "More.",
                                                            "max_output_tokens": 2})
    assert s == 200 and again["usage"]["input_tokens_details"]["cached_tokens"] > 0
    # store: false keeps nothing
    _, unstored, _ = http_json(server.base + "/v1/responses", {"input": "x", "store": False, "max_output_tokens": 2})
    s, err, _ = http_json(server.base + "/v1/responses", {"previous_response_id": unstored["id"], "input": "y"})
    assert s == 400 and err["error"]["code"] == "previous_response_not_found"
    assert err["error"]["param"] == "previous_response_id"


def test_reasoning_items_and_their_round_trip(server):
    body = {"input": "Why is the sky blue?", "reasoning": {"effort": "high"}, "max_output_tokens": 12,
            "include": ["reasoning.encrypted_content"]}
    s, r, _ = http_json(server.base + "/v1/responses", body)
    assert s == 200
    first = r["output"][0]
    assert first["type"] == "reasoning" and first["content"][0]["type"] == "reasoning_text"
    text = first["content"][0]["text"]
    assert decode_reasoning_blob(first["encrypted_content"]) == text
    details = r["usage"]["output_tokens_details"]
    assert 0 < details["reasoning_tokens"] <= r["usage"]["output_tokens"]
    # Codex's echo (content stripped, blob kept) renders the same prompt as the raw text would
    follow = [{"role": "user", "content": "Why is the sky blue?"}, *r["output"], {"role": "user", "content": "And?"}]
    codex_echo = [{k: v for k, v in it.items() if k != "content"} if it.get("type") == "reasoning" else it
                  for it in follow]
    _, a, _ = http_json(server.base + "/v1/responses", {"input": follow, "reasoning": {"effort": "high"},
                                                        "max_output_tokens": 2})
    _, b, _ = http_json(server.base + "/v1/responses", {"input": codex_echo, "reasoning": {"effort": "high"},
                                                        "max_output_tokens": 2})
    assert a["usage"]["input_tokens"] == b["usage"]["input_tokens"]
    chat = {"reasoning_effort": "high", "max_tokens": 2, "messages": [
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": output_text(r), "reasoning_content": text},
        {"role": "user", "content": "And?"}]}
    _, c, _ = http_json(server.base + "/v1/chat/completions", chat)
    assert c["usage"]["prompt_tokens"] == a["usage"]["input_tokens"]
    _, off, _ = http_json(server.base + "/v1/responses", {"input": "Why is the sky blue?",
                                                          "reasoning": {"effort": "none"}, "max_output_tokens": 4})
    assert [it["type"] for it in off["output"]] == ["message"]
    assert off["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


def not_found_body(response_id: str) -> dict:
    return {"error": {"message": f"Response with id '{response_id}' not found.", "type": "invalid_request_error",
                      "param": None, "code": "response_not_found"}}


def test_a_stored_response_is_retrieved_its_input_listed_and_it_is_deleted(server):
    items = [{"type": "message", "role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]},
             {"type": "message", "role": "assistant", "id": "msg_client1",
              "content": [{"type": "output_text", "text": "Hi!"}]},
             {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
             {"role": "user", "content": "Again."}]
    s, created, _ = http_json(server.base + "/v1/responses", {"input": items, "max_output_tokens": 3})
    assert s == 200
    rid = created["id"]
    assert http_json(server.base + f"/v1/responses/{rid}", method="GET")[:2] == (200, created)
    assert http_json(server.base + f"/responses/{rid}", method="GET")[:2] == (200, created)

    s, listed, _ = http_json(server.base + f"/v1/responses/{rid}/input_items")
    assert s == 200 and set(listed) == {"object", "data", "first_id", "last_id", "has_more"}
    data = listed["data"]
    ids = [it["id"] for it in data]
    assert listed["object"] == "list" and listed["has_more"] is False
    assert (listed["first_id"], listed["last_id"]) == (ids[0], ids[-1]) and len(set(ids)) == 6
    assert ids[3] == "msg_client1" and all(i.startswith(p) for i, p in zip(ids, ("msg_", "fco_", "fc_", "msg_",
                                                                                 "msg_", "msg_")))
    # newest first (OpenAI's default order); string content as its content part
    assert [{k: v for k, v in it.items() if k != "id"} for it in data] == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again."}]},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi."}]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]}]
    # pages: limit, order, after
    s, page, _ = http_json(server.base + f"/v1/responses/{rid}/input_items?order=asc&limit=4")
    assert s == 200 and [it["id"] for it in page["data"]] == ids[::-1][:4] and page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == (ids[5], ids[2])
    s, rest, _ = http_json(server.base + f"/v1/responses/{rid}/input_items?order=asc&limit=4&after={ids[2]}")
    assert s == 200 and [it["id"] for it in rest["data"]] == ids[::-1][4:] and rest["has_more"] is False
    s, tail, _ = http_json(server.base + f"/v1/responses/{rid}/input_items?after={ids[-1]}")
    assert s == 200 and tail == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"), ("order=up", "order"),
                         ("after=msg_nope", "after")):
        s, err, _ = http_json(server.base + f"/v1/responses/{rid}/input_items?{query}")
        assert s == 400 and err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error", query

    s, gone, _ = http_json(server.base + f"/v1/responses/{rid}", method="DELETE")
    assert (s, gone) == (200, {"id": rid, "object": "response", "deleted": True})
    for method, path in (("GET", rid), ("DELETE", rid), ("GET", f"{rid}/input_items")):
        assert http_json(server.base + f"/v1/responses/{path}", method=method)[:2] == (404, not_found_body(rid))
    s, err, _ = http_json(server.base + "/v1/responses", {"previous_response_id": rid, "input": "y"})
    assert s == 400 and err["error"]["code"] == "previous_response_not_found"
    assert http_json(server.base + "/v1/responses/resp_nope", method="GET")[:2] == (404, not_found_body("resp_nope"))


def test_a_streamed_response_is_retrieved_as_its_last_event_showed_it_and_an_unstored_one_is_not(server):
    raw = post_stream(server.base + "/v1/responses", {"input": "Stream me.", "max_output_tokens": 3})
    final = sse_events(raw)[-1][1]["response"]
    assert http_json(server.base + f"/v1/responses/{final['id']}", method="GET")[:2] == (200, final)
    s, listed, _ = http_json(server.base + f"/v1/responses/{final['id']}/input_items")
    assert s == 200 and [{k: v for k, v in it.items() if k != "id"} for it in listed["data"]] == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Stream me."}]}]
    _, unstored, _ = http_json(server.base + "/v1/responses", {"input": "x", "store": False, "max_output_tokens": 2})
    assert http_json(server.base + f"/v1/responses/{unstored['id']}", method="GET")[:2] == \
        (404, not_found_body(unstored["id"]))


@pytest.mark.parametrize("method, path, status, allow", [
    ("PUT", "/v1/responses", 405, "POST"),
    ("PATCH", "/v1/chat/completions", 405, "POST"),
    ("DELETE", "/v1/models", 405, "GET"),
    ("POST", "/v1/responses/resp_x", 405, "DELETE, GET"),
    ("DELETE", "/v1/responses/resp_x/input_items", 405, "GET"),
    ("OPTIONS", "/v1/messages", 405, "POST"),
    ("DELETE", "/nowhere", 404, None),
    ("PUT", "/nowhere", 404, None),
    ("BREW", "/v1/responses", 501, None),
])
def test_every_method_on_every_path_answers_json(server, method, path, status, allow):
    body = b"{}" if method in ("POST", "PUT", "PATCH") else None
    s, err, headers = http_json(server.base + path, body, method=method)
    assert s == status and isinstance(err, dict) and set(err["error"]) == {"message", "type", "param", "code"}, err
    assert headers.get("Content-Type") == "application/json" and headers.get("Allow") == allow
    assert method in err["error"]["message"]


def test_a_request_http_server_cannot_read_is_answered_in_json_not_an_html_page(server):
    import socket

    for line in (b"GARBAGE\r\n\r\n", b"GET /health HTTP/9.9\r\n\r\n",
                 b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(line)
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        assert b"Content-Type: application/json" in head and b"<html" not in raw.lower(), raw[:200]
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and int(head.split()[1]) >= 400


@pytest.mark.parametrize("body, status, code", [
    ({"input": [{"type": "local_shell_call"}]}, 400, None),
    ({"input": "x", "previous_response_id": "resp_nope"}, 400, "previous_response_not_found"),
    ({"input": "x", "model": "gpt-9"}, 404, "model_not_found"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, 400, None),
    ({"input": "x", "max_output_tokens": 0}, 400, None),
])
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, body, status, code):
    s, err, _ = http_json(server.base + "/v1/responses", body)
    assert s == status and set(err["error"]) == {"message", "type", "param", "code"}
    if code:
        assert err["error"]["code"] == code
    s, ok, _ = http_json(server.base + "/v1/responses", {"input": "ok?", "max_output_tokens": 2})
    assert s == 200 and ok["usage"]["output_tokens"] == 2


# ============================================================================ through the real LiteLLM proxy
@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_path):
    from tests.test_e2e_stack import Stack

    s = Stack(tmp_path_factory.mktemp("stack"), str(embedded_model_path.parent), DEFAULT_THINKING="false")
    yield s
    if s.proc.poll() is None:
        s.stop()


def test_responses_through_litellm(stack):
    from tests.test_e2e_stack import KEY, MODEL

    body = {"model": MODEL, "instructions": "Answer in one word.", "input": "What is the capital of France?",
            "max_output_tokens": 8, "prompt_cache_key": "codex-conv-1"}
    s, r, _ = stack.post("/v1/responses", body)
    assert s == 200, r
    assert r["status"] in ("completed", "incomplete") and "Paris" in output_text(r)
    assert r["usage"]["input_tokens"] > 0
    row = stack.recent()[-1]
    assert row["session"].startswith("codex-conv-1") and row["prompt_tokens"] == r["usage"]["input_tokens"]
    req = urllib.request.Request(stack.base + "/v1/responses", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=180) as resp:
        raw = resp.read().decode()
    types = [json.loads(line[6:])["type"] for line in raw.splitlines() if line.startswith("data: {")]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] in ("response.completed",
                                                                                       "response.incomplete")
    done = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")][-1]["response"]
    assert done["usage"]["input_tokens_details"]["cached_tokens"] == r["usage"]["input_tokens"] - 1


def test_stored_responses_through_litellm(stack):
    """LiteLLM forwards retrieve / delete / input_items to the backend with its own ids decoded;
    the front door carries input_items' query (LiteLLM drops it), hands the server's own 404 body
    through, and answers 404 for an id LiteLLM never issued (LiteLLM: a 400 "model=None")."""
    from tests.test_e2e_stack import KEY, MODEL

    auth = {"Authorization": f"Bearer {KEY}"}
    s, created, _ = stack.post("/v1/responses", {"model": MODEL, "max_output_tokens": 3, "input": [
        {"role": "user", "content": "Say hi."}, {"role": "user", "content": "Again."}]})
    assert s == 200, created
    rid = created["id"]
    s, got, _ = http_json(stack.base + f"/v1/responses/{rid}", headers=auth, method="GET")
    assert s == 200 and got["output"] == created["output"] and got["usage"] == created["usage"]
    s, page, _ = http_json(stack.base + f"/v1/responses/{rid}/input_items?order=asc&limit=1", headers=auth,
                           method="GET")
    assert s == 200 and [it["content"][0]["text"] for it in page["data"]] == ["Say hi."] and page["has_more"] is True
    s, rest, _ = http_json(stack.base + f"/v1/responses/{rid}/input_items?order=asc&after={page['last_id']}",
                           headers=auth, method="GET")
    assert s == 200 and [it["content"][0]["text"] for it in rest["data"]] == ["Again."] and rest["has_more"] is False
    s, err, _ = http_json(stack.base + f"/v1/responses/{rid}/input_items?limit=0", headers=auth, method="GET")
    assert s == 400 and err["error"]["param"] == "limit"
    s, gone, _ = http_json(stack.base + f"/v1/responses/{rid}", headers=auth, method="DELETE")
    assert s == 200 and gone["deleted"] is True and gone["object"] == "response"
    s, err, _ = http_json(stack.base + f"/v1/responses/{rid}", headers=auth, method="GET")
    ours = gone["id"]     # the MLX server's own id, as the delete answered it
    assert (s, err) == (404, not_found_body(ours))
    assert http_json(stack.base + "/v1/responses/resp_nope", headers=auth, method="GET")[:2] == \
        (404, not_found_body("resp_nope"))
    assert http_json(stack.base + "/v1/responses/resp_nope", method="GET")[0] == 401      # the key first


def test_response_store_is_bounded_in_bytes_too():
    # issue 23 #6: the count alone let 256 chained turns each keep a 64 MB body with its images
    from mlxstack.server.openai.responses import conversation_bytes

    turn = lambda i: [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:" + "A" * 900}}]},  # noqa: E731
                      {"role": "assistant", "content": f"reply {i}"}]
    size = conversation_bytes(turn(0))
    store = ResponseStore(max_entries=100, max_bytes=3 * size)
    for i in range(10):
        assert store.put(f"r{i}", turn(i)) is True
        assert store.nbytes <= 3 * size
    assert len(store) == 3 and [store.get(f"r{i}") is not None for i in range(10)] == [False] * 7 + [True] * 3
    assert store.put("huge", turn(0) * 4) is False and store.get("huge") is None and len(store) == 3
    store.put("r9", turn(9))                                   # replacing an id counts it once
    assert store.nbytes == sum(conversation_bytes(turn(i)) for i in (7, 8, 9))
