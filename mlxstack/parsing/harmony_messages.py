"""GPT-OSS harmony grammar: generated text -> messages exactly as generated, and what each message
contributes (reasoning, content, a tool call, nothing). Shared by the whole-text parser
(`harmony.split_harmony`, `harmony.healing_patch`) and the streaming splitter and stopper
(`harmony_stream`); import the public names from `mlxstack.parsing.harmony`.

Pure: no MLX, no I/O.

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
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlxstack.parsing.reasoning import CONTENT, REASONING
from mlxstack.parsing.tool_calls import ToolCall, make_tool_call_id, parse_tool_calls

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

HEADER_ENDS = (MESSAGE, END, RETURN, CALL, START)
BODY_ENDS = (END, RETURN, CALL, START, CHANNEL)
LONGEST_MARKER = max(len(m) for m in HARMONY_MARKERS)

# Message kinds besides REASONING / CONTENT (what a message contributes).
TOOL = "tool"
DROP = "drop"


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


def earliest_marker(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """(index, marker) of the first of `markers` in text[start:], or (-1, "")."""
    best, found = -1, ""
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, m
    return best, found


def partial_marker_start(buf: str, markers: tuple[str, ...]) -> int:
    """Index of the earliest suffix of `buf` that is a proper prefix of one of `markers` (it may
    still become a marker), or len(buf) when there is none."""
    start = buf.find("<", max(0, len(buf) - LONGEST_MARKER + 1))
    while start >= 0:
        tail = buf[start:]
        if any(m.startswith(tail) and m != tail for m in markers):
            return start
        start = buf.find("<", start + 1)
    return len(buf)


def parse_header(header: str, implied: bool) -> tuple[str, str | None, str | None, str | None]:
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
        hi, marker = earliest_marker(text, HEADER_ENDS, pos)
        if hi < 0:
            hi, marker = n, ""
        header = text[pos:hi]
        role, channel, recipient, constrain = parse_header(header, implied)
        if marker != MESSAGE:
            end = hi + len(marker) if marker in TERMINATORS else hi
            out.append(HarmonyMessage(role, channel, recipient, constrain, "",
                                      marker if marker in TERMINATORS else "", False, text[begin:end]))
            pos = end
            continue
        body_start = hi + len(MESSAGE)
        bi, bmarker = earliest_marker(text, BODY_ENDS, body_start)
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


def message_kind(role: str, channel: str | None, recipient: str | None) -> str:
    """What a message with a body contributes: reasoning, content, a tool call, or nothing."""
    if role != ASSISTANT:
        return DROP
    if recipient is not None:
        return TOOL if recipient.startswith(FUNCTIONS_PREFIX) else REASONING
    return REASONING if channel == "analysis" else CONTENT


def bodyless_text(header: str, implied: bool) -> str:
    """Content a body-less message contributes: a marker-free implied header is plain text."""
    if implied and CHANNEL not in header and CONSTRAIN not in header:
        return header
    return ""


def _reject_constant(name: str) -> float:
    # NaN/Infinity would be written back as invalid JSON (tool_calls.py rejects them the same way).
    raise ValueError(f"non-finite number {name!r}")


def call_from_body(recipient: str, body: str, tools: list | None, index: int, salt: str) -> ToolCall | None:
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
