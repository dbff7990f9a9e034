"""GPT-OSS harmony, incrementally: `HarmonyStreamSplitter` (the streaming counterpart of
`harmony.split_harmony`) and `HarmonyStopper` (when generation must end). Text arrives in any
pieces; a marker split across pieces is recognised. Grammar and classification:
`harmony_messages`. Import these names from `mlxstack.parsing.harmony`.

Pure: no MLX, no I/O.

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

from mlxstack.parsing.harmony_messages import (
    ASSISTANT,
    BODY_ENDS,
    CALL,
    CHANNEL,
    END,
    HEADER_ENDS,
    LONGEST_MARKER,
    MESSAGE,
    RETURN,
    START,
    STOP_MARKERS,
    TERMINATORS,
    TOOL,
    bodyless_text,
    call_from_body,
    earliest_marker,
    message_kind,
    parse_header,
    partial_marker_start,
)
from mlxstack.parsing.reasoning import (
    CONTENT,
    REASONING,
    TOOL_CALLS,
    Event,
    StreamTrimmer,
)
from mlxstack.parsing.tool_calls import ToolCall

__all__ = ["HarmonyStreamSplitter", "HarmonyStopper"]


# ---------------------------------------------------------------------------------------------
# streaming
# ---------------------------------------------------------------------------------------------


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
        scan_from = max(0, len(self._header) - LONGEST_MARKER + 1)
        header = self._header + buf
        i, marker = earliest_marker(header, HEADER_ENDS, scan_from)
        if i < 0:
            self._header = header
            return ""
        rest = header[i + len(marker):]
        self._header = header[:i]
        if marker == MESSAGE:
            role, channel, recipient, _ = parse_header(self._header, self._implied)
            self._kind = message_kind(role, channel, recipient)
            self._recipient = recipient
            self._saw_call = self._saw_call or self._kind == TOOL
            self._in_body = True
            return rest
        if marker == START and not self._header and self._implied:
            # An empty implied message: the text simply starts a new explicit one.
            self._open_message(implied=False, header="")
            return rest
        self._push(out, CONTENT, self._trim, bodyless_text(self._header, self._implied))
        self._open_message(implied=marker != START, header="")
        return rest

    def _feed_body(self, out: list[Event], buf: str) -> str:
        i, marker = earliest_marker(buf, BODY_ENDS)
        if i < 0:
            keep = partial_marker_start(buf, BODY_ENDS)
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
        if self._kind == TOOL:
            self._body.append(text)
        elif self._kind in (REASONING, CONTENT):
            self._push(out, self._kind, self._trim, text)

    def _close_body(self, out: list[Event], terminator: str) -> None:
        if self._kind != TOOL:
            return
        body = "".join(self._body)
        call = call_from_body(self._recipient or "", body, self._tools, len(self._calls), self._id_salt)
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
            self._push(out, CONTENT, self._trim, bodyless_text(self._header, self._implied))
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
            i, marker = earliest_marker(buf, self._MARKERS)
            if i < 0:
                keep = partial_marker_start(buf, self._MARKERS)
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
                channel = parse_header(self._header, not self._explicit)[1]
            self._stopped = channel == "final"
            self._new_message(explicit=False, header="")
        elif marker == START:
            self._new_message(explicit=True, header="")
        elif marker == MESSAGE:
            if self._in_header:
                self._check_role_complete()
                self._channel = parse_header(self._header, not self._explicit)[1]
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
            role = parse_header(self._header, False)[0]
            self._stopped = role != ASSISTANT

