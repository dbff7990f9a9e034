"""What the runner knows of a request in flight, and how a row's failure travels.

The runner never imports the engine (imports point down only): a row is the engine's request
object (engine/request.py ``Request``), read and advanced through the attributes the runner
uses -- its live cache, tokens, sampler, and the engine's ``consume`` / ``should_stop`` callbacks
held by the group's owner.
"""
from __future__ import annotations

from typing import Any, Callable

Row = Any     # engine/request.py Request: one request in flight
Owner = Any   # engine/chat.py ChatEngine: state, settings, the loaded model, consume / stop callbacks


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
