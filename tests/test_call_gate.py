"""The call gate (parsing/call_gate.py): a reply's calls are shown once they close, a repeated call
ends the reply before it, a call cut by max_tokens is never text -- pure, on plain strings. The
engine's use of it (streamed == whole, the finish reasons): tests/test_structured_output.py; the
official SDKs through port 4000: tests/test_official_sdks.py."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxstack.parsing.call_gate import CallGate
from mlxstack.parsing.output import split_reply

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARIS_AGAIN = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'   # same, other spacing
OSLO = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'


def run(text: str, pieces: int = 1, *, cut: bool = False, **kw) -> tuple[str, bool]:
    """Push ``text`` in ``pieces`` even chunks, then flush; (all text shown, ended by the gate)."""
    gate = CallGate(tools=TOOLS, **kw)
    size = max(1, -(-len(text) // pieces))
    out, end = [], False
    for i in range(0, len(text), size):
        shown, end = gate.push(text[i:i + size])
        out.append(shown)
        if end:
            return "".join(out), True
    return "".join(out) + gate.flush(cut=cut), False


def test_a_repeated_call_ends_the_reply_before_it():
    text = f"{PARIS}\n{OSLO}\n{PARIS_AGAIN}\n{OSLO}\n"
    for pieces in (1, 3, len(text)):
        assert run(text, pieces) == (f"{PARIS}\n{OSLO}\n", True)
    gate = CallGate(tools=TOOLS)
    gate.push(text)
    assert gate.calls == [("get_weather", '{"city":"Paris"}'), ("get_weather", '{"city":"Oslo","days":2}')]
    assert gate.push("more") == ("", True) and gate.flush(cut=False) == ""


def test_different_calls_and_the_text_around_them_pass_unchanged():
    text = f"Checking both.\n{PARIS}\n{OSLO}\nDone."
    assert run(text, 7) == (text, False)
    assert run("No calls here, 1 < 2 and a <b>tag</b>.", 5) == ("No calls here, 1 < 2 and a <b>tag</b>.", False)


def test_a_call_is_held_until_it_closes():
    gate = CallGate(tools=TOOLS)
    assert gate.push("Sure. <tool_") == ("Sure. ", False)
    assert gate.push(PARIS[len("<tool_"):-3]) == ("", False)
    assert gate.push(PARIS[-3:] + "\n") == (PARIS + "\n", False)


def test_single_ends_the_reply_after_the_first_call():
    assert run(f"{PARIS}\n{OSLO}", 4, single=True) == (PARIS, True)


def test_a_cut_inside_a_call_drops_it_and_keeps_the_calls_before():
    text = f"Let me see.\n{PARIS}\n" + OSLO[:30]
    for pieces in (1, 4, len(text)):
        assert run(text, pieces, cut=True) == (f"Let me see.\n{PARIS}\n", False)
    assert run("Let me see. <tool_ca", cut=True) == ("Let me see. ", False)    # the start of a call
    assert run("Let me see. <tool_ca", cut=False) == ("Let me see. <tool_ca", False)
    # not a cut (a stop token ended it): the unclosed block goes on to the parsers as written
    unclosed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
    assert run(unclosed, 3) == (unclosed, False)
    assert [c.name for c in split_reply(unclosed, tools=TOOLS).tool_calls] == ["get_weather"]


def test_calls_inside_reasoning_are_reasoning_text():
    text = f"I could write {PARIS} or {PARIS}.</think>\n{PARIS}\n{PARIS}"
    assert run(text, 6, thinking_started=True) == (f"I could write {PARIS} or {PARIS}.</think>\n{PARIS}\n", True)
    assert run(f"<think>{PARIS[:20]}", cut=True) == (f"<think>{PARIS[:20]}", False)


def test_a_block_that_is_not_one_call_stays_text():
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert run(f"{bad}\n{bad}\n{PARIS}", 5) == (f"{bad}\n{bad}\n{PARIS}", False)


def test_qwen_xml_calls_are_compared_by_their_typed_arguments():
    xml = "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n<parameter=days>\n{}\n" \
          "</parameter>\n</function>\n</tool_call>"
    # " 3" and "3" are the same integer argument: the same call
    assert run(xml.format(3) + "\n" + xml.format(" 3") + "\n", 4, family="qwen3") == (xml.format(3) + "\n", True)
    assert run(xml.format(3) + "\n" + xml.format(4), 4, family="qwen3") == (xml.format(3) + "\n" + xml.format(4), False)


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.sampled_from([PARIS, OSLO, "\n", "text ", "<think>", "</think>", "<tool_call>", "<", "{"]),
                      max_size=8),
       cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6), cut=st.booleans(), thinking=st.booleans())
def test_any_chunking_shows_the_same_prefix_of_the_text(parts, cuts, cut, thinking):
    text = "".join(parts)
    whole = run(text, cut=cut, thinking_started=thinking)
    gate = CallGate(tools=TOOLS, thinking_started=thinking)
    out, end, last = [], False, 0
    for at in sorted(set(c for c in cuts if c < len(text))) + [len(text)]:
        shown, end = gate.push(text[last:at])
        out.append(shown)
        last = at
        if end:
            break
    shown = "".join(out) + ("" if end else gate.flush(cut=cut))
    assert (shown, end) == whole
    assert text.startswith(shown)
