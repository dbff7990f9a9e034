"""The gate a reply's text passes before anyone sees it, when the reply may call tools (pure).

    gate = CallGate(tools=tools, family="llama", thinking_started=False, single=False)
    text, end = gate.push(delta)      # text safe to show now; end: the reply ends here
    tail = gate.flush(cut=False)      # at the end: what the gate still holds (cut: a max_tokens cut)

A call's text (``<tool_call>`` up to ``</tool_call>``) is held until the call closes, then judged:

- a call identical to an earlier one of the same reply (same name, same canonical arguments) is
  never shown: the reply ends before it, as a finished reply (the model was looping; a client
  would run the same call twice or, streamed, wait for a reply cut at max_tokens: LESSONS 70);
- with ``single`` (one call allowed and no grammar enforcing it), the reply ends after the first call;
- a reply cut inside a call (``flush(cut=True)``) drops the unfinished call -- markup and partial
  arguments are never text; calls that closed before the cut were shown already.

Everything else passes unchanged and in order, so the text shown is a prefix of the text
generated. Only a possible tag at the end of a delta is held back until the next one says what it
is. The modes follow parsing/reasoning.py: ``<tool_call>`` inside a reasoning block is reasoning
text, and after the first call every later block is a call (the splitter is in tool mode for good).
A block the parsers do not read as exactly one call is let through as it is (it stays visible as
text, parsing/tool_calls.py).
"""
from __future__ import annotations

from .reasoning import THINK_CLOSE, THINK_OPEN, partial_tag_start
from .tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, canonical_arguments, extract_tool_calls

__all__ = ["CallGate"]

_REASONING, _CONTENT, _CALL = "reasoning", "content", "call"


def _first(buf: str, tags: tuple[str, ...]) -> tuple[int, str]:
    hits = [(buf.find(t), t) for t in tags]
    hits = [(i, t) for i, t in hits if i >= 0]
    return min(hits) if hits else (-1, "")


class CallGate:
    """Holds each tool call until it closes; ends the reply at a repeated call (see the module
    docstring). ``calls``: the (name, canonical arguments) of every call let through."""

    def __init__(self, *, tools: list | None = None, family: str = "generic", thinking_started: bool = False,
                 single: bool = False) -> None:
        self.tools, self.family, self.single = tools, family, single
        self.calls: list[tuple[str, str]] = []
        self.ended = False
        self._mode = _REASONING if thinking_started else _CONTENT
        self._called = False     # a call opened: no more reasoning blocks (the splitter's tool mode)
        self._pending = ""       # the end of the last delta, which may be the start of a tag
        self._held = ""          # the open call's text so far

    def _tags(self) -> tuple[str, ...]:
        if self._mode == _REASONING:
            return (THINK_CLOSE,)
        if self._mode == _CALL:
            return (TOOL_CALL_CLOSE, TOOL_CALL_OPEN)
        return (TOOL_CALL_OPEN,) if self._called else (THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN)

    def push(self, text: str) -> tuple[str, bool]:
        """(text to show now, whether the reply ends here). Nothing is shown once it ended."""
        if self.ended:
            return "", True
        out: list[str] = []
        buf = self._pending + text
        while buf:
            tags = self._tags()
            i, tag = _first(buf, tags)
            if i < 0:
                keep = partial_tag_start(buf, tags)
                self._show(out, buf[:keep])
                buf = buf[keep:]
                break
            if self._mode != _CALL:
                out.append(buf[:i + len(tag)] if tag != TOOL_CALL_OPEN else buf[:i])
                buf = buf[i + len(tag):]
                if tag == TOOL_CALL_OPEN:
                    self._mode, self._called, self._held = _CALL, True, TOOL_CALL_OPEN
                else:
                    self._mode = _REASONING if tag == THINK_OPEN else _CONTENT
                continue
            if tag == TOOL_CALL_OPEN:          # a new call before this one closed: judge it as it is
                block, buf = self._held + buf[:i], buf[i:]
                self._mode = _CONTENT
            else:
                block, buf = self._held + buf[:i + len(tag)], buf[i + len(tag):]
                self._mode = _CONTENT
            self._held = ""
            if self._judge(block, out):
                self.ended, self._pending = True, ""
                return "".join(out), True
        self._pending = buf
        return "".join(out), False

    def _show(self, out: list[str], text: str) -> None:
        if self._mode == _CALL:
            self._held += text
        else:
            out.append(text)

    def _judge(self, block: str, out: list[str]) -> bool:
        """Let a finished call's text through (True: the reply ends instead, or right after it)."""
        _rest, calls = extract_tool_calls(block, self.tools, self.family)
        if len(calls) != 1:
            out.append(block)                  # not one call: the parsers keep it visible as text
            return False
        key = (calls[0].name, canonical_arguments(calls[0].arguments))
        if key in self.calls:
            return True                        # the same call again: never shown, the reply ends
        self.calls.append(key)
        out.append(block)
        return self.single

    def flush(self, cut: bool) -> str:
        """The text still held when the reply ends. ``cut`` (max_tokens, the context window): an
        unfinished call -- or the start of one -- is dropped; otherwise it is shown as it is."""
        if self.ended:
            return ""
        held, pending = self._held, self._pending
        self._held = self._pending = ""
        self.ended = True
        if self._mode == _CALL:
            return "" if cut else held + pending
        if cut and pending and TOOL_CALL_OPEN.startswith(pending) and self._mode == _CONTENT:
            return ""
        return pending
