"""The helpers the three API fronts share (server/common/usage.py, finish.py, opaque.py, chat_body.py, items.py,
error_shapes.py; server/http/sse.py event_frame; server/openai/chat_reply.py ChatStream): pure, exact values."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace as NS

from mlxstack.server.common.chat_body import copy_fields, function_tool, joined
from mlxstack.server.common.error_shapes import answer_errors, internal_logged, messages_error, responses_error
from mlxstack.server.http.errors import APIError
from mlxstack.server.common.finish import (chat_finish_reason, matched_stop_sequence, messages_stop_reason,
                                           outcome_incomplete, outcome_truncated, responses_status)
from mlxstack.server.common.items import ReplyParts, ReplySplit, whole_reply_events
from mlxstack.server.common.opaque import decode_opaque, encode_opaque
from mlxstack.server.openai.chat_reply import ChatStream
from mlxstack.server.http.sse import DONE, event_frame
from mlxstack.server.common.usage import Usage, chat_usage, messages_usage, outcome_usage, responses_usage
from mlxstack.cache.lifetimes import Segment, applied_lifetime, long_tokens, written_segments
from mlxstack.engine.chat import GRAMMAR_DEAD_END
from mlxstack.parsing.reasoning import CONTENT, REASONING, TOOL_CALLS
from mlxstack.parsing.tool_calls import ToolCall


def outcome(finish="stop", text="", raw_text=None, thinking_started=False):
    return NS(finish_reason=finish, text=text, raw_text=text if raw_text is None else raw_text,
              thinking_started=thinking_started, prompt_tokens=100, cached_tokens=80, completion_tokens=12,
              logprobs=None)


# ============================================================================ usage.py
def test_usage_in_each_fronts_words():
    usage = outcome_usage(outcome())    # no cache report (the cache off): nothing written
    assert usage == Usage(prompt_tokens=100, cached_tokens=80, completion_tokens=12)
    assert chat_usage(usage) == {"prompt_tokens": 100, "completion_tokens": 12, "total_tokens": 112,
                                 "prompt_tokens_details": {"cached_tokens": 80, "cache_write_tokens": 0}}
    assert responses_usage(usage, reasoning_tokens=5) == {
        "input_tokens": 100, "input_tokens_details": {"cached_tokens": 80, "cache_write_tokens": 0,
                                                      "cache_write_tokens_details": {"ttl_30m_tokens": 0,
                                                                                     "ttl_12h_tokens": 0}},
        "output_tokens": 12, "output_tokens_details": {"reasoning_tokens": 5}, "total_tokens": 112}
    assert responses_usage(usage, reasoning_tokens=40)["output_tokens_details"] == {"reasoning_tokens": 12}
    assert messages_usage(usage) == {"input_tokens": 20, "output_tokens": 12, "cache_read_input_tokens": 80,
                                     "cache_creation_input_tokens": 0,
                                     "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}}
    # the prompt's 20 new tokens stored without breakpoints, at the server's default lifetime:
    # all of them creation (the server caches every turn), none long-lived
    segs = tuple(written_segments(80, 100, [], rest=1800.0))
    written = outcome_usage(NS(**vars(outcome()), cache=NS(written=20, segments=segs, breakpoints=())))
    assert written == Usage(100, 80, 12, 20, segs, False)
    assert messages_usage(written) == {"input_tokens": 0, "output_tokens": 12, "cache_read_input_tokens": 80,
                                       "cache_creation_input_tokens": 20,
                                       "cache_creation": {"ephemeral_5m_input_tokens": 20, "ephemeral_1h_input_tokens": 0}}
    assert chat_usage(written)["prompt_tokens_details"] == {"cached_tokens": 80, "cache_write_tokens": 20}
    assert responses_usage(written, 0)["input_tokens_details"] == {
        "cached_tokens": 80, "cache_write_tokens": 20,
        "cache_write_tokens_details": {"ttl_30m_tokens": 20, "ttl_12h_tokens": 0}}


def test_breakpoints_split_what_a_request_writes_by_the_lifetime_applied():
    """Anthropic's rule with breakpoints: creation = the tokens up to the last breakpoint not read
    (by each breakpoint's lifetime), input_tokens = the tokens after it; the Responses buckets
    count every written token by the lifetime that applies to it."""
    # reused 10; a 1h breakpoint at 40, a 5m (applied: the 30 min default) one at 70; prompt 100
    segs = tuple(written_segments(10, 100, [(70, 1800.0), (40, 3600.0)], rest=43200.0))
    assert segs == (Segment(10, 40, 3600.0, True), Segment(40, 70, 1800.0, True), Segment(70, 100, 43200.0, False))
    usage = outcome_usage(NS(**{**vars(outcome()), "cached_tokens": 10},
                             cache=NS(written=90, segments=segs, breakpoints=((40, 3600.0), (70, 1800.0)))))
    assert messages_usage(usage) == {"input_tokens": 30, "output_tokens": 12, "cache_read_input_tokens": 10,
                                     "cache_creation_input_tokens": 60,
                                     "cache_creation": {"ephemeral_5m_input_tokens": 30, "ephemeral_1h_input_tokens": 30}}
    assert responses_usage(usage, 0)["input_tokens_details"] == {
        "cached_tokens": 10, "cache_write_tokens": 90,
        "cache_write_tokens_details": {"ttl_30m_tokens": 60, "ttl_12h_tokens": 30}}
    # a breakpoint inside what was reused writes nothing: all new tokens are after it
    read = tuple(written_segments(50, 100, [(40, 3600.0)], rest=1800.0))
    assert read == (Segment(50, 100, 1800.0, False),)
    usage = outcome_usage(NS(**{**vars(outcome()), "cached_tokens": 50},
                             cache=NS(written=50, segments=read, breakpoints=((40, 3600.0),))))
    assert messages_usage(usage)["input_tokens"] == 50 and messages_usage(usage)["cache_creation_input_tokens"] == 0


def test_an_entrys_lifetime_stays_within_the_servers_limits():
    assert applied_lifetime(None, 1800.0, 3600.0) == 1800.0      # nothing asked: the default
    assert applied_lifetime(300.0, 1800.0, 3600.0) == 1800.0     # 5m asked: never shorter than the default
    assert applied_lifetime(3600.0, 1800.0, 3600.0) == 3600.0
    assert applied_lifetime(86400.0, 1800.0, 3600.0) == 3600.0   # capped
    assert applied_lifetime(86400.0, 1800.0, 0.0) == 86400.0     # no cap
    assert applied_lifetime(3600.0, 0.0, 600.0) == 0.0           # entries never expire: stays so
    assert long_tokens([Segment(0, 5, 0.0, True), Segment(5, 9, 3600.0, False), Segment(9, 10, 60.0, False)],
                       3600.0) == 9


def test_chat_usage_keys_keep_their_wire_order():
    assert list(chat_usage(Usage(3, 0, 2))) == ["prompt_tokens", "completion_tokens", "total_tokens",
                                                "prompt_tokens_details"]


# ============================================================================ finish.py
def test_each_engine_finish_in_each_fronts_words():
    table = {  # engine finish -> (chat, chat with tool calls, responses status, anthropic, anthropic with tool use)
        "stop": ("stop", "tool_calls", ("completed", None), "end_turn", "tool_use"),
        "length": ("length", "length", ("incomplete", "max_output_tokens"), "max_tokens", "max_tokens"),
        "cancelled": ("length", "length", ("incomplete", "max_output_tokens"), "max_tokens", "max_tokens"),
        GRAMMAR_DEAD_END: ("content_filter", "content_filter", ("incomplete", "content_filter"), "refusal",
                           "refusal"),
    }
    for finish, (chat, chat_tools, status, stop, stop_tools) in table.items():
        o = outcome(finish)
        assert chat_finish_reason(o, False) == chat, finish
        assert chat_finish_reason(o, True) == chat_tools, finish
        assert responses_status(o) == status, finish
        assert messages_stop_reason(finish, False, None) == stop, finish
        assert messages_stop_reason(finish, True, None) == stop_tools, finish


def test_truncated_and_incomplete():
    assert [outcome_truncated(outcome(f)) for f in ("stop", "length", "cancelled", GRAMMAR_DEAD_END)] == \
        [False, True, True, False]
    assert [outcome_incomplete(outcome(f)) for f in ("stop", "length", "cancelled", GRAMMAR_DEAD_END)] == \
        [None, "length", "length", GRAMMAR_DEAD_END]


def test_a_stop_sequence_names_itself_only_when_the_raw_text_continues_with_it():
    assert messages_stop_reason("stop", False, "END") == "stop_sequence"
    assert messages_stop_reason("stop", True, "END") == "tool_use"
    assert matched_stop_sequence("ab", "abEND!", ["E", "END", ""]) == "END"
    assert matched_stop_sequence("ab", "xbEND", ["END"]) is None      # raw text does not extend the text
    assert matched_stop_sequence("ab", "ab", ["END"]) is None
    assert matched_stop_sequence("ab", "abEND", []) is None


# ============================================================================ opaque.py
def test_opaque_round_trip_in_both_alphabets():
    text = "plan: ?>~ \u00e9\u4e2d"
    std = encode_opaque("p.v1:", text, urlsafe=False)
    safe = encode_opaque("p.v1:", text, urlsafe=True)
    assert std == "p.v1:cGxhbjogPz5+IMOp5Lit" and safe == "p.v1:cGxhbjogPz5-IMOp5Lit"
    assert decode_opaque("p.v1:", std, urlsafe=False) == text
    assert decode_opaque("p.v1:", safe, urlsafe=True) == text


def test_opaque_refuses_what_it_did_not_write():
    assert decode_opaque("p.v1:", "other:cGxhbg==", urlsafe=False) is None      # another prefix
    assert decode_opaque("p.v1:", None, urlsafe=True) is None
    assert decode_opaque("p.v1:", "p.v1:cGxhbjogPz5-IMOp5Lit", urlsafe=False) is None   # strict: "-" is not std
    assert decode_opaque("p.v1:", "p.v1:/w==", urlsafe=False) is None        # bytes, but not UTF-8
    assert decode_opaque("p.v1:", "p.v1:\u00e9", urlsafe=True) is None       # not ASCII
    assert decode_opaque("p.v1:", "p.v1:", urlsafe=False) == ""


# ============================================================================ chat_body.py
def test_joined_text_parts_become_one_string_else_parts_stay():
    text = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    assert joined(text) == "ab"
    assert joined([]) == ""
    assert joined([*text, image]) == [*text, image]


def test_function_tool_takes_the_schema_under_the_fronts_key():
    tool = {"name": "x", "input_schema": {"type": "object", "properties": {"a": {}}}, "description": "d",
            "strict": True}
    assert function_tool("x", tool, "input_schema") == {"type": "function", "function": {
        "name": "x", "parameters": {"type": "object", "properties": {"a": {}}}, "description": "d", "strict": True}}
    bare = function_tool("y", {"description": 3, "strict": "yes"}, "parameters")
    assert bare == {"type": "function", "function": {"name": "y", "parameters": {"type": "object", "properties": {}}}}
    assert bare["function"]["parameters"] is not function_tool("y", {}, "parameters")["function"]["parameters"]


def test_copy_fields_skips_absent_and_none():
    chat: dict = {"model": "m"}
    copy_fields({"max_output_tokens": 5, "top_p": None, "seed": 0}, chat,
                (("max_output_tokens", "max_tokens"), ("top_p", "top_p"), ("seed", "seed"), ("top_k", "top_k")))
    assert chat == {"model": "m", "max_tokens": 5, "seed": 0}


# ============================================================================ items.py
class Spans(ReplyParts):
    """A minimal front: parts are (kind, text) dicts; events name what happened."""

    def _start(self, kind):
        return [("start", len(self.parts), kind)]

    def _delta(self, kind, text):
        return [("delta", len(self.parts), text)]

    def _end(self, kind, text):
        self.parts.append({"kind": kind, "text": text})
        return [("end", len(self.parts) - 1)]

    def _tool_call(self, call):
        self.parts.append({"kind": "call", "text": call.name})
        return [("call", len(self.parts) - 1)]


def test_runs_of_one_kind_extend_the_open_part_and_calls_stand_alone():
    parts = Spans()
    call = ToolCall(name="f", arguments="{}", id="c1")
    events = (parts.push(REASONING, "a") + parts.push(REASONING, "b") + parts.push(CONTENT, "")
              + parts.push(CONTENT, "c") + parts.push(TOOL_CALLS, calls=(call,)) + parts.push(CONTENT, "d")
              + parts.close() + parts.close())
    assert events == [("start", 0, REASONING), ("delta", 0, "a"), ("delta", 0, "b"), ("end", 0),
                      ("start", 1, CONTENT), ("delta", 1, "c"), ("end", 1), ("call", 2),
                      ("start", 3, CONTENT), ("delta", 3, "d"), ("end", 3)]
    assert parts.parts == [{"kind": REASONING, "text": "ab"}, {"kind": CONTENT, "text": "c"},
                           {"kind": "call", "text": "f"}, {"kind": CONTENT, "text": "d"}]


def test_a_streamed_reply_gives_the_whole_replys_events():
    text = "<think>\nplan\n</think>\n\nThe answer is 4."
    whole = Spans()
    whole.push_events(whole_reply_events(text, thinking_started=False, tools=None, family="qwen3", salt="s"))
    whole.close()
    split = ReplySplit(tools=None, family="qwen3", salt="s")
    split.open(NS(thinking_started=False))
    streamed = Spans()
    for i in range(0, len(text), 3):
        streamed.push_events(split.feed(text[i:i + 3]))
    streamed.push_events(split.finish(outcome()))
    streamed.close()
    assert whole.parts == streamed.parts == [{"kind": REASONING, "text": "plan"},
                                             {"kind": CONTENT, "text": "The answer is 4."}]


def test_a_split_with_no_prompt_ready_opens_from_the_outcome():
    split = ReplySplit(tools=None, family="qwen3", salt="s")
    split.open(None)
    assert split.splitter is None
    parts = Spans()
    parts.push_events(split.finish(outcome(thinking_started=True)))
    assert split.splitter is not None and parts.parts == []


# ============================================================================ error_shapes.py
def test_error_bodies_in_each_fronts_shape():
    assert messages_error(APIError(400, "too many", code="context_length_exceeded")) == \
        {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long: too many"}}
    assert [messages_error(APIError(s, "m"))["error"]["type"] for s in (401, 404, 418, 500, 503, 529, 504)] == \
        ["authentication_error", "not_found_error", "invalid_request_error", "api_error", "overloaded_error",
         "overloaded_error", "api_error"]
    assert responses_error(APIError(503, "busy", code="queue_full")) == {"code": "queue_full", "message": "busy"}
    assert responses_error(APIError(500, "bug")) == {"code": "server_error", "message": "bug"}


def test_internal_logged_names_the_request_id_it_logged(caplog):
    with caplog.at_level(logging.ERROR, logger="mlxstack.http"):
        err = internal_logged(RuntimeError("x"), "failed (request id %s)")
    rid = caplog.records[-1].getMessage().removeprefix("failed (request id ").removesuffix(")")
    assert len(rid) == 12 and err.status == 500 and err.code == "internal_error" and rid in err.message
    assert caplog.records[-1].exc_info[0] is RuntimeError


class FakeHandler:
    def __init__(self):
        self.app = NS(counted=[], count_status=None)
        self.app.count_status = self.app.counted.append
        self.sent = []

    def _send(self, status, body, headers=None):
        self.sent.append((status, json.loads(body), headers))


def test_answer_errors_answers_in_the_envelope_given():
    h = FakeHandler()

    def busy():
        raise APIError(503, "busy", type="server_error", code="queue_full", headers={"Retry-After": "2"})

    answer_errors(h, busy, messages_error)
    answer_errors(h, lambda: None, messages_error)
    assert h.sent == [(503, {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}},
                       {"Retry-After": "2"})]
    assert h.app.counted == [503]

    def bug():
        raise KeyError("k")

    answer_errors(h, bug, responses_error)
    status, body, _ = h.sent[-1]
    assert status == 500 and body["code"] == "internal_error" and "request id" in body["message"]


def test_answer_errors_lets_a_hung_up_client_go():
    h = FakeHandler()

    def gone():
        raise BrokenPipeError()

    try:
        answer_errors(h, gone, messages_error)
    except BrokenPipeError:
        pass
    else:
        raise AssertionError("BrokenPipeError was swallowed")
    assert h.sent == [] and h.app.counted == []


# ============================================================================ sse.event_frame, ChatStream
def test_event_frame_names_the_payloads_type():
    assert event_frame({"type": "message_stop"}) == b'event: message_stop\ndata: {"type": "message_stop"}\n\n'
    assert event_frame({"type": "x", "t": "\u00e9"}) == b'event: x\ndata: {"type": "x", "t": "\\u00e9"}\n\n'


def test_chat_stream_frames_end_with_done_and_an_error_is_one_frame_then_done():
    enc = ChatStream("chatcmpl-1", "m", tools=None, family="qwen3", include_usage=False, parse_tools=True)
    start = enc.start(NS(thinking_started=False))
    assert len(start) == 1 and start[0].startswith(b'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk"')
    assert b'"delta": {"role": "assistant", "content": ""}' in start[0]
    fed = enc.feed("Hi")
    assert fed == [enc.asm.encoder.content_frame("Hi")]
    done = enc.finish(outcome(text="Hi"))
    assert done[-1] == DONE and b'"finish_reason": "stop"' in done[-2] and b'"total_tokens": 112' in done[-2]
    assert enc.error(APIError(500, "bug", code="internal_error")) == [
        b'data: {"error": {"message": "bug", "type": "invalid_request_error", "param": null, '
        b'"code": "internal_error"}}\n\n' + DONE]


def test_chat_stream_without_prompt_ready_builds_its_assembler_at_the_end():
    enc = ChatStream("chatcmpl-2", "m", tools=None, family="qwen3", include_usage=True, parse_tools=True)
    tail = enc.finish(outcome(finish="length", text=""))
    head = enc.start(None)   # JobRun writes the opening frames before the first batch it sends
    assert head == [enc.asm.start()]
    assert tail[-1] == DONE and b'"choices": []' in tail[-2] and b'"finish_reason": "length"' in tail[-3]
