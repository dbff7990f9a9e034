"""The structured-output agent loop through port 4000 with the official SDKs: every turn under a
schema (or a forced tool), each reply echoed back the way the SDK hands it over. Turn 2 reuses
turn 1's prompt and its whole reply (``cached >= prompt + reply - 2``) on chat completions,
Responses and Messages -- a grammar's spelling of the reply is not what the echo encodes to, and
the turn is closed with the echo's tokens (engine/finish.py ``echo_ids``; LESSONS 80).

One stack for the module (the real LiteLLM in front of the real MLX server, embedded SmolLM2).
"""
from __future__ import annotations

import json

import pytest

from tests.test_e2e_stack import MODEL, Stack

pytestmark = pytest.mark.e2e
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
SYSTEM = "You answer with one JSON object describing a person."
ASK = "Describe a famous scientist."
MORE = "Another one."


@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_path):
    s = Stack(tmp_path_factory.mktemp("echo"), str(embedded_model_path.parent))
    yield s
    s.stop()


def test_chat_json_schema_turn_reuses_the_whole_reply(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    r1 = oai.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, max_tokens=60,
                                     extra_body={"session_id": "echo-chat"})
    json.loads(r1.choices[0].message.content)
    messages += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": MORE}]
    r2 = oai.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, max_tokens=60,
                                     extra_body={"session_id": "echo-chat"})
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens + r1.usage.completion_tokens - 2, (r1.usage, r2.usage)


def test_responses_text_format_turn_reuses_the_whole_reply(oai):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    items: list = [{"role": "user", "content": ASK}]
    r1 = oai.responses.create(model=MODEL, instructions=SYSTEM, input=items, text=fmt, max_output_tokens=60,
                              store=False)
    json.loads(r1.output_text)
    items += [o.model_dump(exclude_none=True) for o in r1.output] + [{"role": "user", "content": MORE}]
    r2 = oai.responses.create(model=MODEL, instructions=SYSTEM, input=items, text=fmt, max_output_tokens=60,
                              store=False)
    cached = r2.usage.input_tokens_details.cached_tokens
    assert cached >= r1.usage.input_tokens + r1.usage.output_tokens - 2, (r1.usage, r2.usage)


def test_messages_forced_tool_turn_reuses_the_whole_reply(stack):
    client = anthropic.Anthropic(base_url=stack.base, api_key="unused", max_retries=0, timeout=300,
                                 default_headers={"Authorization": f"Bearer {stack_key()}"})
    tool = {"name": "record_person", "description": "Record a person", "input_schema": PERSON}
    messages: list = [{"role": "user", "content": ASK}]
    r1 = client.messages.create(model=MODEL, system=SYSTEM, messages=messages, tools=[tool], max_tokens=80,
                                tool_choice={"type": "tool", "name": "record_person"})
    call = next(b for b in r1.content if b.type == "tool_use")
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r1.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "ok"}]}]
    r2 = client.messages.create(model=MODEL, system=SYSTEM, messages=messages, tools=[tool], max_tokens=80,
                                tool_choice={"type": "tool", "name": "record_person"})
    prompt1 = r1.usage.input_tokens + (r1.usage.cache_read_input_tokens or 0) + (r1.usage.cache_creation_input_tokens or 0)
    assert r2.usage.cache_read_input_tokens >= prompt1 + r1.usage.output_tokens - 2, (r1.usage, r2.usage)


def stack_key() -> str:
    from tests.test_e2e_stack import KEY

    return KEY
