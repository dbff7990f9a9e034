"""Prometheus metrics for the MLX server: ``GET /metrics`` (text format 0.0.4).

    metrics = install_metrics(app)     # once the model is loaded (server/common/features.py does it)
    curl -s localhost:8080/metrics | grep mlxstack_

Two sources, no double bookkeeping:
- ``EngineCollector`` reads what the engine already counts (``state.counters``, ``state.stats()``,
  ``app.status_counts``, the worker's queue) at scrape time.
- Histograms (TTFT, prefill/decode tokens per second, cache reuse ratio) are fed per request by an
  ``EngineState.on_record`` hook, because the engine keeps only the last rows, not distributions.

Each ``RequestMetrics`` owns its ``CollectorRegistry``: several Apps in one process (tests) never
share or collide in the global registry.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..cache.counters import CORRECTNESS_COUNTERS, MATCH_TYPES

log = logging.getLogger("mlxstack.metrics")

try:
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as CONTENT_TYPE
except ImportError:  # older prometheus_client: its "latest" is 0.0.4
    from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOK_S_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000)
RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


class EngineCollector(Collector):
    """Counters and gauges read from the live App at scrape time."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        app = self.app
        with app._status_lock:
            statuses = dict(app.status_counts)
        responses = CounterMetricFamily("mlxstack_http_responses", "Chat responses by HTTP status.", labels=["status"])
        for status, n in sorted(statuses.items()):
            responses.add_metric([str(status)], n)
        yield responses

        yield GaugeMetricFamily("mlxstack_queue_depth", "Requests waiting for the inference worker.",
                                value=app.worker.queue_depth)
        yield GaugeMetricFamily("mlxstack_worker_busy", "1 while the inference worker runs a job.",
                                value=1 if app.worker.busy else 0)
        yield GaugeMetricFamily("mlxstack_model_ready", "1 once the model is loaded.", value=1 if app.ready else 0)
        sched = getattr(app.worker, "core", None)
        yield GaugeMetricFamily("mlxstack_active_sequences", "Requests in flight (prefilling or decoding).",
                                value=app.worker.active_sequences)
        yield GaugeMetricFamily("mlxstack_batch_size", "Sequences in the last decode forward pass.",
                                value=sched.last_batch if sched is not None else 0)
        yield CounterMetricFamily("mlxstack_batched_prefills", "Scheduler steps that prefilled several short "
                                  "prompts in one forward pass.", value=sched.short_batches if sched is not None else 0)
        yield CounterMetricFamily("mlxstack_turns_closed_together", "Turns closed (last token + turn closer fed) "
                                  "in one forward pass with other sequences finishing in the same step.",
                                  value=sched.closed_together if sched is not None else 0)
        yield GaugeMetricFamily("mlxstack_waiting_for_memory", "Started requests waiting for KV memory "
                                "(admission by PROMPT_CACHE_MAX_BYTES).",
                                value=len(sched.waiting_memory) if sched is not None else 0)
        yield CounterMetricFamily("mlxstack_waited_for_memory", "Requests that had to wait for KV memory before "
                                  "they could start.", value=sched.parked_total if sched is not None else 0)
        yield GaugeMetricFamily("mlxstack_preempted_sequences", "Decode rows out of the batch for a more urgent "
                                "request (PRIORITY_SCHEDULING), their KV kept.",
                                value=len(sched.preempted) if sched is not None else 0)
        yield CounterMetricFamily("mlxstack_preemptions", "Decode rows that left the batch for a more urgent "
                                  "request.", value=sched.preemptions if sched is not None else 0)
        queued = GaugeMetricFamily("mlxstack_queued_requests", "Chat requests waiting for a row, by priority "
                                   "(lower goes first).", labels=["priority"])
        for prio, n in app.worker.queued_by_priority().items():
            queued.add_metric([str(prio)], n)
        yield queued
        flight = GaugeMetricFamily("mlxstack_requests_in_flight", "Requests in flight, by priority and status.",
                                   labels=["priority", "status"])
        for (prio, status), n in sorted((sched.in_flight_counts() if sched is not None else {}).items()):
            flight.add_metric([str(prio), status], n)
        yield flight
        yield GaugeMetricFamily("mlxstack_max_concurrent_sequences", "MAX_CONCURRENT_SEQUENCES in effect.",
                                value=sched.max_sequences if sched is not None else 1)
        info = GaugeMetricFamily("mlxstack_model_info", "The served model (value is always 1).",
                                 labels=["model", "family"])
        info.add_metric([str(app.model_id), str(app.family)], 1)
        yield info
        yield from _rank_metrics(getattr(app, "lockstep", None))

        state = app.state
        if state is None:
            return
        c = state.counters.snapshot()
        stats = state.stats()

        def counter(name: str, doc: str, key: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=c.get(key, 0))

        yield counter("mlxstack_requests", "Chat requests the engine completed (any finish reason).", "requests")
        yield counter("mlxstack_cached_tokens", "Prompt tokens served from the prompt cache.", "cached_tokens")
        yield counter("mlxstack_prefilled_tokens", "Prompt tokens computed by prefill (not from cache).",
                      "prefilled_tokens")
        hits = CounterMetricFamily("mlxstack_cache_hits", "Prompt cache hits by match type.", labels=["match_type"])
        for mt in sorted(set(MATCH_TYPES) | {k[5:] for k in c if k.startswith("hits_")}):
            hits.add_metric([mt], c.get(f"hits_{mt}", 0))
        yield hits
        yield counter("mlxstack_cache_misses", "Requests with no reusable cache entry.", "misses")
        yield counter("mlxstack_cache_evictions", "Cache entries evicted (all reasons).", "evictions")
        by_reason = CounterMetricFamily("mlxstack_cache_evictions_by_reason", "Cache entries evicted, by reason.",
                                        labels=["reason"])
        for key in sorted(k for k in c if k.startswith("evictions_")):
            by_reason.add_metric([key[len("evictions_"):]], c[key])
        yield by_reason
        correctness = CounterMetricFamily(
            "mlxstack_cache_correctness",
            "Correctness counters; any non-zero value is a cache bug to investigate (see cache/counters.py).",
            labels=["kind"])
        for kind in CORRECTNESS_COUNTERS:
            correctness.add_metric([kind], c.get(kind, 0))
        yield correctness
        yield counter("mlxstack_cache_key_safety_fallbacks",
                      "Requests whose canonical cache key was dropped for the model tokens (safety fallback).",
                      "cache_key_safety_fallback")
        yield counter("mlxstack_client_disconnects", "Generations stopped because the client went away.",
                      "disconnects")
        yield counter("mlxstack_watchdog_aborts", "Generations stopped by GENERATION_WATCHDOG_SECONDS.",
                      "watchdog_aborts")

        gauges = (
            ("mlxstack_cache_bytes", "Bytes held by prompt cache entries.", "bytes"),
            ("mlxstack_kv_bytes", "KV / state bytes resident in RAM: the requests in flight (a batch's slab, rows, "
             "prompts in prefill, draft model caches; each array counted once) plus the RAM cache tier.", "kv_bytes"),
            ("mlxstack_cache_budget_bytes", "Prompt cache memory budget (PROMPT_CACHE_MAX_BYTES or derived).",
             "budget_bytes"),
            ("mlxstack_cache_entries", "Prompt cache entries (all pools).", "entries"),
            ("mlxstack_cache_snapshot_entries", "Prompt cache entries in the snapshot pool.", "snapshot_entries"),
            ("mlxstack_cache_tokens", "Tokens held by prompt cache entries.", "tokens"),
            ("mlxstack_cache_sessions", "Sessions tracked by the session index.", "sessions"),
        )
        for name, doc, key in gauges:
            yield GaugeMetricFamily(name, doc, value=stats.get(key, 0) or 0)

        yield counter("mlxstack_salvaged_prefill_tokens",
                      "Prompt tokens prefilled by requests that were aborted, kept in the cache for the retry.",
                      "salvaged_prefill_tokens")
        yield counter("mlxstack_cache_spills", "RAM cache entries moved to the disk tier instead of being dropped.",
                      "spills")
        yield counter("mlxstack_store_failures", "Finished requests whose KV could not be stored (logged).",
                      "store_failures")
        yield counter("mlxstack_spec_proposed_tokens",
                      "Draft tokens proposed by speculative decoding (prompt lookup, draft model, grammar), all rows.",
                      "spec_proposed")
        yield counter("mlxstack_draft_model_tokens", "Tokens the draft model (DRAFT_MODEL) decoded as drafts.",
                      "draft_tokens")
        yield counter("mlxstack_draft_model_fed_tokens",
                      "Tokens the draft model was fed to catch up (its prompt prefill included; DRAFT_WINDOW bounds each).",
                      "draft_fed")
        yield counter("mlxstack_draft_model_reused_tokens",
                      "Tokens a request found in the draft model's stored cache (not fed again).", "draft_reused")
        yield counter("mlxstack_spec_accepted_tokens",
                      "Draft tokens the model accepted (each saved one decode step for its row).", "spec_accepted")
        yield counter("mlxstack_spec_steps", "Decode steps that verified drafts (one forward for the batch).",
                      "spec_steps")
        quant = stats.get("kv_quant") or {}
        bytes_family = GaugeMetricFamily("mlxstack_cache_quantized_bytes",
                                         "Bytes of RAM cache entries held as quantised K/V (KV_BITS), by scheme and bits.",
                                         labels=["scheme", "bits"])
        bytes_family.add_metric([str(quant.get("scheme", "off")), str(quant.get("bits", 0))],
                                stats.get("quantized_bytes", 0) or 0)
        yield bytes_family
        codes = stats.get("recurrent_state_codes") or {}
        yield GaugeMetricFamily("mlxstack_cache_recurrent_state_bits",
                                "Bits of the TurboQuant codes stored recurrent states are kept as "
                                "(RECURRENT_STATE_BITS: lossy); 0 = exact.", value=codes.get("bits", 0))
        disk = stats.get("disk")
        if disk:
            for key, doc in (("entries", "Entries on the disk tier."), ("bytes", "Bytes on the disk tier."),
                             ("max_bytes", "Disk tier byte budget (DISK_CACHE_MAX_BYTES or derived).")):
                yield GaugeMetricFamily(f"mlxstack_disk_{key}", doc, value=disk.get(key, 0))
            for key, doc in (("hits", "Prompt cache hits served by loading an entry from disk."),
                             ("writes", "Entries written to the disk tier."),
                             ("evictions", "Disk tier evictions (least recently used first)."),
                             ("corrupt_dropped", "Disk files dropped because they failed verification."),
                             ("load_failures", "Disk hits that could not be loaded (dropped, served cold)."),
                             ("dropped_writes", "Disk writes dropped because the write queue was full.")):
                yield CounterMetricFamily(f"mlxstack_disk_{key}", doc, value=disk.get(key, 0))


class RequestMetrics:
    """The per-App registry: the scrape-time collector plus per-request histograms."""

    def __init__(self, app: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(app))
        self.ttft = Histogram("mlxstack_ttft_seconds", "Time to first token (queue excluded: from worker start).",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.prefill = Histogram("mlxstack_prefill_tokens_per_second",
                                 "Prefill speed per request (requests that prefilled at least one token).",
                                 buckets=TOK_S_BUCKETS, registry=self.registry)
        self.decode = Histogram("mlxstack_decode_tokens_per_second",
                                "Decode speed per request (requests that generated at least two tokens).",
                                buckets=TOK_S_BUCKETS, registry=self.registry)
        self.reuse = Histogram("mlxstack_cache_reuse_ratio", "Per request: cached tokens / prompt tokens.",
                               buckets=RATIO_BUCKETS, registry=self.registry)
        self.queue_wait = Histogram("mlxstack_queue_wait_seconds", "Time a request waited before it started.",
                                    buckets=TTFT_BUCKETS, registry=self.registry)
        self.batch = Histogram("mlxstack_request_batch_size", "Per request: the largest decode batch it was part of.",
                               buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32), registry=self.registry)
        self.total = Histogram("mlxstack_request_duration_seconds", "Engine time per request (prepare to last token).",
                               buckets=TTFT_BUCKETS, registry=self.registry)

    def observe(self, row: dict) -> None:
        """``EngineState.on_record`` hook: one call per finished request."""
        if row.get("ttft_s") is not None:
            self.ttft.observe(float(row["ttft_s"]))
        if row.get("total_s") is not None:
            self.total.observe(float(row["total_s"]))
        if row.get("queue_wait_s") is not None:
            self.queue_wait.observe(float(row["queue_wait_s"]))
        if row.get("batch_size_max"):
            self.batch.observe(float(row["batch_size_max"]))
        # An exact hit prefills nothing: its "speed" would be 0 or infinite, so it is not a sample.
        if row.get("prefilled_tokens", 0) > 0 and (row.get("prefill_tok_s") or 0) > 0:
            self.prefill.observe(float(row["prefill_tok_s"]))
        if row.get("completion_tokens", 0) > 1 and (row.get("decode_tok_s") or 0) > 0:
            self.decode.observe(float(row["decode_tok_s"]))
        prompt = row.get("prompt_tokens") or 0
        if prompt > 0:
            self.reuse.observe(min(1.0, (row.get("cached_tokens") or 0) / prompt))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _rank_metrics(lock: Any) -> Iterator[Metric]:
    """DISTRIBUTED: the group's ranks, each rank's memory (as it last reported, about once a
    second while it works) and the cost of the per-turn broadcast."""
    yield GaugeMetricFamily("mlxstack_ranks", "Ranks serving the model (1: one process).",
                            value=lock.size if lock is not None else 1)
    if lock is None:
        return
    s = lock.stats()
    yield CounterMetricFamily("mlxstack_lockstep_turns", "Worker turns broadcast to the ranks.", value=s["turns"])
    yield CounterMetricFamily("mlxstack_lockstep_share_seconds", "Time rank 0 spent sending the turns' records.",
                              value=s["share_seconds"])
    for name, key, doc in (("mlxstack_rank_active_memory_bytes", "active_memory", "MLX memory in use, per rank."),
                           ("mlxstack_rank_peak_memory_bytes", "peak_memory", "MLX peak memory, per rank."),
                           ("mlxstack_rank_rss_bytes", "rss", "Resident memory of each rank's process.")):
        g = GaugeMetricFamily(name, doc, labels=["rank"])
        for r in s["per_rank"]:
            g.add_metric([str(r["rank"])], r.get(key, 0))
        yield g


def install_metrics(app: Any) -> RequestMetrics:
    """Register the histogram hook and ``GET /metrics`` on a loaded App."""
    metrics = RequestMetrics(app)
    app.state.on_record.append(metrics.observe)
    app.extra_get_routes["/metrics"] = lambda h: h._send(200, metrics.render(), CONTENT_TYPE)
    app.metrics = metrics
    return metrics
