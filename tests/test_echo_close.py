"""A turn closes with the tokens its echo renders to, so the next turn reuses the whole reply.

What a grammar (or a random fixture's sampler) writes need not be the tokenizer's own encoding of
the text: ``{`` ``"`` ``name`` where the echoed text encodes ``{"`` as one token. The next prompt
holds the canonical encoding (the model sees the original input), so a turn closed with the
sampled ids was reused only up to the reply's first differing token. The turn now closes with the
echo's tokens (engine/finish.py ``echo_ids``): the KV is cut back where they part and the rest
fed; an exact-depth cache goes back to its prompt snapshot and feeds the echo from there.

Every test: turn 2 reuses every token of turn 1's prompt, its reply and its closer
(``cached >= reply_end``), and turn 2's reply equals a cold engine's on the same conversation
(the same healing history: the cold engine runs it too, cache off -- LESSONS 19).
"""
from __future__ import annotations

import json

import pytest

from mlxstack.prompt.render import encode
from mlxstack.server.common.structured import Structured
from tests.conftest import build_engine, engine_settings
from tests.test_structured_output import PERSON, TOOLS, constrained

SYSTEM = "You answer with one JSON object describing a person. " * 3
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def reply_end(engine, history: list[dict], assistant: dict, tools=None) -> int:
    """Tokens of ``history`` and its reply rendered as the last turn, closer included: what the
    next turn must reuse at least (the prompt, the reply, the closer)."""
    text = engine.renderer.render(engine.state.heal(history + [assistant]), tools, False,
                                  add_generation_prompt=False)
    return len(encode(engine.loaded.tokenizer, text))


def echoed(out, engine, tools=None) -> dict:
    """The assistant message a client sends back: visible content, tool calls as the API returns them."""
    from mlxstack.parsing.output import split_reply

    parsed = split_reply(out.text, thinking_started=out.thinking_started, tools=tools, family=engine.loaded.family)
    msg: dict = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        msg["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
    return msg


def two_turns(engine, structured, first_fields: dict, second: dict, tools=None, max_tokens=48):
    """Turn 1 under ``first_fields`` (a grammar), its reply echoed, then ``second``."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Describe a famous scientist."}]
    j, _ = constrained(structured, engine, list(messages), max_tokens=max_tokens, session="echo",
                       **({"tools": tools} if tools else {}), **first_fields)
    o1 = engine.run(j)
    reply = echoed(o1, engine, tools)
    end = reply_end(engine, messages, reply, tools)
    if second["role"] == "tool":
        second = {**second, "tool_call_id": reply["tool_calls"][0]["id"]}
    messages += [reply, second]
    j, _ = constrained(structured, engine, list(messages), max_tokens=max_tokens, session="echo",
                       **({"tools": tools} if tools else {}), **first_fields)
    return o1, end, engine.run(j)


@pytest.fixture(scope="module")
def smol_pair(embedded_model_path):
    warm = build_engine(engine_settings(embedded_model_path))
    cold = build_engine(engine_settings(embedded_model_path, prompt_cache_max_entries_global=0))
    return ((warm, Structured.for_model(warm.loaded, warm, warm.settings)),
            (cold, Structured.for_model(cold.loaded, cold, cold.settings)))


@pytest.mark.parametrize("fields, respelled", [
    ({"response_format": FORMAT}, True),       # this model's schema reply is not its text's encoding
    ({"response_format": {"type": "json_object"}}, False),
], ids=["json_schema", "json_object"])
def test_a_constrained_reply_is_reused_whole_on_the_next_turn(smol_pair, fields, respelled):
    (warm, ws), (cold, cs) = smol_pair
    before = warm.state.counters.get("echo_closes")
    o1, end, o2 = two_turns(warm, ws, fields, {"role": "user", "content": "Another one."})
    json.loads(o1.text)                                  # the grammar held
    assert o2.cached_tokens >= end, (o2.cached_tokens, end, o1.prompt_tokens, o1.completion_tokens)
    assert o2.cached_tokens >= o1.prompt_tokens + o1.completion_tokens - 2
    assert o2.cached_tokens < o2.prompt_tokens
    # the sampled ids were not the text's own encoding: the turn closed with the echo's
    assert (warm.state.counters.get("echo_closes") > before) == respelled
    c1, _, c2 = two_turns(cold, cs, fields, {"role": "user", "content": "Another one."})
    assert (c1.text, c2.text) == (o1.text, o2.text) and c2.cached_tokens == 0
    assert c2.prompt_tokens == o2.prompt_tokens


def test_a_forced_tool_call_is_reused_whole_with_its_result(smol_pair):
    (warm, ws), (cold, cs) = smol_pair
    fields = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    nxt = {"role": "tool", "tool_call_id": "", "content": '{"temp": 21}'}
    o1, end, o2 = two_turns(warm, ws, fields, nxt, tools=TOOLS, max_tokens=60)
    assert o1.finish_reason == "stop" and "get_weather" in o1.raw_text
    assert o2.cached_tokens >= end, (o2.cached_tokens, end)
    c1, _, c2 = two_turns(cold, cs, fields, nxt, tools=TOOLS, max_tokens=60)
    assert (c1.raw_text, c2.raw_text) == (o1.raw_text, o2.raw_text)


def test_the_echo_costs_no_reuse_when_the_sampled_ids_are_canonical(smol_pair):
    """A free-text reply of the trained model is its own encoding: the turn closes as before
    (no echo close counted) and the next turn reuses it whole."""
    (warm, _), _ = smol_pair
    before = warm.state.counters.get("echo_closes")
    o1, end, o2 = two_turns(warm, None, {}, {"role": "user", "content": "Another one."}, max_tokens=24)
    assert o2.cached_tokens >= end
    assert warm.state.counters.get("echo_closes") == before


@pytest.mark.parametrize("kind", ["dense", "hybrid", "gpt_oss"])
def test_free_text_of_a_random_fixture_is_reused_whole(kind, tiny_kind_paths):
    """Random weights write ids that are not their text's encoding even without a grammar; the
    hybrid's recurrent state cannot be cut back, so its turn is closed again from the prompt's
    snapshot (``echo_refeeds``)."""
    path = tiny_kind_paths(kind)
    warm = build_engine(engine_settings(path))
    cold = build_engine(engine_settings(path, prompt_cache_max_entries_global=0))
    outs = {}
    for name, eng in (("warm", warm), ("cold", cold)):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say something."}]
        turns = []
        for follow in ("And more.", "Once more."):
            j, _ = constrained(None, eng, list(messages), max_tokens=20, session=f"free-{kind}")
            o = eng.run(j)
            reply = echoed(o, eng)
            turns.append((o, reply_end(eng, messages, reply)))
            messages += [reply, {"role": "user", "content": follow}]
        j, _ = constrained(None, eng, list(messages), max_tokens=20, session=f"free-{kind}")
        turns.append((eng.run(j), None))
        outs[name] = turns
    (o1, end1), (o2, end2), (o3, _) = outs["warm"]
    assert o2.cached_tokens >= end1 and o3.cached_tokens >= end2, (kind, o2.cached_tokens, end1, o3.cached_tokens, end2)
    assert [o.raw_text for o, _ in outs["warm"]] == [o.raw_text for o, _ in outs["cold"]]
    assert warm.state.counters.get("echo_closes") >= 1
    if kind == "hybrid":
        assert warm.state.counters.get("echo_refeeds") >= 1
        assert {o2.match_type, o3.match_type} <= {"prefix", "session", "exact"}
    assert warm.state.counters.get("exact_key_rejected_by_model_lcp") == 0
