"""A reply as a front's parts -- Responses output items, Anthropic content blocks -- whole or streamed.

The reply splitter (parsing/output.py) cuts generated text into events: reasoning, content, tool
calls. ``ReplyParts`` turns those events into parts and into the stream events that build them,
the same way for every front: consecutive pieces of one kind extend the open part, a change of
kind closes it, and each tool call is a part of its own. A front says only how a part starts,
grows and ends (openai/responses.py OutputItems, anthropic/messages.py ContentBlocks).

    parts.push_events(whole_reply_events(text, thinking_started=..., tools=..., family=..., salt=...))
    parts.close()                                      # a whole reply, in one pass

    split = ReplySplit(tools=..., family=..., salt=...)   # a streamed one
    split.open(ready)                                  # PromptReady (None: it never came)
    events = parts.push_events(split.feed(text))       # per delta
    events = parts.push_events(split.finish(outcome)) + parts.close()

Both paths feed the same splitter events, so a streamed reply's parts equal the whole reply's.
"""
from __future__ import annotations

from typing import Any, Iterable

from ...parsing.output import reply_splitter
from ...parsing.reasoning import TOOL_CALLS


class ReplyParts:
    """Splitter events -> parts (``parts``, in order) and the stream events that build them.

    ``push`` / ``close`` return event payloads. Subclasses write the four hooks; the open part's
    kind is the splitter's (REASONING or CONTENT) and its text arrives in pieces.
    """

    def __init__(self) -> None:
        self.parts: list[dict] = []
        self._open: str | None = None     # kind of the part being built (REASONING | CONTENT)
        self._text: list[str] = []

    def push(self, kind: str, text: str = "", calls: tuple = ()) -> list[dict]:
        out = self.close() if self._open is not None and self._open != kind else []
        if kind == TOOL_CALLS:
            for call in calls:
                out += self._tool_call(call)
            return out
        if not text:
            return out
        if self._open is None:
            out += self._begin(kind)
        self._text.append(text)
        return out + self._delta(kind, text)

    def push_events(self, events: Iterable[Any]) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            out += self.push(ev.kind, ev.text, ev.calls)
        return out

    def close(self) -> list[dict]:
        """Finish the open part, if any."""
        if self._open is None:
            return []
        kind, text = self._open, "".join(self._text)
        self._open, self._text = None, []
        return self._end(kind, text)

    def _begin(self, kind: str) -> list[dict]:
        self._open = kind
        return self._start(kind)

    # per front -----------------------------------------------------------------------------------
    def _start(self, kind: str) -> list[dict]:
        """Events opening a part of ``kind`` at index ``len(self.parts)``."""
        raise NotImplementedError

    def _delta(self, kind: str, text: str) -> list[dict]:
        """Events for one more piece of the open part's text."""
        raise NotImplementedError

    def _end(self, kind: str, text: str) -> list[dict]:
        """Append the finished part (its whole ``text``) to ``parts``; the events closing it."""
        raise NotImplementedError

    def _tool_call(self, call: Any) -> list[dict]:
        """Append one tool call as a finished part; the events building it."""
        raise NotImplementedError


def whole_reply_events(text: str, *, thinking_started: bool, tools: list | None, family: str,
                       salt: str) -> list[Any]:
    """A whole reply's splitter events: what the streaming path sees, in one pass."""
    splitter = reply_splitter(thinking_started=thinking_started, tools=tools, family=family, id_salt=salt)
    return [*splitter.feed(text), *splitter.finish()]


class ReplySplit:
    """A streamed reply's splitter, opened when the prompt is ready (``PromptReady.thinking_started``);
    when no PromptReady came, ``finish`` opens it from the outcome."""

    def __init__(self, *, tools: list | None, family: str, salt: str) -> None:
        self.tools, self.family, self.salt = tools, family, salt
        self.splitter: Any = None

    def _make(self, thinking_started: bool) -> None:
        self.splitter = reply_splitter(thinking_started=thinking_started, tools=self.tools, family=self.family,
                                       id_salt=self.salt)

    def open(self, ready: Any) -> None:
        if ready is not None:
            self._make(ready.thinking_started)

    def feed(self, text: str) -> list[Any]:
        return self.splitter.feed(text)

    def finish(self, outcome: Any) -> list[Any]:
        if self.splitter is None:
            self._make(outcome.thinking_started)
        return self.splitter.finish()


__all__ = ["ReplyParts", "ReplySplit", "whole_reply_events"]
