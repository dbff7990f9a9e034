#!/usr/bin/env python3
"""Benchmark guard: the project's headline figures side by side in one run, each a RATIO of two
things measured in that same run (never an absolute number compared across machines), judged
against the committed baseline (benchmarks/baseline.json) for this backend ("cpu", or "cuda"
with mlx[cuda]). Exit 1 when a figure drops past its tolerance, below its target, or its replies
are not identical; 0 otherwise. Not part of CI: ~12 min on the reference machine (2 cores).

Stages and their figures (benchmarks/guard/verdict.py lists them):
  bandwidth  decode_bandwidth: single-stream decode tok/s (SPECULATIVE=off, in process) x the
             model's weight bytes / the memory read bandwidth measured here (numpy sums of 1 GiB
             on 1 and 2 threads, best; on a GPU an MLX sum on the device)
  grammar    grammar8: 8 rows decoding with a JSON-schema response_format / the same 8 rows
             without, tok/s over steps where all 8 decode (bench_structured.py's decode bench)
  warm       restart_warm_4k, ram_warm_4k: TTFT of a continuing turn at ~4k tokens, cold (one
             cold prefill of the same tokens) / after a restart with the disk tier (median of
             restarts) and / warm in RAM (bench_disk.py's engines, in process)
  agents     agents8_short, agents8_long: 8 concurrent multi-turn agent sessions, aggregate turn
             tok/s over warm turns, ours / mlx_lm.server, ~340-token system prompt and ~2k-token
             shared prompt (bench_concurrency.py's run_sessions; ours on its own port: see below)
  spec       spec_copy, spec_loop, spec_free, spec_mixed8: decode tok/s (first streamed token to
             the last) with SPECULATIVE=auto / off, two whole stacks streamed through LiteLLM,
             rounds interleaved in alternating order; replies must be identical
  priority   priority8: the user's question asked while 8 Claude Code sub-agents decode (priorities
             on, through LiteLLM): its TTFT alone / behind them (bench_priority.py); its reply
             must be its reply alone

Every ratio over rounds is the median of the per-round ratios. ``--set KEY=VALUE`` changes OUR
server / engines in every stage (never mlx_lm.server; the speculation stage's reference stack
stays SPECULATIVE=off and the bandwidth stage decodes with SPECULATIVE=off), so
``--set SPECULATIVE=off --only spec`` is a regression the guard must report (exit 1).

    .venv/bin/python benchmarks/bench_guard.py                                  # all stages
    .venv/bin/python benchmarks/bench_guard.py --only spec grammar              # some stages
    .venv/bin/python benchmarks/bench_guard.py --only spec --set SPECULATIVE=off   # must exit 1
    .venv/bin/python benchmarks/bench_guard.py --json /tmp/guard.json --markdown --docs   # table -> docs/benchmarks.md
    .venv/bin/python benchmarks/bench_guard.py --update-baseline                # this run -> the baseline
    .venv/bin/python benchmarks/bench_guard.py --from-json /tmp/guard.json --markdown   # judge a saved run
"""
from __future__ import annotations

import argparse
import atexit
import datetime as _dt
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))         # probelib
sys.path.insert(0, str(REPO / "benchmarks"))    # guard, the bench_* stages

from guard.verdict import (  # noqa: E402  (pure: no MLX)
    BY_NAME,
    DOCS_PAGE,
    FIGURES,
    STAGES,
    MarkerError,
    judge,
    median_of_ratios,
    parse_sets,
    render_markdown,
    render_text,
    replace_between_markers,
    skeleton_baseline,
    stages_for,
    updated_baseline,
)

DEFAULT_BASELINE = REPO / "benchmarks" / "baseline.json"
STACK_KEY, STACK_MLX_KEY = "sk-bench-guard", "sk-bench-guard-mlx"
BUSY_WARN_CORES = 0.25     # other processes' average CPU (cores) during a stage that makes its ratios noise

# ----------------------------------------------------------------------------- the workloads
CHECKLIST_WORDS = ["logs", "tests", "docs", "config", "ports", "keys", "cache", "disk", "build", "deps", "lint",
                   "notes"]
SPEC_COPY = ("Here is a checklist:\n"
             + "\n".join(f"- item {n}: check the {w} before release" for n, w in enumerate(CHECKLIST_WORDS, 1))
             + "\nWrite the checklist again exactly.")
SPEC_LOOP = "Write the word 'hello' 50 times."
SPEC_FREE = "Write a short story about a robot who learns to paint."
# bench_concurrency.py's settings for "ours batched" (its main()'s ``common``), 8 rows
AGENTS_OURS_ENV = {"DEFAULT_TEMPERATURE": "0", "DEFAULT_REPETITION_PENALTY": "1.0", "ENABLE_REQUEST_LOGGING": "false",
                   "DISK_CACHE_DIR": "off", "PREFILL_CHUNK_TOKENS": "256", "MAX_QUEUED_REQUESTS": "64",
                   "MAX_CONCURRENT_SEQUENCES": "8"}


# ----------------------------------------------------------------------------- cleanup
_LIVE: list = []            # started servers / stacks (each has .stop()); stopped on any exit
_LIVE_LOCK = threading.Lock()


def _register(obj) -> None:
    with _LIVE_LOCK:
        _LIVE.append(obj)


def _release(obj) -> None:
    with _LIVE_LOCK:
        if obj in _LIVE:
            _LIVE.remove(obj)
    obj.stop()


def _stop_all() -> None:
    with _LIVE_LOCK:
        live = list(reversed(_LIVE))
        _LIVE.clear()
    for obj in live:
        try:
            obj.stop()
        except Exception as exc:  # noqa: BLE001 - keep stopping the others
            print(f"[guard] stopping {obj!r}: {exc}", file=sys.stderr)


def _on_signal(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def log(msg: str) -> None:
    print(f"[guard {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- the machine
def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if not cpu:
        import platform

        cpu = platform.processor() or platform.machine()
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        ram = float("nan")
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(ram, 1)}


def detect_backend() -> str:
    """"cuda" where MLX computes on an NVIDIA GPU (mlx[cuda]), "metal" on Apple silicon, else "cpu"."""
    import mlx.core as mx

    if mx.default_device() != mx.gpu:
        return "cpu"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    metal = getattr(mx, "metal", None)
    if metal is not None and metal.is_available():
        return "metal"
    return "cpu"


# ----------------------------------------------------------------------------- other load on the machine
def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU ticks used so far) for every process (Linux /proc; {} elsewhere)."""
    out = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(d.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))   # ppid, utime + stime
        except (OSError, IndexError, ValueError):
            continue
    return out


class BusyMeter:
    """CPU used by processes outside this guard's process tree (another test run, a build), as
    cores on average since the last ``take()``: ratios measured on a busy 2-core machine are
    noise (a decode step on two threads slows down ~5x when one core is taken)."""

    def __init__(self, every: float = 2.0) -> None:
        self.every = every
        self.enabled = Path("/proc/self/stat").exists()
        self._lock = threading.Lock()
        self._ticks = 0
        self._since = time.monotonic()
        self._prev = self._others()
        self._stop = threading.Event()
        if self.enabled:
            threading.Thread(target=self._loop, daemon=True, name="busy-meter").start()

    def _others(self) -> dict[int, int]:
        if not self.enabled:
            return {}
        table = _proc_table()
        kids: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            kids.setdefault(ppid, []).append(pid)
        ours, todo = {os.getpid()}, [os.getpid()]
        while todo:
            for c in kids.get(todo.pop(), []):
                ours.add(c)
                todo.append(c)
        return {pid: ticks for pid, (_, ticks) in table.items() if pid not in ours}

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            now = self._others()
            used = sum(t - self._prev.get(pid, 0) for pid, t in now.items() if t >= self._prev.get(pid, 0))
            with self._lock:
                self._ticks += used if self._prev else 0
            self._prev = now

    def take(self) -> float:
        """Cores other processes used on average since the last call."""
        with self._lock:
            ticks, self._ticks = self._ticks, 0
            since, self._since = self._since, time.monotonic()
        secs = max(1e-6, self._since - since)
        return ticks / os.sysconf("SC_CLK_TCK") / secs if self.enabled else 0.0

    def stop(self) -> None:
        self._stop.set()


# ----------------------------------------------------------------------------- in-process engines
class Ctx:
    """What the stages share: options, --set values, the model loaded once for the in-process stages."""

    def __init__(self, args: argparse.Namespace, sets: dict[str, str], backend: str) -> None:
        self.args, self.sets, self.backend = args, sets, backend
        self._loaded = None
        self.info: dict = {}       # per stage: what else it saw (acceptance, ports, ...), into --json

    def settings(self, forced: dict | None = None, **stage):
        """bench_disk.py's settings (greedy, no request logs, disk tier off) + this stage's keys +
        the --set values + what the stage forces (a reference side's definition)."""
        from bench_disk import settings

        return settings(**{**{k.upper(): v for k, v in stage.items()}, **self.sets, **(forced or {})})

    @property
    def loaded(self):
        if self._loaded is None:
            from mlxstack.models.loader import hf_offline_env, load_model

            hf_offline_env()
            t0 = time.perf_counter()
            self._loaded = load_model(self.settings())
            log(f"model {self._loaded.model_id} loaded in process in {time.perf_counter() - t0:.1f} s")
        return self._loaded


def free_memory() -> None:
    gc.collect()
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # noqa: BLE001
        pass


def spread(figs: dict[str, dict], own: dict[str, float], total: float) -> None:
    """Each figure's seconds: its own measuring plus an equal share of the stage's overhead
    (starting servers, warm-ups), so the figures' seconds add up to the stage's."""
    rest = max(0.0, total - sum(own.values())) / max(1, len(figs))
    for name, fig in figs.items():
        fig["seconds"] = round(own.get(name, 0.0) + rest, 1)


# ----------------------------------------------------------------------------- stage: bandwidth
def read_bandwidth(backend: str, repeat: int = 5) -> dict:
    """Memory read bandwidth (``best``, bytes/s; the others GB/s): best of ``repeat`` sums of a 1 GiB float32 array, on one
    thread and on two (each summing half; numpy lets go of the GIL in a reduction)."""
    n = 1 << 28    # 1 GiB of float32
    if backend in ("cuda", "metal"):
        import mlx.core as mx

        x = mx.ones((n,), dtype=mx.float32)
        mx.eval(x)
        best = float("inf")
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            mx.eval(x.sum())
            best = min(best, time.perf_counter() - t0)
        return {"device_gb_s": x.nbytes / best / 1e9, "best": x.nbytes / best}
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(n, dtype=np.float32)
    halves = [a[: n // 2], a[n // 2:]]
    one = two = float("inf")
    with ThreadPoolExecutor(2) as pool:
        for _ in range(repeat):
            t0 = time.perf_counter()
            a.sum()
            one = min(one, time.perf_counter() - t0)
            t0 = time.perf_counter()
            list(pool.map(lambda h: h.sum(), halves))
            two = min(two, time.perf_counter() - t0)
    out = {"one_thread_gb_s": a.nbytes / one / 1e9, "two_threads_gb_s": a.nbytes / two / 1e9,
           "best": a.nbytes / min(one, two)}
    del a, halves
    return out


def stage_bandwidth(ctx: Ctx) -> dict[str, dict]:
    from mlx.utils import tree_flatten

    from bench_speculative import run as run_sched
    from mlxstack.engine.factory import make_engine

    t_stage = time.perf_counter()
    quick = ctx.args.quick
    bw = read_bandwidth(ctx.backend)
    engine = make_engine(ctx.loaded, ctx.settings(forced={"SPECULATIVE": "off"}))
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(ctx.loaded.model.parameters()))
    convo = [{"role": "user", "content": SPEC_FREE}]
    run_sched(engine, [convo], 8)                                  # warm-up
    max_tokens = 64 if quick else 128
    rates = []
    for _ in range(1 if quick else 3):
        outs, tps = run_sched(engine, [convo], max_tokens)
        n = outs[0].completion_tokens
        rates.append(tps * (n - 1) / n)                            # (n - 1) tokens after the first / the span
    tok_s = statistics.median(rates)
    value = tok_s * weight_bytes / bw["best"]
    fig = {"value": value, "parts": {"decode_tok_s": round(tok_s, 2), "decode_runs_tok_s": [round(r, 2) for r in rates],
                                     "weight_bytes": weight_bytes,
                                     **{k: round(v, 2) for k, v in bw.items() if k != "best"},
                                     "bandwidth_gb_s": round(bw["best"] / 1e9, 2)},
           "summary": f"{tok_s:.1f} tok/s x {weight_bytes / 1e6:.0f} MB = {tok_s * weight_bytes / 1e9:.1f} GB/s "
                      f"of {bw['best'] / 1e9:.1f} GB/s"}
    fig["seconds"] = round(time.perf_counter() - t_stage, 1)
    return {"decode_bandwidth": fig}


# ----------------------------------------------------------------------------- stage: grammar
def stage_grammar(ctx: Ctx) -> dict[str, dict]:
    from bench_structured import BENCH_PERSON, PEOPLE, make_job, run_jobs
    from mlxstack.server.common.structured import Structured
    from mlxstack.engine.factory import make_engine

    t_stage = time.perf_counter()
    quick = ctx.args.quick
    rows, max_tokens, rounds = 8, (32 if quick else 64), (1 if quick else ctx.args.grammar_rounds)
    settings = ctx.settings()
    engine = make_engine(ctx.loaded, settings)
    structured = Structured.for_model(engine.loaded, engine, settings)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": BENCH_PERSON, "strict": True}}
    variants = (("free", {}), ("schema", {"response_format": fmt}))

    def jobs(fields: dict, tag: str) -> list:
        return [make_job(engine, structured, [{"role": "user", "content": f"Describe {PEOPLE[i % 8]} as a JSON "
                                               f"object with name, age, city, bio and tags. ({tag})"}],
                         max_tokens, f"{tag}{i}", **fields) for i in range(rows)]

    for _, fields in variants:
        run_jobs(engine, jobs(fields, "warm"), rows)               # kernels, masks, the compiled grammar
    rates: dict[str, list[float]] = {"free": [], "schema": []}
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for label, fields in order:
            _, steady = run_jobs(engine, jobs(fields, f"r{r}"), rows)
            full = [dt for n, dt in steady if n == rows]
            rates[label].append(rows * len(full) / sum(full) if full else float("nan"))
    value = median_of_ratios(rates["schema"], rates["free"])
    med = {k: statistics.median(v) for k, v in rates.items()}
    fig = {"value": value, "parts": {"schema_tok_s": round(med["schema"], 2), "free_tok_s": round(med["free"], 2),
                                     "rounds": rounds, "rows": rows, "max_tokens": max_tokens,
                                     "schema_rounds": [round(x, 2) for x in rates["schema"]],
                                     "free_rounds": [round(x, 2) for x in rates["free"]]},
           "summary": f"schema {med['schema']:.1f} / free {med['free']:.1f} tok/s (8 rows)",
           "seconds": round(time.perf_counter() - t_stage, 1)}
    return {"grammar8": fig}


# ----------------------------------------------------------------------------- stage: warm
def stage_warm(ctx: Ctx) -> dict[str, dict]:
    """Turn 1 (~4k tokens) on an engine with the disk tier; its folder copied (flushed); turn 2 on
    that engine (warm in RAM); turn 2 on restarted engines, each on a fresh copy of the folder
    (from disk, median); turn 2 on a cache-off engine (cold, once). Turn 2 echoes turn 1's reply
    as generated (raw text), so every side renders the same tokens without healing state."""
    from bench_disk import engine as make, job, long_conversation
    from mlxstack.runner.shared_prefix import shared_prefix_ok

    t_stage = time.perf_counter()
    quick = ctx.args.quick
    size = 1000 if quick else ctx.args.warm_tokens
    restarts = 1 if quick else ctx.args.warm_restarts
    loaded = ctx.loaded
    size = min(size, loaded.context_length - 200)
    work = Path(tempfile.mkdtemp(prefix="bench-guard-warm-"))
    engines = []
    try:
        disk = work / "kv"
        first = make(ctx.settings(disk_cache_dir=disk, disk_cache_min_tokens=256), loaded)
        engines.append(first)
        shared_prefix_ok(first)                   # decided at load in the server, not in a TTFT
        msgs = long_conversation(loaded.tokenizer, size)
        o1 = first.run(job(msgs))
        follow = msgs + [{"role": "assistant", "content": o1.raw_text}, {"role": "user", "content": "Which one first?"}]
        if not first.state.disk.tier.flush(timeout=120):
            raise RuntimeError("the disk tier did not flush turn 1 in 120 s")
        snapshot = work / "kv-after-turn1"
        shutil.copytree(disk, snapshot)
        ram = first.run(job(follow))                                 # warm in RAM
        first.state.close()
        warms, loads = [], []
        for r in range(restarts):
            copy = work / f"kv-restart-{r}"
            shutil.copytree(snapshot, copy)
            restarted = make(ctx.settings(disk_cache_dir=copy, disk_cache_min_tokens=256), loaded)
            engines.append(restarted)
            shared_prefix_ok(restarted)
            out = restarted.run(job(follow))
            restarted.state.close()
            warms.append(out)
            loads.append(restarted.state.disk.load_seconds)
        cold_engine = make(ctx.settings(forced={"PROMPT_CACHE_MAX_ENTRIES_GLOBAL": "0", "DISK_CACHE_DIR": "off"}),
                           loaded)
        engines.append(cold_engine)
        shared_prefix_ok(cold_engine)
        cold = cold_engine.run(job(follow))
    finally:
        for e in engines:
            try:
                e.state.close()
            except Exception:  # noqa: BLE001
                pass
        shutil.rmtree(work, ignore_errors=True)
    cold_s = cold.timings["ttft_s"]
    warm_s = [w.timings["ttft_s"] for w in warms]
    ram_s = ram.timings["ttft_s"]
    same = all(o.raw_text == cold.raw_text for o in [ram, *warms])
    same_tokens = all(o.prompt_tokens == cold.prompt_tokens for o in [ram, *warms])
    common = {"tokens": cold.prompt_tokens, "cold_ttft_s": round(cold_s, 3), "cold_cached_tokens": cold.cached_tokens,
              "same_prompt_tokens": same_tokens}
    restart = {"value": cold_s / statistics.median(warm_s), "identical": same,
               "parts": {**common, "restart_ttft_s": round(statistics.median(warm_s), 4),
                         "restart_ttft_runs_s": [round(x, 4) for x in warm_s],
                         "restart_cached_tokens": warms[0].cached_tokens,
                         "restart_tier": warms[0].timings.get("cache_tier"),
                         "disk_load_s": round(statistics.median(loads), 4)},
               "summary": f"cold {cold_s:.2f} s / from disk {statistics.median(warm_s):.3f} s at {cold.prompt_tokens} tokens"}
    ramfig = {"value": cold_s / ram_s, "identical": same,
              "parts": {**common, "ram_ttft_s": round(ram_s, 4), "ram_cached_tokens": ram.cached_tokens,
                        "ram_tier": ram.timings.get("cache_tier")},
              "summary": f"cold {cold_s:.2f} s / RAM {ram_s:.3f} s at {cold.prompt_tokens} tokens"}
    if not same_tokens:
        for fig in (restart, ramfig):
            fig["error"] = "the warm and cold sides rendered different prompt lengths"
    figs = {"restart_warm_4k": restart, "ram_warm_4k": ramfig}
    total = time.perf_counter() - t_stage
    # the cold prefill serves both; turn 1 is the restart side's setup: half the stage each
    spread(figs, {}, total)
    return figs


# ----------------------------------------------------------------------------- stage: agents
def stage_agents(ctx: Ctx) -> dict[str, dict]:
    from bench_concurrency import SYSTEM, model_id, run_sessions, stream_chat
    from probelib.servers import ServerProcess

    t_stage = time.perf_counter()
    quick = ctx.args.quick
    rounds = 1 if quick else ctx.args.agents_rounds
    turns = 2 if quick else ctx.args.agents_turns
    max_tokens = 16 if quick else 32
    configs = (("agents8_short", 2), ("agents8_long", 12))
    ours = ServerProcess("ours", env={**AGENTS_OURS_ENV, **ctx.sets})
    _register(ours)
    ref = ServerProcess("mlx_lm")
    _register(ref)
    own = {name: 0.0 for name, _ in configs}
    runs: dict[str, dict[str, list[dict]]] = {name: {"ours": [], "mlx_lm": []} for name, _ in configs}
    try:
        ours.wait_ready(300)
        ref.wait_ready(300)
        log(f"agents: ours on :{ours.port}, mlx_lm.server on :{ref.port} ready after "
            f"{time.perf_counter() - t_stage:.0f} s")
        for _, repeat in configs:    # each system prompt prefilled once per server before the rounds (both
            for srv in (ours, ref):  # keep a prompt cache): a round's cold turn is 8 tails, not 8 x 2k tokens
                stream_chat(srv.root, model_id(srv.root), [{"role": "system", "content": SYSTEM * repeat},
                                                           {"role": "user", "content": "Say ready."}], 1)
        for rnd in range(rounds):
            for name, repeat in configs:
                sides = [("ours", ours), ("mlx_lm", ref)]
                for side, srv in (sides if rnd % 2 == 0 else sides[::-1]):
                    t0 = time.perf_counter()
                    r = run_sessions(srv.root, 8, turns, max_tokens, repeat, first=100 * (rnd + 1))
                    own[name] += time.perf_counter() - t0
                    r.pop("texts", None)
                    runs[name][side].append(r)
                    log(f"agents round {rnd + 1} {name} {side}: turn {r['agg_turn_tok_s']:.1f} tok/s, "
                        f"decode {r['agg_decode_tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50']:.2f} s")
    finally:
        _release(ours)
        _release(ref)
    figs = {}
    for name, repeat in configs:
        o = [r["agg_turn_tok_s"] for r in runs[name]["ours"]]
        m = [r["agg_turn_tok_s"] for r in runs[name]["mlx_lm"]]
        med = lambda side, col: round(statistics.median(r[col] for r in runs[name][side]), 3)  # noqa: E731
        figs[name] = {
            "value": median_of_ratios(o, m),
            "what": BY_NAME[name].what + " (ours direct on its port, as mlx_lm.server)",
            "parts": {"ours_turn_tok_s": med("ours", "agg_turn_tok_s"), "mlx_lm_turn_tok_s": med("mlx_lm", "agg_turn_tok_s"),
                      "round_ratios": [round(a / b, 3) for a, b in zip(o, m) if b],
                      "ours_decode_tok_s": med("ours", "agg_decode_tok_s"),
                      "mlx_lm_decode_tok_s": med("mlx_lm", "agg_decode_tok_s"),
                      "ours_ttft_p50_s": med("ours", "ttft_p50"), "mlx_lm_ttft_p50_s": med("mlx_lm", "ttft_p50"),
                      "ours_uncached_per_warm_turn": med("ours", "uncached_per_warm_turn"),
                      "system_repeat": repeat, "sessions": 8, "turns": turns, "rounds": rounds,
                      "max_tokens": max_tokens, "via": "direct"},
            "summary": f"ours {statistics.median(o):.1f} / mlx_lm {statistics.median(m):.1f} turn tok/s "
                       f"(both direct)"}
    spread(figs, own, time.perf_counter() - t_stage)
    return figs


# ----------------------------------------------------------------------------- stage: spec
def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux /proc; [] elsewhere)."""
    children: dict[int, list[int]] = {}
    for child, (parent, _) in _proc_table().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class Stack:
    """A whole stack (launcher: MLX server + LiteLLM) on its own free ports (probelib's launch_stack)."""

    def __init__(self, label: str, env: dict, mlx_port: int, proxy_port: int, tmp: Path) -> None:
        from probelib.servers import launch_stack

        self.label, self.mlx_port, self.proxy_port = label, mlx_port, proxy_port
        self.proc = None
        tmp.mkdir(parents=True, exist_ok=True)
        full = {"MLX_PORT": str(mlx_port), "PROXY_PORT": str(proxy_port), "LITELLM_MASTER_KEY": STACK_KEY,
                "MLX_API_KEY": STACK_MLX_KEY, "LOG_ROOT": str(tmp / "logs"), "BACKENDS_FILE": str(tmp / "none.yaml"),
                "DISK_CACHE_DIR": "off", "ENABLE_REQUEST_LOGGING": "false", "PROXY_STARTUP_TIMEOUT_SECONDS": "300",
                **env}
        self.env = full
        self.log_path = tmp / "stack.log"
        self.proc, self.log = launch_stack(full, self.log_path, timeout=400)
        _register(self)
        self.base = f"http://127.0.0.1:{proxy_port}"
        self.mlx = f"http://127.0.0.1:{mlx_port}"

    def __repr__(self) -> str:
        return f"Stack({self.label}, proxy :{self.proxy_port}, mlx :{self.mlx_port})"

    def get(self, url: str, key: str) -> dict:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.load(resp)

    def stop(self) -> None:
        if self.proc is None:
            return
        kids = _descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pid in kids:             # anything the launcher left behind, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc = None
        self.log.close()


def start_stacks(specs: list[tuple[str, dict]], tmp: Path) -> dict[str, Stack]:
    """The stacks started at once (each waits for its READY line); all stopped if one fails."""
    from probelib.client import free_ports

    ports = free_ports(2 * len(specs))
    out: dict[str, object] = {}

    def go(i: int, label: str, env: dict) -> None:
        try:
            out[label] = Stack(label, env, ports[2 * i], ports[2 * i + 1], tmp / label)
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[label] = exc

    threads = [threading.Thread(target=go, args=(i, label, env)) for i, (label, env) in enumerate(specs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    bad = {k: v for k, v in out.items() if not isinstance(v, Stack)}
    if bad:
        for v in out.values():
            if isinstance(v, Stack):
                _release(v)
        raise RuntimeError("; ".join(f"stack {k}: {v}" for k, v in bad.items()))
    return out  # type: ignore[return-value]


def stream(base: str, model: str, content: str, max_tokens: int, system: str | None = None) -> dict:
    """One streamed chat completion through LiteLLM (temperature 0, nothing else sampling-related;
    ``system``: a system message first): text, completion tokens (usage), times of the first and
    last content delta."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {STACK_KEY}"})
    first = last = None
    text, usage, deltas = [], {}, 0
    from probelib.client import sse_data

    with urllib.request.urlopen(req, timeout=600) as resp:
        for payload in sse_data(resp):
            frame = json.loads(payload)
            if frame.get("error"):
                raise RuntimeError(f"stream error: {json.dumps(frame)[:500]}")
            if frame.get("usage"):
                usage = frame["usage"]
            for ch in frame.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    deltas += 1
                    text.append(piece)
    tokens = int(usage.get("completion_tokens") or deltas)
    return {"text": "".join(text), "tokens": tokens, "first": first, "last": last, "deltas": deltas}


def run_load(stack: Stack, model: str, contents: list[str], max_tokens: int) -> tuple[float, list[str], int]:
    """``contents`` sent at once (one stream each); aggregate decode tok/s: tokens after each
    stream's first / (last token of any stream - first token of any stream)."""
    results: list[dict] = [{}] * len(contents)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = stream(stack.base, model, contents[i], max_tokens)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(contents))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    timed = [r for r in results if r["first"] is not None and r["last"] is not None and r["tokens"] > 1]
    span = max(r["last"] for r in timed) - min(r["first"] for r in timed) if timed else 0.0
    tokens = sum(r["tokens"] - 1 for r in timed)
    return (tokens / span if span > 0 else float("nan")), [r["text"] for r in results], sum(r["tokens"] for r in results)


def stage_spec(ctx: Ctx) -> dict[str, dict]:
    t_stage = time.perf_counter()
    quick = ctx.args.quick
    rounds = 1 if quick else ctx.args.spec_rounds
    max_tokens = 64 if quick else ctx.args.spec_max_tokens
    loads = {"spec_copy": [SPEC_COPY], "spec_loop": [SPEC_LOOP], "spec_free": [SPEC_FREE],
             "spec_mixed8": [SPEC_COPY] * 4 + [SPEC_FREE] * 4}
    tmp = Path(tempfile.mkdtemp(prefix="bench-guard-spec-"))
    on_env = {"SPECULATIVE": "auto", **ctx.sets}
    off_env = {**ctx.sets, "SPECULATIVE": "off"}
    own = {name: 0.0 for name in loads}
    speeds: dict[str, dict[str, list[float]]] = {n: {"on": [], "off": []} for n in loads}
    identical = {n: True for n in loads}
    tokens = {n: {"on": 0, "off": 0} for n in loads}
    stacks: dict[str, Stack] = {}
    try:
        stacks = start_stacks([("on", on_env), ("off", off_env)], tmp)
        log(f"spec: stacks ready after {time.perf_counter() - t_stage:.0f} s: "
            + ", ".join(repr(s) for s in stacks.values()))
        model = (stacks["on"].get(stacks["on"].base + "/v1/models", STACK_KEY).get("data") or [{}])[0].get(
            "id", "default_model")
        for name, contents in loads.items():         # warm-up: graphs, allocator, the step-cost table
            for side in ("off", "on"):
                run_load(stacks[side], model, contents, 32)
        for r in range(rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for name, contents in loads.items():
                texts = {}
                t0 = time.perf_counter()
                for side in order:
                    tps, texts[side], n = run_load(stacks[side], model, contents, max_tokens)
                    speeds[name][side].append(tps)
                    tokens[name][side] += n
                own[name] += time.perf_counter() - t0
                same = texts["on"] == texts["off"]
                identical[name] &= same
                log(f"spec round {r + 1} {name}: on {speeds[name]['on'][-1]:.1f} / off {speeds[name]['off'][-1]:.1f} "
                    f"tok/s = {speeds[name]['on'][-1] / speeds[name]['off'][-1]:.2f}x, identical {same}")
        try:
            spec_stats = stacks["on"].get(stacks["on"].mlx + "/v1/cache/stats", STACK_MLX_KEY).get("speculation")
        except Exception as exc:  # noqa: BLE001 - informative only
            spec_stats = {"error": str(exc)}
        ctx.info["spec"] = {"speculation_stats_on_side": spec_stats, "model": model}
    finally:
        for s in stacks.values():
            _release(s)
        shutil.rmtree(tmp, ignore_errors=True)
    figs = {}
    for name in loads:
        on, off = speeds[name]["on"], speeds[name]["off"]
        figs[name] = {"value": median_of_ratios(on, off), "identical": identical[name],
                      "what": BY_NAME[name].what + " (two stacks, streamed through LiteLLM)",
                      "parts": {"on_tok_s": round(statistics.median(on), 2), "off_tok_s": round(statistics.median(off), 2),
                                "round_ratios": [round(a / b, 3) for a, b in zip(on, off) if b],
                                "on_tokens": tokens[name]["on"], "off_tokens": tokens[name]["off"],
                                "rounds": rounds, "max_tokens": max_tokens, "streams": len(loads[name]),
                                "via": "LiteLLM"},
                      "summary": f"on {statistics.median(on):.1f} / off {statistics.median(off):.1f} tok/s via LiteLLM"
                                 + ("" if identical[name] else ", REPLIES DIFFER")}
    spread(figs, own, time.perf_counter() - t_stage)
    return figs


# ----------------------------------------------------------------------------- stage: priority
def stage_priority(ctx: Ctx) -> dict[str, dict]:
    """bench_priority.py at 8 sub-agents with PRIORITY_SCHEDULING on (the default), one stack through
    LiteLLM: the user's question asked once 8 rows decode; its TTFT alone (median of 3, right before)
    / behind the 8. Its reply must be its reply alone."""
    from bench_priority import background_load, interactive

    t_stage = time.perf_counter()
    max_tokens, ask_tokens = (60 if ctx.args.quick else 160), 48
    env = {**AGENTS_OURS_ENV, "MAX_CONCURRENT_SEQUENCES": "8", "MAX_QUEUED_REQUESTS": "64", **ctx.sets}
    tmp = Path(tempfile.mkdtemp(prefix="bench-guard-priority-"))
    stacks: dict[str, Stack] = {}
    try:
        stacks = start_stacks([("priority", env)], tmp)
        stack = stacks["priority"]
        model = (stack.get(stack.base + "/v1/models", STACK_KEY).get("data") or [{}])[0].get("id", "default_model")
        interactive(stack.base, model, ask_tokens)          # warm: the question's prefix cached
        t0 = time.perf_counter()
        alone = [interactive(stack.base, model, ask_tokens) for _ in range(3)]
        mixed = background_load(stack.base, stack.mlx, model, 8, max_tokens, True, ask_tokens)
        own = time.perf_counter() - t0
        sched = stack.get(stack.mlx + "/v1/cache/stats", STACK_MLX_KEY).get("scheduler") or {}
    finally:
        for st in stacks.values():
            _release(st)
        shutil.rmtree(tmp, ignore_errors=True)
    a_ttft = statistics.median(a["ttft"] for a in alone)
    ask = mixed["ask"]
    identical = ask["text"] == alone[0]["text"]
    figs = {"priority8": {
        "value": a_ttft / ask["ttft"], "identical": identical,
        "what": BY_NAME["priority8"].what + " (one stack, streamed through LiteLLM)",
        "parts": {"alone_ttft_s": round(a_ttft, 3), "ttft_s": round(ask["ttft"], 3),
                  "alone_decode_tok_s": round(statistics.median(a["decode"] for a in alone), 1),
                  "decode_tok_s": round(ask["decode"], 1), "background": 8, "background_max_tokens": max_tokens,
                  "preemptions": sched.get("preemptions_total"), "resumed": sched.get("resumed_total"),
                  "via": "LiteLLM"},
        "summary": f"TTFT alone {a_ttft:.3f} s / behind 8 sub-agents {ask['ttft']:.3f} s"
                   + ("" if identical else ", REPLY DIFFERS")}}
    spread(figs, {"priority8": own}, time.perf_counter() - t_stage)
    return figs


STAGE_FUNCS = {"bandwidth": stage_bandwidth, "grammar": stage_grammar, "warm": stage_warm, "agents": stage_agents,
               "spec": stage_spec, "priority": stage_priority}
RUN_ORDER = ("bandwidth", "grammar", "warm", "agents", "spec", "priority")   # in-process stages first, one model load


# ----------------------------------------------------------------------------- main
def run_stages(ctx: Ctx, stages: tuple[str, ...]) -> dict[str, dict]:
    figures: dict[str, dict] = {}
    meter = BusyMeter()
    busy = ctx.info.setdefault("other_processes_cpu_cores", {})
    for stage in [s for s in RUN_ORDER if s in stages]:
        t0 = time.perf_counter()
        meter.take()
        log(f"stage {stage} ...")
        try:
            got = STAGE_FUNCS[stage](ctx)
        except Exception as exc:  # noqa: BLE001 - the stage's figures fail, the others still run
            traceback.print_exc()
            took = time.perf_counter() - t0
            names = [f.name for f in FIGURES if f.stage == stage]
            got = {n: {"error": f"{type(exc).__name__}: {exc}"[:500], "seconds": round(took / len(names), 1)}
                   for n in names}
        figures.update(got)
        free_memory()                    # the stage's engines are gone with its frame
        busy[stage] = round(meter.take(), 2)
        if busy[stage] > BUSY_WARN_CORES:
            log(f"WARNING: other processes used {busy[stage]:.2f} cores on average during stage {stage}: "
                f"its ratios are unreliable (run the guard alone)")
        log(f"stage {stage} done in {time.perf_counter() - t0:.0f} s: "
            + ", ".join(f"{n} {g['value']:.2f}" if g.get("value") is not None else f"{n} error" for n, g in got.items()))
    meter.stop()
    return figures


def load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Stages: " + ", ".join(STAGES) + ". Figures: " + ", ".join(BY_NAME),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these stages (or the stages of these figures)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting for OUR server / engines in every stage (repeatable)")
    ap.add_argument("--baseline", type=Path, default=DEFAULT_BASELINE, help=f"default {DEFAULT_BASELINE.relative_to(REPO)}")
    ap.add_argument("--update-baseline", action="store_true",
                    help="write this run's figures as the baseline of this backend (tolerances and targets kept); "
                         "the verdict printed and returned is still the one against the old baseline")
    ap.add_argument("--json", type=Path, metavar="PATH", help="write everything (figures, parts, verdicts) here")
    ap.add_argument("--markdown", action="store_true", help="also print the markdown table (the one docs/benchmarks.md holds)")
    ap.add_argument("--docs", type=Path, nargs="?", const=REPO / DOCS_PAGE, metavar="PATH",
                    help="replace the text between <!-- bench-guard:start --> and <!-- bench-guard:end --> in PATH "
                         f"(default {DOCS_PAGE})")
    ap.add_argument("--readme", type=Path, dest="docs", metavar="PATH", help=argparse.SUPPRESS)  # the old name
    ap.add_argument("--from-json", type=Path, metavar="PATH", help="judge / render a run saved with --json (runs nothing)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes for trying the guard out (~5 min; judged against the targets only, never a baseline)")
    ap.add_argument("--agents-rounds", type=int, default=3)
    ap.add_argument("--agents-turns", type=int, default=3, help="turns per session (the first is cold, not counted)")
    ap.add_argument("--spec-rounds", type=int, default=4)
    ap.add_argument("--spec-max-tokens", type=int, default=160)
    ap.add_argument("--grammar-rounds", type=int, default=3)
    ap.add_argument("--warm-tokens", type=int, default=4000)
    ap.add_argument("--warm-restarts", type=int, default=3)
    args = ap.parse_args()
    try:
        sets = parse_sets(args.set)
        stages = stages_for(args.only)
    except ValueError as exc:
        ap.error(str(exc))

    if args.from_json:
        saved = load_json(args.from_json)
        if not saved.get("figures"):
            ap.error(f"{args.from_json}: no figures in it")
        figures, meta = saved["figures"], saved.get("meta") or {}
        backend = meta.get("backend", "cpu")
    else:
        from mlxstack.config.settings import SPEC_BY_NAME, load_settings
        from mlxstack.system.process_env import reexec_with

        unknown = [k for k in sets if k not in SPEC_BY_NAME]
        if unknown:
            ap.error(f"--set: unknown setting(s) {', '.join(unknown)} (see .env.example)")
        reexec_with(load_settings(env={}), [str(Path(__file__).resolve()), *sys.argv[1:]])  # OpenBLAS preloaded
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGHUP, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)   # also when started in the background (SIGINT inherited ignored)
        atexit.register(_stop_all)
        backend = detect_backend()
        ctx = Ctx(args, sets, backend)
        meta = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"), "commit": git("rev-parse", "--short", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no")), "machine": machine(),
                "backend": backend, "sets": sets, "stages": list(stages), "quick": args.quick,
                "argv": sys.argv[1:]}
        log(f"backend {backend}; {meta['machine']}; commit {meta['commit']}{' (+ local changes)' if meta['dirty'] else ''}; "
            f"stages {', '.join(s for s in RUN_ORDER if s in stages)}" + (f"; --set {sets}" if sets else ""))
        t0 = time.perf_counter()
        try:
            figures = run_stages(ctx, stages)
        finally:
            _stop_all()
        meta["total_seconds"] = round(time.perf_counter() - t0, 1)
        meta["info"] = ctx.info

    baseline = load_json(args.baseline)
    if not baseline:
        print(f"[guard] no baseline at {args.baseline}: figures judged against the default targets only",
              file=sys.stderr)
        baseline = skeleton_baseline()
    judged_against = baseline
    if meta.get("quick"):      # other sizes than the baseline's: judged against the targets only
        judged_against = {**baseline, "backends": {}}
        print("[guard] --quick: sizes differ from the baseline's; judged against the targets only", file=sys.stderr)
    verdicts = judge(figures, judged_against, backend)
    took = meta.get("total_seconds")
    print(f"\n## bench guard: backend {backend}, commit {meta.get('commit')}, "
          f"{(took or 0) / 60:.1f} min{' (--quick)' if meta.get('quick') else ''}"
          + (f", --set {meta.get('sets')}" if meta.get("sets") else "") + "\n")
    print(render_text(verdicts, figures))
    busy = {k: v for k, v in ((meta.get("info") or {}).get("other_processes_cpu_cores") or {}).items()
            if v > BUSY_WARN_CORES}
    if busy:
        print("WARNING: the machine was busy (other processes' CPU, cores on average): "
              + ", ".join(f"{k} {v:.2f}" for k, v in busy.items()) + "; those stages' ratios are unreliable")
    markdown = render_markdown(verdicts, figures, meta)
    if args.markdown:
        print("\n" + markdown)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "figures": figures, "verdicts": [v.__dict__ for v in verdicts],
                                         "passed": not any(v.failed for v in verdicts)}, indent=2) + "\n")
        print(f"[guard] wrote {args.json}")
    if args.docs:
        try:
            args.docs.write_text(replace_between_markers(args.docs.read_text(), markdown))
        except (OSError, MarkerError) as exc:
            print(f"[guard] error: --docs {args.docs}: {exc}", file=sys.stderr)
            return 2
        print(f"[guard] table written into {args.docs}")
    if args.update_baseline:
        if meta.get("quick") or meta.get("sets"):
            print("[guard] not writing a baseline from a --quick run or one with --set", file=sys.stderr)
            return 2
        args.baseline.parent.mkdir(parents=True, exist_ok=True)
        args.baseline.write_text(json.dumps(updated_baseline(baseline, backend, figures, meta), indent=2) + "\n")
        print(f"[guard] baseline for {backend} written to {args.baseline}")
    return 1 if any(v.failed for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
