"""What the runner knows of a request in flight, and how a row's failure travels.

The runner never imports the engine (imports point down only): a row is the engine's request
object (engine/request.py ``Request``), read and advanced through the attributes the runner
uses -- its live cache, tokens, sampler, and the engine's ``consume`` / ``should_stop`` callbacks
held by the group's owner.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

Row = Any     # engine/request.py Request: one request in flight


class Owner(Protocol):
    """What the decode group and the speculative step use of the engine that owns the rows
    (engine/chat.py ChatEngine) -- the whole seam: nothing else of the engine is reached from
    runner/."""
    state: Any          # .layout (cache kinds), .kv_quant, .replicated (several ranks)
    settings: Any       # SHARED_PREFIX_MIN_TOKENS
    loaded: Any         # .model, .is_vlm, .extra (a rank group)
    speculation: Any    # drafters, step costs, the draft model

    @property
    def decode_model(self) -> Any: ...

    def new_cache(self) -> Any: ...

    def consume(self, row: Row, token: int) -> bool: ...

    def _should_stop(self, row: Row) -> Callable[[], bool]: ...


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
