"""The front door of port 4000: SDK-exact 401 and 400 answers before LiteLLM sees a bad request.

Measured on LiteLLM 1.106.2 without a database:

| request | LiteLLM alone | here |
|---|---|---|
| a key that is not the master key | 400 "No connected db." (virtual-key lookup) | 401 ``authentication_error`` |
| a JSON list body (chat, /v1/messages, /v1/responses) | 500: the auth dependency calls ``.get`` on it, then so does its error handler | 400 |
| ``messages[i].content: 7`` | 500 from the hosted_vllm transform | 400 naming ``messages[0].content`` |
| ``messages: "hello"`` | 400 "Invalid request format: ... 'str' object has no attribute 'get'" | 400 naming ``messages`` |

The list body fails inside LiteLLM's auth dependency, before ``custom_auth`` and every hook, so
the checks run as an ASGI layer around LiteLLM's app. LiteLLM installs it by importing this module
as a callback (``litellm_settings.callbacks``, see launcher/litellm_config.py): on import the
layer wraps ``litellm.proxy.proxy_server.app`` (its built middleware stack, or the build itself
when not built yet). Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``)
and Anthropic-shaped on ``/v1/messages`` (``{"type": "error", "error": {"type", "message"}}``), so
the SDKs raise AuthenticationError / BadRequestError.

Structured output (JSON schemas, strict tools) needs two more repairs, both measured on 1.106.2: LiteLLM's hosted_vllm
transform deletes ``strict`` and ``additionalProperties: false`` from chat tool schemas (a property
named "strict" too), so the pre-call hook copies the client's tools to ``mlxstack_tools``, which
LiteLLM forwards untouched and the MLX server prefers (server/common/validation.py); and LiteLLM wraps the
MLX server's 400s (a schema that cannot be enforced, naming its JSON pointer in ``param``) in its own
message with ``param: null``, so a wrapped 400 on the chat and Responses paths is answered with the
MLX server's own body.

The key check only refuses what LiteLLM refuses anyway: with a master key and no database
(``DATABASE_URL`` unset) no other key can pass. The body checks cover the shapes that break
LiteLLM's transforms (types of ``messages`` / ``input`` and their parts); the MLX server validates
everything else itself.
"""
from __future__ import annotations

import ast
import copy
import hmac
import json
import logging
import os
import re
import sys
from typing import Any, Awaitable, Callable, NamedTuple
from urllib.parse import parse_qs, unquote

from litellm.integrations.custom_logger import CustomLogger

from ..cache.summary import TENANT_HEADER, sign_tenant
from ..prompt.content_parts import IMAGE_PART_TYPES, TEXT_PART_TYPES, unsupported_part
from ..prompt.tool_results import orphan_tool_result
from ..config.tenants import TenantKeys, TenantsError

log = logging.getLogger("mlxstack.front_door")
TENANT_HEADER_BYTES = TENANT_HEADER.encode()

MAX_BODY = 256 * 1024 * 1024       # bytes buffered for a check; larger bodies go to LiteLLM unchecked
# LiteLLM serves each route under aliases (1.106.2): with and without /v1, under /openai, as Azure's
# /openai/deployments/{model}/... and as /engines/{model}/...: every alias gets the same checks. The
# model is a path parameter there ({model:path}): a model id with a "/" (openai/<name>, as /v1/models
# lists first) is still that alias
_PREFIX = r"(?:/openai)?(?:/v1)?"
_MODEL_SCOPED = r"(?:/openai/deployments|/engines)/.*"     # Starlette's path convertor: .*
ROUTES: tuple[tuple[str, re.Pattern], ...] = (
    ("chat", re.compile(rf"^(?:{_PREFIX}|{_MODEL_SCOPED})/chat/completions/?$")),
    ("responses", re.compile(rf"^{_PREFIX}/responses/?$")),
    ("messages", re.compile(r"^(?:/anthropic)?/v1/messages(?:/count_tokens)?/?$")),
    ("completions", re.compile(rf"^(?:{_PREFIX}|{_MODEL_SCOPED})/completions/?$")),
    ("keyed", re.compile(rf"^(?:{_PREFIX}|{_MODEL_SCOPED})/embeddings/?$")),
    ("keyed", re.compile(rf"^{_PREFIX}/responses/.+$")),
    ("keyed", re.compile(rf"^{_PREFIX}/models(?:/.*)?$")),
    ("keyed", re.compile(r"^(?:/v1)?/model/info/?$")),
)
# a stored response and its input items (GET / DELETE; POST .../cancel and /compact are LiteLLM's own)
STORED_RESPONSE = re.compile(rf"^{_PREFIX}/responses/(?P<id>[^/]+)(?P<items>/input_items)?/?$")
INPUT_ITEMS_QUERY = ("after", "limit", "order")     # OpenAI's input_items parameters LiteLLM passes on
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions", "/openai/v1/chat/completions")     # examples
RESPONSES_PATHS = ("/v1/responses", "/responses")
MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
KEY_HEADERS = (b"authorization", b"x-api-key", b"api-key", b"x-goog-api-key", b"x-litellm-api-key",
               b"ocp-apim-subscription-key")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class Rejection(NamedTuple):
    status: int
    body: dict


# ------------------------------------------------------------------ error shapes
def openai_error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> Rejection:
    return Rejection(status, {"error": {"message": message, "type": kind, "param": param, "code": code}})


def anthropic_error(status: int, message: str, kind: str = "invalid_request_error") -> Rejection:
    return Rejection(status, {"type": "error", "error": {"type": kind, "message": message}})


def _error(path: str, status: int, message: str, param: str | None = None, auth: bool = False) -> Rejection:
    if route_kind(path) == "messages":
        return anthropic_error(status, message, "authentication_error" if auth else "invalid_request_error")
    if auth:
        return openai_error(status, message, None, "authentication_error", "invalid_api_key")
    return openai_error(status, message, param)


# ------------------------------------------------------------------ checks (pure)
def presented_keys(headers: list[tuple[bytes, bytes]]) -> list[str]:
    """Every key the request carries, where LiteLLM looks for one."""
    out = []
    for name, value in headers:
        if name.lower() in KEY_HEADERS:
            text = value.decode("latin-1").strip()
            if name.lower() == b"authorization" and text.lower().startswith("bearer "):
                text = text[7:].strip()
            if text:
                out.append(text)
    return out


def check_key(path: str, headers: list[tuple[bytes, bytes]], master_key: str,
              tenants: TenantKeys | None = None) -> Rejection | None:
    return authenticate(path, headers, master_key, tenants)[0]


def authenticate(path: str, headers: list[tuple[bytes, bytes]], master_key: str,
                 tenants: TenantKeys | None = None) -> tuple[Rejection | None, str | None]:
    """(a refusal, the tenant): the master key is the default tenant "", a key of TENANT_KEYS_FILE
    its tenant's name (routing/tenants.py); anything else is 401."""
    keys = presented_keys(headers)
    if not keys:
        return _error(path, 401, "No API key provided. Send 'Authorization: Bearer <LITELLM_MASTER_KEY>' "
                                 "(or 'x-api-key' for /v1/messages).", auth=True), None
    if any(hmac.compare_digest(k.encode(), master_key.encode()) for k in keys):
        return None, ""
    for k in keys:
        name = tenants.tenant_of(k) if tenants is not None else None
        if name is not None:
            return None, name
    return _error(path, 401, "Incorrect API key provided. Use the LITELLM_MASTER_KEY from the server's .env "
                             "(or your tenant's key).", auth=True), None


def as_tenant(headers: list[tuple[bytes, bytes]], master_key: str, tenant: str,
              backend_key: str | None = None) -> list[tuple[bytes, bytes]]:
    """A tenant's request as LiteLLM takes it: every key header carries the master key (LiteLLM
    knows no other without a database) and ``x-mlxstack-tenant`` names the tenant, signed with the
    backend key (cache/summary.py ``sign_tenant``), which LiteLLM forwards to the MLX server."""
    key = os.environ.get("MLX_API_KEY", "") if backend_key is None else backend_key
    out = []
    for name, value in headers:
        low = name.lower()
        if low in KEY_HEADERS:
            value = (b"Bearer " + master_key.encode()) if low == b"authorization" else master_key.encode()
        out.append((name, value))
    return out + [(TENANT_HEADER_BYTES, sign_tenant(tenant, key).encode())]


def _content_problem(content: Any, where: str, allow_none: bool = True) -> tuple[str, str] | None:
    if content is None and allow_none or isinstance(content, str):
        return None
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                return f"{where}[{j}]", f"'{where}[{j}]' must be an object with a 'type', got {type(part).__name__}"
            if not isinstance(part.get("type"), str):
                return f"{where}[{j}].type", f"'{where}[{j}].type' must be a string"
        return None
    return where, f"'{where}' must be a string or a list of content parts, got {type(content).__name__}"


def _part_kinds(content: Any, where: str) -> tuple[str, str] | None:
    """A chat content part of a type the MLX server does not take (LiteLLM's transforms 500 on
    some): the server's own 400, here."""
    for j, part in enumerate(content if isinstance(content, list) else ()):
        kind = part.get("type")
        if kind not in TEXT_PART_TYPES and kind not in IMAGE_PART_TYPES:
            at = f"{where}.content[{j}]"
            return f"{at}.type", unsupported_part(at, repr(kind))
    return None


def check_chat(body: dict) -> tuple[str, str] | None:
    """(param, message) for a chat-completions body LiteLLM cannot take, else None."""
    if "model" in body and not isinstance(body["model"], str):
        return "model", "'model' must be a string"
    messages = body.get("messages")
    if messages is None:
        return "messages", "'messages' is required"
    if not isinstance(messages, list):
        return "messages", f"'messages' must be a list of message objects, got {type(messages).__name__}"
    if not messages:
        return "messages", "'messages' must contain at least one message"
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            return where, f"'{where}' must be an object, got {type(msg).__name__}"
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            return f"{where}.role", f"'{where}.role' must be one of {', '.join(ROLES)}"
        if role in ("system", "developer", "user", "tool") and msg.get("content") is None:
            return f"{where}.content", f"'{where}.content' is required for a {role} message"
        problem = _content_problem(msg.get("content"), f"{where}.content") or _part_kinds(msg.get("content"), where)
        if problem:
            return problem
        calls = msg.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            return f"{where}.tool_calls", f"'{where}.tool_calls' must be a list of objects"
        orphan = orphan_tool_result(messages, i)
        if orphan:
            return orphan
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        return "tools", "'tools' must be a list of objects"
    return None


def check_responses(body: dict) -> tuple[str, str] | None:
    if "model" in body and not isinstance(body["model"], str):
        return "model", "'model' must be a string"
    items = body.get("input")
    if items is None and not body.get("previous_response_id"):
        return "input", "'input' is required"
    if items is not None and not isinstance(items, (str, list)):
        return "input", f"'input' must be a string or a list of items, got {type(items).__name__}"
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if not isinstance(item, dict):
            return f"input[{i}]", f"'input[{i}]' must be an object, got {type(item).__name__}"
        problem = _content_problem(item.get("content"), f"input[{i}].content")
        if problem:
            return problem
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        return "instructions", "'instructions' must be a string"
    return None


def check_messages(body: dict) -> tuple[str, str] | None:
    if "model" in body and not isinstance(body["model"], str):
        return "model", "model: must be a string"
    messages = body.get("messages")
    if not isinstance(messages, list):
        return "messages", "messages: Field required" if messages is None else "messages: Input should be a valid list"
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            return f"messages.{i}", f"messages.{i}: Input should be a valid dictionary"
        if not isinstance(msg.get("role"), str):
            return f"messages.{i}.role", f"messages.{i}.role: Input should be 'user' or 'assistant'"
        problem = _content_problem(msg.get("content"), f"messages.{i}.content", allow_none=False)
        if problem:
            return problem[0], f"{problem[0]}: Input should be a valid string or a list of content blocks"
    system = body.get("system")
    if system is not None and _content_problem(system, "system"):
        return "system", "system: Input should be a valid string or a list of text blocks"
    return None


def route_kind(path: str) -> str | None:
    """"chat" / "responses" / "messages" (key and body checked), "completions" (key checked, a
    token-id prompt carried past LiteLLM), "keyed" (key only) or None (not ours to check) for any
    alias LiteLLM serves the route under."""
    for kind, pattern in ROUTES:
        if pattern.match(path):
            return kind
    return None


def check_headers(method: str, path: str, headers: list[tuple[bytes, bytes]], master_key: str,
                  tenants: TenantKeys | None = None) -> Rejection | None:
    """The key, from the headers alone: answered before a byte of the body is read."""
    return check_tenant(method, path, headers, master_key, tenants)[0]


def check_tenant(method: str, path: str, headers: list[tuple[bytes, bytes]], master_key: str,
                 tenants: TenantKeys | None = None) -> tuple[Rejection | None, str | None]:
    if method == "OPTIONS" or route_kind(path) is None or not master_key:
        return None, None
    return authenticate(path, headers, master_key, tenants)


def check_request(method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes | None,
                  master_key: str) -> Rejection | None:
    """The answer for a request the front door refuses, else None (LiteLLM takes it)."""
    return check_headers(method, path, headers, master_key) or check_body(method, path, body)


TOKEN_PROMPT = "mlxstack_prompt"    # a completion's token-id prompt, past LiteLLM (server/openai/completions.py)


def carry_token_prompt(body: bytes) -> bytes | None:
    """A text completion whose ``prompt`` is token ids (a list of ints, or a list holding one),
    rewritten so LiteLLM forwards it: LiteLLM 1.106.2 takes only a string or a list of strings
    (anything else is its 500 "Unmapped prompt format"), so the ids go in ``mlxstack_prompt``,
    which it forwards untouched and the MLX server prefers, and ``prompt`` becomes a placeholder
    string. None: nothing to rewrite (a string prompt, a body that is not JSON)."""
    return carried_prompt(decode_body(body)[0])


def carried_prompt(data: Any) -> bytes | None:
    """``carry_token_prompt`` over a body already decoded."""
    if not isinstance(data, dict):
        return None
    prompt = data.get("prompt")
    one = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list) else prompt
    if not (isinstance(one, list) and one and all(isinstance(t, int) and not isinstance(t, bool) for t in one)):
        return None
    return json.dumps({**data, "prompt": "(token ids in mlxstack_prompt)", TOKEN_PROMPT: one}).encode()


def decode_body(body: bytes | None) -> tuple[Any, str | None]:
    """(the body's JSON value, or None; why it is not JSON, or None) -- decoded once per request
    for every check below."""
    if body is None or not body.strip():
        return None, None
    try:
        return json.loads(body), None
    except ValueError as exc:
        return None, f"The request body is not valid JSON: {exc}"
    except RecursionError:
        return None, "The request body is nested too deeply"


def check_body(method: str, path: str, body: bytes | None) -> Rejection | None:
    """The body of a request whose key passed: 400 for a shape LiteLLM cannot take, else None."""
    return check_decoded(method, path, body, *decode_body(body))


def check_decoded(method: str, path: str, body: bytes | None, data: Any, invalid: str | None) -> Rejection | None:
    """``check_body`` over the body ``decode_body`` gave."""
    if method != "POST" or body is None or path.rstrip("/").endswith("/count_tokens") and not body:
        return None
    checker = {"chat": check_chat, "responses": check_responses, "messages": check_messages}.get(route_kind(path))
    if checker is None:
        return None
    if invalid is not None:
        return _error(path, 400, invalid, "body")
    if not isinstance(data, dict):
        return _error(path, 400, f"The request body must be a JSON object, got {type(data).__name__ if data is not None else 'nothing'}",
                      "body")
    problem = checker(data)
    if problem is not None:
        return _error(path, 400, problem[1], problem[0])
    return None


def unknown_model(path: str, data: Any, known: Callable[[str], bool],
                  available: Callable[[], list[str]]) -> Rejection | None:
    """404 ``model_not_found`` listing what is served, for a decoded body naming a model no
    deployment or wildcard of LiteLLM's router takes (LiteLLM 1.106.2 answers those 400 "no healthy
    deployments", which the SDKs raise as BadRequestError); None for every other request."""
    if route_kind(path) not in ("chat", "responses", "completions", "messages"):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, str) or not model or known(model):
        return None
    names = available()
    aliases = [n for n in names if "*" in n]
    message = (f"The model `{model}` does not exist. Available models: {', '.join(n for n in names if '*' not in n)}"
               + (f"; aliases: {', '.join(aliases)}." if aliases else "."))
    if route_kind(path) == "messages":
        return anthropic_error(404, message, "not_found_error")
    return openai_error(404, message, "model", code="model_not_found")


def _litellm_router_names() -> tuple[Callable[[str], bool], Callable[[], list[str]]] | None:
    """(does LiteLLM's router take this model name, the names it lists), or None before it has one."""
    proxy_server = sys.modules.get("litellm.proxy.proxy_server")     # the running proxy's, never imported here
    router = getattr(proxy_server, "llm_router", None)
    if router is None:
        return None

    def known(model: str) -> bool:
        return model in router.get_model_names() or bool(router.pattern_router.route(model))

    def available() -> list[str]:
        return list(dict.fromkeys(router.get_model_names()))

    return known, available


# ------------------------------------------------------------------ ASGI layer
Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class FrontDoor:
    """ASGI middleware: buffer a watched request's body, check it, answer or replay it downstream."""

    def __init__(self, app: Callable, master_key: str | None = None, tenants: TenantKeys | None = None) -> None:
        self.app = app
        self.master_key = master_key
        self._tenants = tenants

    @property
    def tenants(self) -> TenantKeys | None:
        """TENANT_KEYS_FILE's tenants (read once, then again whenever the file changes); an unusable
        file at start means no tenant key passes (logged once; the launcher refuses it first)."""
        if self._tenants is None:
            try:
                self._tenants = TenantKeys(os.environ.get("TENANT_KEYS_FILE") or None)
            except (TenantsError, OSError) as exc:
                log.error("tenant keys not loaded: %s", exc)
                self._tenants = TenantKeys(None)
        return self._tenants

    def key(self) -> str:
        if self.master_key is not None:
            return self.master_key
        if os.environ.get("DATABASE_URL"):       # virtual keys exist: LiteLLM decides
            return ""
        return os.environ.get("LITELLM_MASTER_KEY", "")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "http":   # only the front door names a tenant: a client's header goes
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers") or []
                                          if k.lower() != TENANT_HEADER_BYTES]}
        if scope.get("type") != "http" or route_kind(scope.get("path") or "") is None:
            await self.app(scope, receive, send)
            return
        method, path = scope.get("method", "GET"), scope["path"]
        try:
            refused, tenant = check_tenant(method, path, list(scope.get("headers") or []), self.key(), self.tenants)
        except Exception:  # noqa: BLE001 - a bug here must never cost a request: LiteLLM decides
            log.exception("front door key check failed; passing the request on")
            refused, tenant = None, None
        if refused is not None:        # before any body byte: a stranger's 200 MB costs nothing
            await _respond(send, refused)
            return
        if tenant:
            scope = {**scope, "headers": as_tenant(list(scope.get("headers") or []), self.key(), tenant)}
        stored = STORED_RESPONSE.match(path) if method in ("GET", "DELETE") else None
        if stored is not None:
            await self._stored_response(scope, receive, send, stored)
            return
        body: bytes | None = None
        replay: list[dict] = []
        if method == "POST":
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                replay.append(message)
                if message["type"] != "http.request":
                    break
                chunk = message.get("body", b"")
                size += len(chunk)
                chunks.append(chunk)
                more = message.get("more_body", False)
                if size > MAX_BODY:
                    break
            body = b"".join(chunks) if not more and size <= MAX_BODY else None
        data, invalid = decode_body(body) if method == "POST" else (None, None)
        try:
            refused = check_decoded(method, path, body, data, invalid)      # the key passed above
        except Exception:  # noqa: BLE001 - a bug here must never cost a request: LiteLLM decides
            log.exception("front door check failed; passing the request on")
            refused = None
        if refused is None and method == "POST":
            try:
                names = _litellm_router_names()
                refused = unknown_model(path, data, *names) if names is not None else None
            except Exception:  # noqa: BLE001 - a bug here must never cost a request: LiteLLM decides
                log.exception("front door model check failed; passing the request on")
                refused = None
        if refused is not None:
            await _respond(send, refused)
            return
        kind = route_kind(path)
        carried = carried_prompt(data) if kind == "completions" and method == "POST" else None
        if carried is not None:
            headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(carried)).encode())]}
            replay = [{"type": "http.request", "body": carried, "more_body": False}]
        downstream = _unwrapping(send) if kind in ("chat", "responses", "completions") else send
        await self.app(scope, _replaying(replay, receive), downstream)


    async def _stored_response(self, scope: Scope, receive: Receive, send: Send, stored: re.Match) -> None:
        """GET / DELETE /v1/responses/{id}[/input_items], which LiteLLM forwards to the backend
        that made the response (measured on 1.106.2), with three repairs: an id LiteLLM never
        issued is OpenAI's 404 here (LiteLLM: 400 "You passed in model=None"); input_items' query
        (limit, order, after) goes to LiteLLM as the JSON body it reads them from (it ignores the
        query string); the backend's own error body (its 404, its 400 naming ``limit``) is
        answered instead of LiteLLM's wrapper."""
        rid = unquote(stored["id"])
        if not litellm_issued(rid):
            await _respond(send, openai_error(404, f"Response with id '{rid}' not found.", code="response_not_found"))
            return
        query = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
        carried: dict[str, Any] = {k: v[-1] for k, v in query.items() if k in INPUT_ITEMS_QUERY} if stored["items"] else {}
        tenant = [v for k, v in scope.get("headers") or [] if k.lower() == TENANT_HEADER_BYTES]
        if tenant:   # LiteLLM forwards no client header on these routes, only the call's extra_headers
            carried["extra_headers"] = {TENANT_HEADER: tenant[-1].decode("latin-1")}
        if carried:
            if str(carried.get("limit", "")).isdigit():
                carried["limit"] = int(carried["limit"])
            body = json.dumps(carried).encode()
            while (await receive()).get("more_body"):     # a GET's (empty) body, replaced
                pass
            headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() not in (b"content-length",
                                                                                          b"content-type")]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())]}
            receive = _replaying([{"type": "http.request", "body": body, "more_body": False}], receive)
        await self.app(scope, receive, _unwrapping(send))


def _replaying(messages: list[dict], receive: Receive) -> Receive:
    pending = list(messages)

    async def again() -> dict:
        return pending.pop(0) if pending else await receive()
    return again


def backend_error(body: bytes) -> bytes | None:
    """The MLX server's own error inside LiteLLM's wrapper, or None. LiteLLM 1.106.2 answers a
    backend's 400 as ``{"error": {"message": "litellm.BadRequestError: Hosted_vllmException -
    {<the backend's error JSON>}\n\nLiteLLM: ...", "param": null, "code": "400"}}``: the field the
    error names (``param``, e.g. the JSON pointer of a schema that cannot be enforced) and its
    ``code`` are lost to the SDKs. This is the backend's body, as it sent it."""
    try:
        outer = json.loads(body)
    except ValueError:
        return None
    message = outer.get("error", {}).get("message") if isinstance(outer, dict) and isinstance(outer.get("error"), dict) \
        else None
    if not isinstance(message, str):
        return None
    at = message.find("Exception - ")
    brace = message.find("{", at) if at >= 0 else -1
    if brace < 0 or message[at + len("Exception - "):brace].strip() not in ("", "Error code: 400 -"):
        return None
    try:
        inner, _ = json.JSONDecoder().raw_decode(message[brace:])
    except ValueError:
        # the openai provider (text completions) words it as the openai SDK's error: "Error code:
        # 400 - {<the backend's error as a Python dict>}" -- a literal, read as one, never run
        end = message.find("\n\nLiteLLM", brace)
        try:
            inner = ast.literal_eval(message[brace:end if end >= 0 else len(message)].strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None
    if not (isinstance(inner, dict) and isinstance(inner.get("error"), dict)
            and isinstance(inner["error"].get("message"), str)):
        return None
    return json.dumps(inner).encode()


def _unwrapping(send: Send) -> Send:
    """``send`` for LiteLLM's answers: an error response (4xx) carrying the backend's own error
    (``backend_error``) goes out as that error; everything else passes unchanged."""
    held: list[dict] = []

    async def out(message: dict) -> None:
        if message["type"] == "http.response.start" and 400 <= int(message.get("status", 200)) < 500:
            held.append(message)
            return
        if not held:
            await send(message)
            return
        held.append(message)
        if message["type"] == "http.response.body" and message.get("more_body"):
            return
        start, parts = held[0], held[1:]
        held.clear()
        body = b"".join(m.get("body", b"") for m in parts)
        inner = backend_error(body)
        if inner is None:
            for m in (start, *parts):
                await send(m)
            return
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(inner)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": inner})
    return out


async def _respond(send: Send, refused: Rejection) -> None:
    payload = json.dumps(refused.body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if refused.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def install(app: Any) -> bool:
    """Wrap a Starlette/FastAPI ``app`` (once): its built middleware stack, or its build."""
    if getattr(app, "_mlxstack_front_door", False):
        return False
    if getattr(app, "middleware_stack", None) is not None:
        app.middleware_stack = FrontDoor(app.middleware_stack)
    else:
        build = app.build_middleware_stack
        app.build_middleware_stack = lambda: FrontDoor(build())
    app._mlxstack_front_door = True
    return True


# ------------------------------------------------------------------ structured output through LiteLLM
ORIGINAL_TOOLS_FIELD = "mlxstack_tools"   # = server/common/validation.py ORIGINAL_TOOLS_FIELD (tests keep them equal)


def keep_original_tools(data: Any) -> Any:
    """A chat request's ``tools`` as the client sent them, copied to ``mlxstack_tools`` (LiteLLM
    forwards unknown fields untouched): LiteLLM 1.106.2's hosted_vllm transform deletes every
    ``strict`` key and every ``additionalProperties: false`` from tool schemas -- a property named
    "strict" included -- so the MLX server could no longer enforce strict tools exactly."""
    if isinstance(data, dict) and isinstance(data.get("tools"), list) and ORIGINAL_TOOLS_FIELD not in data \
            and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in data["tools"]):
        data[ORIGINAL_TOOLS_FIELD] = copy.deepcopy(data["tools"])
    return data


LITELLM_DEFAULT_PORT = 4000


def proxy_port(argv: list[str] | None = None, environ: dict | None = None) -> str:
    """The port the LiteLLM proxy this runs in was told to bind, as its command line resolves it:
    ``--port N`` / ``--port=N``, else ``PORT`` from the environment, else LiteLLM's default 4000 (the
    launcher passes ``--port PROXY_PORT``)."""
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--port="):
            return arg.split("=", 1)[1]
    return environ.get("PORT") or str(LITELLM_DEFAULT_PORT)


class FrontDoorHook(CustomLogger):
    """What LiteLLM's config names; constructing it installs the ASGI layer in the running proxy."""

    def __init__(self) -> None:
        super().__init__()
        self.installed = False
        proxy = sys.modules.get("litellm.proxy.proxy_server")
        if proxy is not None and getattr(proxy, "app", None) is not None:
            self.installed = install(proxy.app) or getattr(proxy.app, "_mlxstack_front_door", False)
            print(f"mlxstack front door: checking keys and request shapes on port {proxy_port()}", file=sys.stderr)

    async def async_pre_call_hook(self, user_api_key_dict, cache, data, call_type):  # noqa: ANN001
        if call_type in ("completion", "acompletion"):
            try:
                keep_original_tools(data)
            except Exception:  # noqa: BLE001 - never cost a request: the tools go on as LiteLLM has them
                log.exception("front door: copying the request's tools failed")
        if call_type in ("responses", "aresponses"):
            comparison_to_backend_id(data, lambda rid: litellm_backend_response_id(rid, user_api_key_dict))
        if call_type == "pass_through_endpoint":
            try:
                name_pass_through_provider(data)
            except Exception:  # noqa: BLE001 - never cost a request: LiteLLM logs it as it would have
                log.exception("front door: naming the pass-through's provider failed")
        return data


# ------------------------------------------------------------------ pass-through logging
PASS_THROUGH_PROVIDER = "hosted_vllm"   # = the provider of every deployment in launcher/litellm_config.py


def name_pass_through_provider(data: Any) -> Any:
    """Name the provider on a pass-through request's LiteLLM logging object. LiteLLM 1.106.2 logs a
    ``/messages`` pass-through with its Anthropic handler, which prices the reply's ``model`` (the
    MLX server's id, no provider prefix) through the provider on that object: a config
    pass-through cannot name one (only LiteLLM's own provider routes do), so every non-streamed
    ``/v1/messages`` logged "LLM Provider NOT provided" with a traceback and reached the callbacks
    without its cost. Every pass-through in the generated config targets an MLX server, which LiteLLM
    knows as ``hosted_vllm`` (self-hosted: priced 0); a provider already named is left alone."""
    logging_obj = data.get("litellm_logging_obj") if isinstance(data, dict) else None
    details = getattr(logging_obj, "model_call_details", None)
    if isinstance(details, dict) and not details.get("custom_llm_provider"):
        details["custom_llm_provider"] = PASS_THROUGH_PROVIDER
    return data


# ------------------------------------------------------------------ Responses ids inside other fields
def comparison_to_backend_id(data: Any, backend_id: Callable[[str], str]) -> Any:
    """``prompt_cache_options.comparison_response_id`` as the MLX server knows it. LiteLLM hands
    clients its own response ids -- encrypted with the proxy's key (its response-id security) around
    a managed id that names the provider, the deployment and ours -- and turns them back into ours
    only in ``previous_response_id`` (and the retrieve / delete routes); an id inside any other
    field reaches the backend as LiteLLM wrote it, which no backend can read."""
    opts = data.get("prompt_cache_options") if isinstance(data, dict) else None
    rid = opts.get("comparison_response_id") if isinstance(opts, dict) else None
    if isinstance(rid, str) and rid:
        opts["comparison_response_id"] = backend_id(rid)
    return data


def litellm_backend_response_id(response_id: str, user_api_key_dict: Any) -> str:
    """The backend's id inside a LiteLLM response id: decrypted and access-checked as LiteLLM does for
    ``previous_response_id`` (another key's id answers 403, LiteLLM's own refusal), then the managed
    id decoded. An id LiteLLM did not issue passes as it is (the MLX server answers
    comparison_response_not_found for an id it does not know)."""
    from litellm.proxy.hooks.responses_id_security import ResponsesIDSecurity
    from litellm.responses.utils import ResponsesAPIRequestUtils

    security = ResponsesIDSecurity()
    try:
        encrypted = security._is_encrypted_response_id(response_id)
    except Exception:  # noqa: BLE001 - a LiteLLM without this layout: the id goes on unchanged
        log.exception("front door: reading a Responses id failed")
        return response_id
    if encrypted:
        managed, user_id, team_id = security._decrypt_response_id(response_id)
        security.check_user_access_to_response_id(user_id, team_id, user_api_key_dict)   # 403 for another's
        response_id = managed
    return ResponsesAPIRequestUtils.decode_previous_response_id_to_original_previous_response_id(response_id)


def litellm_issued(response_id: str) -> bool:
    """Whether LiteLLM can route a Responses id: one it encrypted, a managed id naming the provider,
    or a background poll id. Unsure (a LiteLLM without this layout): True, LiteLLM decides."""
    try:
        from litellm.proxy.hooks.responses_id_security import ResponsesIDSecurity
        from litellm.responses.utils import ResponsesAPIRequestUtils

        if response_id.startswith("litellm_poll_") or ResponsesIDSecurity()._is_encrypted_response_id(response_id):
            return True
        return bool(ResponsesAPIRequestUtils.decode_responses_api_response_id(response_id).get("custom_llm_provider"))
    except Exception:  # noqa: BLE001 - never cost a request
        log.exception("front door: reading a Responses id failed")
        return True


front_door = FrontDoorHook()
