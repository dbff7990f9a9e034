"""The one seam between the API fronts (chat completions, Responses, Anthropic Messages) and the engine.

Each front translates its request into a chat-completions body (pure, in its own module; the chat
front's body already is one); this module validates that body with the chat parser, builds the
``ChatJob``, runs it on the inference worker and hands back the engine's outcome -- streamed
through a front-specific frame encoder, or whole:

    req = chat_request(app, chat_body)                     # parse_chat_request + model + images
    run = JobRun.submit(handler, req, "resp_1234", stream=req.stream)
    outcome = run.answer(handler, make_encoder, whole_body)   # streamed or whole; None: client left

Only this file builds a ChatJob, so an engine refactor is adapted here once; what a front reports
from the outcome is read in usage.py (token counts) and finish.py (why it ended).
"""
from __future__ import annotations

import fnmatch

import json
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from ...cache.summary import TENANT_HEADER, scope_of, verify_tenant
from ...engine.chat import ChatJob, PromptReady
from ...engine.worker import QueueFull
from ...prompt.images import ImageError
from ...runner.generate import SamplingParams
from ...prompt import urgency as priority
from .cache_diagnostics import cache_header
from .error_shapes import internal_logged
from ..http.errors import APIError, bad_request, not_found, unavailable
from .structured import CHAT_FIELDS, Fields
from .usage import Usage, outcome_usage  # noqa: F401 - re-exported: every front's usage starts here
from .validation import ChatRequest, model_matches, parse_chat_request, reject_images

_DONE = object()


def require_ready(app: Any) -> None:
    if not app.ready:
        raise unavailable("model is still loading; retry shortly", retry_after=5, code="model_loading")


def chat_request(app: Any, chat_body: dict, fields: Fields | None = CHAT_FIELDS,
                 patterns: tuple[str, ...] = ()) -> ChatRequest:
    """Validate a translated chat body exactly as /v1/chat/completions would, check the model name
    and the images, compile the reply's grammar (``fields`` name the front's schema fields in
    errors; None: no grammar, e.g. for counting tokens); raises APIError (4xx) saying what to fix.
    ``patterns``: more names the model answers to (MODEL_ALIASES, ``*`` any run of characters)."""
    req = parse_chat_request(chat_body, app.settings, vocab_size=getattr(app, "vocab_size", None),
                             defaults=getattr(app, "sampling", None))
    if not model_matches(req.model, app.model_id, app.aliases) \
            and not any(fnmatch.fnmatchcase(req.model or "", p) for p in patterns):
        also = f"; aliases: {', '.join(patterns)}" if patterns else ""
        raise not_found(f"model {req.model!r} is not served here; available: {app.model_id}{also}",
                        code="model_not_found")
    if not getattr(app.loaded, "is_vlm", False):
        reject_images(req.messages, app.model_id)
    else:  # remote fetches and header checks on this handler thread, never on the inference worker
        from .image_fetch import prepare_request_images

        try:
            req.messages = prepare_request_images(req.messages, app.image_limits, app.image_fetcher())
        except ImageError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_image") from None
    if fields is not None:
        attach_grammar(app, req, fields)
    return req


def attach_grammar(app: Any, req: ChatRequest, fields: Fields = CHAT_FIELDS) -> None:
    """``req.grammar`` from its response_format / tools / tool_choice, compiled here on the handler
    thread (server/common/structured.py); APIError(400) for a schema that cannot be enforced."""
    structured = getattr(app, "structured", None)
    if structured is not None:
        req.grammar = structured.grammar_for(req, fields)


def chat_job(req: ChatRequest, request_id: str, headers: dict[str, str], *, emit: Callable[[str], None],
             on_prompt: Callable[[PromptReady], None], is_cancelled: Callable[[], bool],
             diagnosis: "Diagnosis | None" = None, api: str = "", raw_prompt: list | None = None) -> ChatJob:
    """The ChatJob /v1/chat/completions builds for the same validated request (``diagnosis``: the
    reply's id, and the comparison the client asked for; ``api``: the front, for the logs;
    ``raw_prompt``: a text completion's prompt parts, which the model sees instead of the messages)."""
    d = diagnosis or Diagnosis()
    try:
        urgency = priority.resolve(req.body.get("priority"), headers.get(priority.HEADER), req.messages)
    except ValueError as exc:
        raise bad_request(str(exc), param="priority") from None
    return ChatJob(
        request_id=request_id, messages=req.messages, tools=req.tools, enable_thinking=req.enable_thinking,
        params=SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, repetition_context_size=req.repetition_context_size,
            repetition_scope=req.repetition_scope, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logit_bias=req.logit_bias or None, max_tokens=req.max_tokens, seed=req.seed,
            logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0, grammar=req.grammar,
        ),
        stop=req.stop, body=req.body, headers=headers, emit=emit, is_cancelled=is_cancelled, on_prompt=on_prompt,
        tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls, response_format=req.response_format,
        sampling_origin=req.sampling_origin,
        response_id=d.response_id, diagnose=d.wanted, compare_to=d.compare_to, prefill_only=d.prewarm,
        breakpoints=d.breakpoints, cache_ttl=d.cache_ttl, api=api,
        scope=scope_of(headers.get(TENANT_HEADER, ""), req.cache_salt), raw_prompt=raw_prompt,
        priority=urgency.value, priority_source=urgency.source,
    )


@dataclass(frozen=True)
class Diagnosis:
    """What a front asks of the cache beside the reply: the id the reply is known by (its
    fingerprint is kept under it), whether the client wants a diagnosis and against which reply,
    a prewarm (prefill and store, no output), the client's cache breakpoints (engine/request.py
    CacheBreakpoint) and the lifetime it asked for the rest (seconds; None: the server's)."""
    response_id: str = ""
    wanted: bool = False
    compare_to: str | None = None
    prewarm: bool = False
    breakpoints: tuple = ()
    cache_ttl: float | None = None


def cache_headers(report: Any) -> dict[str, str]:
    """The response headers every front sends about the cache (``x-mlxstack-cache``)."""
    return {"x-mlxstack-cache": cache_header(report)}


def submit_on_worker(app: Any, fn: Callable[[], Any]) -> Any:
    """A future for ``fn`` on the inference worker; 503 + Retry-After when its queue is full."""
    try:
        return app.worker.submit(fn)
    except QueueFull:
        raise unavailable(f"server busy: {app.settings.max_queued_requests} requests queued", retry_after=2,
                          code="queue_full") from None


def submit_chat(app: Any, job: ChatJob) -> Any:
    """A future for a chat job: run alone, or by the continuous-batching scheduler; 503 when full."""
    try:
        return app.worker.submit_chat(job)
    except QueueFull:
        raise unavailable(f"server busy: {app.settings.max_queued_requests} requests queued", retry_after=2,
                          code="queue_full") from None


def request_headers(handler: Any) -> dict[str, str]:
    """The request's headers, lower-case, the tenant header as the tenant's name. That header is
    the front door's word, signed with the backend key (cache/summary.py ``sign_tenant``): one
    this server's MLX_API_KEY did not sign is refused (403), and on a server without a key it is
    dropped (every request is then the default tenant's)."""
    headers = {k.lower(): v for k, v in handler.headers.items()}
    app = getattr(handler, "app", None)
    key = getattr(getattr(app, "settings", None), "mlx_api_key", "")
    claimed = headers.pop(TENANT_HEADER, None)
    name = verify_tenant(claimed, key) if claimed is not None and key else None
    if name is not None:       # the guard refused an unsigned one before the body was read
        headers[TENANT_HEADER] = name
    return headers


API_ROUTES = (("/chat/completions", "chat"), ("/completions", "completions"), ("/responses", "responses"),
              ("/messages", "messages"))


def api_name(path: str) -> str:
    """The front a request path belongs to (request logs, /v1/cache/stats): chat, completions,
    responses, messages; the path itself for any other."""
    route = (path or "").split("?", 1)[0].rstrip("/")
    for suffix, name in API_ROUTES:
        if route.endswith(suffix):
            return name
    return route


class FrameEncoder(Protocol):
    """A front's streaming encoder: bytes to write for each stage of one generation."""

    def start(self, ready: PromptReady | None) -> list[bytes]: ...
    def feed(self, text: str) -> list[bytes]: ...
    def finish(self, outcome: Any) -> list[bytes]: ...
    def error(self, err: APIError) -> list[bytes]: ...


class JobRun:
    """One ChatJob on the inference worker, seen from its HTTP handler thread."""

    def __init__(self, handler: Any, job_factory: Callable[["JobRun"], ChatJob], stream: bool) -> None:
        from ..http.pooled_server import peer_closed

        self.app = handler.app
        self.cancelled = threading.Event()
        self.deltas: "queue.Queue[Any]" = queue.Queue()
        self.stream_mode = stream
        sock = handler.connection

        def is_cancelled() -> bool:
            if not self.cancelled.is_set() and peer_closed(sock):
                self.cancelled.set()
            return self.cancelled.is_set()

        self.is_cancelled = is_cancelled
        self.job = job_factory(self)
        self.future = submit_chat(self.app, self.job)
        self.future.add_done_callback(lambda _f: self.deltas.put(_DONE))

    @classmethod
    def submit(cls, handler: Any, req: ChatRequest, request_id: str, stream: bool,
               diagnosis: Diagnosis | None = None, raw_prompt: list | None = None) -> "JobRun":
        def factory(run: "JobRun") -> ChatJob:
            sink = run.deltas.put if stream else (lambda _x: None)
            return chat_job(req, request_id, request_headers(handler), emit=sink, on_prompt=sink,
                            is_cancelled=run.is_cancelled, diagnosis=diagnosis,
                            api=api_name(getattr(handler, "path", "")), raw_prompt=raw_prompt)
        return cls(handler, factory, stream)

    def _events(self) -> Iterator[Any]:
        while True:
            item = self.deltas.get()
            if item is _DONE:
                return
            yield item

    def wait(self, handler: Any) -> Any | None:
        """The outcome (APIError raised for a failed job), or None when the client left first."""
        while not self.future.done():
            try:
                self.future.result(timeout=0.25)
            except Exception:  # noqa: BLE001 - inspected by handler._result below
                pass
            if not self.future.done() and self.is_cancelled():
                return None  # the worker sees the flag between tokens; nobody to answer
        return handler._result(self.future)

    def answer(self, handler: Any, encoder: Callable[[], FrameEncoder], whole: Callable[[Any], dict]) -> Any | None:
        """Answer the request: stream ``encoder()``'s frames, or 200 with ``whole(outcome)``; then the
        app's after-response hooks. Returns the outcome, or None when nobody was answered."""
        if self.stream_mode:
            outcome = self.stream(handler, encoder())
        else:
            outcome = self.wait(handler)
            if outcome is None:
                return None
            body = whole(outcome)
            self.app.count_status(200)
            handler._send(200, json.dumps(body).encode(), headers=cache_headers(outcome.cache))
        if outcome is not None:
            self.app.after_response(self.job, outcome)
        return outcome

    def stream(self, handler: Any, encoder: FrameEncoder, content_type: str = "text/event-stream") -> Any | None:
        """Write ``encoder``'s frames as generation proceeds; returns the outcome, or None when the
        client left or the stream ended with an error event (headers already sent)."""
        app = self.app
        started = False

        def write(frames: list[bytes], ready: PromptReady | None = None) -> None:
            nonlocal started
            if not started:
                handler.send_response(200)
                handler.send_header("Content-Type", content_type)
                handler.send_header("Cache-Control", "no-cache")
                handler.send_header("Connection", "close")
                if ready is not None and ready.cache is not None:
                    for k, v in cache_headers(ready.cache).items():
                        handler.send_header(k, v)
                handler.end_headers()
                handler.close_connection = True
                frames = [*encoder.start(ready), *frames]
                started = True
            if frames:
                handler.wfile.write(b"".join(frames))
                handler.wfile.flush()

        try:
            for item in self._events():
                if isinstance(item, PromptReady):
                    write([], item)  # headers and the opening events as soon as the prompt is ready
                else:
                    write(encoder.feed(item))
            outcome = handler._result(self.future)  # raises APIError before any byte if it failed early
            write(encoder.finish(outcome))
            app.count_status(200)
            return outcome
        except OSError:  # client gone, or it stopped reading
            self.cancelled.set()
            return None
        except Exception as exc:  # noqa: BLE001 - APIError from the job, or a bug while encoding frames
            client_gone = self.cancelled.is_set()
            self.cancelled.set()  # the worker stops at its next token
            if not started:
                raise
            if client_gone:
                return None
            err = exc if isinstance(exc, APIError) else internal_logged(exc, "stream failed after it started "
                                                                               "(request id %s)")
            app.count_status(err.status)
            try:
                handler.wfile.write(b"".join(encoder.error(err)))
                handler.wfile.flush()
            except OSError:
                pass
            return None


__all__ = ["Diagnosis", "FrameEncoder", "JobRun", "Usage", "attach_grammar", "cache_headers", "chat_job", "chat_request", "outcome_usage",
           "request_headers", "require_ready", "submit_on_worker"]
