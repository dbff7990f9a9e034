"""GPT-OSS "harmony" output: split it into reasoning, content and tool calls, whole or streamed;
expose its messages exactly as generated; decide where generation must stop; heal a turn.

Pure: no MLX, no I/O.

    >>> text = ("<|channel|>analysis<|message|>Plan.<|end|>"
    ...         "<|start|>assistant<|channel|>final<|message|>Answer.<|return|>")
    >>> split_harmony(text)
    ParsedOutput(reasoning='Plan.', content='Answer.', tool_calls=[])
    >>> s = HarmonyStreamSplitter()
    >>> [e for c in (text[:20], text[20:50], text[50:]) for e in s.feed(c)] + s.finish()
    [Event(kind='reasoning', text='Plan.', calls=()), Event(kind='content', text='Answer.', calls=())]

The text is what the model generated after the prompt's `<|start|>assistant`, decoded WITH its
special tokens. This module is the public face; the code lives in three parts:

- `harmony_messages`: the grammar (text -> `HarmonyMessage`s, byte for byte) and the
  classification rules (which message is reasoning, content, a tool call or nothing) -- the one
  definition both paths below share; its docstring states the rules.
- here: `split_harmony` (whole text -> response fields) and `healing_patch` (generated text ->
  the assistant-message fields that re-render it).
- `harmony_stream`: `HarmonyStreamSplitter` (streamed fields) and `HarmonyStopper` (stop rule).

Invariants (property-tested in tests/test_harmony.py): for any chunking, the streamed reasoning /
content / tool calls equal `split_harmony`'s; `"".join(m.raw for m in parse_harmony_messages(t))
== t`; nothing here raises on any input.

Why not openai-harmony 0.0.8 (measured by scripts/compare_parsers.py, numbers
and cases in .context/notes/parsers.md). Rendering is not ours to replace: the model's chat
template renders harmony, and tests/test_harmony.py already pins the fixture's template to the
library's `render_conversation_for_completion`. Parsing and stopping stay ours, because the
library cannot do this job:

- It parses token ids of its own o200k encoding; the engine holds the model tokenizer's ids
  (the tiny GPT-OSS fixture: SmolLM2 ids plus the harmony specials). Fed those, it parses 0 of
  the 40 texts in tests/test_harmony.py. Using it means re-encoding every reply with o200k, whose
  vocab it downloads on first use (offline only a copy rebuilt from quicktok-v1 works).
- Even re-encoded, its messages match ours on 29 of 40 test texts and the response fields built
  from them on 27 (realistic outputs: 17 of 20; random near-harmony texts: 46 of 300). It raises
  HarmonyError ("Unexpected EOS while waiting for message header") on text cut inside a header
  (max_tokens, streamed prefixes) and on a reply without markup; when the model skips
  `<|end|><|start|>assistant` it keeps `<|channel|>final<|message|>A` inside the analysis body
  (the answer would leak into reasoning); it reads `<|start|>system<|message|>` as a recipient
  and keeps `x<|start|>user` as final text.
- It keeps no raw text or terminator, so a malformed call cannot be shown as written (our rule:
  never dropped silently); streamed, a marker cut across chunks must still be held back by our
  code before re-encoding, and the fields then match on no more cases than whole.
- Stops: `stop_tokens()` holds `<|end|>` (LESSONS.md 16: every reply would stop after its
  analysis); `stop_tokens_for_assistant_actions()` (`<|return|>`, `<|call|>`) agrees with
  `HarmonyStopper` on 31 of 40 test texts: no rule for a `<|start|>` opening another role, nor
  for `<|end|>` closing a final message.
- Classification, argument typing, call ids and whitespace would stay ours anyway (it has none).
"""

from __future__ import annotations

from mlxstack.parsing.harmony_messages import (
    ASSISTANT,
    CALL,
    CHANNEL,
    CONSTRAIN,
    DROP,
    END,
    HARMONY_MARKERS,
    MESSAGE,
    RETURN,
    START,
    STOP_MARKERS,
    TOOL,
    HarmonyMessage,
    bodyless_text,
    call_from_body,
    message_kind,
    parse_harmony_messages,
)
from mlxstack.parsing.harmony_stream import HarmonyStopper, HarmonyStreamSplitter
from mlxstack.parsing.reasoning import CONTENT, REASONING, ParsedOutput
from mlxstack.parsing.tool_calls import ToolCall

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
            pieces[CONTENT].append(bodyless_text(msg.header, msg.implied).strip())
            continue
        kind = message_kind(msg.role, msg.channel, msg.recipient)
        if kind == DROP:
            continue
        if kind == TOOL:
            call = call_from_body(msg.recipient or "", msg.content, tools, len(calls), id_salt)
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
        kind = message_kind(m.role, m.channel, m.recipient)
        if kind == TOOL:
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
