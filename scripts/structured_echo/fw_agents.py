"""The OpenAI Agents SDK (``openai-agents``): ``Agent(output_type=Person)``, the SDK's structured
output (``text.format`` json_schema strict on Responses, ``response_format`` on chat). Modes:
``output_type/responses`` (OpenAIResponsesModel, the default) and ``output_type/chat``
(OpenAIChatCompletionsModel). Echo: ``result.to_input_list()`` plus the next user message, as the
SDK's docs continue a conversation. Tracing is off (it would call out)."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import ASK, MORE, run  # noqa: E402


def version() -> str:
    from importlib.metadata import version as v

    import agents  # noqa: F401

    return v("openai-agents")


def body(args, marks) -> dict:
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        set_tracing_disabled)
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int
        city: str

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=args.base_url + "/v1", api_key=args.key, max_retries=0, timeout=600)
    api = args.mode.split("/")[1]
    model = (OpenAIResponsesModel(model=args.model, openai_client=client) if api == "responses"
             else OpenAIChatCompletionsModel(model=args.model, openai_client=client))
    agent = Agent(name="people", instructions=args.system, model=model, output_type=Person,
                  model_settings=ModelSettings(max_tokens=args.max_tokens, temperature=0, store=False)
                  if api == "responses" else ModelSettings(max_tokens=args.max_tokens, temperature=0))

    async def go() -> list:
        replies = []
        marks.mark()
        r1 = await Runner.run(agent, ASK)
        marks.mark()
        replies.append(r1.final_output.model_dump())
        r2 = await Runner.run(agent, r1.to_input_list() + [{"role": "user", "content": MORE}])
        marks.mark()
        replies.append(r2.final_output.model_dump())
        return replies

    return {"replies": asyncio.run(go()), "echo": "result.to_input_list() + user"}


if __name__ == "__main__":
    sys.exit(run("openai-agents", version, lambda mode: mode.split("/")[1], body))
