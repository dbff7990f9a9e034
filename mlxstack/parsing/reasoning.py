"""Split generated text into reasoning, content and tool calls, whole or streamed.

Pure: no MLX, no I/O.

    >>> strip_thinking("<think>\\nplan\\n</think>\\n\\nAnswer.")
    ('plan', 'Answer.')
    >>> s = ReasoningStreamSplitter()
    >>> [e for c in ("<thi", "nk>plan</th", "ink>Answer.") for e in s.feed(c)] + s.finish()
    [Event(kind='reasoning', text='plan', calls=()), Event(kind='content', text='Answer.', calls=())]

Grammar (one definition, shared by `strip_thinking` and `ReasoningStreamSplitter`):

- The text starts in *content* mode, or in *reasoning* mode when `thinking_started=True` (the
  rendered prompt already ended inside an open `<think>`, as Qwen3/GLM templates do with
  enable_thinking; see `prompt_opens_thinking`). That is how GLM's orphan close
  (`reasoning</think>answer`, no opening tag) is classified.
- content mode: `<think>` switches to reasoning; a stray `</think>` is dropped; the first
  `<tool_call>` switches to tool mode for the rest of the text.
- reasoning mode: `</think>` switches back to content; a nested `<think>` is dropped;
  `<tool_call>` is plain reasoning text (models talk about calls while thinking). An unterminated
  `<think>` makes the rest of the text reasoning.
- tool mode: everything is kept verbatim (raw markup) for `parse_tool_calls`.
- Whitespace: reasoning = concatenated reasoning pieces, `.strip()`ped; content = concatenated
  content pieces (including tool-mode text), `.strip()`ped. So the newlines after `<think>` and
  before/after `</think>` vanish, and inner whitespace is kept byte for byte.

Invariant (property-tested): for any chunking, the splitter's concatenated `content` events equal
`split_output(...).content`, its `reasoning` events equal `split_output(...).reasoning`, and its
one `tool_calls` event equals `split_output(...).tool_calls`.
"""

from __future__ import annotations

from typing import NamedTuple

from mlxstack.parsing.tool_calls import (
    TOOL_CALL_OPEN,
    ToolCall,
    extract_tool_calls,
    parse_tool_calls,
)

__all__ = [
    "THINK_OPEN",
    "THINK_CLOSE",
    "Event",
    "ParsedOutput",
    "strip_thinking",
    "split_output",
    "prompt_opens_thinking",
    "ReasoningStreamSplitter",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

REASONING = "reasoning"
CONTENT = "content"
TOOL_CALLS = "tool_calls"


class Event(NamedTuple):
    """One streamed piece: kind is "reasoning", "content" or "tool_calls".

    `text` is set for reasoning/content, `calls` (a tuple of ToolCall) for tool_calls.
    """

    kind: str
    text: str = ""
    calls: tuple[ToolCall, ...] = ()


class ParsedOutput(NamedTuple):
    """Non-streaming result: what `message.reasoning_content/content/tool_calls` carry."""

    reasoning: str
    content: str
    tool_calls: list[ToolCall]


def prompt_opens_thinking(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open `<think>` (pass as thinking_started)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


# ---------------------------------------------------------------------------------------------
# non-streaming reference
# ---------------------------------------------------------------------------------------------


def strip_thinking(text: str, *, thinking_started: bool = False, parse_tools: bool = True) -> tuple[str, str]:
    """Split a whole generated text into (reasoning, content).

    Args:
        text: the generated text.
        thinking_started: the prompt ended inside an open `<think>`, so the output starts as
            reasoning (GLM / Qwen3 with enable_thinking).

    Returns:
        (reasoning, content), each stripped. Content still holds any raw `<tool_call>` markup;
        `split_output` also extracts the calls.
    """
    reasoning: list[str] = []
    content: list[str] = []
    in_think = thinking_started
    pos = 0
    n = len(text)
    while pos < n:
        if in_think:
            close = text.find(THINK_CLOSE, pos)
            end = n if close < 0 else close
            # nested <think> tags inside reasoning are dropped
            reasoning.append(text[pos:end].replace(THINK_OPEN, ""))
            if close < 0:
                break
            pos = close + len(THINK_CLOSE)
            in_think = False
            continue
        tags = [(text.find(tag, pos), tag) for tag in ((THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN) if parse_tools
                                                       else (THINK_OPEN, THINK_CLOSE))]
        found = [(i, tag) for i, tag in tags if i >= 0]
        if not found:
            content.append(text[pos:])
            break
        i, tag = min(found)
        content.append(text[pos:i])
        if tag == TOOL_CALL_OPEN:
            content.append(text[i:])  # tool mode: the rest verbatim
            break
        pos = i + len(tag)
        in_think = tag == THINK_OPEN
    return "".join(reasoning).strip(), "".join(content).strip()


def split_output(
    text: str,
    *,
    thinking_started: bool = False,
    tools: list | None = None,
    family: str = "generic",
    id_salt: str = "",
    parse_tools: bool = True,
) -> ParsedOutput:
    """`strip_thinking` then `parse_tool_calls`: the non-streaming response fields. With
    ``parse_tools=False`` (tool_choice "none") tool-call markup stays content text."""
    reasoning, content = strip_thinking(text, thinking_started=thinking_started, parse_tools=parse_tools)
    if not parse_tools:
        return ParsedOutput(reasoning, content, [])
    content, calls = parse_tool_calls(content, tools, family, id_salt=id_salt)
    return ParsedOutput(reasoning, content, calls)


# ---------------------------------------------------------------------------------------------
# streaming
# ---------------------------------------------------------------------------------------------


class StreamTrimmer:
    """Streams `"".join(pieces).strip()`: drops leading whitespace, holds trailing whitespace
    until more non-whitespace text arrives, and drops what is still held at the end."""

    __slots__ = ("started", "held")

    def __init__(self) -> None:
        self.started = False
        self.held = ""

    def push(self, piece: str) -> str:
        if not self.started:
            piece = piece.lstrip()
            if not piece:
                return ""
            self.started = True
        body = piece.rstrip()
        if not body:
            self.held += piece
            return ""
        out = self.held + body
        self.held = piece[len(body):]
        return out


_CONTENT_TAGS = (THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN)
_REASONING_TAGS = (THINK_CLOSE, THINK_OPEN)


def partial_tag_start(buf: str, tags: tuple[str, ...]) -> int:
    """Index of the earliest suffix of `buf` that is a proper prefix of one of `tags`
    (that text may still become a tag), or len(buf) when there is none (pure)."""
    # every tag starts with "<", so only a "<" in the last len(tag)-1 characters can begin one
    start = buf.find("<", max(0, len(buf) - max(len(t) for t in tags) + 1))
    while start >= 0:
        tail = buf[start:]
        if any(t.startswith(tail) for t in tags):
            return start
        start = buf.find("<", start + 1)
    return len(buf)


class ReasoningStreamSplitter:
    """Character-level state machine over streamed chunks (see the module docstring grammar).

    Holds back at most len("<tool_call>") - 1 characters that could start a tag, so a tag split
    across chunks is recognised and never emitted as text; plus whitespace held by the trimming
    rule. Once `<tool_call>` is seen in content, the rest is buffered and parsed at `finish()`.

        splitter = ReasoningStreamSplitter(thinking_started=True, tools=tools, family="qwen3")
        for chunk in chunks:
            for event in splitter.feed(chunk): ...
        for event in splitter.finish(): ...
    """

    __slots__ = (
        "_mode", "_pending", "_tool_buf", "_reasoning", "_content",
        "_tools", "_family", "_id_salt", "_finished", "_content_tags",
    )

    def __init__(
        self,
        *,
        thinking_started: bool = False,
        tools: list | None = None,
        family: str = "generic",
        id_salt: str = "",
        parse_tools: bool = True,
    ) -> None:
        self._mode = REASONING if thinking_started else CONTENT
        self._content_tags = _CONTENT_TAGS if parse_tools else (THINK_OPEN, THINK_CLOSE)
        self._pending = ""
        self._tool_buf: list[str] = []
        self._reasoning = StreamTrimmer()
        self._content = StreamTrimmer()
        self._tools = tools
        self._family = family
        self._id_salt = id_salt
        self._finished = False

    @property
    def in_tool_call(self) -> bool:
        """True once the stream switched to buffered tool-call mode."""
        return self._mode == TOOL_CALLS

    def feed(self, chunk: str) -> list[Event]:
        """Classify the next generated chunk; returns the events now safe to send."""
        if self._finished:
            raise RuntimeError("ReasoningStreamSplitter.feed() called after finish()")
        if self._mode == TOOL_CALLS:
            self._tool_buf.append(chunk)
            return []
        out: list[Event] = []
        buf = self._pending + chunk
        while buf:
            if self._mode == TOOL_CALLS:
                self._tool_buf.append(buf)
                buf = ""
                break
            tags = _REASONING_TAGS if self._mode == REASONING else self._content_tags
            hit, tag = -1, ""
            for t in tags:
                i = buf.find(t)
                if i >= 0 and (hit < 0 or i < hit):
                    hit, tag = i, t
            if hit < 0:
                keep = partial_tag_start(buf, tags)
                self._emit(out, buf[:keep])
                buf = buf[keep:]
                break
            self._emit(out, buf[:hit])
            buf = buf[hit + len(tag):]
            if tag == THINK_OPEN:
                self._mode = REASONING  # (a nested open inside reasoning is just dropped)
            elif tag == THINK_CLOSE:
                self._mode = CONTENT  # (a stray close in content is just dropped)
            else:
                self._mode = TOOL_CALLS
                self._tool_buf.append(TOOL_CALL_OPEN)
        self._pending = buf
        return out

    def finish(self) -> list[Event]:
        """End of stream: flush held text, parse buffered tool calls, drop trailing whitespace."""
        if self._finished:
            return []
        self._finished = True
        out: list[Event] = []
        if self._pending:
            if self._mode == TOOL_CALLS:
                self._tool_buf.append(self._pending)
            else:
                self._emit(out, self._pending)  # a partial tag at the very end is just text
            self._pending = ""
        if self._mode == TOOL_CALLS:
            # rstrip first: the non-streaming path parses content that was already stripped.
            rest, calls = extract_tool_calls(
                "".join(self._tool_buf).rstrip(), self._tools, self._family, id_salt=self._id_salt
            )
            self._tool_buf = []
            text = self._content.push(rest)
            if text:
                out.append(Event(CONTENT, text))
            if calls:
                out.append(Event(TOOL_CALLS, calls=tuple(calls)))
        return out

    def _emit(self, out: list[Event], text: str) -> None:
        if not text:
            return
        if self._mode == REASONING:
            kind, text = REASONING, self._reasoning.push(text)
        else:
            kind, text = CONTENT, self._content.push(text)
        if not text:
            return
        if out and out[-1].kind == kind:
            out[-1] = Event(kind, out[-1].text + text)
        else:
            out.append(Event(kind, text))
