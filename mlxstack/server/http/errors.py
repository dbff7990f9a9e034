"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status."""
from __future__ import annotations

import json
from typing import Any


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def encode(self) -> bytes:
        return json.dumps(self.body()).encode()

    def sse_frame(self) -> bytes:
        """The error as one server-sent event: once a stream's 200 headers are out, a status line
        can no longer be sent, so clients read ``data: {"error": ...}`` and then ``data: [DONE]``."""
        return b"data: " + self.encode() + b"\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, code: str = "not_found") -> APIError:
    return APIError(404, message, code=code)


def unavailable(message: str, retry_after: int = 1, code: str = "unavailable") -> APIError:
    return APIError(503, message, type="server_error", code=code, headers={"Retry-After": str(retry_after)})


def rate_limited(message: str, retry_after: int = 1, code: str = "rate_limit_exceeded") -> APIError:
    return APIError(429, message, type="rate_limit_error", code=code, headers={"Retry-After": str(retry_after)})


def internal(request_id: str) -> APIError:
    return APIError(500, f"internal server error (request id {request_id}); see the server log",
                    type="server_error", code="internal_error")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str, code: str) -> APIError:
    return APIError(403, message, code=code)


def unsupported_media_type(message: str) -> APIError:
    return APIError(415, message, code="unsupported_media_type")
