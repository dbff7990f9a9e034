"""The session a request belongs to, as the router sees it before choosing a backend (pure).

    ctx = routing_session(body, headers, messages)      # SessionContext(session_id, source)
    chain = request_digests(messages)                   # message-boundary digests (placement)

Explicit ids are the MLX server's own (mlxstack/prompt/session_context.py, same order: body
``session_id`` / ``conversation_id`` / ``thread_id`` / ``chat_id`` at the top level, in
``extra_body`` or ``metadata``; headers ``x-session-affinity`` > ``x-session-id`` >
``x-claude-code-session-id``; Claude Code's ``metadata.user_id``), so one id means one session
on both sides.

Without one, both sides hash the canonical *messages* of the opening (up to the end of the first
user message, scrubbed: prompt/session_context.py ``session_opening``) the same way
(``msg:<digest>``, source ``message-prefix``): stable over the turns of one conversation, and
the same id on the router and on the server.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from mlxstack.cache.summary import IMPLICIT_PREFIX, message_digests, opening_session_id
from mlxstack.prompt.canonicalize import canonicalize_messages
from mlxstack.prompt.session_context import SessionContext, extract_session_context, session_opening

__all__ = ["IMPLICIT_PREFIX", "canonical_messages", "opening_session_id", "request_digests", "routing_session"]


def canonical_messages(messages: Sequence[Any], *, canonicalize: bool = True, strip_billing_header: bool = True) -> list:
    """The canonical messages the server keys its cache and turn store by."""
    usable = [m for m in messages if isinstance(m, dict)] if isinstance(messages, (list, tuple)) else []
    return canonicalize_messages(usable, enabled=canonicalize, strip_billing_header=strip_billing_header)[1]


def request_digests(messages: Sequence[Any], **canon: bool) -> list[tuple[str, int]]:
    """Message-boundary digests of a request, comparable with a backend's /v1/cache/summary."""
    return message_digests(canonical_messages(messages, **canon))


def routing_session(body: Mapping[str, Any], headers: Mapping[str, str] | None, messages: Sequence[Any],
                    **canon: bool) -> SessionContext:
    """The request's session id: the client's own when it sends one, else the opening's digest."""
    explicit = extract_session_context(body if isinstance(body, Mapping) else {}, headers or {}, ())
    if explicit.source != "prefix-hash":
        return explicit
    usable = [m for m in messages if isinstance(m, dict)] if isinstance(messages, (list, tuple)) else []
    first_user = next((i for i, m in enumerate(usable) if m.get("role") == "user"), len(usable) - 1)
    # only the opening is hashed, so only the opening is canonicalised (per message: same result)
    opening = session_opening(canonical_messages(usable[: first_user + 1], **canon))
    return SessionContext(opening_session_id(opening), "message-prefix")
