"""Turn engine output into OpenAI chat.completion bodies and SSE frames (the chat front's reply side).

The streaming path feeds text deltas through ReasoningStreamSplitter; the non-streaming path
uses split_output on the whole text. Both share one grammar, so the concatenated streamed
content equals the non-streaming message.content byte for byte (tests/test_reasoning.py).
"""
from __future__ import annotations

import time
from typing import Any

from ...parsing.output import reply_splitter, split_reply
from ...parsing.reasoning import CONTENT, REASONING, TOOL_CALLS
from ..http.errors import APIError
from ..common.finish import chat_finish_reason
from ..http.sse import DONE, ChunkEncoder, encode_frame
from ..common.usage import chat_usage, outcome_usage


def logprobs_body(outcome: Any) -> dict | None:
    """OpenAI ``choices[].logprobs`` when the request asked for them (one entry per token)."""
    entries = getattr(outcome, "logprobs", None)
    return None if entries is None else {"content": entries, "refusal": None}


def completion_body(completion_id: str, model: str, outcome: Any, *, tools: list | None, family: str,
                    enable_thinking: bool, parse_tools: bool = True) -> dict:
    parsed = split_reply(outcome.text, thinking_started=outcome.thinking_started, tools=tools,
                         family=family, id_salt=completion_id, parse_tools=parse_tools)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning or enable_thinking and outcome.thinking_started:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        if not parsed.content:
            message["content"] = None
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs_body(outcome),
                     "finish_reason": chat_finish_reason(outcome, bool(parsed.tool_calls))}],
        "usage": chat_usage(outcome_usage(outcome)),
    }


class StreamAssembler:
    """Feeds text deltas to the splitter and yields ready SSE frames."""

    def __init__(self, completion_id: str, model: str, *, thinking_started: bool, tools: list | None,
                 family: str, include_usage: bool, parse_tools: bool = True) -> None:
        self.encoder = ChunkEncoder(completion_id, int(time.time()), model)
        self.splitter = reply_splitter(thinking_started=thinking_started, tools=tools,
                                       family=family, id_salt=completion_id, parse_tools=parse_tools)
        self.include_usage = include_usage
        self.parse_tools = parse_tools
        self.tool_calls = 0

    def start(self) -> bytes:
        return self.encoder.role_frame()

    def _frames(self, events: list) -> list[bytes]:
        out = []
        for ev in events:
            if ev.kind == CONTENT and ev.text:
                out.append(self.encoder.content_frame(ev.text))
            elif ev.kind == REASONING and ev.text:
                out.append(self.encoder.reasoning_frame(ev.text))
            elif ev.kind == TOOL_CALLS and ev.calls and not self.parse_tools:
                # tool_choice "none" and the model called anyway: shown as text, never dropped
                text = "\n".join(f"{c.name}({c.arguments})" for c in ev.calls)
                out.append(self.encoder.content_frame(text))
            elif ev.kind == TOOL_CALLS and ev.calls:
                self.tool_calls += len(ev.calls)
                out.append(self.encoder.tool_calls_frame(ev.calls))
        return out

    def feed(self, text: str) -> list[bytes]:
        return self._frames(self.splitter.feed(text))

    def finish(self, outcome: Any) -> list[bytes]:
        frames = self._frames(self.splitter.finish())
        usage = chat_usage(outcome_usage(outcome))
        reason = chat_finish_reason(outcome, self.tool_calls > 0)
        lp = logprobs_body(outcome)
        if lp is not None:  # per-token logprobs in one chunk before the finish frame
            frames.append(encode_frame(self.encoder.chunk({}, None) | {"choices": [
                {"index": 0, "delta": {}, "logprobs": lp, "finish_reason": None}]}))
        frames.append(self.encoder.final_frame(reason, None if self.include_usage else usage))
        if self.include_usage:
            frames.append(self.encoder.usage_frame(usage))
        return frames


class ChatStream:
    """FrameEncoder (job_adapter) for one streamed chat completion: a StreamAssembler made when the
    prompt is ready (or from the outcome when no PromptReady came), ``data: [DONE]`` after the last
    frame; an error after the 200 is one ``data: {"error": ...}`` frame, then ``[DONE]``."""

    def __init__(self, completion_id: str, model: str, *, tools: list | None, family: str, include_usage: bool,
                 parse_tools: bool) -> None:
        self.completion_id, self.model, self.tools, self.family = completion_id, model, tools, family
        self.include_usage, self.parse_tools = include_usage, parse_tools
        self.asm: StreamAssembler | None = None

    def _assembler(self, thinking_started: bool) -> StreamAssembler:
        return StreamAssembler(self.completion_id, self.model, thinking_started=thinking_started, tools=self.tools,
                               family=self.family, include_usage=self.include_usage, parse_tools=self.parse_tools)

    def start(self, ready: Any) -> list[bytes]:
        if ready is not None:
            self.asm = self._assembler(ready.thinking_started)
        return [self.asm.start()]

    def feed(self, text: str) -> list[bytes]:
        return self.asm.feed(text)

    def finish(self, outcome: Any) -> list[bytes]:
        if self.asm is None:
            self.asm = self._assembler(outcome.thinking_started)
        return [*self.asm.finish(outcome), DONE]

    def error(self, err: APIError) -> list[bytes]:
        return [err.sse_frame() + DONE]
