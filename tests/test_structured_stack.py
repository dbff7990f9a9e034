"""Structured output and guaranteed tool calls (#18) through port 4000 -- the real LiteLLM proxy in
front of the real MLX server on the embedded SmolLM2 -- driven by the official openai and anthropic
SDKs: ``chat.completions.parse`` / ``responses.parse`` / ``messages.parse`` with pydantic models,
strict tools with a forced, required or named ``tool_choice`` (plain, streamed through the SDKs'
stream accumulators, Responses, Anthropic), ``tool_choice`` none, the finish reasons (``tool_calls``,
``length``, ``content_filter`` for a grammar dead end; ``tool_use`` on Anthropic), typed errors for
schemas that cannot be enforced, and warm turns that reuse as much with constraints as without.
One stack for the module (a stack start costs 20-40 s here). In-process engine tests:
tests/test_structured_output.py.
"""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pydantic
import pytest

from tests.test_e2e_stack import MODEL, Stack

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)
    city: Literal["Paris", "London", "Berlin"]


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON_Q = [{"role": "user", "content": "Describe a person who lives in Paris."}]
# A strict tool with a property named "strict": LiteLLM deletes such keys (and additionalProperties:
# false) on the way; the front door carries the client's tools past it (mlxstack_tools).
FLAGS = {"type": "object", "properties": {"strict": {"type": "boolean"}, "level": {"type": "integer", "minimum": 1,
                                                                                     "maximum": 3}},
         "required": ["strict", "level"], "additionalProperties": False}
SET_FLAGS = {"type": "function", "function": {"name": "set_flags", "description": "Set the checker flags",
                                              "parameters": FLAGS, "strict": True}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_path):
    s = Stack(tmp_path_factory.mktemp("structured"), str(embedded_model_path.parent))
    yield s
    s.stop()


def weather_tool():
    return openai.pydantic_function_tool(GetWeather, name="get_weather", description="Weather for a city")


# ------------------------------------------------------------------ chat completions
def test_parse_with_a_pydantic_model(oai):
    reply = oai.chat.completions.parse(model=MODEL, messages=PERSON_Q, response_format=Person, max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
    obj = oai.chat.completions.create(model=MODEL, messages=PERSON_Q, max_tokens=80,
                                      response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    lenient = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                                "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
               "required": ["title", "year"]}
    # greedy is the argmax with only the penalties asked for (LESSONS 64): this model's greedy reply
    # loops inside an extra property ("VOD&V, VOD&V, ...") until max_tokens, so the request asks for one
    raw = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a film."}], max_tokens=60,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "film", "schema": lenient}},
                                      extra_body={"repetition_penalty": 1.08})
    jsonschema.validate(json.loads(raw.choices[0].message.content), lenient)


def test_a_reply_cut_by_max_tokens_says_length_and_parse_raises(oai):
    with pytest.raises(openai.LengthFinishReasonError):
        oai.chat.completions.parse(model=MODEL, messages=PERSON_Q, response_format=Person, max_tokens=3)


def test_named_strict_tool_whose_schema_litellm_would_strip(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Turn strict mode on."}],
                                        tools=[SET_FLAGS], max_tokens=60,
                                        tool_choice={"type": "function", "function": {"name": "set_flags"}},
                                        parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0].function
    assert call.name == "set_flags"
    jsonschema.validate(json.loads(call.arguments), FLAGS)      # "strict" present, nothing extra


def test_streamed_named_tool_call_assembles_in_the_sdk(oai):
    with oai.chat.completions.stream(model=MODEL, messages=WEATHER_Q, tools=[weather_tool()], max_tokens=60,
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                     parallel_tool_calls=False) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert isinstance(choice.message.tool_calls[0].function.parsed_arguments, GetWeather)


def test_required_none_and_parallel(oai):
    one = oai.chat.completions.parse(model=MODEL, messages=WEATHER_Q, tools=[weather_tool()], max_tokens=60,
                                     tool_choice="required", parallel_tool_calls=False)
    calls = one.choices[0].message.tool_calls
    assert one.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert isinstance(calls[0].function.parsed_arguments, GetWeather)
    many = oai.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[weather_tool()], max_tokens=160,
                                       tool_choice="required")
    for c in many.choices[0].message.tool_calls:
        GetWeather.model_validate_json(c.function.arguments)
    few_shot = [{"role": "system", "content": "Call get_weather for weather questions."}, *WEATHER_Q,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"},
                {"role": "user", "content": "And in London?"}]
    none = oai.chat.completions.create(model=MODEL, messages=few_shot, tools=[weather_tool()], max_tokens=40,
                                       tool_choice="none")
    msg = none.choices[0].message
    assert not msg.tool_calls and "<tool_call>" not in (msg.content or "")
    assert none.choices[0].finish_reason in ("stop", "length")


def test_auto_engages_when_the_model_opens_a_call(oai):
    """The model learned from the conversation to call: the lazy grammar takes over at <tool_call>."""
    few_shot = [{"role": "system", "content": "Answer weather questions by calling get_weather."}]
    for i, city in enumerate(("Paris", "Oslo", "Rome")):
        few_shot += [{"role": "user", "content": f"What is the weather in {city}?"},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
                         "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": "18 degrees"},
                     {"role": "assistant", "content": f"It is 18 degrees in {city}."}]
    few_shot.append({"role": "user", "content": "What is the weather in London?"})
    reply = oai.chat.completions.parse(model=MODEL, messages=few_shot, tools=[weather_tool()], max_tokens=60,
                                       parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0].function
    assert call.name == "get_weather" and isinstance(call.parsed_arguments, GetWeather)


def test_a_grammar_dead_end_is_content_filter_not_stop(oai, stack):
    """'<tool_call>,' (the model pushed there by logit_bias) opens a call nothing can continue."""
    ids = {"<": 44, "tool": 19324, "_": 79, "call": 4350, ">,": 18128}          # SmolLM2's tokenizer
    reply = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write the tag <tool_call>, then stop."}],
                                        tools=[weather_tool()], max_tokens=30,
                                        logit_bias={str(i): 30 for i in ids.values()})
    choice = reply.choices[0]
    assert choice.finish_reason == "content_filter" and choice.message.content.endswith("<tool_call>,"), choice
    with pytest.raises(openai.ContentFilterFinishReasonError):
        oai.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Write the tag <tool_call>, then stop."}],
                                   tools=[weather_tool()], max_tokens=30, logit_bias={str(i): 30 for i in ids.values()})


def test_schemas_that_cannot_be_enforced_are_typed_400s(oai, claude):
    bad = {"type": "object", "properties": {"when": {"type": "string", "format": "no-such-format"}}}
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=PERSON_Q, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": bad, "strict": True}})
    # the MLX server's own error, not LiteLLM's wrapper around it (the front door unwraps it)
    assert err.value.body["param"] == "response_format.json_schema.schema#/properties/when"
    assert err.value.body["code"] == "invalid_json_schema"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=PERSON_Q, max_tokens=8, tool_choice="required", tools=[
            {"type": "function", "function": {"name": "f", "strict": True, "parameters": bad}}])
    assert err.value.body["param"] == "tools[0].function.parameters#/properties/when"
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="hi", max_output_tokens=8, text={"format": {
            "type": "json_schema", "name": "x", "strict": True, "schema": bad}})
    assert "text.format.schema#/properties/when" in str(err.value)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=8, messages=PERSON_Q, tool_choice={"type": "any"},
                               tools=[{"name": "f", "strict": True, "input_schema": bad}])
    assert "tools[0].input_schema#/properties/when" in err.value.body["error"]["message"]


def test_warm_turns_reuse_as_much_with_constraints_as_without(oai):
    """The same client conversation twice (a nonce at the very start keeps the two apart in the
    cache): cached tokens per turn with response_format are at least those without it -- more where
    the reply generated under the grammar and the (here fixed) echo agree past the reply's start,
    since the turn's entry holds the reply as the echo encodes it (LESSONS 80)."""
    history = ['{"name": "Ada", "age": 36, "city": "London"}', '{"name": "Alan", "age": 41, "city": "London"}']

    def run(nonce: str, constrained: bool) -> list[int]:
        messages = [{"role": "system", "content": f"{nonce} You describe people as JSON objects. " * 3}]
        cached = []
        for turn in range(3):
            messages.append({"role": "user", "content": f"Describe person number {turn + 1}."})
            extra = {"response_format": Person} if constrained else {}
            call = oai.chat.completions.parse if constrained else oai.chat.completions.create
            reply = call(model=MODEL, messages=messages, max_tokens=60, extra_body={"session_id": nonce}, **extra)
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
            if turn < 2:
                messages.append({"role": "assistant", "content": history[turn]})
        return cached

    free, strict = run("Zq1", False), run("Zq2", True)
    assert strict[0] == free[0] == 0 and all(s >= f for s, f in zip(strict, free)), (free, strict)
    assert strict[1] > 0 and strict[2] > strict[1] and free[2] > free[1] > 0, (free, strict)


# ------------------------------------------------------------------ Responses
def test_responses_parse_and_tool_choice(oai):
    parsed = oai.responses.parse(model=MODEL, input=PERSON_Q[0]["content"], text_format=Person, max_output_tokens=80)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    tool = {"type": "function", "name": "get_weather", "strict": True,
            "parameters": openai.pydantic_function_tool(GetWeather)["function"]["parameters"]}
    for choice in ({"type": "function", "name": "get_weather"}, "required"):
        reply = oai.responses.create(model=MODEL, input=WEATHER_Q[0]["content"], tools=[tool], tool_choice=choice,
                                     parallel_tool_calls=False, max_output_tokens=60)
        calls = [o for o in reply.output if o.type == "function_call"]
        assert reply.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
        GetWeather.model_validate_json(calls[0].arguments)
    with oai.responses.stream(model=MODEL, input=WEATHER_Q[0]["content"], tools=[tool], tool_choice="required",
                              parallel_tool_calls=False, max_output_tokens=60) as stream:
        final = stream.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert len(calls) == 1
    GetWeather.model_validate_json(calls[0].arguments)


# ------------------------------------------------------------------ Anthropic
def test_anthropic_tool_choice_and_json_output(claude):
    schema = GetWeather.model_json_schema() | {"additionalProperties": False}
    tools = [{"name": "get_weather", "description": "Weather for a city", "input_schema": schema, "strict": True}]
    for choice in ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                   {"type": "any", "disable_parallel_tool_use": True}):
        msg = claude.messages.create(model=MODEL, max_tokens=60, messages=WEATHER_Q, tools=tools, tool_choice=choice)
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather", msg
        GetWeather.model_validate(uses[0].input)
    with claude.messages.stream(model=MODEL, max_tokens=60, messages=WEATHER_Q, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(uses) == 1
    GetWeather.model_validate(uses[0].input)
    parsed = claude.messages.parse(model=MODEL, max_tokens=80, messages=PERSON_Q, output_format=Person)
    assert parsed.stop_reason == "end_turn" and isinstance(parsed.parsed_output, Person)
    none = claude.messages.create(model=MODEL, max_tokens=30, messages=WEATHER_Q, tools=tools,
                                  tool_choice={"type": "none"})
    assert none.stop_reason in ("end_turn", "max_tokens") and not [b for b in none.content if b.type == "tool_use"]
