"""Streaming stop-string matcher: text is released only once it cannot start a stop string.

    m = StopMatcher(["</answer>"])
    out, hit = m.push("hello </ans")   # -> ("hello ", False): "</ans" is held back
    out, hit = m.push("wer> tail")     # -> ("", True): the stop string never leaks
    rest = m.flush()                    # held text at end of stream
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self._max = max((len(s) for s in self.stops), default=0)

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return buf[:cut], True
        # Hold back the longest suffix that is a proper prefix of some stop string.
        keep = 0
        for n in range(min(self._max - 1, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                keep = n
                break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
