"""Every model family users run, through the real request engine (issue 9): multi-turn
conversations long enough to rotate sliding windows and drop attention chunks give exactly the
cache-off replies, warm turns reuse the previous turn's prompt, no request fails after
generation; GPT-OSS harmony replies are parsed, stopped and healed so tool loops stay warm;
prompts past the context window are refused before any prefill.
"""
from __future__ import annotations

import json

import pytest

from mlxstack.engine.chat import ContextLengthExceeded
from mlxstack.prompt.render import encode
from tests.conftest import build_engine, engine_settings
from tests.fixtures.scripted import ScriptedReplies
from tests.test_engine import job

pytestmark = pytest.mark.slow  # multi-turn parity for every model family in process (docs/testing.md#tiers)

FAMILIES = ["gemma3", "gpt_oss", "llama4", "mamba2", "lfm2"]
SYSTEM = ("You are a careful coding agent working in a large repository. Read files before "
          "editing them, run the tests after each change, and explain briefly what you did. ") * 2


@pytest.fixture(scope="module")
def engines(tiny_kind_paths):
    made: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in made:
            path = tiny_kind_paths(kind)
            made[kind] = (build_engine(engine_settings(path)),
                          build_engine(engine_settings(path, prompt_cache_max_entries_global=0)))
        return made[kind]

    return get


def conversation(engine, turns, max_tokens=12):
    messages = [{"role": "system", "content": SYSTEM}]
    outs = []
    for user in turns:
        messages.append({"role": "user", "content": user})
        j, _ = job(list(messages), max_tokens=max_tokens, session="fam")
        o = engine.run(j)
        outs.append(o)
        messages.append({"role": "assistant", "content": o.text})
    return outs


TURNS = ["Open the README and summarise the install steps for a new contributor, please.",
         "Now list the test commands you would run and why each one matters.",
         "Which of those would you run first on a slow laptop?",
         "Thanks. One line to finish."]


@pytest.mark.parametrize("kind", FAMILIES)
def test_multi_turn_parity_and_warm_reuse(engines, kind):
    warm, cold = engines(kind)
    w = conversation(warm, TURNS)
    c = conversation(cold, TURNS)
    assert [o.raw_text for o in w] == [o.raw_text for o in c]
    assert w[-1].prompt_tokens > 150          # well past the 32-token window / chunk
    assert all(o.cached_tokens == 0 for o in c) and w[0].cached_tokens == 0
    for prev, o in zip(w, w[1:]):
        # at least everything before the previous turn's generation prompt is reused
        assert o.cached_tokens >= prev.prompt_tokens - 8, (kind, o.match_type, o.cached_tokens, prev.prompt_tokens)
        assert o.timings["prefilled_tokens"] == o.prompt_tokens - o.cached_tokens
    counters = warm.state.counters
    assert counters.get("store_failures") == 0 and counters.get("exact_key_rejected_by_model_lcp") == 0
    assert warm.state.layout.supported


def test_context_window_refuses_before_prefill_and_caps_the_reply(engines):
    warm, _ = engines("gemma3")
    limit = warm.context_limit
    assert limit == 4096                       # the fixture's max_position_embeddings
    big = [{"role": "user", "content": "word " * (limit + 50)}]
    j, out = job(big, max_tokens=10)
    with pytest.raises(ContextLengthExceeded) as err:
        warm.run(j)
    assert err.value.limit == limit and err.value.prompt_tokens > limit and out == []
    assert f"maximum context length is {limit} tokens" in str(err.value)
    assert warm.state.counters.get("context_length_exceeded") == 1
    # a prompt that fits, with max_tokens running past the window: generate up to the window
    tok = warm.loaded.tokenizer
    n_user = limit - 40
    fits = [{"role": "user", "content": tok.decode(encode(tok, "word " * n_user)[:n_user])}]
    j, _ = job(fits, max_tokens=32000)
    o = warm.run(j)
    room = limit - o.prompt_tokens
    assert 0 < room < 64 and o.completion_tokens <= room
    assert o.finish_reason in ("length", "stop")
    if o.finish_reason == "length":
        assert o.completion_tokens == room


def test_max_kv_size_overrides_the_model_window(tiny_kind_paths):
    eng = build_engine(engine_settings(tiny_kind_paths("dense"), max_kv_size=300))
    assert eng.context_limit == 300
    j, _ = job([{"role": "user", "content": "hello " * 400}], max_tokens=4)
    with pytest.raises(ContextLengthExceeded):
        eng.run(j)


# ---------------------------------------------------------------------------- GPT-OSS harmony
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                           "required": ["city"]}}}]


def test_harmony_tool_loop_is_parsed_healed_and_stays_warm(engines, monkeypatch):
    warm, cold = engines("gpt_oss")
    assert warm.loaded.family == "harmony" and warm.harmony
    tok = warm.loaded.tokenizer
    end_id = tok.get_vocab()["<|end|>"]
    assert end_id not in warm.stop_ids and tok.get_vocab()["<|call|>"] in warm.stop_ids
    reply = ('<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>'
             '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
             '<|message|>{"city":"Paris","days":2}<|call|>')
    script = ScriptedReplies().install(monkeypatch)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris for two days?"}]
    outs = {}
    for name, eng in (("warm", warm), ("cold", cold)):
        script.queue.append(encode(tok, reply))
        j, _ = job(list(history), tools=WEATHER, max_tokens=200, session=f"harmony-{name}")
        first = eng.run(j)
        assert first.finish_reason == "stop"
        from mlxstack.parsing.output import split_reply

        parsed = split_reply(first.text, tools=WEATHER, family="harmony")
        assert parsed.reasoning == "The user wants the weather; call the tool."
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris", "days": 2})]
        # the client echoes the call re-serialised (LiteLLM style) and drops the reasoning
        echoed = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]}
        follow = history + [echoed, {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24C."}]
        j2, _ = job(follow, tools=WEATHER, max_tokens=8, session=f"harmony-{name}")
        outs[name] = (first, eng.run(j2))
    (w1, w2), (c1, c2) = outs["warm"], outs["cold"]
    assert w1.raw_text == c1.raw_text and w2.raw_text == c2.raw_text
    # healed: the whole first prompt and the generated call (through <|call|>) are reused
    assert w2.cached_tokens >= w1.prompt_tokens + len(encode(tok, reply)) - 1, (w2.cached_tokens, w1.prompt_tokens)
    assert warm.state.healing.healed >= 1


def test_harmony_final_answer_stops_and_splits(engines, monkeypatch):
    warm, _ = engines("gpt_oss")
    tok = warm.loaded.tokenizer
    # The model ends its final message with <|end|> instead of <|return|>, then starts a user
    # turn: the harmony stopper ends generation at the <|end|>, nothing after leaks.
    reply = ('<|channel|>analysis<|message|>Short.<|end|><|start|>assistant<|channel|>final<|message|>'
             'It is sunny.<|end|><|start|>user<|message|>more')
    script = ScriptedReplies().install(monkeypatch)
    script.queue.append(encode(tok, reply))
    j, out = job([{"role": "user", "content": "Weather?"}], max_tokens=200, session="harmony-final")
    o = warm.run(j)
    assert o.finish_reason == "stop"
    assert "<|start|>user" not in o.text and o.text.endswith("It is sunny.<|end|>")
    from mlxstack.parsing.output import split_reply

    parsed = split_reply(o.text, family="harmony")
    assert (parsed.reasoning, parsed.content, parsed.tool_calls) == ("Short.", "It is sunny.", [])
