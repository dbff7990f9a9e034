"""Reasoning splitter: recorded model outputs, split tags, and streamed == non-streamed parity.

Run: python -m pytest tests/test_reasoning.py
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxstack.parsing.reasoning import (
    Event,
    ReasoningStreamSplitter,
    prompt_opens_thinking,
    split_output,
    strip_thinking,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
            },
        },
    }
]

# Recorded-shape outputs (as the models write them).
QWEN3_THINK = "<think>\nThe user wants a greeting.\nKeep it short.\n</think>\n\nHello! How can I help?"
GLM_ORPHAN = "The user asks for 2+2.\nThat is 4.</think>\n\nThe answer is 4."
QWEN3_TOOL = (
    "<think>\nI should read the file.\n</think>\n\n"
    "<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.py\n</parameter>\n"
    "<parameter=limit>\n40\n</parameter>\n</function>\n</tool_call>"
)
CONTENT_ONLY = "Plain answer with <b>html</b> and a < sign.\n\nSecond paragraph."


def stream(text, cuts=None, **kw):
    """Feed text in pieces cut at `cuts` (default: one char at a time); return joined fields."""
    splitter = ReasoningStreamSplitter(**kw)
    if cuts is None:
        cuts = range(1, len(text))
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    events = []
    for a, b in zip(bounds, bounds[1:]):
        events += splitter.feed(text[a:b])
    events += splitter.finish()
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    tool_events = [e for e in events if e.kind == "tool_calls"]
    assert len(tool_events) <= 1
    calls = list(tool_events[0].calls) if tool_events else []
    return reasoning, content, calls, events


def assert_parity(text, cuts=None, **kw):
    expected = split_output(text, **kw)
    reasoning, content, calls, _ = stream(text, cuts, **kw)
    assert content == expected.content
    assert reasoning == expected.reasoning
    assert calls == expected.tool_calls
    return expected


def test_qwen3_think_then_answer():
    assert strip_thinking(QWEN3_THINK) == (
        "The user wants a greeting.\nKeep it short.",
        "Hello! How can I help?",
    )
    assert_parity(QWEN3_THINK)
    assert_parity(QWEN3_THINK, cuts=[])


def test_qwen3_prompt_opened_think():
    # enable_thinking templates end the prompt with "<think>\n"; the output has no open tag.
    prompt = "<|im_start|>assistant\n<think>\n"
    assert prompt_opens_thinking(prompt)
    assert not prompt_opens_thinking("<think>\nold\n</think>\n\nhi<|im_start|>assistant\n")
    out = "Short plan.\n</think>\n\nDone."
    assert strip_thinking(out, thinking_started=True) == ("Short plan.", "Done.")
    assert_parity(out, thinking_started=True)


def test_glm_orphan_close():
    assert strip_thinking(GLM_ORPHAN, thinking_started=True) == (
        "The user asks for 2+2.\nThat is 4.",
        "The answer is 4.",
    )
    assert_parity(GLM_ORPHAN, thinking_started=True)
    # Without the flag a stray close tag is dropped and never leaks into content.
    assert strip_thinking(GLM_ORPHAN)[1] == "The user asks for 2+2.\nThat is 4.\n\nThe answer is 4."
    assert_parity(GLM_ORPHAN)


def test_unterminated_think_is_all_reasoning():
    assert strip_thinking("<think>\nstill thinking when max_tokens hit") == (
        "still thinking when max_tokens hit",
        "",
    )
    assert_parity("<think>\nstill thinking when max_tokens hit")
    assert strip_thinking("no close", thinking_started=True) == ("no close", "")


def test_content_only():
    assert strip_thinking(CONTENT_ONLY) == ("", CONTENT_ONLY)
    assert_parity(CONTENT_ONLY)
    r, c, calls, events = stream(CONTENT_ONLY, cuts=[10, 20])
    assert all(e.kind == "content" for e in events)


def test_think_then_tool_call():
    out = assert_parity(QWEN3_TOOL, tools=TOOLS, family="qwen3", id_salt="chatcmpl-1")
    assert out.reasoning == "I should read the file."
    assert out.content == ""
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("read_file", '{"path": "src/main.py", "limit": 40}')
    ]
    # the tool call event comes once, at finish
    splitter = ReasoningStreamSplitter(tools=TOOLS, family="qwen3", id_salt="chatcmpl-1")
    mid = splitter.feed(QWEN3_TOOL)
    assert all(e.kind == "reasoning" for e in mid) and splitter.in_tool_call
    end = splitter.finish()
    assert [e.kind for e in end] == ["tool_calls"]
    assert list(end[0].calls) == out.tool_calls


def test_text_around_tool_calls_is_content():
    text = (
        "Let me check.\n"
        '<tool_call>{"name": "read_file", "arguments": {"path": "a"}}</tool_call>\n'
        '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"b\\"}"}</tool_call>\n'
        "trailing words\n"
    )
    out = assert_parity(text, tools=TOOLS)
    assert out.content == "Let me check.\n\n\ntrailing words"
    assert [c.arguments for c in out.tool_calls] == ['{"path": "a"}', '{"path": "b"}']


def test_tool_call_inside_reasoning_is_reasoning():
    text = "<think>maybe <tool_call>{...}</tool_call> later</think>answer"
    out = assert_parity(text)
    assert out.reasoning == "maybe <tool_call>{...}</tool_call> later"
    assert out.content == "answer" and out.tool_calls == []


def test_malformed_tool_call_kept_as_content():
    text = "ok <tool_call>not a call at all</tool_call> end"
    out = assert_parity(text)
    assert out.tool_calls == []
    assert out.content == text


@pytest.mark.parametrize("text", [QWEN3_THINK, GLM_ORPHAN, QWEN3_TOOL, CONTENT_ONLY])
@pytest.mark.parametrize("started", [False, True])
def test_tags_split_at_every_position(text, started):
    expected = split_output(text, thinking_started=started, tools=TOOLS)
    for cut in range(len(text) + 1):
        for second in (cut + 1, cut + 3):
            r, c, calls, _ = stream(text, [cut, second], thinking_started=started, tools=TOOLS)
            assert (r, c, calls) == tuple(expected), (cut, second)


def test_no_partial_tag_is_emitted_early():
    splitter = ReasoningStreamSplitter()
    assert splitter.feed("Hi <thi") == [Event("content", "Hi")]  # " <thi" held back
    assert splitter.feed("nk>plan") == [Event("reasoning", "plan")]
    assert splitter.feed("</thi") == []
    # content pieces are joined then stripped as a whole: the held " " is inner whitespace now
    assert splitter.feed("nk>\n\nanswer <") == [Event("content", " \n\nanswer")]
    assert splitter.feed("b>") == [Event("content", " <b>")]
    assert splitter.finish() == []


def test_partial_tag_at_end_is_text():
    assert_parity("answer <thi")
    assert stream("answer <tool_c", [8])[1] == "answer <tool_c"


def test_feed_after_finish_is_a_bug():
    s = ReasoningStreamSplitter()
    s.finish()
    with pytest.raises(RuntimeError):
        s.feed("x")


# ---------------------------------------------------------------------------------------------
# property: streamed concatenation == non-streaming result, for any text and any chunking
# ---------------------------------------------------------------------------------------------

PIECES = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<thi", "</th", "<tool", "<", ">", "/",
    "think", " ", "\n", "\n\n", "\t", "\u3000", "\xa0", "word", "é", "日本", "🙂", "{", "}",
    '{"name": "read_file", "arguments": {"path": "x", "limit": "3"}}',
    "<function=read_file>", "<parameter=path>", "\nsrc/a.py\n", "</parameter>", "</function>",
    "read_file\n", "<arg_key>limit</arg_key>", "<arg_value>7</arg_value>",
    # whole calls in the three formats, so many generated strings carry real tool calls
    '<tool_call>{"name": "read_file", "arguments": {"path": "x"}}</tool_call>',
    "<tool_call>\n<function=read_file>\n<parameter=limit>\n5\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>b</arg_value>\n</tool_call>",
]

texts = st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=25).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=texts,
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30),
    started=st.booleans(),
    family=st.sampled_from(["generic", "qwen3", "glm4"]),
)
def test_streaming_matches_non_streaming_property(text, cuts, started, family):
    assert_parity(text, cuts, thinking_started=started, tools=TOOLS, family=family, id_salt="s")


def test_streaming_matches_non_streaming_seeded_soak():
    rng = random.Random(1234)
    for trial in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30)))
        started = rng.random() < 0.5
        for _ in range(4):
            cuts = [rng.randint(0, len(text)) for _ in range(rng.randint(0, 12))]
            assert_parity(text, cuts, thinking_started=started, tools=TOOLS), (trial, text, cuts)
        assert_parity(text, None, thinking_started=started, tools=TOOLS)  # char by char
