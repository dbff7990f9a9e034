"""HTTP front: a threaded stdlib server whose handlers never touch MLX.

Handlers parse and validate, enqueue a job on the single inference worker, and write the
result (JSON, or SSE frames as text arrives). /health and /v1/models answer from any thread
while a generation runs. Every response closes its connection (``Connection: close``), so
LiteLLM's pooled keep-alive sockets never park a handler.

    app = App(settings); app.start_loading(); serve(app)      # see mlxstack/serve.py
"""
from __future__ import annotations

import io
import json
import logging
import re
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from ...engine.chat import ClientGone, ContextLengthExceeded
from ...engine.worker import WorkerDied
from .errors import APIError, bad_request, internal, not_found, unavailable
from .pooled_server import DeadlineReader
from ...prompt.images import ImageError

log = logging.getLogger("mlxstack.http")

_DECIMAL = re.compile(r"^[0-9]{1,18}$")
GUARD_DRAIN_BYTES = 1 << 20  # a refused request's body is read this far so the client sees our answer


def content_length(values: list[str] | None) -> int | None:
    """The body size from Content-Length header value(s): None when absent, APIError(400) unless
    it is one plain decimal number (``-1``, ``+5``, ``5_0``, ``0x10`` and conflicting copies are refused:
    int() accepts some of them, and a negative length used to read until the client hung up)."""
    if not values:
        return None
    distinct = {v.strip() for v in values}
    if len(distinct) != 1 or not _DECIMAL.match(next(iter(distinct))):
        raise bad_request("invalid Content-Length header: send the body size in bytes as one decimal number")
    return int(next(iter(distinct)))


class Handler(BaseHTTPRequestHandler):
    server_version = "mlxstack"
    protocol_version = "HTTP/1.1"
    app: Any = None  # set by make_server

    def log_message(self, fmt: str, *args: Any) -> None:  # quieter than stderr spam
        log.debug("%s %s", self.address_string(), fmt % args)

    def setup(self) -> None:
        super().setup()
        # The request line and headers must all arrive within MLX_HEADER_TIMEOUT_SECONDS.
        self._reader = DeadlineReader(self.connection, time.monotonic() + self.app.settings.mlx_header_timeout_seconds)
        self.rfile = io.BufferedReader(self._reader, 65536)

    # ------------------------------------------------------------------ plumbing
    def _send(self, status: int, body: bytes, content_type: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if getattr(self, "command", None) != "HEAD":      # a HEAD answer has the headers only
            self.wfile.write(body)
        self.close_connection = True

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode())

    def _error(self, err: APIError) -> None:
        self.app.count_status(err.status)
        try:
            self._send(err.status, err.encode(), headers=err.headers)
        except OSError:
            pass

    def _dispatch(self) -> None:
        """Route one request (the app's ``route``: the handler for this method and path, and the
        methods the path answers): 404 for an unknown path, 405 with ``Allow`` for a known path
        asked with another method -- JSON either way."""
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        self.connection.settimeout(self.app.settings.mlx_body_timeout_seconds)  # writes to a stalled reader end
        try:
            refusal = self.app.guard.check(self.command, path, {k.lower(): v for k, v in self.headers.items()},
                                           str(self.client_address[0]))
            if refusal is not None:
                self._drain_refused()
                raise refusal
            route, allowed = self.app.route(self, self.command, path)
            if route is None:
                self._drain_refused()
                if allowed:
                    raise APIError(405, f"{self.command} is not allowed on {path}; use {' or '.join(allowed)}",
                                   code="method_not_allowed", headers={"Allow": ", ".join(allowed)})
                raise not_found(f"unknown path {self.command} {path}")
            route()
        except APIError as err:
            self._error(err)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception:  # noqa: BLE001 - last resort: 500 with the request id, server keeps serving
            rid = uuid.uuid4().hex[:12]
            log.exception("internal error (request id %s)", rid)
            self._error(internal(rid))

    # every method a client may send is routed (404 / 405 in JSON); any other is http.server's 501,
    # in JSON too (send_error below)
    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = do_OPTIONS = do_HEAD = _dispatch  # noqa: N815

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a request line or headers it cannot read, a method nothing
        routes) as the same JSON errors as every other answer, never its HTML page."""
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "Error"
        code_name = re.sub(r"[^a-z0-9]+", "_", phrase.lower()).strip("_")
        if getattr(self, "request_version", "") == "HTTP/0.9":
            self.request_version = self.protocol_version   # an unreadable line still gets a status line
        self.close_connection = True
        self._error(APIError(code, message or phrase, type="server_error" if code >= 500 else "invalid_request_error",
                             code=code_name))

    def _start_body_deadline(self) -> None:
        self._reader.deadline = time.monotonic() + self.app.settings.mlx_body_timeout_seconds

    def read_body(self) -> bytes:
        limit = self.app.settings.max_request_bytes
        if self.headers.get("Transfer-Encoding") is not None:
            raise APIError(411, "chunked request bodies are not supported; send Content-Length", code="length_required")
        n = content_length(self.headers.get_all("Content-Length"))
        if n is None:
            raise APIError(411, "Content-Length header is required", code="length_required")
        self._start_body_deadline()
        if n > limit:
            self._drain(n)
            raise APIError(413, f"request body of {n} bytes exceeds MAX_REQUEST_BYTES={limit}",
                           code="request_too_large")
        try:
            raw = self.rfile.read(n)
        except TimeoutError:
            raise APIError(408, f"request body not received within MLX_BODY_TIMEOUT_SECONDS="
                           f"{self.app.settings.mlx_body_timeout_seconds:g}", code="request_timeout") from None
        finally:
            self.connection.settimeout(self.app.settings.mlx_body_timeout_seconds)  # the reader narrowed it
        if len(raw) != n:
            raise bad_request(f"request body ended after {len(raw)} of the {n} bytes announced by Content-Length")
        return raw

    def _drain_refused(self) -> None:
        """A request refused before its body was read: read a small body so the answer arrives."""
        if self.headers.get("Transfer-Encoding") is not None:
            return
        try:
            n = content_length(self.headers.get_all("Content-Length"))
        except APIError:
            return
        if n is not None and n <= GUARD_DRAIN_BYTES:
            self._start_body_deadline()
            self._drain(n)

    def _drain(self, n: int, cap: int = 256 * 1024 * 1024) -> None:
        """Read and discard a refused body so the client sees our 413, not a broken pipe."""
        if n > cap:
            return
        try:
            while n > 0:
                chunk = self.rfile.read(min(n, 1 << 20))
                if not chunk:
                    break
                n -= len(chunk)
        except OSError:
            pass
        finally:
            self.connection.settimeout(self.app.settings.mlx_body_timeout_seconds)

    # ------------------------------------------------------------------ job results
    def _result(self, future: Any) -> Any:
        exc = future.exception()
        if exc is None:
            return future.result()
        if isinstance(exc, APIError):
            raise exc
        if isinstance(exc, ClientGone):
            raise APIError(499, str(exc), code="client_closed")
        if isinstance(exc, ValueError) and exc.__class__.__name__ == "TemplateError":
            raise APIError(400, str(exc), code="template_error")
        if isinstance(exc, ContextLengthExceeded):
            raise APIError(400, str(exc), param="messages", code="context_length_exceeded")
        if isinstance(exc, ImageError):
            raise APIError(400, str(exc), param="messages", code="invalid_image")
        if isinstance(exc, WorkerDied):   # the launcher restarts this server (/health says why)
            raise unavailable(f"{exc}; the server is being restarted", retry_after=5, code="inference_thread_died")
        rid = uuid.uuid4().hex[:12]
        log.error("generation failed (request id %s)", rid, exc_info=exc)
        raise internal(rid)
