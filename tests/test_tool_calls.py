"""Tool-call parsers (Qwen XML, GLM legacy, Hermes JSON), schema typing, ids, tool prompt.

Run: python -m pytest tests/test_tool_calls.py
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxstack.parsing.tool_calls import (
    ToolCall,
    canonical_arguments,
    inject_tool_prompt,
    make_tool_call_id,
    parse_tool_calls,
    render_tool_prompt,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search files",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "score": {"type": "number"},
                    "regex": {"type": "boolean"},
                    "filters": {"type": "object"},
                    "paths": {"type": "array", "items": {"type": "string"}},
                    "maybe": {"type": ["integer", "null"]},
                },
            },
        },
    }
]

QWEN_XML = (
    "<tool_call>\n<function=search>\n"
    "<parameter=query>\nfoo bar\n</parameter>\n"
    "<parameter=limit>\n42\n</parameter>\n"
    "<parameter=score>\n0.5\n</parameter>\n"
    "<parameter=regex>\ntrue\n</parameter>\n"
    '<parameter=filters>\n{"ext": "py"}\n</parameter>\n'
    '<parameter=paths>\n["a", "b"]\n</parameter>\n'
    "<parameter=maybe>\n7\n</parameter>\n"
    "</function>\n</tool_call>"
)
GLM_LEGACY = (
    "<tool_call>search\n"
    "<arg_key>query</arg_key>\n<arg_value>foo bar</arg_value>\n"
    "<arg_key>limit</arg_key>\n<arg_value>42</arg_value>\n"
    "<arg_key>score</arg_key>\n<arg_value>0.5</arg_value>\n"
    "<arg_key>regex</arg_key>\n<arg_value>true</arg_value>\n"
    '<arg_key>filters</arg_key>\n<arg_value>{"ext": "py"}</arg_value>\n'
    '<arg_key>paths</arg_key>\n<arg_value>["a", "b"]</arg_value>\n'
    "<arg_key>maybe</arg_key>\n<arg_value>7</arg_value>\n"
    "</tool_call>"
)
HERMES_JSON = (
    '<tool_call>\n{"name": "search", "arguments": {"query": "foo bar", "limit": 42, "score": 0.5,'
    ' "regex": true, "filters": {"ext": "py"}, "paths": ["a", "b"], "maybe": 7}}\n</tool_call>'
)
EXPECTED_ARGS = {
    "query": "foo bar",
    "limit": 42,
    "score": 0.5,
    "regex": True,
    "filters": {"ext": "py"},
    "paths": ["a", "b"],
    "maybe": 7,
}


@pytest.mark.parametrize("family", ["generic", "qwen3", "glm4"])
@pytest.mark.parametrize("text", [QWEN_XML, GLM_LEGACY, HERMES_JSON], ids=["xml", "glm", "json"])
def test_all_formats_all_families(text, family):
    content, calls = parse_tool_calls("Looking.\n" + text + "\n", TOOLS, family)
    assert content == "Looking."
    assert len(calls) == 1
    assert calls[0].name == "search"
    assert json.loads(calls[0].arguments) == EXPECTED_ARGS
    assert type(json.loads(calls[0].arguments)["limit"]) is int


def test_hermes_arguments_as_json_string():
    text = '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\", \\"limit\\": \\"3\\"}"}</tool_call>'
    _, calls = parse_tool_calls(text, TOOLS)
    # the string "3" is coerced because the schema says integer
    assert json.loads(calls[0].arguments) == {"query": "x", "limit": 3}


def test_multiple_calls_and_interleaved_text():
    text = f"A {QWEN_XML} B {GLM_LEGACY} C {HERMES_JSON} D"
    content, calls = parse_tool_calls(text, TOOLS, "qwen3", id_salt="req")
    assert content == "A  B  C  D"
    assert [c.name for c in calls] == ["search"] * 3
    assert len({c.id for c in calls}) == 3  # index makes identical calls distinct


def test_missing_final_close_tag():
    content, calls = parse_tool_calls(HERMES_JSON.removesuffix("</tool_call>"), TOOLS)
    assert content == "" and json.loads(calls[0].arguments) == EXPECTED_ARGS
    xml = "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n"
    content, calls = parse_tool_calls(xml, TOOLS, "qwen3")
    assert content == "" and json.loads(calls[0].arguments) == {"query": "x"}
    glm = "<tool_call>search\n<arg_key>limit</arg_key><arg_value>9"
    assert json.loads(parse_tool_calls(glm, TOOLS, "glm4")[1][0].arguments) == {"limit": 9}
    # an unterminated call followed by another call ends at the next open tag
    both = HERMES_JSON.removesuffix("</tool_call>") + "\n" + HERMES_JSON
    assert len(parse_tool_calls(both, TOOLS)[1]) == 2


def test_no_argument_calls():
    assert parse_tool_calls("<tool_call>list_files</tool_call>")[1][0].arguments == "{}"
    assert parse_tool_calls('<tool_call>{"name": "ls"}</tool_call>')[1][0].arguments == "{}"
    xml = "<tool_call><function=ls></function></tool_call>"
    assert parse_tool_calls(xml, family="qwen3")[1][0].name == "ls"


def test_schema_typing_falls_back_to_string():
    xml = (
        "<tool_call><function=search><parameter=limit>many</parameter>"
        "<parameter=regex>yes</parameter><parameter=filters>{broken</parameter>"
        "<parameter=query>42</parameter></function></tool_call>"
    )
    args = json.loads(parse_tool_calls(xml, TOOLS, "qwen3")[1][0].arguments)
    assert args == {"limit": "many", "regex": "yes", "filters": "{broken", "query": "42"}


def test_untyped_values_only_parse_when_unambiguous():
    xml = (
        "<tool_call><function=other>"
        '<parameter=obj>{"a": 1}</parameter><parameter=arr>[1, 2]</parameter>'
        "<parameter=num>42</parameter><parameter=neg>-1.5</parameter>"
        "<parameter=zip>007</parameter><parameter=big>1e3</parameter>"
        "<parameter=flag>true</parameter><parameter=nul>null</parameter>"
        "<parameter=text>hello</parameter></function></tool_call>"
    )
    args = json.loads(parse_tool_calls(xml, TOOLS)[1][0].arguments)
    assert args == {
        "obj": {"a": 1}, "arr": [1, 2], "num": 42, "neg": -1.5, "zip": "007", "big": "1e3",
        "flag": "true", "nul": "null", "text": "hello",
    }


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>not a call at all</tool_call>",
        "<tool_call>{\"name\": 3}</tool_call>",
        "<tool_call>{broken json</tool_call>",
        "<tool_call></tool_call>",
        "<tool_call>",
        "</tool_call> stray close",
        "<tool_call>{\"name\": \"x\", \"arguments\": \"not json\"}</tool_call>",
        "<tool_call>{\"name\": \"x\", \"arguments\": [1]}</tool_call>",
        "<tool_call><function=>oops</tool_call>",
    ],
)
def test_malformed_input_is_preserved(text):
    content, calls = parse_tool_calls(f"before {text} after", TOOLS)
    assert calls == []
    assert content == f"before {text} after"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_never_crashes_and_arguments_are_json_objects(text):
    for family in ("generic", "qwen3", "glm4"):
        content, calls = parse_tool_calls("<tool_call>" + text, TOOLS, family)
        for call in calls:
            assert isinstance(json.loads(call.arguments), dict)
        if not calls:
            assert content == ("<tool_call>" + text).strip()


def test_ids_are_stable_and_salted():
    a = parse_tool_calls(HERMES_JSON, TOOLS, id_salt="chatcmpl-1")[1]
    b = parse_tool_calls(QWEN_XML, TOOLS, "qwen3", id_salt="chatcmpl-1")[1]
    c = parse_tool_calls(HERMES_JSON, TOOLS, id_salt="chatcmpl-2")[1]
    assert a[0].id == b[0].id  # same call, same scope -> same id, whatever the format
    assert a[0].id != c[0].id
    assert a[0].id.startswith("call_") and len(a[0].id) == 5 + 24
    assert make_tool_call_id("f", '{"b": 1, "a": 2}', 0, "s") == make_tool_call_id(
        "f", {"a": 2, "b": 1}, 0, "s"
    )
    assert make_tool_call_id("f", {}, 0, "s") != make_tool_call_id("f", {}, 1, "s")


def test_canonical_arguments():
    forms = ['{"path": "a", "n": 1}', '{"n":1,"path":"a"}', '{ "path" : "\\u0061", "n" : 1 }']
    assert {canonical_arguments(f) for f in forms} == {'{"n":1,"path":"a"}'}
    assert canonical_arguments({"path": "a", "n": 1}) == '{"n":1,"path":"a"}'
    assert canonical_arguments('{"é": "ü"}') == '{"é":"ü"}'
    assert canonical_arguments("not json") == "not json"


def test_to_openai():
    call = ToolCall("f", "{}", "call_x")
    assert call.to_openai() == {
        "id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{}"}
    }
    assert call.to_openai(2)["index"] == 2


def test_tool_prompt_round_trip():
    prompt = render_tool_prompt(TOOLS)
    assert prompt == render_tool_prompt(TOOLS)  # deterministic, cache-friendly
    assert "<tools>" in prompt and '"name": "search"' in prompt and "<tool_call>" in prompt
    # what the prompt asks for parses back
    _, calls = parse_tool_calls('<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n</tool_call>')
    assert calls[0].name == "search"


def test_inject_tool_prompt():
    block = render_tool_prompt(TOOLS)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out = inject_tool_prompt(msgs, TOOLS)
    assert out[0] == {"role": "system", "content": "Be brief.\n\n" + block}
    assert msgs[0]["content"] == "Be brief."  # input untouched
    assert out[1] is msgs[1]

    no_sys = [{"role": "user", "content": "hi"}, {"role": "system", "content": "mid reminder"}]
    out = inject_tool_prompt(no_sys, TOOLS)
    assert out[0] == {"role": "system", "content": block}
    assert out[2] == {"role": "system", "content": "mid reminder"}  # stays where it occurs

    parts = [{"role": "system", "content": [{"type": "text", "text": "S"}]}]
    assert inject_tool_prompt(parts, TOOLS)[0]["content"][-1] == {"type": "text", "text": "\n\n" + block}
    assert inject_tool_prompt(msgs, None) == msgs
    assert inject_tool_prompt(msgs, []) is not msgs
