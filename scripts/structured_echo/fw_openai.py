"""Baseline: the official OpenAI SDK. Modes: ``chat.parse`` (chat completions ``.parse`` with a
pydantic model = response_format json_schema strict; echo: the message's content) and
``responses.text.format`` (Responses with ``text.format`` json_schema; echo: the output items as
the SDK returns them, ``model_dump(exclude_none=True)``)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import ASK, MORE, PERSON_SCHEMA, run  # noqa: E402


def version() -> str:
    import openai

    return openai.__version__


def body(args, marks) -> dict:
    from openai import OpenAI
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int
        city: str

    client = OpenAI(base_url=args.base_url + "/v1", api_key=args.key, max_retries=0, timeout=600)
    replies = []
    if args.mode == "chat.parse":
        messages: list = [{"role": "system", "content": args.system}, {"role": "user", "content": ASK}]
        marks.mark()
        for turn in (1, 2):
            r = client.chat.completions.parse(model=args.model, messages=messages, response_format=Person,
                                              max_tokens=args.max_tokens, temperature=0)
            marks.mark()
            replies.append(r.choices[0].message.content)
            messages = messages + [{"role": "assistant", "content": r.choices[0].message.content},
                                   {"role": "user", "content": MORE}]
        return {"replies": replies, "echo": "assistant content = message.content"}
    if args.mode == "responses.text.format":
        fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON_SCHEMA, "strict": True}}
        items: list = [{"role": "user", "content": ASK}]
        marks.mark()
        for turn in (1, 2):
            r = client.responses.create(model=args.model, instructions=args.system, input=items, text=fmt,
                                        max_output_tokens=args.max_tokens, temperature=0, store=False)
            marks.mark()
            replies.append(r.output_text)
            items = items + [o.model_dump(exclude_none=True) for o in r.output] + [{"role": "user", "content": MORE}]
        return {"replies": replies, "echo": "output items, model_dump(exclude_none=True)"}
    raise ValueError(f"unknown mode {args.mode}")


if __name__ == "__main__":
    sys.exit(run("openai (SDK)", version, lambda mode: mode.split(".")[0], body))
