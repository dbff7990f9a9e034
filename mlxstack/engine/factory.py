"""One place that builds the request engine for a loaded model (server and tests share it).

    engine = make_engine(load_model(settings), settings)   # engine.renderer, engine.state
    core, line = make_core(engine, settings)                # the step loop the worker drives (or None)

It is also where the backend is composed (``install_backend``): chosen for the loaded model
(``select``, backends/__init__.py: the CPU backend where it applies, else MLX's own), installed (its
report logged once and kept on ``loaded.extra["backend"]`` for /health) and attached to the model
-- and to the draft model -- through runner/forward.py. The engine never imports backends/cpu.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..backends import Backend, select
from ..cache.layer_kinds import CacheLayout, KVQuant, probe_layout
from ..cache.state_codes import StateCodes
from ..cache.turboquant import SEED as TURBOQUANT_SEED
from ..prompt.render import ChatRenderer
from ..models.loader import load_draft_model
from .chat import ChatEngine, tokenizer_size
from .core import EngineCore, PriorityPolicy
from ..runner.forward import attach
from ..runner.spec.draft_model import DraftModel
from ..runner.spec.speculation import DRAFT_MODEL_MODES
from .state import EngineState

log = logging.getLogger("mlxstack.engine")

DEFAULT_MAX_SEQUENCES = 8   # MAX_CONCURRENT_SEQUENCES=0


def make_engine(loaded: Any, settings: Any) -> ChatEngine:
    """ChatEngine for text models, VLMChatEngine (engine/vlm_chat.py) when ``loaded.is_vlm``."""
    backend = install_backend(loaded, settings)
    if loaded.is_vlm:
        from .vlm_chat import VLMChatEngine, VLMChatRenderer

        renderer: ChatRenderer = VLMChatRenderer(loaded.tokenizer, preserve_thinking=settings.preserve_thinking)
        engine_cls: type[ChatEngine] = VLMChatEngine
    else:
        renderer = ChatRenderer(loaded.tokenizer, preserve_thinking=settings.preserve_thinking)
        engine_cls = ChatEngine
    layout = probe_cache_layout(loaded)
    if not layout.supported:
        log.warning("model %s builds cache layers of a kind this server does not know (%s): prefix caching "
                    "is OFF for this model (every request is a cold prefill); please report the class name",
                    loaded.model_id, ", ".join(layout.unknown))
    else:
        log.info("cache layout: %s", layout.describe())
    quant = kv_quant_policy(loaded, settings, layout)
    codes = state_codes_policy(loaded, settings, layout)
    state = EngineState(settings, loaded.model_id, renderer.template_source, layout,
                        disk_namespace_parts=disk_namespace_parts(loaded, renderer, layout, settings, quant, codes),
                        kv_quant=quant, state_codes=codes)
    if loaded.is_vlm:
        engine = engine_cls(loaded, renderer, state, settings)
    else:
        engine = ChatEngine(loaded, renderer, state, settings,
                            draft=draft_model(loaded, settings, state.counters, backend))
    # ``engine.run`` (warm prompts, tools, tests) serves one request through an engine core of its
    # own: one decode loop, one prefill path for every caller (LESSONS 90)
    engine.alone = EngineCore(engine, 1, settings.prefill_chunk_tokens, False)
    engine.speculation.calibrated(engine.decode_model, settings.max_concurrent_sequences or 8)
    log.info("speculative decoding: %s%s", engine.speculation.describe(),
             f"; a step of 1 + k drafts costs (rows x width: plain steps) {engine.speculation.costs.table}"
             if engine.speculation.costs.table else "")
    return engine


def make_core(engine: ChatEngine, settings: Any) -> tuple[EngineCore | None, str]:
    """The engine core for ``engine`` -- continuous batching (MAX_CONCURRENT_SEQUENCES > 1), or one
    slot (= 1, and a VLM: its prefill is mlx-vlm's own, its decode rows unbatched) -- and the line
    that says how it schedules. Whether decode steps batch is decided once here, by a real batched
    forward against single ones (runner/batch.py ``batching_support``)."""
    from ..runner.batch import batching_support

    n = settings.max_concurrent_sequences or DEFAULT_MAX_SEQUENCES
    if engine.loaded.is_vlm:
        return (EngineCore(engine, 1, settings.prefill_chunk_tokens, False),
                "scheduling: one request at a time (VLM)")
    engine.by_reference_depth()   # decided at load (a model check), not in a first hit's TTFT
    if n <= 1:   # one slot: first come, first served, and the decode group's drafts still apply
        return (EngineCore(engine, 1, settings.prefill_chunk_tokens, False),
                "scheduling: one request at a time (MAX_CONCURRENT_SEQUENCES=1)")
    batching, why = batching_support(engine)
    policy = PriorityPolicy(settings.priority_scheduling, settings.priority_decode_rows,
                            settings.priority_aging_seconds, settings.priority_decode_share)
    return (EngineCore(engine, n, settings.prefill_chunk_tokens, batching, policy),
            f"scheduling: up to {n} sequences in flight, prefill chunks of {settings.prefill_chunk_tokens} tokens, "
            f"decode {'batched' if batching else f'interleaved, unbatched ({why})'}")


def install_backend(loaded: Any, settings: Any) -> Backend:
    """The backend for ``loaded`` chosen, installed and attached to its model; its report logged
    (one line) and the backend kept on ``loaded.extra["backend"]`` (/health shows its report). An
    engine built again on the same loaded model with the same settings reuses the installed one."""
    import mlx.core as mx

    backend = select(settings, loaded, mx.default_device())
    report = backend.install(loaded, settings)
    attach(loaded.model, backend)
    loaded.extra["backend"] = backend
    log.info("%s", report.line())
    return backend


def draft_model(loaded: Any, settings: Any, counters: Any = None, backend: Backend | None = None) -> DraftModel | None:
    """DRAFT_MODEL loaded and checked against the target (models/loader.py), with its cache store;
    None when none is set or the SPECULATIVE mode does not draft with one. ``backend`` (the
    target's) serves the draft model's forwards too where it applies to it; the CPU backend's host
    path is installed on the target only, so the draft keeps mlx-lm's forward, as it always did."""
    if not settings.draft_model.strip() or settings.speculative not in DRAFT_MODEL_MODES:
        return None
    draft = load_draft_model(settings, loaded)
    if backend is not None:
        import mlx.core as mx

        if backend.applies(draft.model, mx.default_device())[0]:
            attach(draft.model, backend)
    return DraftModel(draft.model, vocab=tokenizer_size(loaded.tokenizer) or 1 << 30,
                      cost=draft.extra["cost"], step=settings.prefill_step_size, window=settings.draft_window,
                      max_bytes=settings.draft_cache_max_bytes, name=draft.model_id, counters=counters)


def kv_quant_policy(loaded: Any, settings: Any, layout: CacheLayout) -> KVQuant | None:
    """KV_BITS for this model, or None (off, or the model cannot attend over quantised K/V:
    attention sinks, a head_dim the group size does not divide, a VLM) -- decided by a real
    two-token forward over quantised caches, logged once."""
    if settings.kv_bits == "off":
        return None
    turbo = settings.kv_quant_scheme == "turboquant"
    quant = KVQuant(int(settings.kv_bits), int(settings.kv_group_size), int(settings.quantized_kv_start),
                    settings.kv_quant_scheme, TURBOQUANT_SEED if turbo else 0)
    why = ""
    if loaded.is_vlm:
        why = "vision-language models prefill through mlx-vlm's own path"
    elif "kv" not in layout.kinds:
        why = "the model has no plain KV layers"
    else:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from ..cache.kv_ops import LiveCache
        from ..runner.forward import forward

        try:
            live = LiveCache(make_prompt_cache(loaded.model), 0, dataclasses.replace(quant, start=0))
            live.maybe_quantize()
            mx.eval(forward(loaded.model, mx.array([[1, 2]], dtype=mx.int32), live.layers))
        except Exception as exc:  # noqa: BLE001 - any failure means: not for this model
            why = f"{type(exc).__name__}: {exc}"
    if why:
        log.warning("KV_BITS=%s KV_QUANT_SCHEME=%s is off for %s: %s", settings.kv_bits, settings.kv_quant_scheme,
                    loaded.model_id, why)
        return None
    if turbo:
        log.info("KV quantisation: TurboQuant %d-bit (seed %#x), from %d tokens", quant.bits, quant.seed, quant.start)
    else:
        log.info("KV quantisation: %d-bit, group %d, from %d tokens", quant.bits, quant.group_size, quant.start)
    return quant


def state_codes_policy(loaded: Any, settings: Any, layout: CacheLayout) -> StateCodes | None:
    """RECURRENT_STATE_BITS for this model (cache/state_codes.py), or None: off, no recurrent layer
    to code, or no prefix caching (a layout with an unknown class). Logged once: it is the one cache
    setting that is lossy."""
    codes = StateCodes.of(settings.recurrent_state_bits, layout.kinds) if layout.supported else None
    if codes is not None:
        # one token through a fresh cache, its state coded: every codebook this model's states need
        # is built now (seconds at 8 bits), not on the inference thread at the first store
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from ..cache.kv_ops import LiveCache, capture
        from ..cache.layer_kinds import eval_state
        from ..runner.forward import forward

        model = loaded.model.language_model if loaded.is_vlm else loaded.model
        live = LiveCache(make_prompt_cache(model), 0)
        mx.eval(forward(model, mx.array([[1]], dtype=mx.int32), live.layers))
        live.advance(1)
        eval_state(codes.code_layers(capture(live).layers))
        log.info("RECURRENT_STATE_BITS=%d: %s stores its recurrent states as TurboQuant codes (lossy: a warm "
                    "turn may differ from a cold run)", codes.bits, loaded.model_id)
    return codes


def disk_namespace_parts(loaded: Any, renderer: Any, layout: CacheLayout, settings: Any,
                         quant: KVQuant | None = None, codes: StateCodes | None = None) -> dict | None:
    """Everything that makes stored KV incompatible: model content (every weight byte, model
    code versions, every file that changes the computation: models/fingerprint.py) and numerics,
    chat template, cache-kind layout, KV quantisation, recurrent-state codes (named only when on:
    an exact server's namespace is what it always was). A change in any of them opens another disk
    namespace. None when there is no disk tier (the weights are then not hashed)."""
    from ..cache.disk.config import resolve_disk_cache_dir
    from ..cache.hashing import template_hash
    from ..config.settings import REPO_ROOT
    from ..models.device import is_cpu_only
    from ..models.fingerprint import MEMO_NAME, model_fingerprint

    if not settings.cache_enabled or not layout.supported or resolve_disk_cache_dir(
            settings.disk_cache_dir, auto_base=settings.model_cache_path, repo_root=REPO_ROOT) is None:
        return None
    fp = model_fingerprint(loaded.path, upcast=bool(settings.cpu_float32 and is_cpu_only()),
                           memo_path=settings.model_cache_path / MEMO_NAME)
    parts = {"model": fp, "template": template_hash(renderer.template_source), "layout": list(layout.kinds),
             "kv_quant": ([quant.bits, quant.group_size, quant.start, quant.scheme]
                          + ([quant.seed] if quant.scheme == "turboquant" else []) if quant else "off")}
    if codes is not None:
        parts["recurrent_state"] = [codes.bits, codes.seed]
    group = loaded.extra.get("group") if getattr(loaded, "extra", None) else None
    if group is not None:     # each rank keeps its own part of every entry: a namespace per rank and layout
        parts["ranks"] = f"{settings.distributed}-{group.rank()}-of-{group.size()}"
    return parts


def probe_cache_layout(loaded: Any) -> CacheLayout:
    """Build one cache for the model and classify its layers (cache/layer_kinds.py)."""
    from mlx_lm.models.cache import make_prompt_cache

    model = loaded.model.language_model if loaded.is_vlm else loaded.model
    return probe_layout(make_prompt_cache(model))
