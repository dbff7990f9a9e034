"""Prefix stability the client cannot see (issue 4): on the tiny dense fixture and template
variants of it, the rendered prompt keeps every earlier turn byte-identical where it can, so
warm turns reuse the KV cache; and where a template itself changes an earlier turn (Qwen's
``last_query_index``), reuse stops exactly there and nowhere earlier.

Replies the random model cannot produce (a closed ``<think>`` block, a tool call) come from a
scripted decode: the scripted tokens are fed through the real model into the real cache, just
as the decode loop feeds sampled ones (tests/fixtures/scripted.py), so the KV holds what a real model would have.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlxstack.server.openai.chat_reply import StreamAssembler, completion_body
from mlxstack.parsing.reasoning import split_output
from mlxstack.parsing.tool_calls import make_tool_call_id
from mlxstack.prompt.render import encode
from tests.conftest import build_engine, engine_settings
from tests.fixtures.scripted import ScriptedReplies
from tests.fixtures import agent_shapes as shapes
from tests.fixtures.tiny_models import CHAT_TEMPLATE
from tests.test_engine import SYSTEM, TOOLS, job

REMINDER = "<system-reminder>\nToday's date is 2026-03-28.\n</system-reminder>"
REASONING = "The user wants the sum. Two plus two is four."
ANSWER = "The answer is 4."
CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>'

# ----------------------------------------------------------------------------------- template variants


def _swap(template: str, old: str, new: str) -> str:
    assert template.count(old) == 1, f"fixture template changed; cannot patch {old[:60]!r}"
    return template.replace(old, new)


_USER_OR_LATE_SYSTEM = "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
# Refuses a system message anywhere but first, as many real templates do.
REFUSING_TEMPLATE = _swap(CHAT_TEMPLATE, _USER_OR_LATE_SYSTEM,
                          "{%- if message.role == 'system' and not loop.first %}"
                          "{{- raise_exception('System message must be at the beginning.') }}"
                          "{%- elif message.role == 'user' %}")

_REASONING_BRANCH = """        {%- if message.reasoning_content is defined and message.reasoning_content is string and message.reasoning_content %}
            {{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}"""
# Knows nothing of reasoning_content: the renderer must re-insert the <think> block itself.
NO_REASONING_TEMPLATE = _swap(CHAT_TEMPLATE, _REASONING_BRANCH, "        {{- content }}")


def _qwen_template(preserve_flag: bool) -> str:
    """Qwen3's rule: past <think> blocks are rendered only for assistant turns after the last
    user query (``last_query_index``); with ``preserve_flag`` a ``preserve_thinking`` kwarg keeps them all."""
    keep = " or (preserve_thinking is defined and preserve_thinking)" if preserve_flag else ""
    head = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string and not message.content.startswith('<tool_response>') %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
"""
    assistant = """        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if (loop.index0 > ns.last_query_index""" + keep + """) and reasoning_content %}
            {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}"""
    tpl = _swap(CHAT_TEMPLATE, "{%- if tools %}", head + "{%- if tools %}")
    tpl = _swap(tpl, "        {{- '<|im_start|>assistant\\n' }}\n" + _REASONING_BRANCH,
                "        {{- '<|im_start|>assistant\\n' }}\n" + assistant)
    return tpl


def variant(tmp_path: Path, base: Path, name: str, template: str) -> Path:
    """A copy of the fixture folder (weights linked) whose tokenizer has ``template``."""
    out = tmp_path / name
    out.mkdir()
    for f in base.iterdir():
        if f.name == "model.safetensors":
            (out / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def variants(tmp_path_factory, tiny_dense_path):
    tmp = tmp_path_factory.mktemp("templates")
    return {
        "fixture": tiny_dense_path,
        "refusing": variant(tmp, tiny_dense_path, "refusing", REFUSING_TEMPLATE),
        "no_reasoning": variant(tmp, tiny_dense_path, "no_reasoning", NO_REASONING_TEMPLATE),
        "qwen": variant(tmp, tiny_dense_path, "qwen", _qwen_template(False)),
        "qwen_preserve": variant(tmp, tiny_dense_path, "qwen_preserve", _qwen_template(True)),
    }


# ----------------------------------------------------------------------------------- scripted replies


@pytest.fixture
def script(monkeypatch):
    return ScriptedReplies().install(monkeypatch)


def say(script: ScriptedReplies, engine, text: str) -> None:
    """Queue ``text`` followed by the end-of-turn token as the next reply."""
    tok = engine.loaded.tokenizer
    script.queue.append(encode(tok, text) + [tok.convert_tokens_to_ids("<|im_end|>")])


def think_then(reply: str) -> str:
    """A thinking-on reply (the prompt already opened ``<think>``).

    NOTE: the conversations below run with thinking on. With it off, the fixture's generation
    prompt ends in ``</think>\n\n`` and the SmolLM2 pre-tokenizer splits ``\n\nHello`` as
    ``\n``, ``\n``, ``Hello``, so the re-rendered turn differs from the KV in its first token (a
    property of this tokenizer; Qwen's keeps ``\n\n`` whole) and reuse ends one token early."""
    return f"Let me think.\n</think>\n\n{reply}"


def reused_whole(previous, now) -> bool:
    """``now`` reused the previous prompt and its whole reply (the last generated token is never in the KV)."""
    return now.cached_tokens >= previous.prompt_tokens + previous.completion_tokens - 1


def no_rejections(engine) -> None:
    assert engine.state.counters.get("exact_key_rejected_by_model_lcp") == 0


# ----------------------------------------------------------------------------------- (a) mid-conversation system


def _with_reminder(first_reply: str = "Hello.", second_reply: str = "Sure.") -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first_reply},
        {"role": "user", "content": "open the file"},
        {"role": "assistant", "content": second_reply},
        {"role": "system", "content": REMINDER},
        {"role": "user", "content": "what day is it?"},
    ]


@pytest.mark.parametrize("template, rendered", [
    ("fixture", "<|im_start|>system\n" + REMINDER + "<|im_end|>\n"),
    ("refusing", "<|im_start|>user\n[system] " + REMINDER + "<|im_end|>\n"),
])
def test_mid_conversation_system_message_stays_where_it_occurs(variants, template, rendered):
    eng = build_engine(engine_settings(variants[template]))
    j, _ = job(_with_reminder())
    text = eng.prepare(j).model_text
    assert text.count(REMINDER) == 1 and rendered in text
    leading = text[: text.index("<|im_start|>user\n")]
    assert SYSTEM in leading and REMINDER not in leading  # never hoisted into the leading block
    assert text.index("Sure.") < text.index(rendered) < text.index("what day is it?")


@pytest.mark.parametrize("template", ["fixture", "refusing"])
def test_reminders_arriving_mid_conversation_keep_every_turn_warm(variants, template, script):
    eng = build_engine(engine_settings(variants[template]))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    outcomes = []
    for i, (reply, follow_up) in enumerate((("Hello.", "open the file"), ("Sure.", "what day is it?"),
                                            ("Saturday.", "thanks"))):
        say(script, eng, think_then(reply))
        o = eng.run(job(list(messages), thinking=True, max_tokens=40, session=f"mid-{template}")[0])
        assert split_output(o.text, thinking_started=True).content == reply
        if outcomes:
            assert reused_whole(outcomes[-1], o), (i, o.cached_tokens, o.prompt_tokens)
        outcomes.append(o)
        # A new reminder every turn (Claude Code's date / todo reminders), as a system turn.
        messages += [{"role": "assistant", "content": reply},
                     {"role": "system", "content": f"{REMINDER} (turn {i})"},
                     {"role": "user", "content": follow_up}]
    no_rejections(eng)


# ----------------------------------------------------------------------------------- (b) echoed reasoning_content


@pytest.mark.parametrize("template", ["fixture", "no_reasoning"])
def test_pi_echoed_reasoning_content_is_a_hit_without_healing(variants, template, script):
    eng = build_engine(engine_settings(variants[template], healing_store=False))
    assert eng.state.healing is None
    assert eng.renderer.renders_reasoning_content is (template == "fixture")
    history = [{"role": "developer", "content": shapes.PI_SYSTEM}, shapes.pi_user("What is 2 + 2?")]
    say(script, eng, f"{REASONING}\n</think>\n\n{ANSWER}")     # the prompt already opened <think>
    o1 = eng.run(job(list(history), thinking=True, max_tokens=40, session=f"pi-{template}")[0])
    parsed = split_output(o1.text, thinking_started=o1.thinking_started)
    assert o1.thinking_started and (parsed.reasoning, parsed.content) == (REASONING, ANSWER)

    # PI keeps the reasoning and sends it back in the field it arrived in.
    kept = history + [shapes.pi_assistant(parsed.content, reasoning=parsed.reasoning), shapes.pi_user("And 3 + 3?")]
    j2, _ = job(kept, thinking=True, max_tokens=40, session=f"pi-{template}")
    assert "<|im_start|>assistant\n<think>\n" + o1.raw_text + "<|im_end|>" in eng.prepare(j2).model_text
    o2 = eng.run(j2)
    assert reused_whole(o1, o2), (o1.prompt_tokens, o1.completion_tokens, o2.cached_tokens)

    # Control: the same turn with the reasoning stripped (and no healing store) re-prefills the reply.
    say(script, eng, "x")
    stripped = history + [shapes.pi_assistant(parsed.content), shapes.pi_user("And 3 + 3?")]
    o3 = eng.run(job(stripped, thinking=True, max_tokens=40, session=f"pi-stripped-{template}")[0])
    assert o3.cached_tokens < o1.prompt_tokens
    no_rejections(eng)


# ----------------------------------------------------------------------------------- (c) last_query_index


def _tool_loop(eng, script, session):
    """u1 -> a1 (think + tool call) -> tool -> a2 (think + answer) -> u2; returns (outcomes, messages)."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summarise README.md"}]
    say(script, eng, f"I need the file.\n</think>\n\n{CALL}")
    a = eng.run(job(list(msgs), thinking=True, max_tokens=40, session=session)[0])
    call_args = json.dumps({"path": "README.md"})  # as the API returned it
    msgs += [{"role": "assistant", "content": None, "reasoning_content": "I need the file.",
              "tool_calls": [{"id": "call_1", "type": "function",
                              "function": {"name": "read_file", "arguments": call_args}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "# Project\nA server."}]
    say(script, eng, f"Now I can answer.\n</think>\n\n{ANSWER}")
    b = eng.run(job(list(msgs), thinking=True, max_tokens=40, session=session)[0])
    msgs += [{"role": "assistant", "content": ANSWER, "reasoning_content": "Now I can answer."},
             {"role": "user", "content": "Thanks. Anything else?"}]
    c = eng.run(job(list(msgs), thinking=True, session=session, max_tokens=2)[0])
    return (a, b, c), msgs


@pytest.mark.parametrize("template, preserve", [("qwen", True), ("qwen_preserve", False)])
def test_last_query_index_reuse_stops_at_first_reworded_assistant_turn(variants, template, preserve, script):
    eng = build_engine(engine_settings(variants[template], preserve_thinking=preserve))
    assert eng.renderer.preserve_thinking is False
    (a, b, c), msgs = _tool_loop(eng, script, f"lqi-{template}")
    # Within one user query (the tool loop) the earlier assistant turn keeps its <think>: reusable.
    assert reused_whole(a, b)
    # A new user query drops <think> from every earlier assistant turn: reuse stops at the first
    # one -- exactly the end of its "<|im_start|>assistant\n" opener, nothing before is lost.
    opener = eng.renderer.render(msgs[:2], add_generation_prompt=False) + "<|im_start|>assistant\n"
    assert c.cached_tokens == len(encode(eng.loaded.tokenizer, opener))
    assert c.cached_tokens < a.prompt_tokens
    # Key and model were rendered with identical kwargs: the key never promised more than the model gave.
    no_rejections(eng)


def test_preserve_thinking_keeps_every_turn_reusable(variants, script):
    eng = build_engine(engine_settings(variants["qwen_preserve"]))
    assert eng.renderer.preserve_thinking is True
    (a, b, c), msgs = _tool_loop(eng, script, "lqi-preserve")
    assert reused_whole(a, b) and reused_whole(b, c)
    text = eng.renderer.render(msgs, enable_thinking=True)
    assert text.count("<think>\n") == 3  # both past turns and the generation prompt
    no_rejections(eng)


# ----------------------------------------------------------------------------------- (d) tool-call ids


def test_tool_call_ids_are_stable_for_one_completion():
    outcome = SimpleNamespace(text=CALL, thinking_started=False, finish_reason="stop", prompt_tokens=10,
                              cached_tokens=0, completion_tokens=5)
    cid = "chatcmpl-0123456789abcdef01234567"
    body = completion_body(cid, "m", outcome, tools=None, family="qwen3", enable_thinking=False)
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert call["id"] == make_tool_call_id("read_file", {"path": "README.md"}, 0, cid)
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    # Re-rendering the same completion never invents another id ...
    again = completion_body(cid, "m", outcome, tools=None, family="qwen3", enable_thinking=False)
    assert again["choices"][0]["message"]["tool_calls"][0]["id"] == call["id"]
    # ... and the streamed form of the same completion carries the same id.
    asm = StreamAssembler(cid, "m", thinking_started=False, tools=None, family="qwen3", include_usage=True)
    frames = asm.feed(CALL[:7]) + asm.feed(CALL[7:]) + asm.finish(outcome)
    streamed = [tc["id"] for f in frames for ch in json.loads(f[6:])["choices"]
                for tc in ch["delta"].get("tool_calls", ())]
    assert streamed == [call["id"]]
    # Another completion of the same call gets its own id (ids never collide across turns).
    other = completion_body("chatcmpl-other", "m", outcome, tools=None, family="qwen3", enable_thinking=False)
    assert other["choices"][0]["message"]["tool_calls"][0]["id"] != call["id"]


@pytest.mark.parametrize("healing", [True, False])
def test_echoed_tool_call_id_is_never_regenerated(variants, script, healing):
    """The id the server returned comes back in history; the pipeline passes it through as is,
    and the tool-call turn is still a hit."""
    eng = build_engine(engine_settings(variants["fixture"], healing_store=healing))
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Read README.md"}]
    say(script, eng, think_then(CALL))
    o1 = eng.run(job(list(msgs), tools=TOOLS, thinking=True, max_tokens=40, session=f"ids-{healing}")[0])
    cid = "chatcmpl-fixedcompletionid000000"
    body = completion_body(cid, "m", o1, tools=TOOLS, family=eng.loaded.family, enable_thinking=True)
    message = body["choices"][0]["message"]
    call_id = message["tool_calls"][0]["id"]
    msgs += [message, {"role": "tool", "tool_call_id": call_id, "content": "# Project"}]
    j2, _ = job(msgs, tools=TOOLS, thinking=True, max_tokens=40, session=f"ids-{healing}")
    prep = eng.prepare(j2)
    assert prep.original[-1]["tool_call_id"] == call_id
    if not healing:
        assert prep.original[-2]["tool_calls"][0]["id"] == call_id
    assert msgs[-2]["tool_calls"][0]["id"] == call_id  # the caller's list is never mutated
    o2 = eng.run(j2)
    # Healed, or rendered from the echoed reasoning_content: either way the whole turn is reused.
    assert reused_whole(o1, o2), (o1.prompt_tokens, o1.completion_tokens, o2.cached_tokens)


# ----------------------------------------------------------------------------------- (e) billing header


def _claude_messages(cch: str, list_system: bool) -> list[dict]:
    system = ([{"type": "text", "text": shapes.billing_line(cch)},
               {"type": "text", "text": shapes.CLAUDE_CODE_IDENTITY}, {"type": "text", "text": SYSTEM}]
              if list_system else f"{shapes.billing_line(cch)}\n{shapes.CLAUDE_CODE_IDENTITY}\n{SYSTEM}")
    return [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("list_system", [False, True], ids=["string", "blocks"])
def test_billing_header_stripped_from_model_text_only_when_on(tiny_dense_path, list_system):
    on = build_engine(engine_settings(tiny_dense_path, strip_billing_header=True))
    off = build_engine(engine_settings(tiny_dense_path, strip_billing_header=False))
    msgs = _claude_messages("fa690", list_system)
    text_on = on.prepare(job(msgs)[0]).model_text
    text_off = off.prepare(job(msgs)[0]).model_text
    assert "x-anthropic-billing-header" not in text_on and "cch=" not in text_on
    assert shapes.billing_line("fa690") in text_off
    assert text_on.startswith("<|im_start|>system\n" + shapes.CLAUDE_CODE_IDENTITY)


@pytest.mark.parametrize("strip", [True, False])
def test_rotating_cch_keeps_full_reuse_when_stripped(tiny_dense_path, script, strip):
    eng = build_engine(engine_settings(tiny_dense_path, strip_billing_header=strip))
    say(script, eng, think_then("Hello."))
    o1 = eng.run(job(_claude_messages("fa690", True), thinking=True, max_tokens=40, session="cc")[0])
    msgs = _claude_messages("0aaa9", True) + [{"role": "assistant", "content": "Hello."},
                                              {"role": "user", "content": "read the file"}]
    o2 = eng.run(job(msgs, thinking=True, session="cc", max_tokens=2)[0])
    if strip:
        assert reused_whole(o1, o2), (o1.prompt_tokens, o2.cached_tokens)
    else:  # the line differs at its cch= value: reuse ends inside the very first line
        line = "<|im_start|>system\n" + shapes.billing_line("fa690")
        assert o2.cached_tokens < len(encode(eng.loaded.tokenizer, line))
    no_rejections(eng)
