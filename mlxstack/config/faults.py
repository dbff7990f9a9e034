"""Fault injection for tests: raise (or stall) at named points of the inference loop.

Off unless armed, and then a call costs one global read:

    from mlxstack.config import faults
    faults.hit("sampler", seq.job.request_id)       # at a point in the code (no-op when disarmed)

Arming -- the environment of a server process, read once at import:

    MLXSTACK_FAULTS="sampler@req-b:3,disk_write"      python -m mlxstack.serve

or a test, in process:

    with faults.injected("decode_forward:2"):      # disarmed (and stalls woken) on exit
        ...

A spec is comma-separated rules ``point[@key][:nth][:action]``:
  point   one of POINTS (an unknown name is an error: a typo must not test nothing)
  @key    only hits whose key contains ``key`` (per-request points pass the request id)
  nth     which matching hit fires, 1-based (default 1); ``*`` = every matching hit
  action  ``raise`` (default: InjectedFault, an ordinary Exception), ``fatal`` (InjectedFatal, a
          BaseException: nothing in the engine may survive it, the inference thread dies),
          ``stall=SECONDS`` (the calling thread sleeps; disarm() wakes it)

Stdlib only, importable from every layer (docs/architecture.md#layers).
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

ENV = "MLXSTACK_FAULTS"

POINTS = (
    "admission",        # engine.start: render, lookup, checkout (engine/chat.py)
    "prefill_chunk",    # one sequence's prefill chunk (runner/prefill.py prefill_chunk)
    "prefill_batch",    # short prefills fed together (runner/batch_prefill.py)
    "slab_join",        # a sequence joining the decode batch (runner/batch.py add / adopt)
    "slab_leave",       # finished sequences leaving the decode batch (runner/batch.py)
    "decode_forward",   # the decode step's forward pass (runner/batch.py step)
    "sampler",          # one row's sampling (runner/batch.py step)
    "detokenizer",      # one generated token read back into text (engine/chat.py consume)
    "store",            # a finished turn stored in the prompt cache (engine/chat.py _store)
    "disk_write",       # a disk-tier entry file written, before its rename (cache/disk/tier.py)
    "disk_load",        # a disk-only entry loaded on a hit (cache/disk/backing.py)
)


class InjectedFault(RuntimeError):
    """Raised at an armed point (action ``raise``)."""


class InjectedFatal(BaseException):
    """Raised at an armed point (action ``fatal``): not an Exception, so no request-level handler
    catches it -- it stands for whatever kills a thread outright."""


@dataclass
class Rule:
    point: str
    key: str = ""
    nth: int | None = 1          # None: every matching hit
    action: str = "raise"        # raise | fatal | stall
    seconds: float = 0.0
    seen: int = 0
    fired: int = 0
    keys: list[str] = field(default_factory=list)   # the key of each hit that fired (who it touched)


@dataclass
class _Armed:
    rules: list[Rule] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: threading.Event = field(default_factory=threading.Event)


_armed: _Armed | None = None


def parse(spec: str) -> list[Rule]:
    """Rules from a spec string (ValueError naming what is wrong)."""
    rules = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        fields = part.split(":")
        head, rest = fields[0], fields[1:]
        point, _, key = head.partition("@")
        if point not in POINTS:
            raise ValueError(f"{ENV}: unknown fault point {point!r} in {part!r}; known: {', '.join(POINTS)}")
        rule = Rule(point, key)
        if rest and rest[0] and not rest[0].startswith(("raise", "fatal", "stall")):
            nth = rest.pop(0)
            if nth == "*":
                rule.nth = None
            elif nth.isdigit() and int(nth) >= 1:
                rule.nth = int(nth)
            else:
                raise ValueError(f"{ENV}: {nth!r} in {part!r} is not a hit number (1, 2, ... or *)")
        if rest:
            action = rest.pop(0)
            if action in ("raise", "fatal"):
                rule.action = action
            elif action.startswith("stall="):
                rule.action, rule.seconds = "stall", float(action[6:])
            else:
                raise ValueError(f"{ENV}: action {action!r} in {part!r} is not raise, fatal or stall=SECONDS")
        if rest:
            raise ValueError(f"{ENV}: {part!r} has too many fields (point[@key][:nth][:action])")
        rules.append(rule)
    return rules


def arm(spec: str) -> None:
    """Arm ``spec`` (replacing whatever was armed); an empty spec disarms."""
    global _armed
    rules = parse(spec)
    disarm()
    _armed = _Armed(rules) if rules else None


def disarm() -> None:
    """Disarm every rule and wake every stalled thread."""
    global _armed
    armed, _armed = _armed, None
    if armed is not None:
        armed.wake.set()


def active() -> bool:
    return _armed is not None


def fired(point: str | None = None) -> int:
    """How many times armed rules (for ``point``, or all) fired."""
    armed = _armed
    if armed is None:
        return 0
    with armed.lock:
        return sum(r.fired for r in armed.rules if point is None or r.point == point)


def touched(point: str | None = None) -> list[str]:
    """The key of every hit that fired (for ``point``, or all): per-request points pass the
    request ids they touch, comma-separated when a hit touches several (a batch step)."""
    armed = _armed
    if armed is None:
        return []
    with armed.lock:
        return [k for r in armed.rules if point is None or r.point == point for k in r.keys]


@contextmanager
def injected(spec: str) -> Iterator[None]:
    arm(spec)
    try:
        yield
    finally:
        disarm()


def hit(point: str, key: str = "") -> None:
    """A fault point: nothing when disarmed; otherwise raise / die / stall as a rule says."""
    armed = _armed
    if armed is None:
        return
    rule = None
    with armed.lock:
        for r in armed.rules:
            if r.point != point or (r.key and r.key not in key):
                continue
            r.seen += 1
            if r.nth is None or r.seen == r.nth:
                r.fired += 1
                r.keys.append(key)
                rule = r
                break
    if rule is None:
        return
    what = f"injected fault at {point}" + (f" ({key})" if key else "")
    if rule.action == "fatal":
        raise InjectedFatal(what)
    if rule.action == "stall":
        armed.wake.wait(rule.seconds)
        return
    raise InjectedFault(what)


def _from_env() -> None:
    spec = os.environ.get(ENV, "")
    if spec.strip():
        arm(spec)
        import sys  # stderr: a server with faults armed must never pass for a normal one

        print(f"{ENV}={spec!r}: fault injection ARMED (tests only)", file=sys.stderr, flush=True)


_from_env()

__all__ = ["ENV", "POINTS", "InjectedFatal", "InjectedFault", "active", "arm", "disarm", "fired", "hit",
           "injected", "parse"]
