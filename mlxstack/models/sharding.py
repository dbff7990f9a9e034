"""One model over several ranks with MLX's own engine: mlx-lm's ``model.shard(group)`` (tensor
parallel: every layer's heads and MLP columns split, two all_sums per layer) or
``model.model.pipeline(group)`` (pipeline parallel: the layers split, activations sent rank to
rank). No transport or sharding scheme of our own.

    group = distributed_group(settings)                    # mx.distributed.init over the ranks
    why = refusal(settings.distributed, group.size(), facts_from_config(config), model)
    shard(model, settings.distributed, group)              # before the weights are evaluated

``refusal`` is checked at start: a model whose heads do not divide by the rank count, or a family
without ``shard`` / ``pipeline``, is refused with one line saying which modes and rank counts work.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

MAX_RANKS = 16     # the rank counts a refusal suggests go up to this


@dataclass(frozen=True)
class ShardFacts:
    """What decides which splits a model allows (from its config; pure data)."""
    name: str
    heads: int
    kv_heads: int
    layers: int
    intermediate: int          # MLP columns (0: unknown -- not checked)
    tensor: bool               # the family has model.shard
    pipeline: bool             # the family has model.model.pipeline


def facts_from_config(config: dict, name: str, model: Any = None) -> ShardFacts:
    """ShardFacts from a model's config.json (a nested ``text_config`` is read where the top has
    no heads) and, when given, the model object (which sharding methods its family has)."""
    c = config if "num_attention_heads" in config else config.get("text_config", config)
    heads = int(c.get("num_attention_heads", 0) or 0)
    inner = getattr(model, "model", None) if model is not None else None
    return ShardFacts(
        name=name, heads=heads, kv_heads=int(c.get("num_key_value_heads", heads) or heads),
        layers=int(c.get("num_hidden_layers", 0) or 0), intermediate=int(c.get("intermediate_size", 0) or 0),
        tensor=model is not None and hasattr(model, "shard"),
        pipeline=inner is not None and hasattr(inner, "pipeline"))


def tensor_counts(f: ShardFacts) -> list[int]:
    """Rank counts tensor parallelism can use: heads, KV heads and MLP columns divide by them (pure)."""
    if not f.tensor or f.heads <= 0:
        return []
    g = math.gcd(f.heads, f.kv_heads)
    if f.intermediate:
        g = math.gcd(g, f.intermediate)
    return [n for n in range(2, MAX_RANKS + 1) if g % n == 0]


def pipeline_counts(f: ShardFacts) -> list[int]:
    """Rank counts pipeline parallelism can use: at least one layer per rank (pure)."""
    return list(range(2, min(f.layers, MAX_RANKS) + 1)) if f.pipeline and f.layers >= 2 else []


def _counts(ns: list[int]) -> str:
    if not ns:
        return ""
    runs, start = [], ns[0]
    for a, b in zip(ns, ns[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(runs)


def refusal(mode: str, ranks: int, f: ShardFacts) -> str | None:
    """Why ``mode`` over ``ranks`` cannot serve this model, in one line naming what would (pure);
    None when it can."""
    ok = {"tensor": tensor_counts(f), "pipeline": pipeline_counts(f)}
    if ranks in ok.get(mode, []):
        return None
    works = "; ".join(f"DISTRIBUTED={m} with {_counts(ns)} ranks" for m, ns in ok.items() if ns) or "nothing: "\
        "its family has neither model.shard nor model.model.pipeline in mlx-lm"
    if mode == "tensor" and not f.tensor:
        why = "its family has no tensor-parallel split in mlx-lm (model.shard)"
    elif mode == "pipeline" and not f.pipeline:
        why = "its family has no pipeline split in mlx-lm (model.model.pipeline)"
    elif mode == "tensor":
        why = (f"its {f.heads} attention heads / {f.kv_heads} KV heads"
               + (f" / {f.intermediate} MLP columns" if f.intermediate else "") + f" do not divide by {ranks}")
    else:
        why = f"it has {f.layers} layers for {ranks} ranks"
    return f"DISTRIBUTED={mode} over {ranks} ranks cannot serve {f.name}: {why}. Works: {works}."


def backend_for(settings: Any) -> str:
    """Local ranks talk over ring (TCP on 127.0.0.1); otherwise DISTRIBUTED_BACKEND."""
    return "ring" if settings.distributed_local_ranks else settings.distributed_backend


def distributed_group(settings: Any) -> Any:
    """This rank's group (MLX_RANK / MLX_HOSTFILE set by serve.py's local ranks or mlx.launch)."""
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend=backend_for(settings))
    if group.size() < 2:
        raise RuntimeError(f"DISTRIBUTED={settings.distributed}: this process joined a group of "
                           f"{group.size()} (MLX_RANK={os.environ.get('MLX_RANK')!r}); start it through start_llm.py")
    return group


def agree(group: Any, leader_says: bool, every_rank_can: bool) -> tuple[bool, bool]:
    """(rank 0's ``leader_says``, whether ``every_rank_can`` holds on every rank), the same on
    every rank: one all_sum, so every rank must call it at the same point. For choices that shape
    the forward (which kernels run, whether decode batches): a rank deciding alone -- from a timing,
    a build, a check -- runs its collectives in another order than its peers, which hangs the group
    or silently mixes up the results (LESSONS 60)."""
    import mlx.core as mx

    votes = mx.array([int(bool(leader_says)) if group.rank() == 0 else 0, int(bool(every_rank_can))], dtype=mx.int32)
    total = mx.distributed.all_sum(votes, group=group)
    mx.eval(total)
    lead, every = total.tolist()
    return lead > 0, every == group.size()


def from_rank0(group: Any, value: int) -> int:
    """Rank 0's ``value`` on every rank (one all_sum; every rank calls it at the same point): e.g.
    the port rank 0's control channel is already listening on, so no port is picked free, released
    and bound later (another user could take it in between)."""
    import mlx.core as mx

    total = mx.distributed.all_sum(mx.array([int(value) if group.rank() == 0 else 0], dtype=mx.int64), group=group)
    mx.eval(total)
    return int(total.item())


# Settings a rank may hold for its own host: where its files are, how it is reached and logged,
# how the launcher supervises it. Every other one shapes what the engine decides at each step
# (budgets, batching, speculation, sampling defaults, kernels...) and must be the same on every rank.
HOST_LOCAL_SETTINGS = frozenset({
    "BACKENDS_FILE", "BLAS_PRELOAD", "DISK_CACHE_DIR", "DISTRIBUTED_HOSTS", "ENABLE_REQUEST_LOGGING",
    "HUGE_PAGES", "LITELLM_MASTER_KEY", "LOG_LEVEL", "LOG_MAX_BYTES", "LOG_ROOT", "MLX_ALLOWED_HOSTS",
    "MLX_ALLOWED_ORIGINS", "MLX_API_KEY", "MLX_HOST", "MLX_HTTP_THREADS", "MLX_MAX_RESTARTS", "MLX_PORT",
    "MLX_REPLICAS", "MLX_RESTART_WINDOW_SECONDS", "MLX_STARTUP_TIMEOUT_SECONDS", "MLX_UNHEALTHY_RESTART_SECONDS",
    "MODEL_CACHE_DIR", "MODEL_PATH", "PROXY_HOST", "PROXY_MODEL_ID", "PROXY_PORT", "PROXY_REQUEST_TIMEOUT_SECONDS",
    "PROXY_STARTUP_TIMEOUT_SECONDS", "PROXY_STARTUP_WAIT_SECONDS", "ROUTING", "ROUTING_AFFINITY_TTL_SECONDS",
    "VLM_CACHE_DEBUG", "WARM_PROMPTS",
})


def shared_settings(settings: Any) -> dict[str, str]:
    """The settings every rank must run with alike, as text (pure): all but ``HOST_LOCAL_SETTINGS``;
    DRAFT_MODEL by whether one is set (its folder may lie elsewhere on another host)."""
    out = {k: v for k, v in settings.as_env().items() if k not in HOST_LOCAL_SETTINGS}
    out["DRAFT_MODEL"] = "set" if out.get("DRAFT_MODEL", "").strip() else ""
    return out


def differing_settings(group: Any, values: dict[str, str]) -> list[str]:
    """The names in ``values`` whose value differs from rank 0's on some rank -- the same list on
    every rank (two all_gathers of CRC32s: every rank must call it at the same point). Ranks on
    other machines read their own .env; one with another MAX_CONCURRENT_SEQUENCES or SPECULATIVE
    would take other steps than rank 0 and hang the group or mix up results."""
    import zlib

    import mlx.core as mx

    names = sorted(values)
    crc = lambda text: zlib.crc32(text.encode()) & 0x7FFFFFFF   # noqa: E731
    shape = mx.distributed.all_gather(mx.array([[len(names), crc("\0".join(names))]], dtype=mx.int32), group=group)
    if not bool((shape == shape[0:1]).all().item()):
        return ["(the settings themselves: the ranks run different mlxstack versions)"]
    mine = mx.array([[crc(f"{n}={values[n]}") for n in names]], dtype=mx.int32)
    every = mx.distributed.all_gather(mine, group=group)
    differs = (every != every[0:1]).any(axis=0).tolist()
    return [n for n, d in zip(names, differs) if d]


def shard(model: Any, mode: str, group: Any) -> None:
    """Split ``model`` in place for this rank (weights still lazy: only this rank's part is read)."""
    if mode == "tensor":
        model.shard(group)
    elif mode == "pipeline":
        model.model.pipeline(group)
    else:
        raise ValueError(f"unknown DISTRIBUTED mode {mode!r}")
