"""The differential harness: one warm engine under concurrent traffic, one cold reference.

    h = Harness(Config(kind="dense", speculative=True, disk=True), model_path, tmp)
    h.run([req, req, ...])     # a wave: admitted together, stepped by the real Scheduler
    h.restart()                # the warm engine again, from its disk tier
    h.findings                 # [] when every reply equalled the reference

The warm side is the product as configured (prompt cache, session store, shared prefixes and
copy-free checkouts, continuous batching, speculation, KV_BITS, a byte budget that spills and
parks, the disk tier); requests enter the Scheduler as the worker admits them (while it has room)
and are stepped on this thread. A hang-up cancels a request after a number of scheduler steps.

The reference is a cold engine of the same model and the same KV scheme: prompt cache off, no
shared prefixes, no speculation, one sequence at a time; it serves every request that was not hung
up, alone, after its wave (a wave's requests never read each other's replies: traffic.py). Parity
is checked on tokens: the prompt tokens the model saw and every generated token -- seeded sampled
rows included, with or without speculation (each draw is keyed by the reply's position:
runner/sampling.py). Every request must answer; any exception is a finding.
"""
from __future__ import annotations

import itertools
import shutil
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlxstack.cache.summary import scope_of
from mlxstack.runner.batch import batching_support
from mlxstack.runner.kv_bytes import measured_token_bytes
from mlxstack.engine.request import CacheBreakpoint, ChatJob, ContextLengthExceeded
from mlxstack.engine.core import EngineCore, PriorityPolicy
from mlxstack.runner.sampling import SamplingParams
from mlxstack.engine.factory import make_engine
from mlxstack.models.loader import load_model
from tests.conftest import engine_settings

from .traffic import PERSON, Req


@dataclass(frozen=True)
class Config:
    """One combination of the warm engine's settings."""
    kind: str                         # a tiny fixture kind (tests/conftest.py tiny_kind_paths) or "embedded"
    min_shared: int = 16              # SHARED_PREFIX_MIN_TOKENS
    speculative: bool = True
    kv_bits: int | None = None
    quant_start: int = 0              # QUANTIZED_KV_START (with kv_bits)
    kv_scheme: str = "uniform"        # KV_QUANT_SCHEME (with kv_bits): uniform | turboquant
    budget_tokens: int = 0            # PROMPT_CACHE_MAX_BYTES, in tokens of this model (0: none)
    disk: bool = False
    keep_on_exit: bool = False        # with disk: entries reach it only at shutdown (DISK_KEEP_ON_EXIT), none written through
    max_sequences: int = 8
    chunk: int = 64                   # PREFILL_CHUNK_TOKENS / PREFILL_STEP_SIZE: several chunks a prompt

    def name(self) -> str:
        parts = [self.kind, f"min{self.min_shared}", "spec" if self.speculative else "nospec"]
        parts += [f"{'tq' if self.kv_scheme == 'turboquant' else 'kv'}{self.kv_bits}@{self.quant_start}"] if self.kv_bits else []
        parts += [f"budget{self.budget_tokens}"] if self.budget_tokens else []
        parts += ["disk"] if self.disk else []
        parts += ["keep"] if self.keep_on_exit else []
        return "-".join(parts)


@dataclass
class Served:
    """One request's outcome on one engine."""
    req: Req
    prompt: list[int] | None = None     # model tokens the engine fed
    tokens: list[int] | None = None     # generated tokens
    text: str = ""
    finish: str = ""
    cached: int = 0
    error: BaseException | None = None
    verified: bool = False              # its tokens equalled the reference's (a conversation may go on from it)


@dataclass
class Finding:
    what: str                          # "error" | "mismatch" | "prompt" | "scope"
    req: Req
    detail: str

    def __str__(self) -> str:
        return f"{self.what} {self.req.rid} ({self.req.session}): {self.detail}"


@dataclass
class Stats:
    requests: int = 0
    compared: int = 0
    hung_up: int = 0
    refused: int = 0                    # past the context window on both engines (a 400, not a finding)
    reused_tokens: int = 0
    shared_prefills: int = 0
    parked: int = 0
    preemptions: int = 0
    restarts: int = 0
    features: set[str] = field(default_factory=set)


_LOADED: dict[str, Any] = {}


def build_engine(settings: Any) -> Any:
    """An engine on the model of ``settings``, loaded once per folder and shared by every engine the
    fuzzer builds (an engine's state is its own; the weights are never written)."""
    key = str(settings.model_path)
    if key not in _LOADED:
        _LOADED[key] = load_model(settings)
    return make_engine(_LOADED[key], settings)


@dataclass
class Totals(Stats):
    """Stats summed over the examples of a run (scripts/fuzz_parity.py, the CI tier)."""
    examples: int = 0
    last_findings: list[str] = field(default_factory=list)   # of the last failing example (the shrunk one)

    def add(self, st: Stats) -> None:
        self.examples += 1
        for name in ("requests", "compared", "hung_up", "refused", "reused_tokens", "shared_prefills", "parked",
                     "restarts"):
            setattr(self, name, getattr(self, name) + getattr(st, name))
        self.features |= st.features

    def line(self) -> str:
        return (f"{self.examples} examples, {self.requests} requests ({self.compared} compared token for token, "
                f"{self.hung_up} hung up), {self.reused_tokens} tokens reused, {self.shared_prefills} shared prefills, "
                f"{self.parked} parked, {self.restarts} restarts; features: {', '.join(sorted(self.features))}")


def _settings(path: Path, config: Config, tmp: Path, warm: bool, budget: int = 0) -> Any:
    common = {"prefill_step_size": config.chunk, "prefill_chunk_tokens": max(16, config.chunk),
              "grammar_compile_timeout_seconds": 120}     # a loaded CI box is not a finding
    if config.kv_bits:
        common |= {"kv_bits": str(config.kv_bits), "quantized_kv_start": config.quant_start,
                   "kv_quant_scheme": config.kv_scheme}
    if not warm:
        return engine_settings(path, prompt_cache_max_entries_global=0, shared_prefix_min_tokens=0,
                               speculative="off", max_concurrent_sequences=1, **common)
    warm_only = {"shared_prefix_min_tokens": config.min_shared, "speculative": "auto" if config.speculative else "off",
                 "max_concurrent_sequences": config.max_sequences, "prompt_cache_max_bytes": budget}
    if config.disk:
        warm_only |= {"disk_cache_dir": str(tmp / "disk"), "disk_cache_min_tokens": 1}
        if config.keep_on_exit:
            warm_only |= {"disk_cache_min_tokens": 1 << 20, "disk_keep_on_exit": True}
    return engine_settings(path, **common, **warm_only)


class Harness:
    def __init__(self, config: Config, model_path: Path, tmp: Path) -> None:
        self.config, self.path, self.tmp = config, Path(model_path), Path(tmp)
        if config.disk:
            shutil.rmtree(self.tmp / "disk", ignore_errors=True)
        self.cold = build_engine(_settings(self.path, config, self.tmp, warm=False))
        self.budget = 0
        if config.budget_tokens:
            per_token, per_seq = measured_token_bytes(self.cold)
            self.budget = per_token * config.budget_tokens + per_seq
        self.warm = self._warm()
        self.log: list[Any] = []          # waves (lists of Req) and "restart", in order: the replay
        self.findings: list[Finding] = []
        self.stats = Stats()
        self.waves = 0                  # waves served together so far
        self._ids = itertools.count()
        self._compilers: dict[int, Any] = {}

    def _warm(self) -> Any:
        eng = build_engine(_settings(self.path, self.config, self.tmp, warm=True, budget=self.budget))
        eng._fuzz_spy = _spy(eng)
        eng._fuzz_batching = batching_support(eng)[0]
        # speculation decides from tokens alone (the prior), never from step times: a run -- and the
        # case a finding is shrunk to -- replays exactly, on any machine (LESSONS 53, 59)
        costs = eng.speculation.costs
        costs.wants_plain, costs.cost = (lambda rows: False), costs.prior_cost
        return eng

    def close(self) -> None:
        for eng in (self.warm, self.cold):
            try:
                eng.state.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass

    # ------------------------------------------------------------------ requests -> jobs
    def _grammar(self, eng: Any) -> Any:
        from mlxstack.constraints import GrammarCompiler, spec_for_request

        comp = self._compilers.get(id(eng))
        if comp is None:
            comp = self._compilers[id(eng)] = GrammarCompiler.for_tokenizer(eng.loaded.tokenizer, stop_ids=eng.stop_ids)
        return comp.compile(spec_for_request(response_format={
            "type": "json_schema", "json_schema": {"schema": PERSON, "strict": True}}))

    def _job(self, eng: Any, req: Req, cancelled: Any = lambda: False) -> ChatJob:
        params = SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens, seed=req.seed,
                                grammar=self._grammar(eng) if req.grammar else None)
        return ChatJob(request_id=req.rid, messages=[dict(m) for m in req.messages], tools=None, priority=req.priority,
                       enable_thinking=False, params=params, stop=[], body={"session_id": req.session},
                       headers={}, emit=lambda _t: None, is_cancelled=cancelled,
                       response_format={"type": "json_schema", "json_schema": {"schema": PERSON}} if req.grammar else None,
                       scope=scope_of("", req.scope),
                       breakpoints=tuple(CacheBreakpoint(int(m), None if c is None else int(c), t)
                                         for m, c, t in req.marks))

    # ------------------------------------------------------------------ one wave
    def run(self, wave: list[Req]) -> list[Served]:
        """Serve ``wave`` concurrently on the warm engine, then each request alone on the cold one;
        record findings. Returns the warm side's outcomes (in wave order)."""
        self.log.append([replace(r) for r in wave])
        warm = self._serve_together(wave)
        for served in warm:
            self._check(served)
        return warm

    def restart(self) -> None:
        """The warm engine stops and starts again on the same disk tier (RAM state lost)."""
        self.log.append("restart")
        self.warm.state.close()
        self.warm = self._warm()
        self.stats.restarts += 1

    def _serve_together(self, wave: list[Req]) -> list[Served]:
        eng = self.warm
        # priorities on: a request marked urgent that arrives mid-wave preempts rows; the rows left
        # beside it (PRIORITY_DECODE_ROWS, or what measured steps afford) go 0, 1, 2 over the waves
        self.waves += 1
        sched = EngineCore(eng, eng.settings.max_concurrent_sequences or 8, eng.settings.prefill_chunk_tokens,
                          batching=eng._fuzz_batching, policy=PriorityPolicy(True, self.waves % 3, 30.0))
        steps = [0]
        out = [Served(r) for r in wave]
        futures: list[Future | None] = [None] * len(wave)
        backlog = list(range(len(wave)))
        spy = eng._fuzz_spy
        spy.clear()
        while backlog or not sched.idle():
            while True:   # the worker's admission (engine/worker.py _admit) among those arrived
                here = [i for i in backlog if wave[i].arrive <= steps[0]]
                if not here:
                    break
                i = here[sched.pick_next([(wave[k].priority, 0.0) for k in here])]
                if not sched.room_for(wave[i].priority):
                    break
                backlog.remove(i)
                f: Future = Future()
                f.set_running_or_notify_cancel()
                sched.admit(self._job(eng, wave[i], _hang_up(wave[i], steps, sched)), f)
                futures[i] = f
            if sched.idle():
                steps[0] += 1          # the rest arrive later
                continue
            sched.step()
            steps[0] += 1
            if steps[0] > 20000:
                raise RuntimeError("the scheduler did not finish the wave in 20000 steps")
        self.stats.shared_prefills += sched.shared_prefills
        self.stats.parked += sched.parked_total
        self.stats.preemptions += sched.preemptions
        self.stats.features |= {name for name, n in (("shared-prefill", sched.shared_prefills),
                                                     ("preempted", sched.preemptions),
                                                     ("set-aside", sched.group.pauses),
                                                     ("paused-whole", sched.group.unpaused),
                                                     ("parked", sched.parked_total),
                                                     ("batched", sched.batch_peak > 1),
                                                     ("restart", self.stats.restarts)) if n}
        counters = eng.state.counters.snapshot()
        self.stats.features |= {k for k in ("spills", "evictions", "hits_disk", "spec_accepted", "salvaged_prefill_tokens", "disconnects",
                                                 "echo_closes", "echo_refeeds", "hits_snapshot") if counters.get(k)}
        for i, (served, f) in enumerate(zip(out, futures)):
            try:
                o = f.result(timeout=0)
                served.text, served.finish, served.cached = o.raw_text, o.finish_reason, o.cached_tokens
            except Exception as exc:  # noqa: BLE001 - a finding
                served.error = exc
            served.prompt, served.tokens = spy.get(wave[i].rid, (None, None))
        return out

    def _check(self, warm: Served) -> None:
        req = warm.req
        self.stats.requests += 1
        self.stats.features.add(req.origin or "request")
        if warm.error is not None:
            if isinstance(warm.error, ContextLengthExceeded) and \
                    isinstance(self.serve_alone(self.cold, req).error, ContextLengthExceeded):
                self.stats.refused += 1          # a conversation grown past the window: refused alike
                return
            self.findings.append(Finding("error", req, f"{type(warm.error).__name__}: {str(warm.error)[:300]}"))
            return
        if req.hang_up is not None and warm.finish == "cancelled":
            self.stats.hung_up += 1
            return
        self.stats.reused_tokens += warm.cached
        if req.fresh_scope and warm.cached:
            self.findings.append(Finding("scope", req, f"the first request of scope {req.scope!r} reused "
                                                       f"{warm.cached} tokens of another scope"))
            return
        cold = self.serve_alone(self.cold, req)
        if cold.error is not None:
            self.findings.append(Finding("error", req, f"cold reference failed: {cold.error!r}"))
            return
        if warm.prompt != cold.prompt:
            self.findings.append(Finding("prompt", req, f"model input differs at token {_first_diff(warm.prompt, cold.prompt)}"))
            return
        self.stats.compared += 1
        warm.verified = warm.tokens == cold.tokens
        if not warm.verified:
            at = _first_diff(warm.tokens, cold.tokens)
            self.findings.append(Finding("mismatch", req, f"generated tokens differ at {at}: warm {warm.text[:80]!r} "
                                                          f"cold {cold.text[:80]!r} (cached {warm.cached})"))

    def serve_alone(self, eng: Any, req: Req) -> Served:
        spy = getattr(eng, "_fuzz_spy", None) or _spy(eng)
        eng._fuzz_spy = spy
        spy.clear()
        served = Served(req)
        try:
            o = eng.run(self._job(eng, req))
            served.text, served.finish, served.cached = o.raw_text, o.finish_reason, o.cached_tokens
        except Exception as exc:  # noqa: BLE001
            served.error = exc
        served.prompt, served.tokens = spy.get(req.rid, (None, None))
        return served


class _Spy(dict):
    """request id -> (model tokens fed, generated tokens), recorded at ``engine.finish``."""


def _spy(eng: Any) -> _Spy:
    seen = _Spy()
    real = eng.finish

    def finish(seq: Any, *args: Any, **kwargs: Any) -> Any:
        seen[seq.job.request_id] = (list(seq.prep.model_tokens), list(seq.generated))
        return real(seq, *args, **kwargs)

    eng.finish = finish
    return seen


def _hang_up(req: Req, steps: list[int], sched: EngineCore) -> Any:
    """``is_cancelled`` for a request that hangs up: after ``n`` steps once it is prefilling
    ("prefill") or once it decodes ("decode")."""
    if req.hang_up is None:
        return lambda: False
    when, n = req.hang_up
    start = [None]

    def cancelled() -> bool:
        seq = next((s for s in [*sched.prefilling, *sched.group.seqs] if s.job.request_id == req.rid), None)
        if start[0] is None and seq is not None and (when == "prefill" or seq in sched.group.seqs):
            start[0] = steps[0]
        return start[0] is not None and steps[0] - start[0] >= n

    return cancelled


def _first_diff(a: list[int] | None, b: list[int] | None) -> int:
    if a is None or b is None:
        return -1
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
