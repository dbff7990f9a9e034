"""SessionContext extraction: body ids, headers, Claude Code metadata, prefix-hash fallback."""
from __future__ import annotations

import dataclasses
import hashlib
from email.message import Message

import numpy as np
import pytest

from mlxstack.prompt.session_context import (
    SessionContext,
    extract_session_context,
    prefix_hash_session_id,
)

TOKENS = list(range(1000, 1300))


@pytest.mark.parametrize(
    "body, sid, source",
    [
        ({"session_id": "s1"}, "s1", "body.session_id"),
        ({"conversation_id": "c1"}, "c1", "body.conversation_id"),
        ({"thread_id": "t1"}, "t1", "body.thread_id"),
        ({"chat_id": 42}, "42", "body.chat_id"),
        ({"metadata": {"session_id": "m1"}}, "m1", "body.metadata.session_id"),
        ({"extra_body": {"thread_id": "e1"}}, "e1", "body.extra_body.thread_id"),
        ({"session_id": "  padded  "}, "padded", "body.session_id"),
    ],
)
def test_body_ids(body, sid, source):
    assert extract_session_context(body, {}, TOKENS) == SessionContext(sid, source)


def test_body_order_key_first_then_location():
    body = {
        "chat_id": "chat",
        "metadata": {"session_id": "meta-session"},
        "extra_body": {"conversation_id": "xb-conv"},
    }
    # session_id (under metadata) outranks conversation_id/chat_id anywhere
    assert extract_session_context(body, {}, TOKENS) == SessionContext("meta-session", "body.metadata.session_id")
    body = {"session_id": "top", "extra_body": {"session_id": "xb"}, "metadata": {"session_id": "meta"}}
    assert extract_session_context(body, {}, TOKENS).session_id == "top"
    body = {"extra_body": {"session_id": "xb"}, "metadata": {"session_id": "meta"}}
    assert extract_session_context(body, {}, TOKENS).session_id == "xb"


def test_empty_and_invalid_ids_are_skipped():
    body = {"session_id": "", "conversation_id": "   ", "thread_id": None, "chat_id": True,
            "metadata": {"session_id": {"nested": 1}}, "extra_body": "not-a-dict"}
    ctx = extract_session_context(body, {}, TOKENS)
    assert ctx.source == "prefix-hash"


def test_long_ids_are_hashed():
    ctx = extract_session_context({"session_id": "x" * 1000}, {}, TOKENS)
    assert ctx.session_id == "sha1:" + hashlib.sha1(b"x" * 1000).hexdigest()


@pytest.mark.parametrize(
    "headers, sid, source",
    [
        ({"X-Session-Affinity": "aff"}, "aff", "header.x-session-affinity"),
        ({"x-session-id": "sid"}, "sid", "header.x-session-id"),
        ({"X-CLAUDE-CODE-SESSION-ID": "cc"}, "cc", "header.x-claude-code-session-id"),
        ({"x-session-id": "sid", "x-session-affinity": "aff"}, "aff", "header.x-session-affinity"),
        ({"x-claude-code-session-id": "cc", "X-Session-Id": "sid"}, "sid", "header.x-session-id"),
    ],
)
def test_headers_case_insensitive_with_order(headers, sid, source):
    assert extract_session_context({}, headers, TOKENS) == SessionContext(sid, source)


def test_http_message_headers():
    msg = Message()
    msg["X-Session-Affinity"] = "from-litellm"
    assert extract_session_context({}, msg, TOKENS) == SessionContext("from-litellm", "header.x-session-affinity")


def test_body_beats_headers():
    ctx = extract_session_context({"session_id": "body"}, {"x-session-affinity": "hdr"}, TOKENS)
    assert ctx == SessionContext("body", "body.session_id")


def test_claude_code_metadata_user_id():
    uid = "user_ab12cd_account_11111111-2222-3333-4444-555555555555_session_aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
    ctx = extract_session_context({"metadata": {"user_id": uid}}, {}, TOKENS)
    assert ctx == SessionContext("aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "body.metadata.user_id")
    as_json = '{"device_id": "d", "account_uuid": "a", "session_id": "sess-json-1"}'
    assert extract_session_context({"metadata": {"user_id": as_json}}, {}, TOKENS).session_id == "sess-json-1"
    # headers outrank it
    assert extract_session_context({"metadata": {"user_id": uid}}, {"x-session-id": "h"}, TOKENS).session_id == "h"
    # a plain user id without a session is not a session
    assert extract_session_context({"metadata": {"user_id": "alice"}}, {}, TOKENS).source == "prefix-hash"


def test_prefix_hash_fallback_hashes_every_opening_token():
    ctx = extract_session_context({}, {}, TOKENS)
    expected = hashlib.sha1(np.asarray(TOKENS, dtype="<i8").tobytes()).hexdigest()
    assert ctx == SessionContext(expected, "prefix-hash")
    # a difference anywhere in the opening -- also past token 128 (long system prompts) -- is
    # another conversation; the engine passes only the opening, so later turns keep the id
    for i in (0, 127, len(TOKENS) - 1):
        changed = list(TOKENS)
        changed[i] += 1
        assert extract_session_context({}, {}, changed).session_id != expected
    assert prefix_hash_session_id(np.asarray(TOKENS)) == expected
    assert extract_session_context({}, None, []).source == "prefix-hash"


def test_session_context_is_frozen():
    ctx = SessionContext("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.session_id = "c"  # type: ignore[misc]
