"""LiteLLM callback that keeps each session on the MLX backend holding its KV.

Loaded by LiteLLM from the generated config (``litellm_settings.callbacks:
[mlxstack.routing.litellm_hook.routing_hook]``; start_llm.py puts the repository on LiteLLM's
PYTHONPATH). Configured from the environment start_llm.py gives LiteLLM: ``ROUTING``
(cache_aware | affinity | shuffle), ``ROUTING_AFFINITY_TTL_SECONDS``,
``CACHE_CANONICALIZE_TOOL_CONTEXT``, ``STRIP_BILLING_HEADER``.

Two hooks:
- ``async_pre_call_hook`` (proxy, before routing, every mode but shuffle): derives the session id
  the way the MLX server does (mlxstack/routing/session_key.py) and writes it to
  ``metadata.session_id``, the field LiteLLM's own ``session_affinity`` check reads. Measured on
  1.106.2: without this, LiteLLM only knows ids from ``x-litellm-session-id``, ``x-*-session-id``
  and Anthropic ``metadata.user_id`` headers/fields; a body ``session_id``, ``x-session-affinity``
  or a client sending no id at all (PI, OpenClaw) is never pinned.
- ``async_filter_deployments`` (router, ``cache_aware`` only): picks exactly one backend
  (mlxstack/routing/placement.py): the session's pinned backend while it is alive; else the
  backend whose ``/v1/cache/summary`` holds the request's deepest message prefix; else the least
  loaded. A dead pinned backend moves the session (logged: its next turn is cold) and the pin
  follows it, so it does not bounce back when the old backend returns. Liveness is our own:
  LiteLLM 1.106 sees a refused connection as a 500 and cools a deployment down only once its
  failure rate over a minute is high (measured: 4 of the next 18 requests failed first), and a
  retry that goes back to the backend it failed on is never sent (see ``attempts``).
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections import OrderedDict
from typing import Any

import httpx
from litellm.integrations.custom_logger import CustomLogger

from mlxstack.routing.placement import BackendView, place
from mlxstack.prompt.session_context import has_reply, opening_end
from mlxstack.routing.session_key import request_digests, request_scope, routing_session

log = logging.getLogger("mlxstack.routing")
if not log.handlers:  # LiteLLM's own logging setup does not show INFO lines from other packages
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("mlxstack routing: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False

HEALTH_TTL = 0.25       # seconds a backend's last health answer is trusted (a probe: ~0.4 ms locally)
SUMMARY_TTL = 0.0       # placing a new session always asks afresh: sub-agents arrive right after their parent
PLACED_MEMORY = 120.0   # seconds the router counts its own placements as held (before summaries show them)
PLACED_MAX = 4096       # digests remembered per backend
PROBE_TIMEOUT = 1.0     # a local backend answers /health in milliseconds even while generating
INFLIGHT_MAX_AGE = 3600.0  # a request whose end we never heard of stops counting as load
GENERATED_FLAG = "litellm_session_id_generated"   # litellm.constants.SESSION_ID_GENERATED_METADATA_KEY


def _flag(name: str, default: bool) -> bool:
    return os.environ.get(name, str(default)).strip().lower() in ("1", "true", "yes", "on")


def backend_url(deployment: dict) -> str:
    info = deployment.get("model_info") or {}
    if info.get("mlx_backend"):
        return str(info["mlx_backend"])
    base = str((deployment.get("litellm_params") or {}).get("api_base") or "")
    return base[:-3] if base.endswith("/v1") else base.rstrip("/")


def _api_key(deployment: dict) -> str:
    key = str((deployment.get("litellm_params") or {}).get("api_key") or "")
    if key.startswith("os.environ/"):
        key = os.environ.get(key.split("/", 1)[1], "")
    return "" if key == "none" else key


def _metadata_dicts(kwargs: dict) -> list[dict]:
    """The metadata the pre-call hook wrote, where LiteLLM keeps it: top level on a call, under
    ``litellm_params`` in a success / failure event's kwargs."""
    params = kwargs.get("litellm_params")
    places = [kwargs, params] if isinstance(params, dict) else [kwargs]
    return [p[k] for p in places for k in ("metadata", "litellm_metadata") if isinstance(p.get(k), dict)]


def _session_source(kwargs: dict) -> str | None:
    """Where the pre-call hook found the request's session (``message-prefix``: the opening's
    digest; else the client's own id), None when the hook did not see it."""
    return next((m["mlxstack_session_source"] for m in _metadata_dicts(kwargs)
                 if isinstance(m.get("mlxstack_session_source"), str)), None)


def _client_body(kwargs: dict) -> dict:
    """The request as the client sent it: without the metadata the pre-call hook wrote (its
    ``session_id`` there is the hook's, not a client's)."""
    return {k: v for k, v in kwargs.items() if k not in ("metadata", "litellm_metadata", "litellm_params")}


def _responses_chain_backend(kwargs: dict, deployments: list[dict]) -> str | None:
    """The backend that produced ``previous_response_id`` (LiteLLM encodes its deployment id into
    the response ids it returns), None when the request does not chain or the id is not ours."""
    previous = kwargs.get("previous_response_id")
    if not previous:
        return None
    try:
        from litellm.responses.utils import ResponsesAPIRequestUtils

        model_id = ResponsesAPIRequestUtils.get_model_id_from_response_id(str(previous))
    except Exception:  # noqa: BLE001 - a foreign or malformed id: no chain to follow
        return None
    for deployment in deployments:
        if model_id and str((deployment.get("model_info") or {}).get("id")) == str(model_id):
            return backend_url(deployment)
    return None


class BackendMonitor:
    """Cached /health and /v1/cache/summary answers per backend (async, short timeouts)."""

    def __init__(self, timeout: float = PROBE_TIMEOUT) -> None:
        self.timeout = timeout
        self.health: dict[str, tuple[float, bool]] = {}
        self.summaries: dict[str, tuple[float, dict | None]] = {}
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
        return self._client

    async def alive(self, url: str, fresh: bool = False) -> bool:
        seen = self.health.get(url)
        if seen is not None and not fresh and time.monotonic() - seen[0] < HEALTH_TTL:
            return seen[1]
        try:
            resp = await self.client().get(url + "/health")
            ok = resp.status_code == 200 and bool(resp.json().get("ready"))
        except (httpx.HTTPError, ValueError, AttributeError):
            ok = False
        self.health[url] = (time.monotonic(), ok)
        return ok

    async def summary(self, url: str, key: str) -> dict | None:
        now = time.monotonic()
        seen, health = self.summaries.get(url), self.health.get(url)
        if seen is not None and now - seen[0] < SUMMARY_TTL:
            return seen[1]
        if health is not None and not health[1] and now - health[0] < HEALTH_TTL:
            return None  # found down moments ago: a held port would make us wait out the timeout again
        try:
            resp = await self.client().get(url + "/v1/cache/summary",
                                           headers={"Authorization": f"Bearer {key}"} if key else {})
            body = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            body = None
        now = time.monotonic()
        self.summaries[url] = (now, body)
        self.health[url] = (now, bool(body and body.get("ready")))
        return body


class MlxRoutingHook(CustomLogger):
    def __init__(self) -> None:
        super().__init__()
        self.mode = os.environ.get("ROUTING", "cache_aware").strip().lower()
        self.ttl = float(os.environ.get("ROUTING_AFFINITY_TTL_SECONDS", "3600"))
        self.canon = {"canonicalize": _flag("CACHE_CANONICALIZE_TOOL_CONTEXT", True),
                      "strip_billing_header": _flag("STRIP_BILLING_HEADER", True)}
        self.monitor = BackendMonitor()
        self.pins: dict[str, tuple[str, float]] = {}          # session id -> (backend url, last used)
        # a first turn's next-turn pin -> the opening's pin: one conversation, counted once
        self.openings: dict[str, str] = {}
        self.inflight: dict[str, tuple[str, float]] = {}      # litellm_call_id -> (backend url, since)
        self.attempts: dict[str, tuple[list[str], float]] = {}  # litellm_call_id -> (backends tried, since)
        self.counts: dict[str, int] = {"pinned": 0, "prefix": 0, "least-load": 0, "moved": 0}
        # What this router sent where, newest last: a session's first turn is not in its backend's
        # summary until it finishes, and its sub-agents often arrive before that.
        self.placed: dict[str, OrderedDict[str, tuple[int, float]]] = {}
        self._lock = asyncio.Lock()
        self._expired = 0.0

    # ---------------------------------------------------------------- session id (proxy side)
    async def async_pre_call_hook(self, user_api_key_dict, cache, data, call_type):  # noqa: ANN001
        if self.mode == "shuffle" or not isinstance(data, dict):
            return data
        headers = (data.get("proxy_server_request") or {}).get("headers") or {}
        messages = data.get("messages") or data.get("input") or []
        scope = request_scope(data, headers)
        ctx = routing_session(data, headers, messages if isinstance(messages, list) else [], scope, **self.canon)
        for metadata in _metadata_dicts(data) or [data.setdefault("metadata", {})]:
            metadata["session_id"] = ctx.session_id
            metadata["mlxstack_session_source"] = ctx.source
            metadata["mlxstack_scope"] = scope
            metadata.pop(GENERATED_FLAG, None)
        return data

    # ---------------------------------------------------------------- placement (router side)
    def _session_of(self, kwargs: dict, messages: Any) -> str:
        for metadata in _metadata_dicts(kwargs):
            if metadata.get("session_id") and not metadata.get(GENERATED_FLAG):
                return str(metadata["session_id"])
        return routing_session(kwargs, {}, messages or [], self._scope_of(kwargs), **self.canon).session_id

    @staticmethod
    def _scope_of(kwargs: dict) -> str:
        """The cache scope the pre-call hook found (placement only ever reads that scope's digests)."""
        for metadata in _metadata_dicts(kwargs):
            if isinstance(metadata.get("mlxstack_scope"), str):
                return metadata["mlxstack_scope"]
        return request_scope(kwargs, {})

    def _opening_of(self, kwargs: dict, messages: Any, session: str) -> str | None:
        """For a later turn in an implicit session, the id its opening had before the first reply
        (a first turn's pin) -- where a client echoes that reply other than as it was sent, the id
        its next turn was pinned under never comes, but the opening still names the conversation."""
        if not isinstance(messages, list) or not has_reply(messages) or _session_source(kwargs) != "message-prefix":
            return None
        usable = [m for m in messages if isinstance(m, dict)]
        before_reply = usable[: opening_end(usable) - 1]        # has_reply: the opening ends with its reply
        ctx = routing_session(_client_body(kwargs), {}, before_reply, self._scope_of(kwargs), **self.canon)
        return ctx.session_id if ctx.source == "message-prefix" and ctx.session_id != session else None

    def _expire(self, now: float) -> None:
        if now - self._expired < 60.0:  # a sweep a minute keeps the tables bounded at no per-request cost
            return
        self._expired = now
        for sid in [s for s, (_, t) in self.pins.items() if now - t > self.ttl]:
            del self.pins[sid]
        for sid in [s for s in self.openings if s not in self.pins]:
            del self.openings[sid]
        for table in (self.inflight, self.attempts):
            for call in [c for c, (_, t) in table.items() if now - t > INFLIGHT_MAX_AGE]:
                del table[call]

    async def async_filter_deployments(self, model, healthy_deployments, messages, request_kwargs=None,
                                       parent_otel_span=None):  # noqa: ANN001
        if self.mode != "cache_aware" or not healthy_deployments:
            return healthy_deployments
        kwargs = request_kwargs or {}
        call = str(kwargs.get("litellm_call_id") or "")
        retry = any(int(m.get("attempted_retries") or 0) > 0 for m in _metadata_dicts(kwargs))
        # A retry never goes back to a backend this request already failed on: a refused connection
        # means it is down, and anything else may have come after a long prefill a retry would repeat.
        tried = self.attempts.get(call, ([], 0.0))[0] if retry and call else []
        by_url = {u: d for u, d in ((backend_url(d), d) for d in healthy_deployments) if u not in tried}
        if not by_url:
            log.warning("request %s failed on %s and %s has no other backend: not retried there", call,
                        ", ".join(tried), model)
            return []
        urls = list(by_url)
        session = self._session_of(kwargs, messages)
        now = time.monotonic()
        async with self._lock:  # one decision at a time: concurrent new sessions see each other's load
            self._expire(now)
            pin = self.pins.get(session)
            opening = None if pin else self._opening_of(kwargs, messages, session)
            if opening is not None:       # the client echoed its first reply otherwise: its opening's pin
                pin = self.pins.get(opening)
                self.openings[session] = opening
            pin_url = pin[0] if pin and now - pin[1] <= self.ttl else None
            chained = _responses_chain_backend(kwargs, healthy_deployments)
            if chained is not None:  # the stored previous response lives on that backend only
                pin_url = chained
            if pin_url in by_url and await self.monitor.alive(pin_url, fresh=retry):
                choice = place(pin_url, [BackendView(pin_url, True)], [])
            else:
                digests = request_digests(messages or [], self._scope_of(kwargs), **self.canon)
                summaries = await asyncio.gather(*(self.monitor.summary(u, _api_key(by_url[u])) for u in urls))
                views = [self._view(u, s, now) for u, s in zip(urls, summaries)]
                choice = place(pin_url, views, digests)
                if choice is not None:
                    self._remember(choice.url, digests, now)
            if choice is None:
                log.warning("no live backend for %s among %s; letting LiteLLM try them all", model, ", ".join(urls))
                return healthy_deployments
            if chained is None:  # a chained turn's id changes every turn: the response id is its pin
                self.pins[session] = (choice.url, now)
            if call:
                self.inflight[call] = (choice.url, now)
                self.attempts[call] = (tried + [choice.url], now)
            self.counts[choice.reason] += 1
            if choice.moved_from:
                self.counts["moved"] += 1
                why = "failed this request" if choice.moved_from in tried else "is down"
                log.warning("session %s moved %s -> %s (%s %s): this turn is cold there; moves so far %d",
                            session[:24], choice.moved_from, choice.url, choice.moved_from, why, self.counts["moved"])
            elif choice.reason != "pinned":
                log.info("new session %s -> %s (%s, %d shared chars)", session[:24], choice.url, choice.reason,
                         choice.shared_chars)
        return [by_url[choice.url]]

    def _remember(self, url: str, digests: list[tuple[str, int]], now: float) -> None:
        placed = self.placed.setdefault(url, OrderedDict())
        for digest, chars in digests:
            placed.pop(digest, None)
            placed[digest] = (chars, now)
        while len(placed) > PLACED_MAX:
            placed.popitem(last=False)

    def _view(self, url: str, summary: dict | None, now: float) -> BackendView:
        if not summary or not summary.get("ready"):
            self.placed.pop(url, None)  # down or restarting: what we sent there is gone
            return BackendView(url, False)
        ours = sum(1 for u, _ in self.inflight.values() if u == url)
        load = int(summary.get("queue_depth") or 0) + int(summary.get("running", 1 if summary.get("busy") else 0) or 0)
        continued = {o for n, o in self.openings.items() if n in self.pins}
        sessions = sum(1 for sid, (u, _) in self.pins.items() if u == url and sid not in continued)
        prefixes = dict(summary.get("prefixes") or {})
        for digest, (chars, when) in (self.placed.get(url) or {}).items():
            if now - when <= PLACED_MEMORY:
                prefixes.setdefault(digest, chars)
        return BackendView(url, True, max(load, ours), sessions, prefixes)

    # ---------------------------------------------------------------- in-flight bookkeeping
    def _done(self, kwargs: dict) -> None:
        call = (kwargs or {}).get("litellm_call_id")
        if call:
            self.inflight.pop(str(call), None)

    def pin_next_turn(self, kwargs: dict, response_obj: Any) -> str | None:
        """A conversation's first turn under an implicit session: its next turn's id is the digest
        of the opening *and this reply* (prompt/session_context.py ``opening_end``), so the next
        turn is pinned where this one ran -- as the server keeps this turn's records under that id.
        Returns the id pinned (None when there is nothing to pin)."""
        messages = (kwargs or {}).get("messages")
        if not isinstance(messages, list) or has_reply(messages):
            return None
        if _session_source(kwargs or {}) not in (None, "message-prefix"):
            return None            # the client named its session (a header the hook saw): nothing moves
        call = str((kwargs or {}).get("litellm_call_id") or "")
        placed = self.inflight.get(call) or self.attempts.get(call, ([None], 0.0))
        url = placed[0][-1] if isinstance(placed[0], list) else placed[0]
        try:
            message = response_obj.choices[0].message
            reply = {"role": "assistant", "content": message.content or "",
                     "tool_calls": [{"function": {"name": c.function.name, "arguments": c.function.arguments}}
                                    for c in (message.tool_calls or [])]}
        except (AttributeError, IndexError, TypeError):
            return None
        ctx = routing_session(_client_body(kwargs), {}, [*messages, reply], self._scope_of(kwargs), **self.canon)
        if url is None or ctx.source != "message-prefix":
            return None
        self.pins[ctx.session_id] = (url, time.monotonic())
        opening = self._session_of(kwargs, messages)
        if opening != ctx.session_id:
            self.openings[ctx.session_id] = opening
        return ctx.session_id

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):  # noqa: ANN001
        try:
            self.pin_next_turn(kwargs, response_obj)
        except Exception:  # noqa: BLE001 - a pin is a hint: never let it cost the request
            log.exception("could not pin the next turn")
        self._done(kwargs)

    async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time):  # noqa: ANN001
        self._done(kwargs)


routing_hook = MlxRoutingHook()
