"""Everything the engine keeps between requests: prompt cache, session layers, healing seam,
counters and the recent-request rows served by /v1/cache/stats.

Only the inference thread mutates these; stats readers take ``rows_lock`` / the counters' lock.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from typing import Any, Callable


from ..cache.counters import CORRECTNESS_COUNTERS, CacheCounters
from ..cache.diagnosis import FingerprintStore, as_dict, describe
from ..cache.disk.backing import DiskBacking
from ..cache.disk.config import plan_disk_cache
from ..cache.disk.tier import DiskTier, DiskTierBusy, disk_namespace
from ..cache.disk.journal import Journal
from ..cache.manager import KVManager, PromptCacheConfig
from ..cache.ranks import RankGroup
from ..runner.kv_bytes import resident_bytes
from ..cache.layer_kinds import QUANTIZED_KINDS, CacheLayout, KVQuant
from ..cache.hashing import namespace_seed, template_hash
from ..cache.sessions import SessionIndex, SessionTurnStore
from ..cache.state_codes import StateCodes
from ..config.settings import Settings
from ..prompt.canonicalize import canonicalize_messages
from ..prompt.healing import HealingStore
from ..models.memory import default_cache_budget

log = logging.getLogger("mlxstack.request")


class EngineState:
    def __init__(self, settings: Settings, model_id: str, template_source: str = "",
                 layout: CacheLayout | None = None, disk_namespace_parts: dict | None = None,
                 kv_quant: KVQuant | None = None, state_codes: StateCodes | None = None) -> None:
        self.settings = settings
        self.counters = CacheCounters()
        self.live_kv_bytes = 0       # KV / state of the requests in flight (runner/kv_bytes.py; the scheduler sets it)
        # several ranks: what differs per rank (its live KV bytes) must not steer a decision
        # every rank makes (the scheduler's admission by memory is off then)
        self.replicated = False
        budget = settings.prompt_cache_max_bytes or default_cache_budget()
        self.cache_budget = budget
        # A cache class we do not understand is never stored half-understood: prefix caching
        # is switched off for that model (logged once at load), and serving goes on.
        self.layout = layout or CacheLayout(("kv",))
        self.kv_quant = kv_quant
        config = PromptCacheConfig(
            block_size=settings.prompt_cache_block_size,
            max_entries=settings.prompt_cache_max_entries_global if self.layout.supported else 0,
            max_bytes=budget,
            ttl_seconds=settings.prompt_cache_ttl_seconds,
            use_block_index=settings.cache_use_block_index,
            snapshot_max_entries=settings.snapshot_max_entries,
            snapshot_ttl_seconds=settings.snapshot_ttl_seconds,
        )
        seed = namespace_seed(model_id, template_hash=template_hash(template_source))
        disk = self._open_disk(disk_namespace_parts) if config.max_entries > 0 else None
        self.turns = SessionTurnStore(settings.prompt_cache_session_max_idle_seconds,
                                      max_bytes=settings.session_store_max_bytes)
        self.sessions = SessionIndex(settings.prompt_cache_max_entries_per_session,
                                     max_idle_seconds=settings.prompt_cache_session_max_idle_seconds)
        # the one set of verbs a request's KV goes through (cache/manager.py): lookup over both
        # tiers, checkout, fork, snapshot, store; it holds the index (nothing here touches it)
        self.kv = KVManager(config, seed, disk, self.sessions, self.counters, kv_quant, codes=state_codes)
        if disk is not None:
            n = self.kv.restore_index()
            log.info("disk tier %s: %d entries indexed (%.1f MiB), budget %.1f GiB", disk.tier.directory, n,
                     disk.tier.stats()["bytes"] / 2**20, disk.tier.max_bytes / 2**30)
        self.healing = (HealingStore(settings.healing_store_max_entries, self._healing_view,
                                     max_bytes=settings.healing_store_max_bytes) if settings.healing_store else None)
        self.healing_journal = None
        if self.disk is not None and self.healing is not None:
            # Healing is what keeps a client-stripped reply a hit; it survives restarts with the KV.
            self.healing_journal = Journal(self.disk.tier.directory / "healing.jsonl", settings.healing_store_max_bytes)
            self.healing.restore(self.healing_journal.load())
            self.healing.on_remember = self.healing_journal.append
        self.rows: deque[dict] = deque(maxlen=200)
        self.rows_lock = threading.Lock()
        # request fingerprints for cache diagnoses (cache/diagnosis.py): "id:<response id>" and
        # "session:<session id>" -> Fingerprint (one held object under both); hashes and counts only,
        # bounded by their measured bytes
        self.fingerprints = FingerprintStore(settings.cache_diagnostics_max_entries,
                                             settings.cache_diagnostics_max_bytes)
        self.fingerprints_lock = threading.Lock()
        self.request_logger: Any = None
        self.on_record: list[Callable[[dict], None]] = []

    @property
    def disk(self) -> DiskBacking | None:
        return self.kv.disk

    @disk.setter
    def disk(self, value: DiskBacking | None) -> None:
        self.kv.disk = value

    def fingerprint(self, key: str) -> Any:
        with self.fingerprints_lock:
            return self.fingerprints.get(key)

    def keep_fingerprint(self, keys: list[str], fp: Any) -> None:
        with self.fingerprints_lock:
            self.fingerprints.put(keys, fp)

    def _open_disk(self, parts: dict | None) -> DiskBacking | None:
        """The disk tier for this model's namespace, or None (off, or another process holds it)."""
        plan = plan_disk_cache(self.settings)
        if plan is None or parts is None:
            return None
        try:
            tier = DiskTier(plan.directory, disk_namespace(**parts), plan.max_bytes)
        except DiskTierBusy as exc:
            log.warning("disk tier off for this process: %s", exc)
            return None
        return DiskBacking(tier, plan.min_tokens)

    def join_ranks(self, ranks: RankGroup) -> None:
        """Several ranks (engine/lockstep.py): every rank's budget and entry sizes are the group's,
        and what each rank's disk tier restored at start, and does from now on, is agreed, so every
        rank keeps the same entries. Runs on every rank at the same point (collectives: the cache's
        own, cache/ranks.py)."""
        self.replicated = True
        self.turns.clock = self.sessions.clock = ranks.clock
        if not ranks.all_ok(self.disk is not None):
            if self.disk is not None:             # another rank has no tier here: none has
                log.warning("disk tier off: not every rank could open its own")
                self._drop_disk(clear_restored=True)
        self.kv.join(ranks)
        if self.disk is None:
            return
        restored = self.kv.entries(include_disk=True)
        seen = "|".join(f"{e.pool}:{e.session_id}:{len(e.model_tokens)}:"
                        f"{hashlib.blake2b(e.key_tokens.tobytes(), digest_size=8).hexdigest()}" for e in restored)
        healed = "|".join(k for k, _ in self.healing.items()) if self.healing is not None else ""
        if not ranks.digest_agrees(seen + "#" + healed):
            log.warning("the ranks' disk tiers restored different entries: every rank starts with its tier empty")
            self.kv.clear()
            if self.healing is not None:
                for key, _ in self.healing.items():
                    self.healing.forget(key)
            return
        now = ranks.clock()
        for i, e in enumerate(restored):          # rank 0's clock from now on: keep their order
            e.last_used = now - (len(restored) - i) * 1e-6

    def _drop_disk(self, clear_restored: bool) -> None:
        self.kv.drop_disk(clear_restored)
        if self.healing_journal is not None:
            self.healing_journal.close()
            self.healing_journal = None
            if self.healing is not None:
                self.healing.on_remember = None

    def close(self) -> None:
        """Flush queued disk writes (shutdown); with DISK_KEEP_ON_EXIT every RAM entry first."""
        if self.disk is not None:
            if self.settings.disk_keep_on_exit and not self.replicated:
                self.kv.keep_on_disk()
            self.disk.close()
        if self.healing_journal is not None:
            self.healing_journal.close()

    def _healing_view(self, message: dict) -> Any:
        """The message as the model will see it (billing line dropped, nothing normalised): healing
        is bound to the exact history, never to a canonical one two conversations can share."""
        return canonicalize_messages([message], enabled=False, strip_billing_header=self.settings.strip_billing_header)[0][0]

    def heal(self, messages: list[dict], scope: str = "") -> list[dict]:
        return self.healing.heal(messages, scope) if self.healing is not None else messages

    def record(self, job: Any, outcome: Any, prep: Any) -> None:
        row = {
            "time": time.time(),
            "request_id": job.request_id,
            "api": getattr(job, "api", ""),
            "session": outcome.session_id[:16],
            "prompt_tokens": outcome.prompt_tokens,
            "cached_tokens": outcome.cached_tokens,
            "prefilled_tokens": outcome.timings["prefilled_tokens"],
            "completion_tokens": outcome.completion_tokens,
            "match_type": outcome.match_type,
            "finish_reason": outcome.finish_reason,
            **{k: outcome.timings[k] for k in ("ttft_s", "prefill_tok_s", "decode_tok_s", "total_s",
                                                "stable_prefix_msgs", "renders", "key_delta_chars", "prepare_ms",
                                                "cache_tier",
                                                "queue_wait_s", "batch_size_max", "batch_size_mean",
                                                "spec_proposed", "spec_accepted")},
            "priority": getattr(job, "priority", 0),
            "priority_from": getattr(job, "priority_source", "default"),
            "preemptions": outcome.timings.get("preemptions", 0),
        }
        report = getattr(outcome, "cache", None)
        # why the cache reused what it reused (hashes and counts only; cache/diagnosis.py)
        row["cache_written"] = report.written if report is not None else 0
        row["cache_explain"] = describe(report.session) if report is not None else "off"
        row["cache_diagnosis"] = as_dict(report.session) if report is not None else None
        with self.rows_lock:
            self.rows.append(row)
        self.counters.bump("requests")
        self.counters.bump("cached_tokens", outcome.cached_tokens)
        self.counters.bump("prefilled_tokens", row["prefilled_tokens"])
        log.info(
            "req=%s session=%s prompt=%d cached=%d match=%s tier=%s prefilled=%d delta_chars=%d stable_msgs=%d "
            "renders=%d queue=%.3fs ttft=%.3fs prefill=%.1ftok/s decode=%.1ftok/s batch=%s spec=%d/%d finish=%s "
            "written=%d vs_session=%s correctness=%s",
            job.request_id, row["session"], row["prompt_tokens"], row["cached_tokens"], row["match_type"],
            row["cache_tier"],
            row["prefilled_tokens"], row["key_delta_chars"], row["stable_prefix_msgs"], row["renders"],
            row["queue_wait_s"],
            row["ttft_s"], row["prefill_tok_s"], row["decode_tok_s"], row["batch_size_max"], row["spec_accepted"],
            row["spec_proposed"], row["finish_reason"], row["cache_written"], row["cache_explain"],
            ",".join(f"{k}:{v}" for k, v in self.counters.correctness().items()),
        )
        for hook in self.on_record:
            try:
                hook({**row, "prep": prep, "outcome": outcome, "job": job})
            except Exception:  # noqa: BLE001 - observability must never fail a request
                log.exception("record hook failed")

    def stats(self) -> dict:
        kv = self.kv
        held = kv.held()                      # payloads read under the cache lock (never re-read)
        entries = [e for e, _ in held]
        counters = self.counters.snapshot()
        with self.rows_lock:
            rows = list(self.rows)
        tier = resident_bytes(payload for _, payload in held)
        return {
            "enabled": kv.enabled,
            "cache_layout": self.layout.describe(),
            "kv_quant": ({"scheme": self.kv_quant.scheme, "bits": self.kv_quant.bits,
                          "group_size": self.kv_quant.group_size, "start": self.kv_quant.start,
                          **({"seed": self.kv_quant.seed} if self.kv_quant.scheme == "turboquant" else {})}
                         if self.kv_quant else None),
            # RECURRENT_STATE_BITS: stored recurrent states as TurboQuant codes (lossy), None = exact
            "recurrent_state_codes": self.kv.codes.describe() if self.kv.codes else None,
            "unsupported_cache_classes": list(self.layout.unknown),
            "entries": len(entries),
            "snapshot_entries": sum(1 for e in entries if e.pool == "snapshot"),
            "tokens": sum(e.depth for e in entries),
            "bytes": sum(e.nbytes for e in entries),
            # resident KV / state: requests in flight (each array once) + the RAM cache tier
            "live_kv_bytes": self.live_kv_bytes,
            # the tier's arrays each counted once: entries that share a root (a prefix another
            # entry holds: cache/layer_kinds.py KVKind.capture_rooted) hold it once between them
            "tier_kv_bytes": tier,
            "kv_bytes": self.live_kv_bytes + tier,
            "quantized_bytes": sum(e.nbytes for e, payload in held
                                   if any(s.kind in QUANTIZED_KINDS for s in getattr(payload, "layers", ()))),
            "budget_bytes": self.cache_budget,
            "max_entries": kv.config.max_entries,
            "block_size": kv.config.block_size,
            "sessions": len(self.sessions),
            "turn_records": len(self.turns),
            "healing": ({"entries": len(self.healing), "healed": self.healing.healed, "bytes": self.healing.nbytes}
                        if self.healing else None),
            "turn_store_bytes": self.turns.nbytes,
            "disk": self.disk.stats() if self.disk is not None else None,
            "disk_only_entries": kv.disk_only(),
            "correctness": {k: counters.get(k, 0) for k in CORRECTNESS_COUNTERS},
            "hits": {k[5:]: v for k, v in counters.items() if k.startswith("hits_")},
            "misses": counters.get("misses", 0),
            "evictions": counters.get("evictions", 0),
            "counters": counters,
            "entry_list": [
                {"id": e.entry_id, "pool": e.pool, "tokens": e.depth, "bytes": e.nbytes, "hits": e.hits,
                 "floor": e.floor, "trimmable": e.trimmable, "on_disk": e.disk_id is not None,
                 "session": e.session_id[:16],
                 "age_s": round(time.monotonic() - e.created, 1)}
                for e in entries
            ],
            "recent": rows[-50:],
        }
