"""The application object: owns the worker, the loaded model, the engine and the routes."""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import Counter
from typing import Any, Callable
from urllib.parse import unquote

from ..cache.summary import summary_for
from ..config.settings import Settings, SettingsError, model_aliases
from ..engine.chat import tokenizer_size
from ..engine.factory import make_core, make_engine
from ..engine.lockstep import Lockstep, portable_job, rebuilt_job
from ..engine.worker import InferenceWorker
from ..models.loaded import read_generation_config
from ..models import hub
from ..models.loader import load_model
from ..models.sharding import from_rank0
from ..prompt.images import ImageLimits
from ..runner.sampling_defaults import SamplingDefaults
from ..system import control_channel
from .anthropic.messages import handle_count_tokens, handle_messages
from .common.features import install_features
from .common.image_fetch import RemoteImageFetcher, is_public_address
from .common.structured import Structured
from .common.warm_prompts import load_warm_jobs
from .http.guard import Guard, bind_refusal
from .http.handler import Handler
from .http.pooled_server import PooledHTTPServer
from .openai.chat import handle_chat_completions
from .openai.completions import handle_completions
from .openai.responses import handle_delete, handle_input_items, handle_responses, handle_retrieve

log = logging.getLogger("mlxstack.app")

# a stored response (GET / DELETE) and its input items (GET), with and without /v1
STORED_RESPONSE = re.compile(r"^(?:/v1)?/responses/(?P<id>[^/]+)(?P<items>/input_items)?$")


class App:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.worker = InferenceWorker(settings.max_queued_requests, arrival_window_s=settings.arrival_window_ms / 1000)
        self.ready = False
        self.load_error: str | None = None
        self.model_id = "loading"
        self.aliases: set[str] = set()
        self.alias_patterns: tuple[str, ...] = ()   # MODEL_ALIASES aimed here: the Anthropic endpoint accepts them
        self.family = "generic"
        self.loaded: Any = None
        self.engine: Any = None
        self.state: Any = None
        self.started = time.time()
        self.status_counts: Counter[int] = Counter()
        self._status_lock = threading.Lock()
        self.after_response_hooks: list[Callable[[Any, Any], None]] = []
        self.extra_get_routes: dict[str, Callable[[Any], None]] = {}
        self.guard = Guard.from_settings(settings)
        self.image_limits = ImageLimits.from_settings(settings)
        self.vocab_size: int | None = None  # logits width, known once the model is loaded
        self.sampling = SamplingDefaults.resolve(settings)   # + the model's generation_config.json at load
        self.structured: Any = None         # server/common/structured.py: grammars for this model's tokenizer

        self.remote_image_policy: Callable[[Any], bool] = is_public_address  # tests aim it at local servers
        self.files_ready: Callable[[], None] | None = None   # serve.py: start the other local ranks
        self.group_joined = threading.Event()   # DISTRIBUTED: this rank's MLX group formed (or the load ended)
        self.lockstep: Any = None           # engine/lockstep.py when DISTRIBUTED is on

    # ------------------------------------------------------------------ lifecycle
    def _attach_core(self, engine: Any) -> None:
        """Chat jobs run by the engine core (engine/factory.py ``make_core``), or one at a time on
        the worker (VLMs)."""
        self.worker.run_chat = engine.run
        self.worker.runner = engine.runner   # its checks between forwards: progress for the stall watchdog
        self.worker.core, line = make_core(engine, self.settings)
        log.info("%s", line)

    def _queue_warm_prompts(self) -> None:
        """Prefill WARM_PROMPTS on the worker (after this load job; real requests queue behind)."""
        jobs = load_warm_jobs(self.settings.warm_prompts, self.settings, self.vocab_size)

        for i, job in enumerate(jobs):
            try:
                self.worker.submit(self._warm_call(i, job))
            except Exception:  # noqa: BLE001 - queue full: the rest is skipped
                log.warning("warm-up queue full: %d warm prompts skipped", len(jobs))
                break

    def _warm_call(self, index: int, job: Any = None) -> Callable[[], None]:
        """Warm prompt ``index`` as a worker call; with several ranks it carries ``replica``, so
        every rank runs it at the same turn (each rank builds the same jobs from WARM_PROMPTS)."""
        if job is None:
            job = load_warm_jobs(self.settings.warm_prompts, self.settings, self.vocab_size)[index]

        def run() -> None:
            try:
                out = self.engine.run(job)
                log.info("warm prompt %s: %d tokens prefilled (%d were cached)", job.request_id,
                         out.prompt_tokens - out.cached_tokens, out.cached_tokens)
            except Exception as exc:  # noqa: BLE001 - a warm-up must never take the server down
                log.warning("warm prompt %s failed: %s", job.request_id, exc)

        run.replica = ("warm", index)  # type: ignore[attr-defined]
        return run

    def close(self) -> None:
        """Stop the worker after its current job, then flush the engine's disk writes."""
        self.worker.stop()
        if self.structured is not None:
            self.structured.close()
        if self.state is not None:
            try:
                self.state.close()
            except Exception:  # noqa: BLE001 - shutting down: log, never hang
                log.exception("closing the engine state failed")

    def start_loading(self, progress: Callable[[str], None] | None = None) -> Any:
        self.worker.start()
        return self.worker.submit(lambda: self._load(progress))

    def _load(self, progress: Callable[[str], None] | None) -> None:
        try:
            loaded = load_model(self.settings, progress, files_ready=self.files_ready, joined=self.group_joined.set)
            engine = make_engine(loaded, self.settings)
            state = engine.state
            self.loaded, self.state = loaded, state
            self.engine = engine
            self.model_id = loaded.model_id
            self.aliases = {loaded.path.name, str(loaded.path), self.settings.model_path} - {""}
            self.alias_patterns = tuple(pattern for pattern, target in model_aliases(self.settings.model_aliases)
                                        if target in ("main", self.model_id, *self.aliases))
            self.family = loaded.family
            self.vocab_size = model_vocab_size(loaded)
            self.sampling = SamplingDefaults.resolve(self.settings, read_generation_config(loaded.path))
            log.info("sampling defaults: %s", ", ".join(f"{k}={v} ({self.sampling.origin[k]})"
                                                        for k, v in self.sampling.values.items()))
            self.structured = self._structured(loaded, engine)
            self._install_features()
            self.ready = True
            log.info("model %s ready (family=%s, context=%d, cache budget %.1f GiB, counters %s)",
                     self.model_id, self.family, loaded.context_length, state.cache_budget / 2**30,
                     state.counters.correctness())
            self._attach_core(engine)
            if "group" in loaded.extra:
                self._begin_lockstep(loaded.extra["group"], engine)
            if self.settings.warm_prompts and (self.lockstep is None or self.lockstep.leader):
                self._queue_warm_prompts()
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("model load failed: %s", self.load_error)
            raise
        finally:
            self.group_joined.set()

    def prepare_call(self, job: Any) -> Callable[[], int]:
        """A worker call rendering ``job`` and counting its model tokens (Anthropic count_tokens).
        Rendering reads the healing store (an LRU): with several ranks every rank runs it at the
        same turn (``replica``), so their stores stay the same."""
        def count() -> int:
            return len(self.engine.prepare(job).model_tokens)

        if self.lockstep is not None:
            count.replica = ("prepare", portable_job(job)[0])  # type: ignore[attr-defined]
        return count

    def _prepare_replica(self, values: dict) -> Callable[[], int]:
        job = rebuilt_job(values)
        return lambda: len(self.engine.prepare(job).model_tokens)

    def _begin_lockstep(self, group: Any, engine: Any) -> None:
        """Several ranks: every rank's engine reads rank 0's clock, keeps the tightest rank's cache
        budget, and takes its work from rank 0's records from the next worker turn on."""
        control = control_channel.from_env(os.environ)
        if control is None:
            raise RuntimeError("DISTRIBUTED: this rank has no control channel (MLXSTACK_CONTROL); start it "
                               "through start_llm.py / mlxstack.serve")
        channel = open_control(group, *control)
        compile_grammar = self.structured.compiler.compile if self.structured is not None else None
        lock = Lockstep(group, channel, compile_grammar,
                        replicas={"warm": self._warm_call, "prepare": self._prepare_replica})
        lock.mode = self.settings.distributed
        per_rank = lock.bind(engine, self.settings.distributed_local_ranks)
        self.lockstep = lock
        self.worker.lockstep = lock
        log.info("rank %d of %d in lockstep (%s parallel); KV cache budget %.2f GiB per rank", lock.rank, lock.size,
                 self.settings.distributed, per_rank / 2**30)

    def _structured(self, loaded: Any, engine: Any) -> Any:
        """The grammar compiler for this model (structured output, tool_choice): built once here."""
        return Structured.for_model(loaded, engine, self.settings)

    def _install_features(self) -> None:
        """Optional layers (healing store, request logs, metrics) hook in here."""
        install_features(self)

    def image_fetcher(self) -> Any:
        """A fetcher for one request's remote images (its deadline starts now)."""
        limits = self.image_limits
        return RemoteImageFetcher(limits.max_bytes, limits.remote_timeout, address_allowed=self.remote_image_policy)

    def count_status(self, status: int) -> None:
        with self._status_lock:
            self.status_counts[status] += 1

    def after_response(self, job: Any, outcome: Any) -> None:
        for hook in self.after_response_hooks:
            try:
                hook(job, outcome)
            except Exception:  # noqa: BLE001
                log.exception("after-response hook failed")

    # ------------------------------------------------------------------ routes
    def get_routes(self, h: Any) -> dict[str, Callable[[], None]]:
        routes = {
            "/health": lambda: self._health_route(h),
            "/v1/models": lambda: h._json(200, self.models()),
            "/models": lambda: h._json(200, self.models()),
            "/v1/cache/stats": lambda: h._json(200, self.cache_stats()),
            "/v1/cache/summary": lambda: h._json(200, summary_for(self)),  # routers placing sessions
        }
        for path, fn in self.extra_get_routes.items():
            routes[path] = (lambda f=fn: f(h))
        return routes

    def post_routes(self, h: Any) -> dict[str, Callable[[], None]]:
        return {"/v1/chat/completions": lambda: handle_chat_completions(h),
                "/chat/completions": lambda: handle_chat_completions(h),
                "/v1/completions": lambda: handle_completions(h), "/completions": lambda: handle_completions(h),
                "/v1/responses": lambda: handle_responses(h), "/responses": lambda: handle_responses(h),
                "/v1/messages": lambda: handle_messages(h),
                "/v1/messages/count_tokens": lambda: handle_count_tokens(h)}

    def route(self, h: Any, method: str, path: str) -> tuple[Callable[[], None] | None, tuple[str, ...]]:
        """(the handler of ``method`` on ``path`` or None, the methods ``path`` answers -- empty:
        an unknown path). Exact paths, then the stored responses' (/v1/responses/{id}[/input_items])."""
        tables = {"GET": self.get_routes(h), "POST": self.post_routes(h)}
        allowed = tuple(m for m, table in sorted(tables.items()) if path in table)
        if allowed:
            return tables.get(method, {}).get(path), allowed
        stored = STORED_RESPONSE.match(path)
        if stored is None:
            return None, ()
        rid = unquote(stored["id"])
        handlers = ({"GET": lambda: handle_input_items(h, rid)} if stored["items"] else
                    {"DELETE": lambda: handle_delete(h, rid), "GET": lambda: handle_retrieve(h, rid)})
        return handlers.get(method), tuple(sorted(handlers))

    def _health_route(self, h: Any) -> None:
        body = self.health()
        h._json(200 if body["ready"] else 503, body)

    def health(self) -> dict:
        """ok + ready once the model is loaded; ``status: error`` (503) with the reason when the
        load failed, or the inference thread died or stalled (INFERENCE_STALL_SECONDS): the
        launcher restarts a server that keeps saying so (launcher/stack.py). ``backend``: the
        backend's report once the model is loaded (backends/base.py: its name, and each feature
        "on (...)" or "off: why"). ``fetch``: the model's download from a hub at load
        (models/hub.py: repo, state, bytes done / total), once one has begun."""
        problem = self.load_error or (self.worker.health_problem(self.settings.inference_stall_seconds)
                                      if self.ready else None)
        body = {"status": "ok" if problem is None else "error", "model": self.model_id,
                "ready": self.ready and problem is None, "queue_depth": self.worker.queue_depth,
                "busy": self.worker.busy}
        if problem:
            body["error"] = problem
        fetching = hub.PROGRESS.snapshot()
        if fetching["state"] != "idle":     # a model downloaded at load (MODEL_FETCH): where it stands
            body["fetch"] = fetching
        backend = self.loaded.extra.get("backend") if self.loaded is not None else None
        if backend is not None and backend.report is not None:   # what the backend turned on, and why
            body["backend"] = backend.report.as_dict()
        return body

    def models(self) -> dict:
        ctx = self.loaded.context_length if self.loaded else None
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": int(self.started),
                                            "owned_by": "mlxstack", "context_length": ctx, "ready": self.ready}]}

    def cache_stats(self) -> dict:
        if self.state is None:
            return {"ready": False}
        stats = self.state.stats()
        stats["model"] = self.model_id
        stats["queue_depth"] = self.worker.queue_depth
        sched = self.worker.core
        stats["scheduler"] = ({"max_sequences": sched.max_sequences, "active": sched.active,
                               "prefilling": len(sched.prefilling), "decoding": len(sched.group),
                               "batched": sched.group.batching, "last_batch_size": sched.last_batch,
                               "prefill_chunk_tokens": sched.prefill_budget, "steps": sched.steps,
                               "batched_prefills": sched.short_batches,
                               "turns_closed_together": sched.closed_together,
                               "waiting_for_memory": len(sched.waiting_memory),
                               "waited_for_memory_total": sched.parked_total,
                               "priority_scheduling": sched.prioritised,
                               "preempted": len(sched.preempted), "preemptions_total": sched.preemptions,
                               "resumed_total": sched.resumed,
                               "queued_by_priority": {str(k): v for k, v in self.worker.queued_by_priority().items()},
                               "in_flight_by_priority": {str(k): v for k, v in sched.by_priority().items()},
                               "in_flight_by_status": sched.by_status()}
                              if sched is not None else {"max_sequences": 1, "active": int(self.worker.busy)})
        stats["sampling"] = self.sampling.describe()
        if sched is not None and sched.engine.speculation.enabled:
            stats["speculation"] = sched.engine.speculation.stats()
        with self._status_lock:
            stats["status_counts"] = {str(k): v for k, v in self.status_counts.items()}
        if self.lockstep is not None:
            stats["distributed"] = self.lockstep.stats()
        return stats


def model_vocab_size(loaded: Any) -> int | None:
    """The token ids a request may name (logit_bias): the logits width -- config ``vocab_size``
    (VLMs: ``text_config``) -- capped at the tokenizer's size. A padded width (Gemma 3: 262,208
    for a 262,145-token tokenizer) holds ids nothing can decode; the sampler never picks them."""
    config = getattr(loaded, "config", None) or {}
    width = None
    for source in (config, config.get("text_config") or {}):
        value = source.get("vocab_size")
        if isinstance(value, int) and value > 0:
            width = value
            break
    tokens = tokenizer_size(getattr(loaded, "tokenizer", None))
    return min(width, tokens) if width and tokens else (width or tokens)


def make_server(app: App, host: str, port: int, listen_fd: int | None = None) -> PooledHTTPServer:
    """Bind the MLX server (IPv4 or IPv6), or serve on an inherited listening socket
    (``listen_fd``: the launcher keeps the port open across restarts). Refuses a non-loopback
    host without MLX_API_KEY."""
    refusal = bind_refusal(host, app.settings.mlx_api_key)
    if refusal:
        raise SettingsError(refusal)
    handler = type("BoundHandler", (Handler,), {"app": app})
    return PooledHTTPServer((host, port), handler, threads=app.settings.mlx_http_threads, listen_fd=listen_fd)


def open_control(group: Any, address: tuple[str, int], secret: bytes) -> Any:
    """This rank's end of the group's control channel (system/control_channel.py): rank 0 leads,
    the others follow. Port 0 (DISTRIBUTED_HOSTS: mlx.launch starts rank 0 on its host) means rank 0
    listens first and the group then learns the port over MLX's own link (``from_rank0``) -- never
    a port picked free, released and bound later, which another user could take in between."""
    server = None
    if address[1] == 0:
        server = control_channel.listener(address[0]) if group.rank() == 0 else None
        address = (address[0], from_rank0(group, server.getsockname()[1] if server is not None else 0))
    if group.rank() == 0:
        return control_channel.ControlChannel.lead(address, secret, followers=group.size() - 1, server=server)
    return control_channel.ControlChannel.follow(address, secret, rank=group.rank())
