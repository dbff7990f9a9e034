"""The session a request belongs to, as the router sees it before choosing a backend (pure).

    ctx = routing_session(body, headers, messages)      # SessionContext(session_id, source)
    chain = request_digests(messages)                   # message-boundary digests (placement)

Explicit ids are the MLX server's own (mlxstack/prompt/session_context.py, same order: body
``session_id`` / ``conversation_id`` / ``thread_id`` / ``chat_id`` at the top level, in
``extra_body`` or ``metadata``; headers ``x-session-affinity`` > ``x-session-id`` >
``x-claude-code-session-id``; Claude Code's ``metadata.user_id``), so one id means one session
on both sides.

Without one, both sides hash the canonical *messages* of the opening (through the first user
message and the first reply after it, scrubbed: prompt/session_context.py ``session_opening``) the same way
(``msg:<digest>``, source ``message-prefix``): stable over the turns of one conversation, and
the same id on the router and on the server.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from mlxstack.cache.summary import IMPLICIT_PREFIX, TENANT_HEADER, message_digests, opening_session_id, scope_of
from mlxstack.prompt.canonicalize import canonicalize_messages
from mlxstack.prompt.session_context import (SessionContext, extract_session_context, opening_end, scoped,
                                             session_opening)

__all__ = ["IMPLICIT_PREFIX", "canonical_messages", "opening_session_id", "request_digests", "request_scope",
           "routing_session"]


def canonical_messages(messages: Sequence[Any], *, canonicalize: bool = True, strip_billing_header: bool = True) -> list:
    """The canonical messages the server keys its cache and turn store by."""
    usable = [m for m in messages if isinstance(m, dict)] if isinstance(messages, (list, tuple)) else []
    return canonicalize_messages(usable, enabled=canonicalize, strip_billing_header=strip_billing_header)[1]


def request_digests(messages: Sequence[Any], scope: str = "", **canon: bool) -> list[tuple[str, int]]:
    """Message-boundary digests of a request in its cache scope, comparable with a backend's
    /v1/cache/summary (whose digests of each session hang from that session's scope)."""
    return message_digests(canonical_messages(messages, **canon), scope)


def request_scope(body: Mapping[str, Any], headers: Mapping[str, str] | None) -> str:
    """The request's cache scope as the MLX server will compute it: the tenant the front door set
    and the body's ``cache_salt`` (top level or ``extra_body``); an unusable salt counts as none
    here (the server answers it 400)."""
    lowered = {str(k).lower(): v for k, v in (headers or {}).items()}
    body = body if isinstance(body, Mapping) else {}
    salt = body.get("cache_salt")
    if salt is None and isinstance(body.get("extra_body"), Mapping):
        salt = body["extra_body"].get("cache_salt")
    return scope_of(str(lowered.get(TENANT_HEADER) or ""), salt if isinstance(salt, str) else "")


def routing_session(body: Mapping[str, Any], headers: Mapping[str, str] | None, messages: Sequence[Any],
                    scope: str = "", **canon: bool) -> SessionContext:
    """The request's session id in its scope: the client's own when it sends one, else the
    opening's digest."""
    return scoped(_session(body, headers, messages, **canon), scope)


def _session(body: Mapping[str, Any], headers: Mapping[str, str] | None, messages: Sequence[Any],
             **canon: bool) -> SessionContext:
    explicit = extract_session_context(body if isinstance(body, Mapping) else {}, headers or {}, ())
    if explicit.source != "prefix-hash":
        return explicit
    usable = [m for m in messages if isinstance(m, dict)] if isinstance(messages, (list, tuple)) else []
    # only the opening is hashed, so only the opening is canonicalised (per message: same result)
    opening = session_opening(canonical_messages(usable[: opening_end(usable)], **canon))
    return SessionContext(opening_session_id(opening), "message-prefix")
