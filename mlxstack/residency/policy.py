"""Which models stay resident (pure: plain data in, names out; no processes, no clocks).

    slots = [Slot("a", need=3 << 30, state="ready", last_used=10.0), ...]
    victims = room_for(slots, need=2 << 30, budget=8 << 30)   # [] fits, [names] to unload first,
                                                                # None: wait (busy rows hold the room)
    stale = expired(slots, now=100.0, ttl=60.0)                 # idle longer than the TTL

Rules (tests/test_residency.py):
- A model is counted at its ``need`` (weights on disk + its KV budget) from the moment its load is
  planned until its process has exited: a loading or unloading model holds its room.
- Room is made from idle models only (ready, no request in flight, not pinned), least recently
  used first (ties: by name); never more of them than the new model needs.
- A model that cannot fit alone, or beside the pinned models, is refused (TooBig): waiting would
  never help. One that would fit once busy models finish waits (None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

LOADING, READY, UNLOADING = "loading", "ready", "unloading"


class TooBig(Exception):
    """The model cannot be resident within the budget: alone, or beside the pinned models."""

    def __init__(self, need: int, budget: int, pinned: int) -> None:
        self.need, self.budget, self.pinned = need, budget, pinned
        super().__init__(f"needs {need} bytes, budget {budget}, pinned {pinned}")


@dataclass
class Slot:
    name: str
    need: int                 # bytes: weights + KV budget
    state: str = LOADING
    last_used: float = 0.0
    in_flight: int = 0
    pinned: bool = False

    @property
    def idle(self) -> bool:
        return self.state == READY and self.in_flight == 0 and not self.pinned


def room_for(slots: Sequence[Slot], need: int, budget: int) -> list[str] | None:
    """Names to unload (in order) so ``need`` more bytes fit in ``budget``: [] when they fit now,
    None when only busy models hold the room (wait, then ask again). TooBig when never."""
    pinned = sum(s.need for s in slots if s.pinned)
    if need > budget or need > budget - pinned:
        raise TooBig(need, budget, pinned)
    free = budget - sum(s.need for s in slots)
    victims: list[str] = []
    for slot in sorted((s for s in slots if s.idle), key=lambda s: (s.last_used, s.name)):
        if free >= need:
            break
        victims.append(slot.name)
        free += slot.need
    return victims if free >= need else None


def expired(slots: Sequence[Slot], now: float, ttl: float) -> list[str]:
    """Idle models unused for ``ttl`` seconds or more, least recently used first (ttl 0: none)."""
    if ttl <= 0:
        return []
    return [s.name for s in sorted(slots, key=lambda s: (s.last_used, s.name)) if s.idle and now - s.last_used >= ttl]
