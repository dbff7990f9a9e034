"""Which agent session a request belongs to: pure function over body, headers and tokens.

Usage:
    ctx = extract_session_context(body, handler.headers, canonical_tokens)
    ctx.session_id, ctx.source   # e.g. ("abc-123", "body.session_id")

Lookup order (first non-empty value wins):
  1. Body ids ``session_id`` > ``conversation_id`` > ``thread_id`` > ``chat_id`` > ``prompt_cache_key``
     (OpenAI's cache routing key: Codex sends it on every request), each looked up at
     the top level, then under ``extra_body``, then under ``metadata``
     (source ``"body.<path>"``, e.g. ``"body.metadata.thread_id"``).
     LiteLLM 1.106 forwards a top-level ``session_id`` but drops ``metadata`` and ``user``.
  2. Headers ``x-session-affinity`` > ``x-session-id`` > ``x-claude-code-session-id``
     (case-insensitive; source ``"header.<name>"``). LiteLLM forwards these; PI and OpenClaw send
     ``session_id`` / ``x-session-affinity`` only when configured to.
  3. Claude Code's ``metadata.user_id``, which embeds the session (``user_…_session_<uuid>`` or a JSON
     string with ``session_id``) (source ``"body.metadata.user_id"``) — only reaches us on direct calls.
  4. The caller's ``implicit`` id: the engine and the router both pass the digest of the
     conversation's opening (``session_opening``: canonical messages through the first user
     message and the first reply after it, scrubbed; ``msg:<digest>``, source ``"message-prefix"``),
     so the turns of one conversation share a session, spelled the same on both sides, and two
     conversations that open alike part at their first reply.
     Without one, SHA-1 of the canonical tokens the caller passes (source ``"prefix-hash"``).

Ids are strings (ints are accepted and stringified), stripped; ids longer than 256 characters
are replaced by ``"sha1:<hex>"`` so logs and keys stay bounded.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .scrub import scrub_cache_key

BODY_ID_KEYS = ("session_id", "conversation_id", "thread_id", "chat_id", "prompt_cache_key")
BODY_LOCATIONS = ((), ("extra_body",), ("metadata",))
HEADER_KEYS = ("x-session-affinity", "x-session-id", "x-claude-code-session-id")
MAX_ID_CHARS = 256

_CLAUDE_USER_SESSION = re.compile(r"_session_([0-9A-Za-z][0-9A-Za-z-]{7,})\s*$")


@dataclass(frozen=True)
class SessionContext:
    """A request's session: ``session_id`` keys the session turn store / index; ``source`` says
    where it came from (``"body.session_id"``, ``"header.x-session-id"``, ``"prefix-hash"``, …)."""

    session_id: str
    source: str


def _clean_id(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    text = str(value).strip()
    if not text:
        return None
    if len(text) > MAX_ID_CHARS:
        return "sha1:" + hashlib.sha1(text.encode("utf-8")).hexdigest()
    return text


def _container(body: Mapping[str, Any], location: tuple[str, ...]) -> Mapping[str, Any] | None:
    node: Any = body
    for key in location:
        node = node.get(key) if isinstance(node, Mapping) else None
    return node if isinstance(node, Mapping) else None


def _claude_code_session(metadata: Mapping[str, Any] | None) -> str | None:
    if metadata is None or not isinstance(metadata.get("user_id"), str):
        return None
    user_id = metadata["user_id"].strip()
    if user_id.startswith("{"):
        try:
            parsed = json.loads(user_id)
        except ValueError:
            return None
        return _clean_id(parsed.get("session_id")) if isinstance(parsed, dict) else None
    match = _CLAUDE_USER_SESSION.search(user_id)
    return _clean_id(match.group(1)) if match else None


def prefix_hash_session_id(canonical_tokens: Sequence[int]) -> str:
    """SHA-1 hex of the canonical token ids (8-byte little-endian each). All of them: a cap (it
    was 128) made every conversation whose system prompt is longer share one session."""
    head = np.asarray(list(canonical_tokens), dtype="<i8")
    return hashlib.sha1(head.tobytes()).hexdigest()


def opening_end(messages: Sequence[Any]) -> int:
    """How many leading messages an implicit session id covers: through the first user message
    and the first reply after it, when the conversation has one (all of them when there is no user
    message). Two conversations that open alike part at their first reply, so their turns from
    the second on never share a session (nor compare with each other in a diagnosis); a first
    turn, which has no reply yet, stores its records under the id its reply gives the
    conversation (``opening_with_reply``)."""
    usable = [m for m in messages if isinstance(m, Mapping)]
    first_user = next((i for i, m in enumerate(usable) if m.get("role") == "user"), len(usable) - 1)
    reply = next((i for i in range(first_user + 1, len(usable)) if usable[i].get("role") == "assistant"), None)
    return (first_user if reply is None else reply) + 1


def has_reply(messages: Sequence[Any]) -> bool:
    """Whether the opening of ``messages`` already holds its first reply."""
    usable = [m for m in messages if isinstance(m, Mapping)]
    end = opening_end(usable)
    return end > 0 and usable[end - 1].get("role") == "assistant"


def session_opening(canonical: Sequence[Any]) -> list[dict]:
    """The opening an implicit session id hashes: the canonical messages ``opening_end`` covers,
    their text scrubbed as the cache key's is (prompt/scrub.py: a reminder, a billing line or a
    clock does not start a new session). The router hashes the same opening of the messages as
    the client sent them (routing/session_key.py), so one id means one session on both sides, and
    the engine needs no render of its own for it. A reply is hashed by its visible text and tool
    calls (cache/summary.py ``message_fingerprint``: reasoning left out), which clients echo."""
    usable = [m for m in canonical if isinstance(m, Mapping)]
    return [_scrubbed(m) for m in usable[: opening_end(usable)]]


def _scrubbed(message: Mapping[str, Any]) -> dict:
    out = dict(message)
    content = out.get("content")
    if isinstance(content, str):
        out["content"] = scrub_cache_key(content)
    elif isinstance(content, list):
        out["content"] = [
            {**part, "text": scrub_cache_key(part["text"])}
            if isinstance(part, Mapping) and isinstance(part.get("text"), str) else part
            for part in content
        ]
    return out


_SCOPED_ID = re.compile(r"^s[0-9a-f]{23}/")


def scoped(ctx: SessionContext, scope: str) -> SessionContext:
    """``ctx`` in a cache scope (cache/summary.py ``scope_of``): the same id in another scope is
    another session. A client's own id spelled like a scoped one is hashed, so no request of the
    default scope can name a session of another."""
    if scope:
        return SessionContext(f"{scope}/{ctx.session_id}", ctx.source)
    if _SCOPED_ID.match(ctx.session_id):
        return SessionContext("sha1:" + hashlib.sha1(ctx.session_id.encode("utf-8")).hexdigest(), ctx.source)
    return ctx


def extract_session_context(
    body: Mapping[str, Any],
    headers: Mapping[str, str] | None,
    canonical_tokens: Sequence[int] = (),
    implicit: SessionContext | None = None,
) -> SessionContext:
    """Session id for a request (see the module docstring for the order).

    Args:
        body: parsed JSON request body.
        headers: request headers (any case; ``http.client.HTTPMessage`` works too).
        canonical_tokens: the canonical cache-key tokens (used only for the fallback).
        implicit: the fallback itself when the caller has one (the engine passes the opening's
            message digest, ``session_opening`` + cache/summary.py ``opening_session_id``).

    Returns:
        A ``SessionContext``; never fails.
    """
    body = body if isinstance(body, Mapping) else {}
    containers = [(loc, _container(body, loc)) for loc in BODY_LOCATIONS]
    for key in BODY_ID_KEYS:
        for loc, container in containers:
            if container is None:
                continue
            session_id = _clean_id(container.get(key))
            if session_id is not None:
                return SessionContext(session_id, "body." + "".join(f"{k}." for k in loc) + key)

    lowered = {str(k).lower(): v for k, v in (headers or {}).items()}
    for name in HEADER_KEYS:
        session_id = _clean_id(lowered.get(name))
        if session_id is not None:
            return SessionContext(session_id, "header." + name)

    session_id = _claude_code_session(_container(body, ("metadata",)))
    if session_id is not None:
        return SessionContext(session_id, "body.metadata.user_id")

    if implicit is not None:
        return implicit
    return SessionContext(prefix_hash_session_id(canonical_tokens), "prefix-hash")


__all__ = ["SessionContext", "extract_session_context", "has_reply", "scoped", "opening_end", "prefix_hash_session_id",
           "session_opening"]
