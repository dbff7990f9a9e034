"""Tool calls the official SDKs never choke on (issue 43): the openai and anthropic SDKs through port
4000 -- the real LiteLLM proxy in front of the real MLX server on the embedded SmolLM2, greedy.

- A named tool_choice is exactly one call of that tool, then the reply ends, parallel calls allowed
  or not (the grammar allows one call: constraints/grammars.py).
- required / any / auto with parallel calls: this model repeats its call; the repeat ends the reply
  before it is shown (parsing/call_gate.py), with the tool-call finish -- not length, which the SDKs'
  stream helpers raise on.
- A max_tokens cut inside a call is each API's own length shape, never the model's markup as text.

One stack for the module; small max_tokens (a call of this tool is 30 tokens). Engine-level tests of
the same rules: tests/test_structured_output.py, tests/test_call_gate.py.
"""
from __future__ import annotations

import json

import pytest

from tests.test_e2e_stack import MODEL, Stack

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                              "parameters": CITY}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": CITY}
CLAUDE_TOOL = {"name": "get_weather", "description": "Weather for a city", "input_schema": CITY}
ASK = "What is the weather in Paris?"
Q = [{"role": "user", "content": ASK}]
PARIS = {"city": "Paris"}
ENOUGH = 72      # room for two calls: the repeat must end the reply, not max_tokens
CUT = 16         # inside the first call: '<tool_call>\n{"name": "get_weather", "arguments": {"' is 18 tokens


@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_path):
    s = Stack(tmp_path_factory.mktemp("sdks"), str(embedded_model_path.parent))
    yield s
    s.stop()


def chat_calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def no_markup(text: str | None) -> bool:
    return "<tool_call>" not in (text or "") and "</tool_call>" not in (text or "") and '{"name"' not in (text or "")


# ------------------------------------------------------------------ chat completions
def test_chat_named_choice_with_parallel_calls_is_one_call(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=Q, tools=[CHAT_TOOL], max_tokens=ENOUGH,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        parallel_tool_calls=True)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert chat_calls(choice.message) == [("get_weather", PARIS)] and not choice.message.content


def test_chat_required_with_parallel_calls_ends_at_the_repeat(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=Q, tools=[CHAT_TOOL], max_tokens=ENOUGH,
                                        tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert chat_calls(choice.message) == [("get_weather", PARIS)] and not choice.message.content
    assert reply.usage.completion_tokens < ENOUGH


def test_chat_stream_helper_with_required_and_parallel_calls(oai):
    with oai.chat.completions.stream(model=MODEL, messages=Q, tools=[CHAT_TOOL], max_tokens=ENOUGH,
                                     tool_choice="required") as stream:
        events = list(stream)
        final = stream.get_final_completion()          # raises LengthFinishReasonError on finish length
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert chat_calls(choice.message) == [("get_weather", PARIS)] and not choice.message.content
    assert "".join(e.delta for e in events if e.type == "content.delta") == ""
    assert [(e.name, json.loads(e.arguments)) for e in events if e.type == "tool_calls.function.arguments.done"] \
        == [("get_weather", PARIS)]


def test_chat_auto_with_parallel_calls_when_the_model_calls(oai):
    few_shot = [{"role": "system", "content": "Answer weather questions by calling get_weather."}]
    for i, city in enumerate(("Oslo", "Rome")):
        few_shot += [{"role": "user", "content": f"What is the weather in {city}?"},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
                         "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": "18 degrees"},
                     {"role": "assistant", "content": f"It is 18 degrees in {city}."}]
    reply = oai.chat.completions.create(model=MODEL, messages=[*few_shot, *Q], tools=[CHAT_TOOL], max_tokens=ENOUGH,
                                        tool_choice="auto", parallel_tool_calls=True)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert chat_calls(choice.message) == [("get_weather", PARIS)] and no_markup(choice.message.content)


def test_chat_cut_inside_a_call_is_length_without_markup(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=Q, tools=[CHAT_TOOL], max_tokens=CUT,
                                        tool_choice="required")
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("length", None)
    assert not choice.message.content and reply.usage.completion_tokens == CUT
    raw = oai.chat.completions.create(model=MODEL, messages=Q, tools=[CHAT_TOOL], max_tokens=CUT,
                                      tool_choice="required", stream=True)
    chunks = [c for c in raw if c.choices]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_chat_stream_helper_raises_length_on_a_cut_call(oai):
    with pytest.raises(openai.LengthFinishReasonError) as err:
        with oai.chat.completions.stream(model=MODEL, messages=Q, tools=[CHAT_TOOL], max_tokens=CUT,
                                         tool_choice="required") as stream:
            stream.get_final_completion()
    message = err.value.completion.choices[0].message
    assert not message.content and not message.tool_calls


def test_chat_cut_after_a_finished_call_keeps_it(oai):
    """Cut inside the repeat: the call that closed before the cut is kept, the API says length."""
    reply = oai.chat.completions.create(model=MODEL, messages=Q, tools=[CHAT_TOOL], max_tokens=40,
                                        tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert chat_calls(choice.message) == [("get_weather", PARIS)] and not choice.message.content


# ------------------------------------------------------------------ Responses
def response_calls(response) -> list[tuple[str, dict]]:
    return [(o.name, json.loads(o.arguments)) for o in response.output if o.type == "function_call"]


def response_text(response) -> str:
    return "".join(c.text for o in response.output if o.type == "message" for c in o.content if c.type == "output_text")


def test_responses_create_named_function_is_one_call(oai):
    reply = oai.responses.create(model=MODEL, input=ASK, tools=[RESPONSES_TOOL], max_output_tokens=ENOUGH,
                                 tool_choice={"type": "function", "name": "get_weather"})
    assert reply.status == "completed" and reply.incomplete_details is None
    assert response_calls(reply) == [("get_weather", PARIS)] and [o.type for o in reply.output] == ["function_call"]


def test_responses_stream_required_ends_at_the_repeat(oai):
    with oai.responses.stream(model=MODEL, input=ASK, tools=[RESPONSES_TOOL], max_output_tokens=ENOUGH,
                              tool_choice="required") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and deltas == []
    assert response_calls(final) == [("get_weather", PARIS)] and [o.type for o in final.output] == ["function_call"]


def test_responses_cut_inside_a_call_is_incomplete_without_markup(oai):
    reply = oai.responses.create(model=MODEL, input=ASK, tools=[RESPONSES_TOOL], max_output_tokens=CUT,
                                 tool_choice="required")
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert response_calls(reply) == [] and response_text(reply) == ""
    # the stream ends with response.incomplete, as OpenAI's does (this SDK's get_final_response()
    # waits for response.completed only): the last event carries the response
    with oai.responses.stream(model=MODEL, input=ASK, tools=[RESPONSES_TOOL], max_output_tokens=CUT,
                              tool_choice="required") as stream:
        events = list(stream)
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and "response.completed" not in {e.type for e in events}
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert [e for e in events if e.type == "response.output_text.delta"] == []
    assert response_calls(final) == [] and response_text(final) == ""


# ------------------------------------------------------------------ Anthropic Messages
def tool_uses(message) -> list[tuple[str, dict]]:
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"]


def texts(message) -> list[str]:
    return [b.text for b in message.content if b.type == "text"]


def test_anthropic_create_named_tool_with_parallel_use_is_one_call(claude):
    msg = claude.messages.create(model=MODEL, max_tokens=ENOUGH, messages=Q, tools=[CLAUDE_TOOL],
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "tool_use", msg
    assert tool_uses(msg) == [("get_weather", PARIS)] and all(no_markup(t) for t in texts(msg))


def test_anthropic_create_any_with_parallel_use_ends_at_the_repeat(claude):
    msg = claude.messages.create(model=MODEL, max_tokens=ENOUGH, messages=Q, tools=[CLAUDE_TOOL],
                                 tool_choice={"type": "any", "disable_parallel_tool_use": False})
    assert msg.stop_reason == "tool_use", msg
    assert tool_uses(msg) == [("get_weather", PARIS)] and texts(msg) == []
    assert msg.usage.output_tokens < ENOUGH


def test_anthropic_stream_any_ends_at_the_repeat(claude):
    with claude.messages.stream(model=MODEL, max_tokens=ENOUGH, messages=Q, tools=[CLAUDE_TOOL],
                                tool_choice={"type": "any"}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use", final
    assert tool_uses(final) == [("get_weather", PARIS)] and no_markup(text) and all(no_markup(t) for t in texts(final))
    assert final.usage.output_tokens < ENOUGH


def test_anthropic_create_cut_inside_a_call_is_max_tokens_without_markup(claude):
    msg = claude.messages.create(model=MODEL, max_tokens=CUT, messages=Q, tools=[CLAUDE_TOOL],
                                 tool_choice={"type": "any"})
    assert msg.stop_reason == "max_tokens", msg
    assert tool_uses(msg) == [] and all(no_markup(t) for t in texts(msg)) and "".join(texts(msg)) == ""


def test_anthropic_stream_cut_inside_a_call_is_max_tokens_without_markup(claude):
    with claude.messages.stream(model=MODEL, max_tokens=CUT, messages=Q, tools=[CLAUDE_TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and text == ""
    assert tool_uses(final) == [] and "".join(texts(final)) == ""
