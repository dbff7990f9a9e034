"""The model router (MODELS_ON_DEMAND): the MLX port serves every installed model, one MLX server
process per resident model behind it.

    python -m mlxstack.residency.router       # what the launcher starts in place of mlxstack.serve

    LiteLLM -> router (MLX_PORT) --relay--> MLX server of model A (127.0.0.1, its own port)
                                  \\-------> MLX server of model B ...

A request's ``model`` (its JSON body, else ``?model=``, else the main model, MODEL_PATH) picks the
process; the first request naming a model starts it and every request arriving meanwhile waits on
the same load. residency/policy.py decides what may stay: weights + KV budget of every resident
model within MODEL_MEMORY_BUDGET, the least recently used idle one unloaded to make room,
MODEL_IDLE_TTL_SECONDS idle ones, never MODEL_PIN ones. Why processes and not several models in
one server: docs/operations.md#models-on-demand (an exited process returns all of its memory;
each model keeps its own inference thread, caches and disk-tier namespace; the supervisor and the
MLX server are the existing ones, unchanged).

The relay is byte-transparent: the body is the client's with ``model`` set to the id the child
serves, the response (JSON or a server-sent-event stream) is copied as it arrives, and a client
that hangs up closes the child's connection (the MLX server then stops that request, as it does
for a direct client). Sessions of an unloaded model stay in its disk-tier namespace: a reloaded
model restores them at start-up, so its next turn is warm.
"""
from __future__ import annotations

import fnmatch
import http.client
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..config.settings import REPO_ROOT, Settings, load_settings, model_aliases
from ..launcher import litellm_config as lc
from ..launcher.stack import LaunchError, _mlx_probe, _spawn_mlx, wait_ready
from ..launcher.supervisor import Child, Supervisor
from ..models.catalog import installed_models
from ..models.hub import FetchError, gib, looks_like_repo_id, remote_repo
from ..models.memory import process_rss_bytes as rss_bytes, total_memory_bytes
from ..server.http.guard import bearer_token, key_matches
from ..server.http.pooled_server import PooledHTTPServer, peer_closed
from ..system.secrets import make_private_dir
from ..system.listen_socket import inherited_listen_fd, listen_socket
from .policy import LOADING, READY, UNLOADING, Slot, TooBig, expired, room_for

log = logging.getLogger("mlxstack.residency")

BUDGET_FRACTION = 0.75          # MODEL_MEMORY_BUDGET=0: of RAM / Metal's recommended working set
KV_SHARE = 4                    # PROMPT_CACHE_MAX_BYTES=0: each model's KV budget is budget / KV_SHARE
UNLOAD_GRACE_SECONDS = 30.0     # an unloading server flushes its disk-tier writes before it exits
MONITOR_SECONDS = 0.5
# A repo id the hub cannot give: FetchError.kind -> (status, code)
FETCH_STATUS = {"not_found": (404, "model_not_found"), "no_revision": (404, "model_not_found"),
                "not_mlx": (400, "model_not_supported"), "gated": (403, "model_gated"),
                "offline": (503, "hub_unreachable"), "unreachable": (503, "hub_unreachable"), "http": (502, "hub_error")}
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                        "proxy-authorization", "proxy-connection", "host", "content-length"})


class RouterError(Exception):
    """An answer the router gives itself: status, OpenAI error code, message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "service_unavailable"
        return {"error": {"message": self.message, "type": kind, "param": "model" if self.status in (400, 404) else None,
                          "code": self.code}}


@dataclass(frozen=True)
class Candidate:
    """A model the router can load: its name, what its server's MODEL_PATH is, its weights' bytes."""
    name: str
    model_path: str
    weights: int
    context: int | None = None
    names: tuple[str, ...] = ()         # every other name a request may use for it


@dataclass
class Resident:
    """A model's server process (loading, ready or unloading)."""
    cand: Candidate
    ready: threading.Event = field(default_factory=threading.Event)
    child: Child | None = None
    listen: socket.socket | None = None
    port: int = 0
    served: str = ""
    error: RouterError | None = None
    fetch: dict | None = None
    started: float = 0.0
    load_seconds: float | None = None


class Router:
    """The resident models and their loads; the HTTP handler asks it for a model and gives it back."""

    def __init__(self, settings: Settings, *, cmd: list[str] | None = None, repo: Path = REPO_ROOT,
                 sup: Supervisor | None = None) -> None:
        self.settings = settings
        self.budget = settings.model_memory_budget or int(total_memory_bytes() * BUDGET_FRACTION)
        self.kv_bytes = settings.prompt_cache_max_bytes or self.budget // KV_SHARE
        self.process_bytes = settings.model_process_bytes     # 0 until measured (MODEL_PROCESS_BYTES=0)
        self.cmd = cmd or [sys.executable, "-m", "mlxstack.serve"]
        self.repo = repo
        self.sup = sup or Supervisor()
        # Children are started from one thread that lives as long as the router: their parent-death
        # signal fires when the *thread* that forked them ends (LESSONS 88), not the process.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="spawn")
        self.logs = make_private_dir(settings.log_root_path)
        self.cond = threading.Condition()
        self.slots: dict[str, Slot] = {}
        self.residents: dict[str, Resident] = {}
        self.loads = 0
        self.unloads: dict[str, int] = {"room": 0, "idle": 0, "exited": 0, "stop": 0}
        self.refused = 0
        self.peak_rss = 0
        self.ready = False
        self._closed = threading.Event()
        self.main = self._main_candidate()
        self.catalog = self._catalog()
        self.pins = {self.resolve(name).name for name in _names(settings.model_pin)}

    # ---------------------------------------------------------------- what is installed
    def _main_candidate(self) -> Candidate:
        s = self.settings
        name = lc.model_name(s)
        path = Path(s.model_path).expanduser() if s.model_path else None
        folder = path if path and path.is_dir() else None      # the embedded model: its catalog entry below
        return Candidate(name=name, model_path=s.model_path, weights=_weights(folder),
                         names=tuple(n for n in {s.model_path, *lc.proxy_model_names(s)} if n and n != name))

    def _catalog(self) -> dict[str, Candidate]:
        """Every name a request may use -> its candidate (the main model's names win)."""
        index: dict[str, Candidate] = {}
        for e in installed_models(self.settings):
            if e.source == "embedded":          # the main model when MODEL_PATH is "": its converted folder
                if not self.settings.model_path:
                    index[self.main.name] = Candidate(self.main.name, "", _weights(e.path), e.context)
                continue
            cand = Candidate(name=e.name, model_path=str(e.path) if e.source == "models_dir" else e.name,
                             weights=_weights(e.path), context=e.context,
                             names=tuple(n for n in {e.served_as, f"openai/{e.name}"} if n != e.name))
            for n in (cand.name, *cand.names):
                index.setdefault(n, cand)
        main = self.main
        if main.context is None:
            known = index.get(main.name)
            main = self.main = Candidate(main.name, main.model_path, main.weights or (known.weights if known else 0),
                                         known.context if known else None, main.names)
        for n in (main.name, *main.names):
            index[n] = main
        return index

    def resolve(self, name: str | None) -> Candidate:
        if not name:
            return self.main
        cand = self.catalog.get(name)
        if cand is None:
            self.catalog = self._catalog()          # installed since start (mlxstack pull, a new folder)
            cand = self.catalog.get(name)
        if cand is None:                            # MODEL_ALIASES (LiteLLM's wildcards; the pass-through's too)
            target = next((t for p, t in model_aliases(self.settings.model_aliases) if fnmatch.fnmatchcase(name, p)), None)
            if target is not None and target != name:
                return self.resolve(None if target == "main" else target)
        if cand is None and looks_like_repo_id(name) and self.settings.model_fetch:
            try:                                    # fetched by its server; sized by the hub's listing first
                remote = remote_repo(name)
            except FetchError as exc:
                status, code = FETCH_STATUS.get(exc.kind, (502, "model_fetch_failed"))
                raise RouterError(status, code, str(exc)) from None
            cand = Candidate(name=name, model_path=name, weights=remote.weights_bytes)
        if cand is None:
            available = ", ".join(sorted({c.name for c in self.catalog.values()}))
            raise RouterError(404, "model_not_found", f"The model {name!r} does not exist here. Installed: {available} "
                              "('mlxstack models' lists them; 'mlxstack pull REPO' fetches one).")
        return cand

    def models_list(self) -> dict:
        seen, data = set(), []
        for cand in [self.main, *self.catalog.values()]:
            if cand.name in seen:
                continue
            seen.add(cand.name)
            slot = self.slots.get(cand.name)
            data.append({"id": cand.name, "object": "model", "created": 0, "owned_by": "mlxstack",
                         "context_length": cand.context, "size_bytes": cand.weights,
                         "resident": bool(slot and slot.state == READY), "pinned": cand.name in self.pins})
        return {"object": "list", "data": data}

    # ---------------------------------------------------------------- acquire / release
    def acquire(self, name: str | None) -> Resident:
        """The ready server of the model ``name`` names, loading it (and unloading others) first when
        needed; the caller must ``release`` it. RouterError: unknown (404), too big (400), no room in
        time or its load failed (503)."""
        cand = self.resolve(name)
        deadline = time.monotonic() + self.settings.proxy_request_timeout_seconds
        with self.cond:
            while True:
                slot = self.slots.get(cand.name)
                if slot is not None and slot.state in (READY, LOADING):
                    slot.in_flight += 1           # a waiting request holds the model too: never idle
                    slot.last_used = time.monotonic()
                    res = self.residents[cand.name]
                    break
                if slot is None:
                    need = self._need(cand.weights)
                    try:
                        victims = room_for(list(self.slots.values()), need, self.budget)
                    except TooBig as exc:
                        self.refused += 1
                        raise RouterError(400, "model_too_large", _too_big(cand, exc, self.kv_bytes)) from None
                    if victims is not None:
                        for v in victims:
                            self.slots[v].state = UNLOADING
                        self.slots[cand.name] = Slot(cand.name, need, LOADING, time.monotonic(), in_flight=1,
                                                     pinned=cand.name in self.pins)
                        res = self.residents[cand.name] = Resident(cand, started=time.monotonic())
                        threading.Thread(target=self._load, args=(res, victims), daemon=True,
                                         name=f"load {cand.name}").start()
                        break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RouterError(503, "model_busy", f"no room for {cand.name} within MODEL_MEMORY_BUDGET "
                                      f"({gib(self.budget)}): every resident model is busy or pinned")
                self.cond.wait(min(left, 1.0))   # a release or an unload makes room
        if not res.ready.wait(max(0.0, deadline - time.monotonic())):
            self.release(res)
            raise RouterError(503, "model_loading", f"{cand.name} is still loading")
        if res.error is not None:
            self.release(res)
            raise res.error
        return res

    def _weights_after_load(self, cand: Candidate) -> int:
        """A model counted at 0 before its load (fetched, or the embedded model converted by it):
        its weights now on disk."""
        self.catalog = self._catalog()
        known = self.catalog.get(cand.name)
        return (known.weights if known is not None else 0) or _weights(_fetched_folder(cand))

    def _need(self, weights: int) -> int:
        """Bytes a model is counted at: weights + KV budget + a server process."""
        return weights + self.kv_bytes + self.process_bytes

    def release(self, res: Resident) -> None:
        with self.cond:
            slot = self.slots.get(res.cand.name)
            if slot is not None and self.residents.get(res.cand.name) is res:
                slot.in_flight = max(0, slot.in_flight - 1)
                slot.last_used = time.monotonic()
            self.cond.notify_all()

    # ---------------------------------------------------------------- loads and unloads
    def _load(self, res: Resident, victims: list[str]) -> None:
        for name in victims:
            self._unload(name, "room")
        cand = res.cand
        try:
            res.listen = listen_socket("127.0.0.1", 0)
            res.port = res.listen.getsockname()[1]
            child_settings = self.settings.replace(model_path=cand.model_path, mlx_host="127.0.0.1", mlx_port=res.port,
                                                   prompt_cache_max_bytes=self.kv_bytes, models_on_demand=False,
                                                   model_pin="", disk_keep_on_exit=True)
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", cand.name)
            log.info("loading %s (weights %s + KV %s; budget %s)", cand.name, gib(cand.weights), gib(self.kv_bytes),
                     gib(self.budget))
            res.child = self._spawner.submit(_spawn_mlx, self.sup, f"mlx:{safe}", child_settings, self.cmd, self.repo,
                                             self.logs / f".mlx-{safe}.pid", res.listen).result()
            probe = _mlx_probe(f"http://127.0.0.1:{res.port}")

            def watched() -> dict | None:
                body = probe()
                res.fetch = getattr(probe, "fetching", None)
                return body

            watched.fetching = None  # type: ignore[attr-defined]
            health = wait_ready(res.child, watched, self.settings.mlx_startup_timeout_seconds,
                                f"MLX server of {cand.name}", lambda m: log.info("%s", m), "MLX_STARTUP_TIMEOUT_SECONDS")
            res.served, res.fetch = str(health.get("model") or cand.name), None
            res.load_seconds = time.monotonic() - res.started
            if cand.name not in self.catalog:                 # fetched by its load: installed now
                self.catalog = self._catalog()
            weights = cand.weights or self._weights_after_load(cand)
            if not self.settings.model_process_bytes:          # measured: what a server holds beyond its weights
                self.process_bytes = max(self.process_bytes, rss_bytes(res.child.pid) - weights)
            with self.cond:
                self.loads += 1
                slot = self.slots[cand.name]
                slot.state, slot.need = READY, self._need(weights)
                others = [s for n, s in self.slots.items() if n != cand.name]
                try:
                    victims = room_for(others, slot.need, self.budget) or []
                except TooBig:
                    victims = []
                for v in victims:                               # the measured need is more than planned
                    self.slots[v].state = UNLOADING
                self.cond.notify_all()
            for v in victims:
                self._unload(v, "room")
            log.info("%s ready in %.1fs (serves %s; counted %s)", cand.name, res.load_seconds, res.served,
                     gib(slot.need))
        except (LaunchError, OSError) as exc:
            res.error = RouterError(503, "model_load_failed", f"{cand.name} could not be loaded: {exc}")
            log.warning("%s", res.error.message)
            self._stop_process(res)
            with self.cond:
                self.slots.pop(cand.name, None)
                self.residents.pop(cand.name, None)
                self.cond.notify_all()
        finally:
            res.ready.set()

    def _unload(self, name: str, reason: str) -> None:
        res = self.residents.get(name)
        if res is None:
            return
        log.info("unloading %s (%s)", name, {"room": "room for another model", "idle": "idle past "
                 "MODEL_IDLE_TTL_SECONDS", "exited": "its server exited", "stop": "stopping"}[reason])
        self._stop_process(res)
        with self.cond:
            if self.residents.get(name) is res:
                self.slots.pop(name, None)
                self.residents.pop(name, None)
                self.unloads[reason] += 1
            self.cond.notify_all()

    def _stop_process(self, res: Resident) -> None:
        if res.child is not None:
            self.sup.terminate(res.child, grace=UNLOAD_GRACE_SECONDS)
            self.sup.forget(res.child)
        if res.listen is not None:
            res.listen.close()

    def unload(self, name: str) -> bool:
        """Unload an idle model now (an operator's request); False when it is busy, pinned or absent."""
        cand = self.resolve(name)
        with self.cond:
            slot = self.slots.get(cand.name)
            if slot is None or not slot.idle:
                return False
            slot.state = UNLOADING
        self._unload(cand.name, "idle")
        return True

    def preload(self) -> None:
        """The main model and the pinned ones, loaded before /health says ready (failures logged)."""
        for name in [self.main.name, *sorted(self.pins - {self.main.name})]:
            try:
                self.release(self.acquire(name))
            except RouterError as exc:
                log.warning("not loaded at start: %s", exc.message)
        self.ready = True

    def monitor(self) -> None:
        """Idle unloads, servers that exited, and the peak resident memory of all model servers."""
        while not self._closed.wait(MONITOR_SECONDS):
            with self.cond:
                stale = expired(list(self.slots.values()), time.monotonic(), self.settings.model_idle_ttl_seconds)
                gone = [n for n, r in self.residents.items()
                        if self.slots[n].state == READY and r.child is not None and r.child.poll() is not None]
                for n in stale:
                    self.slots[n].state = UNLOADING
            for n in stale:
                self._unload(n, "idle")
            for n in gone:
                log.warning("the MLX server of %s exited; the next request naming it loads it again", n)
                self._unload(n, "exited")
            self.peak_rss = max(self.peak_rss, self.resident_rss())

    def resident_rss(self) -> int:
        return sum(rss_bytes(r.child.pid) for r in list(self.residents.values())
                   if r.child is not None and r.child.poll() is None)

    def health(self) -> dict:
        with self.cond:
            models = []
            for name, slot in self.slots.items():
                res = self.residents[name]
                models.append({"model": name, "state": slot.state, "bytes": slot.need, "in_flight": slot.in_flight,
                               "pinned": slot.pinned, "idle_seconds": round(time.monotonic() - slot.last_used, 1),
                               "pid": res.child.pid if res.child else None, "served": res.served or None,
                               "load_seconds": None if res.load_seconds is None else round(res.load_seconds, 2),
                               "rss_bytes": rss_bytes(res.child.pid) if res.child else 0,
                               **({"fetch": res.fetch} if res.fetch else {})})
            fetch = next((m["fetch"] for m in models if "fetch" in m), None)
            return {"status": "ok", "ready": self.ready, "model": self.main.name, "router": True,
                    "budget_bytes": self.budget, "kv_bytes_per_model": self.kv_bytes,
                    "process_bytes_per_model": self.process_bytes,
                    "resident_bytes": sum(s.need for s in self.slots.values()), "peak_rss_bytes": self.peak_rss,
                    "loads_total": self.loads, "unloads_total": dict(self.unloads), "refused_total": self.refused,
                    "models": models, **({"fetch": fetch} if fetch else {})}

    def close(self) -> None:
        self._closed.set()
        for name in list(self.residents):
            self._unload(name, "stop")


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _weights(folder: Path | None) -> int:
    """Bytes of a model folder's weight files (what loading it maps into memory)."""
    if folder is None or not Path(folder).is_dir():
        return 0
    return sum(p.stat().st_size for p in Path(folder).rglob("*.safetensors") if p.is_file())


def _fetched_folder(cand: Candidate) -> Path | None:
    from ..models.catalog import hub_repos
    from ..models.hub import hub_cache_dir

    return dict(hub_repos(hub_cache_dir())).get(cand.model_path)


def _too_big(cand: Candidate, exc: TooBig, kv: int) -> str:
    beside = f" beside the pinned models ({gib(exc.pinned)}, MODEL_PIN)" if exc.need <= exc.budget else ""
    return (f"{cand.name} needs {gib(exc.need)} (weights {gib(cand.weights)} + KV budget {gib(kv)} + its server process) "
            "and cannot fit "
            f"in MODEL_MEMORY_BUDGET={exc.budget} ({gib(exc.budget)}){beside}. Raise MODEL_MEMORY_BUDGET, lower "
            "PROMPT_CACHE_MAX_BYTES, or use a smaller (quantised) model.")


# -------------------------------------------------------------------- HTTP
class RouterHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    router: Router          # set on the subclass serve() builds
    server_version = "mlxstack-router"

    def log_message(self, fmt: str, *args: Any) -> None:  # noqa: D102 - the MLX servers log requests
        pass

    def do_GET(self) -> None:  # noqa: N802
        self._handle()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_GET  # noqa: N815

    def _handle(self) -> None:
        parts = urlsplit(self.path)
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return self._json(400, RouterError(400, "bad_request", "Content-Length is not a number").body())
        body = self.rfile.read(length) if length > 0 else b""
        if parts.path == "/health":
            return self._json(200, self.router.health())
        key = self.router.settings.mlx_api_key
        if key and not (key_matches(bearer_token(self.headers.get("Authorization")), key)
                        or key_matches(self.headers.get("x-api-key"), key)):
            return self._json(401, {"error": {"message": "Invalid or missing API key (MLX_API_KEY).",
                                              "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})
        if parts.path in ("/v1/models", "/models") and self.command == "GET":
            return self._json(200, self.router.models_list())
        if parts.path == "/v1/residency" and self.command == "GET":
            return self._json(200, self.router.health())
        name, payload = _model_of(body, parts.query)
        if parts.path == "/v1/residency/unload" and self.command == "POST":
            try:
                done = self.router.unload(name or "")
            except RouterError as exc:
                return self._json(exc.status, exc.body())
            return self._json(200 if done else 409, {"model": name, "unloaded": done})
        try:
            res = self.router.acquire(name)
        except RouterError as exc:
            return self._json(exc.status, exc.body())
        try:
            if payload is not None and payload.get("model") != res.served:
                body = json.dumps({**payload, "model": res.served}).encode()
            self._relay(res, body)
        finally:
            self.router.release(res)

    def _relay(self, res: Resident, body: bytes) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", res.port, timeout=self.router.settings.proxy_request_timeout_seconds)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        headers.update({"Host": f"127.0.0.1:{res.port}", "Content-Length": str(len(body))})
        done = threading.Event()
        hung_up = threading.Event()

        def watch() -> None:     # a client that leaves closes the child's connection: the server stops it
            while not done.wait(0.1):
                if peer_closed(self.connection):
                    hung_up.set()
                    if conn.sock is not None:
                        try:
                            conn.sock.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
                    return

        watcher = threading.Thread(target=watch, daemon=True)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            watcher.start()
            resp = conn.getresponse()
            self.send_response_only(resp.status, resp.reason)
            length = resp.getheader("Content-Length")
            for k, v in resp.getheaders():
                if k.lower() not in HOP_BY_HOP:
                    self.send_header(k, v)
            if length is not None:
                self.send_header("Content-Length", length)
            else:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            while True:
                chunk = resp.read1(65536) if length is None else resp.read(65536)
                if not chunk:
                    break
                self.wfile.write(chunk)
                if length is None:
                    self.wfile.flush()
        except (OSError, http.client.HTTPException) as exc:
            if not hung_up.is_set():
                log.warning("relay to %s failed: %s", res.cand.name, exc)
            self.close_connection = True
        finally:
            done.set()
            conn.close()

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _model_of(body: bytes, query: str) -> tuple[str | None, dict | None]:
    """(the model a request names, its JSON body when it is an object)."""
    payload = None
    if body:
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
    if isinstance(payload, dict) and isinstance(payload.get("model"), str) and payload["model"]:
        return payload["model"], payload
    names = parse_qs(query).get("model")
    return (names[0] if names else None), payload if isinstance(payload, dict) else None


def serve(settings: Settings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(settings)
    handler = type("Handler", (RouterHandler,), {"router": router})
    fd = inherited_listen_fd(os.environ)
    server = PooledHTTPServer((settings.mlx_host, settings.mlx_port), handler, threads=64, listen_fd=fd)
    threading.Thread(target=router.monitor, daemon=True, name="residency monitor").start()
    threading.Thread(target=router.preload, daemon=True, name="preload").start()
    import signal

    def stop(signum, frame):  # noqa: ARG001
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("model router on %s:%s: budget %s, KV %s per model, idle TTL %s", settings.mlx_host, settings.mlx_port,
             gib(router.budget), gib(router.kv_bytes), settings.model_idle_ttl_seconds or "off")
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        router.close()
    return 0


def main() -> int:
    return serve(load_settings())


if __name__ == "__main__":
    sys.exit(main())
