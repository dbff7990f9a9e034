"""pydantic-ai: an ``Agent`` with ``output_type=NativeOutput(Person)`` (response_format json_schema)
or ``ToolOutput(Person)`` (an output tool the model must call), on ``OpenAIChatModel`` with an
``OpenAIProvider`` pointed at the stack. Modes: ``NativeOutput``, ``ToolOutput``. Echo: turn 2 runs
with ``message_history=result.all_messages()`` -- pydantic-ai's own conversation record, which for
ToolOutput holds the output tool's call and its return ("Final result processed.")."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import ASK, MORE, run  # noqa: E402


def version() -> str:
    from importlib.metadata import version as v

    import pydantic_ai  # noqa: F401

    return v("pydantic-ai-slim")


def body(args, marks) -> dict:
    from pydantic import BaseModel
    from pydantic_ai import Agent, NativeOutput, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Person(BaseModel):
        name: str
        age: int
        city: str

    wrap = {"NativeOutput": NativeOutput, "ToolOutput": ToolOutput}[args.mode]
    model = OpenAIChatModel(args.model, provider=OpenAIProvider(base_url=args.base_url + "/v1", api_key=args.key))
    agent = Agent(model, output_type=wrap(Person), system_prompt=args.system, retries=0,
                  model_settings={"max_tokens": args.max_tokens, "temperature": 0})
    marks.mark()
    r1 = agent.run_sync(ASK)
    marks.mark()
    r2 = agent.run_sync(MORE, message_history=r1.all_messages())
    marks.mark()
    return {"replies": [r1.output.model_dump(), r2.output.model_dump()],
            "echo": "message_history=result.all_messages()"}


if __name__ == "__main__":
    sys.exit(run("pydantic-ai", version, "chat", body))
