"""Server-sent-event frames: OpenAI `chat.completion.chunk` streams (seed 000 §8), and the named
events of the Responses and Anthropic Messages streams (`event_frame`).

Pure: no I/O. The per-token hot path is one C-level string escape plus three byte joins:

    enc = ChunkEncoder("chatcmpl-1", 1700000000, "qwen3")
    wfile.write(enc.role_frame())
    for text in pieces:
        wfile.write(enc.content_frame(text))
    wfile.write(enc.final_frame("stop", usage))
    wfile.write(DONE)

Every frame is byte-identical to `b"data: " + json.dumps(chunk).encode() + b"\\n\\n"` for the
equivalent dict (see `chunk_dict`): json.dumps defaults, i.e. `", "` / `": "` separators and
`ensure_ascii=True` (non-ASCII as \\uXXXX escapes, so every frame is pure ASCII).

Named events (Responses, Anthropic) name the payload's own ``type``:

    event_frame({"type": "message_stop"}) == b'event: message_stop\\ndata: {"type": "message_stop"}\\n\\n'
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii  # the C escaper json.dumps itself uses
from typing import Any, Iterable

__all__ = ["ChunkEncoder", "DONE", "chunk_dict", "encode_frame", "event_frame"]

DONE = b"data: [DONE]\n\n"
_END = b"\n\n"


def encode_frame(obj: Any) -> bytes:
    """Slow path: one SSE `data:` frame for any JSON-serialisable object."""
    return b"data: " + json.dumps(obj).encode("ascii") + _END


def event_frame(payload: dict) -> bytes:
    """One named SSE event (Responses and Anthropic streams): ``event: <payload["type"]>`` and the
    payload as its ``data:`` line."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode("utf-8")


def chunk_dict(
    id: str,
    created: int,
    model: str,
    delta: dict,
    finish_reason: str | None = None,
    usage: dict | None = None,
    *,
    choices: bool = True,
) -> dict:
    """The chunk object a frame encodes (reference for tests and the slow path)."""
    chunk: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": (
            [{"index": 0, "delta": delta, "finish_reason": finish_reason}] if choices else []
        ),
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


class ChunkEncoder:
    """Pre-computed frame parts for one streamed completion."""

    __slots__ = (
        "id", "created", "model",
        "_content_prefix", "_reasoning_prefix", "_delta_suffix",
    )

    def __init__(self, id: str, created: int, model: str) -> None:
        self.id = id
        self.created = int(created)
        self.model = model
        head = (
            'data: {"id": ' + encode_basestring_ascii(id)
            + ', "object": "chat.completion.chunk", "created": ' + json.dumps(self.created)
            + ', "model": ' + encode_basestring_ascii(model)
            + ', "choices": [{"index": 0, "delta": {'
        )
        self._content_prefix = (head + '"content": ').encode("ascii")
        self._reasoning_prefix = (head + '"reasoning_content": ').encode("ascii")
        self._delta_suffix = b'}, "finish_reason": null}]}\n\n'

    # hot path ---------------------------------------------------------------------------------

    def content_frame(self, text: str) -> bytes:
        """`delta.content` frame for one generated piece."""
        return self._content_prefix + encode_basestring_ascii(text).encode("ascii") + self._delta_suffix

    def reasoning_frame(self, text: str) -> bytes:
        """`delta.reasoning_content` frame for one generated piece."""
        return (
            self._reasoning_prefix + encode_basestring_ascii(text).encode("ascii") + self._delta_suffix
        )

    # once per stream --------------------------------------------------------------------------

    def chunk(self, delta: dict, finish_reason: str | None = None, usage: dict | None = None,
              *, choices: bool = True) -> dict:
        return chunk_dict(self.id, self.created, self.model, delta, finish_reason, usage,
                          choices=choices)

    def role_frame(self, role: str = "assistant") -> bytes:
        """First frame: `delta = {"role": role, "content": ""}`."""
        return encode_frame(self.chunk({"role": role, "content": ""}))

    def tool_calls_frame(self, calls: Iterable[Any]) -> bytes:
        """`delta.tool_calls` with every call complete (ids, names, full argument strings).

        `calls` are ToolCall objects (anything with `to_openai(index)`) or ready-made dicts.
        """
        entries = []
        for i, call in enumerate(calls):
            if hasattr(call, "to_openai"):
                entries.append(call.to_openai(i))
            else:
                entries.append({"index": i, **call})
        return encode_frame(self.chunk({"tool_calls": entries}))

    def final_frame(self, finish_reason: str, usage: dict | None = None) -> bytes:
        """Last choice frame: empty delta, the finish_reason, and usage when given."""
        return encode_frame(self.chunk({}, finish_reason, usage))

    def usage_frame(self, usage: dict) -> bytes:
        """`stream_options.include_usage` style frame: `choices: []` plus usage."""
        return encode_frame(self.chunk({}, None, usage, choices=False))
