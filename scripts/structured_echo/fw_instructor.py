"""instructor: ``instructor.from_openai(OpenAI(...), mode=...)`` and ``create_with_completion``.
Modes: ``JSON_SCHEMA`` (response_format json_schema) and ``TOOLS`` (a forced tool call). Echo: the
completion's message as instructor itself appends it when it re-asks (``dump_message``), a tool
message per call in TOOLS mode (as its ``reask_tools`` does), then the next user message.

Person forbids extra fields (``extra="forbid"``): instructor's JSON_SCHEMA sends the model's schema
as it is, not strict, and without ``additionalProperties: false`` the grammar lets the model add
keys of its own until max_tokens cuts the reply (instructor then raises IncompleteOutputException)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import ASK, MORE, run  # noqa: E402


def version() -> str:
    import instructor

    return instructor.__version__


def body(args, marks) -> dict:
    import instructor
    from openai import OpenAI
    from pydantic import BaseModel, ConfigDict

    try:
        from instructor.v2.core.messages import dump_message
    except ImportError:  # instructor 1.x before v2
        from instructor.utils import dump_message

    class Person(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str
        age: int
        city: str

    client = instructor.from_openai(OpenAI(base_url=args.base_url + "/v1", api_key=args.key, max_retries=0,
                                           timeout=600), mode=getattr(instructor.Mode, args.mode))
    messages: list = [{"role": "system", "content": args.system}, {"role": "user", "content": ASK}]
    replies = []
    marks.mark()
    for turn in (1, 2):
        person, completion = client.chat.completions.create_with_completion(
            model=args.model, messages=messages, response_model=Person, max_tokens=args.max_tokens, temperature=0,
            max_retries=0)
        marks.mark()
        replies.append(person.model_dump())
        msg = completion.choices[0].message
        messages = messages + [dump_message(msg)] + [
            {"role": "tool", "tool_call_id": c.id, "name": c.function.name, "content": "ok"}
            for c in (msg.tool_calls or [])] + [{"role": "user", "content": MORE}]
    return {"replies": replies, "echo": "dump_message(completion message) (+ tool message per call) + user"}


if __name__ == "__main__":
    sys.exit(run("instructor", version, "chat", body))
