"""Client cache breakpoints and lifetimes, as numbers (pure).

    applied = applied_lifetime(asked, default=1800, cap=3600)     # seconds an entry is kept idle
    segs = written_segments(cached=40, prompt=300, marks=[(120, 3600.0)], rest=1800.0)
    long_tokens(segs, at_least=3600)                               # tokens kept >= 1h

A client marks where a reusable prefix ends (Anthropic ``cache_control``, Responses
``prompt_cache_breakpoint``) and how long it wants it kept (``ttl`` / ``prompt_cache_retention``).
The server keeps an entry idle for its lifetime, never shorter than its own default (reuse
first: a client asking 5m does not make the server forget sooner than it would anyway) and
never longer than its cap (CACHE_TTL_MAX_SECONDS) -- unless entries never expire (default 0).

The prompt tokens a request writes are counted by the lifetime that applies to them: the
tokens up to each breakpoint (from the previous one, or from what was reused) by that
breakpoint's lifetime, the rest by the request's own.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple


class Segment(NamedTuple):
    start: int      # first written prompt token
    end: int        # one past the last
    lifetime: float  # seconds the entry holding it is kept idle (0: never expires)
    marked: bool    # ends at a client breakpoint (else: the tokens after the last one)


def applied_lifetime(asked: float | None, default: float, cap: float) -> float:
    """The idle lifetime an entry gets: the server's ``default`` (0 = never expires: stays 0),
    raised to what the client ``asked`` (None: nothing asked) up to ``cap`` (0 = no cap)."""
    if default <= 0:
        return 0.0
    if asked is None or asked <= default:
        return float(default)
    return float(asked if cap <= 0 else max(default, min(asked, cap)))


def written_segments(cached: int, prompt: int, marks: Iterable[tuple[int, float]], rest: float) -> list[Segment]:
    """The prompt tokens ``[cached, prompt)`` a request writes, split at its breakpoints
    (``marks``: (token position, applied lifetime)); breakpoints at or before ``cached`` were read,
    not written. The tail after the last breakpoint gets ``rest`` (the request's own lifetime)."""
    out: list[Segment] = []
    at = cached
    for pos, life in sorted(marks):
        pos = min(pos, prompt)
        if pos > at:
            out.append(Segment(at, pos, life, True))
            at = pos
    if prompt > at:
        out.append(Segment(at, prompt, rest, False))
    return out


def long_tokens(segments: Iterable[Segment], at_least: float) -> int:
    """Tokens kept at least ``at_least`` seconds (a lifetime of 0 never expires: counted)."""
    return sum(s.end - s.start for s in segments if s.lifetime <= 0 or s.lifetime >= at_least)


def marked_tokens(segments: Iterable[Segment]) -> int:
    """Written tokens up to the last breakpoint (Anthropic's cache_creation_input_tokens)."""
    return sum(s.end - s.start for s in segments if s.marked)


__all__ = ["Segment", "applied_lifetime", "long_tokens", "marked_tokens", "written_segments"]
