"""Where a request goes among the backends of one model (pure: no I/O, no LiteLLM).

    views = [BackendView(url, alive, load, sessions, prefixes), ...]   # what the router knows
    p = place(pin, views, digests)       # Placement(url, reason, shared_chars, moved_from) or None

Rules, in order:
1. A session pinned to a live backend stays there (its KV is there): reason ``pinned``.
2. Otherwise (a new session, or its backend is down: ``moved_from`` says which) it goes to the
   live backend holding the deepest prefix of its messages, when that prefix is worth it
   (>= ``min_shared_chars`` fingerprint characters, about 64 tokens) and that backend is not
   much busier than the idlest: load <= least + ``max_load_gap`` and pinned sessions <= fewest
   + ``max_session_gap``. Reason ``prefix``. The session gap matters because every session of
   one agent shares its system prompt: without it all of them would pile onto the first backend
   that held it. Past the gap one session pays that prefix once elsewhere, and from then on both
   backends hold it and sessions spread evenly.
3. Else the least loaded live backend (then fewest pinned sessions, then configuration order):
   reason ``least-load``.
No live backend: None (the caller lets LiteLLM answer its usual error).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

MIN_SHARED_CHARS = 256   # below this a shared prefix saves less than a 16-token block or two
MAX_LOAD_GAP = 2         # requests in flight a prefix holder may have beyond the idlest backend
MAX_SESSION_GAP = 2      # pinned sessions a prefix holder may have beyond the emptiest backend


@dataclass(frozen=True)
class BackendView:
    """One backend as the router sees it now."""

    url: str
    alive: bool
    load: int = 0                       # requests queued + running there, plus ours in flight
    sessions: int = 0                   # sessions this router has pinned there
    prefixes: Mapping[str, int] = field(default_factory=dict)   # message digest -> chars (its summary)


class Placement(NamedTuple):
    url: str
    reason: str                 # pinned | prefix | least-load
    shared_chars: int = 0       # of the request's message prefix already held there
    moved_from: str | None = None


def shared_chars(digests: Sequence[tuple[str, int]], prefixes: Mapping[str, int]) -> int:
    """Characters of the deepest message prefix of ``digests`` that ``prefixes`` holds (0: none)."""
    for digest, chars in reversed(digests):
        if digest in prefixes:
            return chars
    return 0


def place(pin: str | None, views: Sequence[BackendView], digests: Sequence[tuple[str, int]], *,
          min_shared_chars: int = MIN_SHARED_CHARS, max_load_gap: int = MAX_LOAD_GAP,
          max_session_gap: int = MAX_SESSION_GAP) -> Placement | None:
    """Choose a backend for one request (see the module docstring for the rules)."""
    alive = [(i, v) for i, v in enumerate(views) if v.alive]
    if not alive:
        return None
    if pin is not None and any(v.url == pin for _, v in alive):
        return Placement(pin, "pinned")
    moved_from = pin
    shared = {v.url: shared_chars(digests, v.prefixes) for _, v in alive}
    least, fewest = min(v.load for _, v in alive), min(v.sessions for _, v in alive)
    eligible = [(i, v) for i, v in alive if v.load <= least + max_load_gap and v.sessions <= fewest + max_session_gap]
    if eligible:
        _, best = max(eligible, key=lambda iv: (shared[iv[1].url], -iv[1].load, -iv[1].sessions, -iv[0]))
        if shared[best.url] >= min_shared_chars:
            return Placement(best.url, "prefix", shared[best.url], moved_from)
    _, pick = min(alive, key=lambda iv: (iv[1].load, iv[1].sessions, iv[0]))
    return Placement(pick.url, "least-load", shared[pick.url], moved_from)
