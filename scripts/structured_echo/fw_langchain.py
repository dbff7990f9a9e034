"""langchain-openai: ``ChatOpenAI(...).with_structured_output(Person, method=..., include_raw=True)``.
Modes: ``json_schema`` (response_format json_schema strict) and ``function_calling`` (a tool the
model is made to call). Echo: the raw ``AIMessage`` the runnable returns (``include_raw``), then for
function_calling a ``ToolMessage`` answering its call (as LangChain's docs pair them), then the
next ``HumanMessage``."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import ASK, MORE, run  # noqa: E402


def version() -> str:
    from importlib.metadata import version as v

    import langchain_openai  # noqa: F401

    return v("langchain-openai")


def body(args, marks) -> dict:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int
        city: str

    llm = ChatOpenAI(model=args.model, base_url=args.base_url + "/v1", api_key=args.key, max_tokens=args.max_tokens,
                     temperature=0, max_retries=0, timeout=600)
    runnable = llm.with_structured_output(Person, method=args.mode, include_raw=True)
    messages: list = [SystemMessage(args.system), HumanMessage(ASK)]
    replies = []
    marks.mark()
    for turn in (1, 2):
        out = runnable.invoke(messages)
        marks.mark()
        if out.get("parsing_error"):
            raise RuntimeError(f"turn {turn}: {out['parsing_error']}")
        replies.append(out["parsed"].model_dump())
        raw = out["raw"]
        messages = messages + [raw] + [ToolMessage("ok", tool_call_id=c["id"]) for c in raw.tool_calls] \
            + [HumanMessage(MORE)]
    return {"replies": replies, "echo": "raw AIMessage (+ ToolMessage per call) + HumanMessage"}


if __name__ == "__main__":
    sys.exit(run("langchain-openai", version, "chat", body))
