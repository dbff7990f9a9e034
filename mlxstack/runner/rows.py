"""What the runner knows of the model it runs and of a request in flight, and how a row's failure
travels.

The runner never imports the engine (imports point down only) and never calls it: what it needs of
the model comes as plain data (``RunnerContext``, built once by the engine), a row is the engine's
request object (engine/request.py ``Request``) read and advanced through the attributes the runner
owns -- its live cache, pending token, sampler, drafter -- and what a step produced goes back as
data (``StepOutput``); the engine core judges it (stop rules, streaming) and hands its verdicts
back (``Verdict``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

Row = Any     # engine/request.py Request: one request in flight


@dataclass
class RunnerContext:
    """The model the runner runs and the facts its steps depend on (engine/chat.py builds it)."""
    model: Any                     # the module prompts are fed through (mlx-lm's model)
    decode_model: Any              # the module decode steps call (a VLM: its language model)
    layout: Any                    # cache/layer_kinds.py CacheLayout: the model's cache kinds
    kv_quant: Any                  # cache/layer_kinds.py KVQuant or None (KV_BITS)
    speculation: Any               # runner/spec/speculation.py Speculation: drafters, step costs
    counters: Any                  # cache/counters.py CacheCounters
    shared_prefix_min_tokens: int = 0
    prefill_step: int = 512        # PREFILL_STEP_SIZE: tokens per forward of a prompt
    # the backend's own prefill of a prompt's rest, in one call (a VLM: runner/vlm.py WholePrefill):
    # (live, prep, start, checkpoint, at, stop) -> (logits, the module the row decodes through); None: chunks
    whole_prefill: Any = None
    is_vlm: bool = False
    rank_group: Any = None         # several ranks: the MLX group every decision is agreed over
    replicated: bool = False       # ranks in lockstep (set when the ranks join: engine/lockstep.py bind)
    memo: dict = field(default_factory=dict)          # load-time checks, answered once
    # what watchdog deadlines are read against: several ranks read rank 0's time as of the step
    # (engine/lockstep.py sets it), so a deadline fires at the same step on every rank
    clock: Callable[[], float] = time.perf_counter
    heard: float = 0.0             # time.monotonic() of the last check between forwards (the stall watchdog reads it)

    def new_cache(self) -> Any:
        """A fresh LiveCache for the model (the KV quantisation policy with it)."""
        from mlx_lm.models.cache import make_prompt_cache

        from ..cache.kv_ops import LiveCache

        return LiveCache(make_prompt_cache(self.model), 0, self.kv_quant)


def halted(ctx: RunnerContext, seq: Row) -> bool:
    """Whether ``seq`` must stop now, read from data: its watchdog deadline against the context's
    clock (``seq.watchdog`` records why), else its job's hang-up probe. Asked between a prompt's
    forwards and between decode steps (LESSONS 90); each ask is progress (``ctx.heard``)."""
    ctx.heard = time.monotonic()
    if seq.deadline is not None and ctx.clock() > seq.deadline:
        seq.watchdog = True
        return True
    return seq.job.is_cancelled()


def context_of(owner: Any) -> RunnerContext:
    """``owner`` itself, or the context an engine carries (``engine.runner``)."""
    return owner if isinstance(owner, RunnerContext) else owner.runner


@dataclass
class RowOutput:
    """What one decode step read back for one row: the tokens, in order (a plain step: the token
    it sampled last step; a speculative step: its pending token, then the drafts it accepted; a row
    that fed its last prompt token: none yet), and the rows of its forward."""
    tokens: list[int]
    size: int = 1


@dataclass
class Verdict:
    """The engine core's word on a row's tokens: how many it consumed (streamed), and whether the
    reply ended there (a stop token or string, max_tokens, a hang-up, the watchdog)."""
    used: int
    done: bool


class GroupReset(RuntimeError):
    """A shared step of the decode batch failed beyond repair: the batch was dropped (the group is
    empty and consistent again) and every member in ``lost`` failed with ``cause``."""

    def __init__(self, lost: list[Row], cause: BaseException) -> None:
        super().__init__(f"decode batch dropped after {type(cause).__name__}: {cause}")
        self.lost = lost
        self.cause = cause


def run_row(failed: dict[int, BaseException], s: Row, work: Callable[[], Any]) -> Any:
    """Per-row work in a step: a failure fails this row only (recorded in ``failed``; None)."""
    try:
        return work()
    except Exception as exc:  # noqa: BLE001 - the row leaves; its request gets the error
        failed[id(s)] = exc
        return None


def row_ids(seqs: list[Row]) -> str:
    return ",".join(s.job.request_id for s in seqs)
