"""An APIError in each front's words, and the one way an unexpected failure becomes one.

OpenAI's body (chat completions, Responses before a stream starts) is ``APIError.body()``
(http/errors.py). The others:

    messages_error(err)      # Anthropic: {"type": "error", "error": {"type", "message"}}
    responses_error(err)     # a failed response's ``error``: {"code", "message"}
    internal_logged(exc, "stream failed after it started (request id %s)")   # 500 with a request id
    answer_errors(h, fn, messages_error)      # run a handler; errors answered in that envelope
"""
from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable

from ..http.errors import APIError, internal

# Anthropic error ``type`` per status; any other 5xx is "api_error", any other 4xx "invalid_request_error"
MESSAGES_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                        404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                        429: "rate_limit_error", 499: "invalid_request_error", 503: "overloaded_error",
                        529: "overloaded_error"}


def messages_error(err: APIError) -> dict:
    """Anthropic's error envelope for an APIError (Claude Code compacts on "prompt is too long")."""
    message = err.message
    if err.code == "context_length_exceeded":
        message = f"prompt is too long: {message}"
    kind = MESSAGES_ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def responses_error(err: APIError) -> dict:
    """The ``error`` of a Responses ``response`` that failed (response.failed)."""
    return {"code": err.code or "server_error", "message": err.message}


def internal_logged(exc: BaseException, message: str) -> APIError:
    """A 500 naming a fresh request id; ``exc`` is logged under it (``message`` has one %s for the id)."""
    rid = uuid.uuid4().hex[:12]
    logging.getLogger("mlxstack.http").error(message, rid, exc_info=exc)
    return internal(rid)


def answer_errors(h: Any, fn: Callable[[], None], envelope: Callable[[APIError], dict]) -> None:
    """Run ``fn`` (a route); an APIError -- or a bug, as a 500 with a request id -- is answered in
    ``envelope``'s shape instead of OpenAI's. A client that hung up gets nothing."""
    try:
        fn()
    except (BrokenPipeError, ConnectionResetError):
        raise
    except Exception as exc:  # noqa: BLE001 - a bug still answers in the client's envelope, with an id
        if not isinstance(exc, APIError):
            exc = internal_logged(exc, "internal error (request id %s)")
        h.app.count_status(exc.status)
        try:
            h._send(exc.status, json.dumps(envelope(exc)).encode(), headers=exc.headers)
        except OSError:
            pass


__all__ = ["MESSAGES_ERROR_TYPES", "answer_errors", "internal_logged", "messages_error", "responses_error"]
