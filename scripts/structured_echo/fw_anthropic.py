"""Baseline: the official Anthropic SDK through /v1/messages with a forced tool (``tool_choice``
``{"type": "tool"}``; mode ``forced_tool``). Echo: the reply's content blocks as the SDK returns them
(``model_dump(exclude_none=True)``), then a user turn holding the tool_result and the next ask."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import ASK, MORE, PERSON_SCHEMA, run  # noqa: E402


def version() -> str:
    import anthropic

    return anthropic.__version__


def body(args, marks) -> dict:
    import anthropic

    if args.mode != "forced_tool":
        raise ValueError(f"unknown mode {args.mode}")
    client = anthropic.Anthropic(base_url=args.base_url, api_key="unused", max_retries=0, timeout=600,
                                 default_headers={"Authorization": f"Bearer {args.key}"})
    tool = {"name": "record_person", "description": "Record a person", "input_schema": PERSON_SCHEMA}
    messages: list = [{"role": "user", "content": ASK}]
    replies = []
    marks.mark()
    for turn in (1, 2):
        r = client.messages.create(model=args.model, system=args.system, messages=messages, tools=[tool],
                                   max_tokens=args.max_tokens, extra_body={"temperature": 0},  # not a keyword of every SDK version
                                   tool_choice={"type": "tool", "name": "record_person"})
        marks.mark()
        call = next(b for b in r.content if b.type == "tool_use")
        replies.append(call.input)
        messages = messages + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "ok"},
                                         {"type": "text", "text": MORE}]}]
    return {"replies": replies, "echo": "content blocks model_dump(exclude_none=True) + tool_result"}


if __name__ == "__main__":
    sys.exit(run("anthropic (SDK)", version, "messages", body))
