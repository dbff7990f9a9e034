"""GPT-OSS "harmony" output: split it into reasoning, content and tool calls, whole or streamed;
expose its messages exactly as generated; decide where generation must stop.

Pure: no MLX, no I/O.

    >>> text = ("<|channel|>analysis<|message|>Plan.<|end|>"
    ...         "<|start|>assistant<|channel|>final<|message|>Answer.<|return|>")
    >>> split_harmony(text)
    ParsedOutput(reasoning='Plan.', content='Answer.', tool_calls=[])
    >>> s = HarmonyStreamSplitter()
    >>> [e for c in (text[:20], text[20:50], text[50:]) for e in s.feed(c)] + s.finish()
    [Event(kind='reasoning', text='Plan.', calls=()), Event(kind='content', text='Answer.', calls=())]

The text is what the model generated after the prompt's `<|start|>assistant`, decoded WITH its
special tokens. Grammar (one definition, shared by `parse_harmony_messages`, `split_harmony` and
`HarmonyStreamSplitter`):

- The text is a sequence of messages. A message that starts with `<|start|>` names its role in its
  header (`<|start|>assistant<|channel|>final<|message|>`); any other message is *implied*: its
  role is assistant (the first one continues the prompt's `<|start|>assistant`; later ones are
  models skipping `<|end|><|start|>assistant`).
- Header: up to `<|message|>`. It may hold `<|channel|>NAME`, a recipient `to=RECIPIENT` (after
  the role or after the channel) and a content type (`<|constrain|>json` or a bare `json`).
- Body: up to a terminator `<|end|>`, `<|return|>` or `<|call|>` (kept in the message), or up to
  a `<|start|>` or `<|channel|>` that begins the next message without one, or the end of the text.
- A header that meets a terminator, `<|start|>` or the end of the text before `<|message|>` has no
  body.

Classification of each message (assistant role only: a message the model wrote under another
role, e.g. `<|start|>user`, is dropped -- the stopper ends generation there anyway):

- recipient `functions.NAME` -> a tool call whose arguments are the body, parsed as a JSON object
  and typed against the request's tool schema exactly as parsing/tool_calls.py types Hermes JSON
  calls. A body that is not a JSON object (or an empty NAME) is a malformed call: its raw message
  text goes to content, never silently dropped (as tool_calls.py keeps unknown blocks visible).
- any other recipient (a built-in tool such as `python`) -> reasoning: not addressed to the user.
- channel `analysis` -> reasoning; `final`, `commentary` without recipient (a preamble), an unknown
  channel or no channel -> content.
- no body: a marker-free implied header is plain text (a model that wrote no harmony markup at
  all) -> content; any other body-less message is markup only and contributes nothing.

Whitespace (reasoning.py's rule, applied per message, since each harmony message is a separate
piece of the model's turn): each message's text is `.strip()`ped, inner whitespace kept byte for
byte; the non-empty texts of one kind are joined with a blank line ("\\n\\n").

Tool calls are emitted in one `tool_calls` event at `finish()`, like ReasoningStreamSplitter, so
the API layer can use either splitter. Ids come from `make_tool_call_id(name, args, index,
id_salt)`, index counting the calls of this output.

Invariants (property-tested in tests/test_harmony.py): for any chunking, the streamed reasoning /
content / tool calls equal `split_harmony`'s; `"".join(m.raw for m in parse_harmony_messages(t))
== t`; nothing here raises on any input.

Stopping: generation must end at `<|return|>` (final answer done) or `<|call|>` (tool call
done). `<|end|>` ends one message only -- the model continues with `<|start|>assistant...` -- so
it is not a general stop token; `HarmonyStopper` also stops at `<|end|>` closing a `final`
message and at a `<|start|>` that opens a non-assistant role.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlxstack.parsing.reasoning import (
    CONTENT,
    REASONING,
    TOOL_CALLS,
    Event,
    ParsedOutput,
    StreamTrimmer,
)
from mlxstack.parsing.tool_calls import ToolCall, make_tool_call_id, parse_tool_calls

__all__ = [
    "START",
    "END",
    "MESSAGE",
    "CHANNEL",
    "CONSTRAIN",
    "RETURN",
    "CALL",
    "HARMONY_MARKERS",
    "STOP_MARKERS",
    "HarmonyMessage",
    "parse_harmony_messages",
    "split_harmony",
    "HarmonyStreamSplitter",
    "HarmonyStopper",
]

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"

HARMONY_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
# Token-level stops: the model's turn is over (answer given, or a tool call waits for its result).
STOP_MARKERS = (RETURN, CALL)
TERMINATORS = (END, RETURN, CALL)

ASSISTANT = "assistant"
FUNCTIONS_PREFIX = "functions."

_HEADER_ENDS = (MESSAGE, END, RETURN, CALL, START)
_BODY_ENDS = (END, RETURN, CALL, START, CHANNEL)
_LONGEST_MARKER = max(len(m) for m in HARMONY_MARKERS)

# Message kinds (what a message contributes).
_TOOL = "tool"
_DROP = "drop"


# ---------------------------------------------------------------------------------------------
# messages as generated
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class HarmonyMessage:
    """One harmony message exactly as generated.

    `raw` is the message's exact slice of the text (start marker, header, `<|message|>`, body,
    terminator), so joining `raw` over `parse_harmony_messages(text)` gives `text` back byte for
    byte: re-render from `raw`, never from the extracted fields.

    Attributes:
        role: "assistant" for an implied message; else the role the header names.
        channel: "analysis" / "commentary" / "final" / ..., or None when the header names none.
        recipient: e.g. "functions.get_weather", or None.
        constrain: the content type, e.g. "json" (from `<|constrain|>json` or a bare `json`).
        content: the body between `<|message|>` and the terminator, byte for byte ("" when the
            message has no body).
        terminator: "<|end|>", "<|return|>", "<|call|>", or "" when the message ended without one.
        has_body: the header was closed by `<|message|>`.
        raw: the exact source text of the message.
    """

    role: str
    channel: str | None
    recipient: str | None
    constrain: str | None
    content: str
    terminator: str
    has_body: bool
    raw: str

    @property
    def implied(self) -> bool:
        """True when the message did not start with `<|start|>` (role assistant by position)."""
        return not self.raw.startswith(START)

    @property
    def header(self) -> str:
        """Header text between the start marker (if any) and `<|message|>` / the message end."""
        text = self.raw[len(START):] if not self.implied else self.raw
        if self.has_body:
            return text[: text.index(MESSAGE)]
        return text[: len(text) - len(self.terminator)]


def _earliest(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """(index, marker) of the first of `markers` in text[start:], or (-1, "")."""
    best, found = -1, ""
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, m
    return best, found


def _parse_header(header: str, implied: bool) -> tuple[str, str | None, str | None, str | None]:
    """(role, channel, recipient, constrain) from a header's text.

    `header` excludes `<|start|>` and `<|message|>`. Before `<|channel|>`: the role word
    (implied messages: "assistant") and optionally `to=RECIPIENT`. After it: the channel word,
    optionally `to=RECIPIENT`, and the content type, `<|constrain|>X` or a bare word X. The
    first recipient and the first content type win; other words are ignored.
    """
    ci = header.find(CHANNEL)
    pre = header if ci < 0 else header[:ci]
    pre_words = pre.replace(CONSTRAIN, " " + CONSTRAIN).split()
    role = ASSISTANT
    if not implied:
        role = pre_words.pop(0) if pre_words and not pre_words[0].startswith(("to=", CONSTRAIN)) else ""
    channel = None
    post_words: list[str] = []
    if ci >= 0:
        post_words = header[ci + len(CHANNEL):].replace(CONSTRAIN, " " + CONSTRAIN).split()
        channel = ""
        if post_words and not post_words[0].startswith(("to=", CONSTRAIN)):
            channel = post_words.pop(0)
    recipient = next((w[3:] for w in pre_words + post_words if w.startswith("to=")), None)
    constrain = next((w[len(CONSTRAIN):] for w in pre_words + post_words if w.startswith(CONSTRAIN)), None)
    if constrain is None:
        constrain = next((w for w in post_words if not w.startswith("to=")), None)
    return role, channel, recipient, constrain


def parse_harmony_messages(text: str) -> list[HarmonyMessage]:
    """Split generated harmony text into its messages, exactly as generated.

    Args:
        text: the generated text (decoded with special tokens), starting right after the
            prompt's `<|start|>assistant`.

    Returns:
        The messages in order; `"".join(m.raw for m in result) == text`. Never raises.
    """
    out: list[HarmonyMessage] = []
    pos, n = 0, len(text)
    while pos < n:
        begin = pos
        implied = not text.startswith(START, pos)
        if not implied:
            pos += len(START)
        hi, marker = _earliest(text, _HEADER_ENDS, pos)
        if hi < 0:
            hi, marker = n, ""
        header = text[pos:hi]
        role, channel, recipient, constrain = _parse_header(header, implied)
        if marker != MESSAGE:
            end = hi + len(marker) if marker in TERMINATORS else hi
            out.append(HarmonyMessage(role, channel, recipient, constrain, "",
                                      marker if marker in TERMINATORS else "", False, text[begin:end]))
            pos = end
            continue
        body_start = hi + len(MESSAGE)
        bi, bmarker = _earliest(text, _BODY_ENDS, body_start)
        if bi < 0:
            bi, bmarker = n, ""
        terminator = bmarker if bmarker in TERMINATORS else ""
        end = bi + len(terminator)
        out.append(HarmonyMessage(role, channel, recipient, constrain, text[body_start:bi],
                                  terminator, True, text[begin:end]))
        pos = end
    return out


# ---------------------------------------------------------------------------------------------
# classification and tool calls (shared by the whole-text and streaming paths)
# ---------------------------------------------------------------------------------------------


def _kind(role: str, channel: str | None, recipient: str | None) -> str:
    """What a message with a body contributes: reasoning, content, a tool call, or nothing."""
    if role != ASSISTANT:
        return _DROP
    if recipient is not None:
        return _TOOL if recipient.startswith(FUNCTIONS_PREFIX) else REASONING
    return REASONING if channel == "analysis" else CONTENT


def _bodyless_text(header: str, implied: bool) -> str:
    """Content a body-less message contributes: a marker-free implied header is plain text."""
    if implied and CHANNEL not in header and CONSTRAIN not in header:
        return header
    return ""


def _reject_constant(name: str) -> float:
    # NaN/Infinity would be written back as invalid JSON (tool_calls.py rejects them the same way).
    raise ValueError(f"non-finite number {name!r}")


def _tool_call(recipient: str, body: str, tools: list | None, index: int, salt: str) -> ToolCall | None:
    """The call a `functions.NAME` message makes, or None when its body is not a JSON object."""
    name = recipient[len(FUNCTIONS_PREFIX):]
    if not name:
        return None
    text = body.strip()
    if text:
        try:
            args, end = json.JSONDecoder(parse_constant=_reject_constant).raw_decode(text)
        except (ValueError, RecursionError):
            return None
        if text[end:].strip() or not isinstance(args, dict):
            return None
    else:
        args = {}  # a call to a function without parameters
    # Type the values through tool_calls.py's own JSON-call path, so both grammars agree.
    # "<" only occurs inside JSON strings, so escaping it keeps a "</tool_call>" value inside.
    dumped = json.dumps({"name": name, "arguments": args}, ensure_ascii=False).replace("<", "\\u003c")
    rest, calls = parse_tool_calls("<tool_call>" + dumped + "</tool_call>", tools)
    if rest or len(calls) != 1:
        return None
    arguments = calls[0].arguments
    return ToolCall(name, arguments, make_tool_call_id(name, arguments, index, salt))


def split_harmony(text: str, *, tools: list | None = None, id_salt: str = "") -> ParsedOutput:
    """Split a whole generated harmony text into the response fields.

    Args:
        text: the generated text (see the module docstring).
        tools: the request's OpenAI `tools` list, used to type argument values.
        id_salt: request-scoped salt for the tool-call ids (e.g. the completion id).

    Returns:
        ParsedOutput(reasoning, content, tool_calls) by the module docstring's rules.
    """
    pieces: dict[str, list[str]] = {REASONING: [], CONTENT: []}
    calls: list[ToolCall] = []
    for msg in parse_harmony_messages(text):
        if not msg.has_body:
            pieces[CONTENT].append(_bodyless_text(msg.header, msg.implied).strip())
            continue
        kind = _kind(msg.role, msg.channel, msg.recipient)
        if kind == _DROP:
            continue
        if kind == _TOOL:
            call = _tool_call(msg.recipient or "", msg.content, tools, len(calls), id_salt)
            if call is None:
                pieces[CONTENT].append(msg.raw.strip())
            else:
                calls.append(call)
            continue
        pieces[kind].append(msg.content.strip())
    return ParsedOutput(
        "\n\n".join(p for p in pieces[REASONING] if p),
        "\n\n".join(p for p in pieces[CONTENT] if p),
        calls,
    )


# ---------------------------------------------------------------------------------------------
# streaming
# ---------------------------------------------------------------------------------------------


def _partial_marker_start(buf: str, markers: tuple[str, ...]) -> int:
    """Index of the earliest suffix of `buf` that is a proper prefix of one of `markers` (it may
    still become a marker), or len(buf) when there is none."""
    start = buf.find("<", max(0, len(buf) - _LONGEST_MARKER + 1))
    while start >= 0:
        tail = buf[start:]
        if any(m.startswith(tail) and m != tail for m in markers):
            return start
        start = buf.find("<", start + 1)
    return len(buf)


class HarmonyStreamSplitter:
    """Streaming counterpart of `split_harmony` (same grammar; see the module docstring).

    Holds back at most len("<|constrain|>") - 1 characters that could start a marker, and a
    message's header until its `<|message|>` (the header decides the message's kind; text with no
    harmony markup at all is therefore released at `finish()`). Reasoning and content stream as
    they arrive; tool calls are emitted together at `finish()`.

        splitter = HarmonyStreamSplitter(tools=tools, id_salt=completion_id)
        for chunk in chunks:
            for event in splitter.feed(chunk): ...
        for event in splitter.finish(): ...
    """

    __slots__ = (
        "_tools", "_id_salt", "_pending", "_in_body", "_implied", "_header", "_kind",
        "_recipient", "_body", "_trim", "_emitted", "_calls", "_saw_call", "_finished",
    )

    def __init__(self, *, tools: list | None = None, id_salt: str = "") -> None:
        self._tools = tools
        self._id_salt = id_salt
        self._pending = ""
        self._emitted = {REASONING: False, CONTENT: False}
        self._calls: list[ToolCall] = []
        self._saw_call = False
        self._finished = False
        self._open_message(implied=True, header="")

    @property
    def in_tool_call(self) -> bool:
        """True once a message addressed to `functions.*` has started (stays True)."""
        return self._saw_call

    def _open_message(self, *, implied: bool, header: str) -> None:
        self._in_body = False
        self._implied = implied
        self._header = header
        self._kind = ""
        self._recipient: str | None = None
        self._body: list[str] = []
        self._trim = StreamTrimmer()

    def feed(self, chunk: str) -> list[Event]:
        """Classify the next generated chunk; returns the events now safe to send."""
        if self._finished:
            raise RuntimeError("HarmonyStreamSplitter.feed() called after finish()")
        out: list[Event] = []
        buf = self._pending + chunk
        self._pending = ""
        while buf:
            if not self._in_body:
                buf = self._feed_header(out, buf)
            else:
                buf = self._feed_body(out, buf)
        return out

    def _feed_header(self, out: list[Event], buf: str) -> str:
        # Search the whole header so far: a marker may straddle two chunks.
        scan_from = max(0, len(self._header) - _LONGEST_MARKER + 1)
        header = self._header + buf
        i, marker = _earliest(header, _HEADER_ENDS, scan_from)
        if i < 0:
            self._header = header
            return ""
        rest = header[i + len(marker):]
        self._header = header[:i]
        if marker == MESSAGE:
            role, channel, recipient, _ = _parse_header(self._header, self._implied)
            self._kind = _kind(role, channel, recipient)
            self._recipient = recipient
            self._saw_call = self._saw_call or self._kind == _TOOL
            self._in_body = True
            return rest
        if marker == START and not self._header and self._implied:
            # An empty implied message: the text simply starts a new explicit one.
            self._open_message(implied=False, header="")
            return rest
        self._push(out, CONTENT, self._trim, _bodyless_text(self._header, self._implied))
        self._open_message(implied=marker != START, header="")
        return rest

    def _feed_body(self, out: list[Event], buf: str) -> str:
        i, marker = _earliest(buf, _BODY_ENDS)
        if i < 0:
            keep = _partial_marker_start(buf, _BODY_ENDS)
            self._body_text(out, buf[:keep])
            self._pending = buf[keep:]
            return ""
        self._body_text(out, buf[:i])
        terminator = marker if marker in TERMINATORS else ""
        self._close_body(out, terminator)
        if marker == START:
            self._open_message(implied=False, header="")
        elif marker == CHANNEL:
            self._open_message(implied=True, header=CHANNEL)
        else:
            self._open_message(implied=True, header="")
        return buf[i + len(marker):]

    def _body_text(self, out: list[Event], text: str) -> None:
        if not text:
            return
        if self._kind == _TOOL:
            self._body.append(text)
        elif self._kind in (REASONING, CONTENT):
            self._push(out, self._kind, self._trim, text)

    def _close_body(self, out: list[Event], terminator: str) -> None:
        if self._kind != _TOOL:
            return
        body = "".join(self._body)
        call = _tool_call(self._recipient or "", body, self._tools, len(self._calls), self._id_salt)
        if call is not None:
            self._calls.append(call)
            return
        raw = ("" if self._implied else START) + self._header + MESSAGE + body + terminator
        self._push(out, CONTENT, StreamTrimmer(), raw)

    def _push(self, out: list[Event], kind: str, trimmer: StreamTrimmer, text: str) -> None:
        """Stream `text` of one piece (a message's text) through its trimmer as `kind`."""
        first = not trimmer.started
        text = trimmer.push(text)
        if not text:
            return
        # A piece's first text is separated from the kind's earlier pieces by a blank line.
        if first and self._emitted[kind]:
            text = "\n\n" + text
        self._emitted[kind] = True
        if out and out[-1].kind == kind:
            out[-1] = Event(kind, out[-1].text + text)
        else:
            out.append(Event(kind, text))

    def finish(self) -> list[Event]:
        """End of stream: flush held text, close the open message, emit the tool calls."""
        if self._finished:
            return []
        self._finished = True
        out: list[Event] = []
        if self._in_body:
            self._body_text(out, self._pending)
            self._pending = ""
            self._close_body(out, "")
        else:
            self._push(out, CONTENT, self._trim, _bodyless_text(self._header, self._implied))
        if self._calls:
            out.append(Event(TOOL_CALLS, calls=tuple(self._calls)))
        return out


# ---------------------------------------------------------------------------------------------
# stopping
# ---------------------------------------------------------------------------------------------


class HarmonyStopper:
    """Decides, token by token, when harmony generation must stop.

    `push(token_text)` returns True (and keeps returning True) once the generated text reaches:
    `<|return|>` or `<|call|>` (the turn is over); `<|end|>` closing a message in the `final`
    channel (defensive: a final answer ends with `<|return|>`); or a `<|start|>` that opens any
    role but assistant (the model must never write a user/system/tool turn) -- decided as soon as
    the role text can no longer be "assistant". `<|end|>` after any other message is not a stop:
    the model goes on with `<|start|>assistant...`.

        stopper = HarmonyStopper()
        for tok in tokens:
            detokenizer.add_token(tok)
            if stopper.push(detokenizer.last_segment): break

    Push decoded text (a detokenizer segment), not raw BPE token strings: in those a space is
    "Ġ", and `<|start|>assistant to=...` would read as the role "assistantĠto=...". Text may come
    in any pieces (a marker split across pushes is recognised).
    """

    __slots__ = ("_pending", "_in_header", "_explicit", "_header", "_channel", "_stopped")

    _MARKERS = (START, END, RETURN, CALL, MESSAGE, CHANNEL)

    def __init__(self) -> None:
        self._pending = ""
        self._stopped = False
        self._new_message(explicit=False, header="")  # the prompt already opened the assistant turn

    @property
    def stopped(self) -> bool:
        return self._stopped

    def _new_message(self, *, explicit: bool, header: str) -> None:
        self._in_header = True
        self._explicit = explicit
        self._header = header
        self._channel: str | None = None

    def push(self, token_text: str) -> bool:
        """Feed the next generated text; True once generation must stop."""
        if self._stopped:
            return True
        buf = self._pending + token_text
        self._pending = ""
        while buf and not self._stopped:
            i, marker = _earliest(buf, self._MARKERS)
            if i < 0:
                keep = _partial_marker_start(buf, self._MARKERS)
                self._text(buf[:keep])
                self._pending = buf[keep:]
                break
            self._text(buf[:i])
            if self._stopped:
                break
            buf = buf[i + len(marker):]
            self._marker(marker)
        return self._stopped

    def _text(self, text: str) -> None:
        if not text or not self._in_header:
            return
        self._header += text
        self._check_role()

    def _check_role(self) -> None:
        if not self._explicit:
            return
        head = self._header
        cut = min((j for j in (head.find("<|"), *(head.find(c) for c in " \t\r\n")) if j >= 0),
                  default=-1)
        if cut < 0:
            self._stopped = not ASSISTANT.startswith(head)
        else:
            self._stopped = head[:cut] != ASSISTANT

    def _marker(self, marker: str) -> None:
        if marker in STOP_MARKERS:
            self._stopped = True
        elif marker == END:
            channel = self._channel
            if self._in_header:
                channel = _parse_header(self._header, not self._explicit)[1]
            self._stopped = channel == "final"
            self._new_message(explicit=False, header="")
        elif marker == START:
            self._new_message(explicit=True, header="")
        elif marker == MESSAGE:
            if self._in_header:
                self._check_role_complete()
                self._channel = _parse_header(self._header, not self._explicit)[1]
                self._in_header = False
        elif marker == CHANNEL:
            if self._in_header:
                self._header += CHANNEL
                self._check_role_complete()
            else:  # a body interrupted by a new message that skipped <|end|><|start|>assistant
                self._new_message(explicit=False, header=CHANNEL)

    def _check_role_complete(self) -> None:
        # A marker ends the role word: an explicit header must have named exactly "assistant".
        if self._explicit:
            role = _parse_header(self._header, False)[0]
            self._stopped = role != ASSISTANT


# ---------------------------------------------------------------------------------------------
# healing: the assistant message fields that re-render what the model generated
# ---------------------------------------------------------------------------------------------


def healing_patch(text: str) -> dict | None:
    """The assistant-message fields that make a harmony template re-render ``text`` (what the
    model generated, terminator included) instead of what a client echoed back: the analysis
    body as ``reasoning_content``, the final / preamble body as ``content``, and each call's
    arguments byte for byte (``tool_arguments``, in call order; the client's call ids are kept).

    Returns None when the generation does not fit one assistant message (several analysis or
    content messages, or a message under another role): such a turn is left as the client sent
    it, and cache reuse simply stops where the tokens differ.
    """
    reasoning: list[str] = []
    content: list[str] = []
    arguments: list[str] = []
    for m in parse_harmony_messages(text):
        if not m.has_body and not m.content:
            continue
        if m.role != ASSISTANT:
            return None
        kind = _kind(m.role, m.channel, m.recipient)
        if kind == _TOOL:
            arguments.append(m.content)
        elif kind == REASONING and m.recipient is None:
            reasoning.append(m.content)
        elif kind == CONTENT and m.has_body:
            content.append(m.content)
        else:
            return None
    if len(reasoning) > 1 or len(content) > 1 or not (reasoning or content or arguments):
        return None
    patch: dict = {"content": content[0] if content else ""}
    if reasoning:
        patch["reasoning_content"] = reasoning[0]
    if arguments:
        patch["tool_arguments"] = arguments
    return patch
