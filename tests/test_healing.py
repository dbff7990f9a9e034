"""Healing store: unit behaviour, and on the thinking-style fixture a stripped assistant turn
becomes a cache hit with parity preserved."""
from __future__ import annotations

import json

from mlxstack.prompt.healing import HealingStore, history_digest
from tests.conftest import build_engine, engine_settings
from tests.test_engine import SYSTEM, job

HISTORY = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]


def test_heals_stripped_reply_in_its_own_conversation_only():
    store = HealingStore()
    store.remember(history_digest(HISTORY), "Answer.", [], "<think>\nwhy\n</think>\n\nAnswer.")
    healed = store.heal(HISTORY + [{"role": "assistant", "content": "Answer."}])
    assert healed[-1]["content"] == "<think>\nwhy\n</think>\n\nAnswer."
    other = [{"role": "system", "content": "sys"}, {"role": "user", "content": "different"}]
    assert store.heal(other + [{"role": "assistant", "content": "Answer."}])[-1]["content"] == "Answer."


def test_tool_call_arguments_match_on_parsed_json_not_bytes():
    store = HealingStore()
    raw = '<tool_call>\n{"name":"read","arguments":{"path":"a","n":1}}\n</tool_call>'
    store.remember(history_digest(HISTORY), "", [{"function": {"name": "read", "arguments": '{"path":"a","n":1}'}}], raw)
    echoed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "read", "arguments": json.dumps({"n": 1, "path": "a"})}}]}
    healed = store.heal(HISTORY + [echoed])[-1]
    assert healed["content"] == raw and "tool_calls" not in healed
    different_args = {**echoed, "tool_calls": [{"function": {"name": "read", "arguments": '{"path":"b"}'}}]}
    assert store.heal(HISTORY + [different_args])[-1] == different_args


def test_lru_capacity():
    store = HealingStore(max_entries=2)
    for i in range(3):
        store.remember("h", f"c{i}", [], f"raw{i}")
    assert len(store) == 2
    assert store.lookup("h", {"content": "c0"}) is None and store.lookup("h", {"content": "c2"}) == "raw2"


def _two_turns(engine, session):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Think about caches."}]
    j1, _ = job(list(messages), thinking=True, max_tokens=12, session=session)
    o1 = engine.run(j1)
    # All output was reasoning (the prompt opened <think>); the client strips it: content "".
    messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": "Now answer briefly."}]
    j2, _ = job(messages, thinking=True, max_tokens=12, session=session)
    return o1, engine.run(j2)


def test_healing_turns_assistant_miss_into_hit_with_parity(tiny_dense_path):
    healed_engine = build_engine(engine_settings(tiny_dense_path))
    plain_engine = build_engine(engine_settings(tiny_dense_path, healing_store=False))
    cold_engine = build_engine(engine_settings(tiny_dense_path, prompt_cache_max_entries_global=0))
    o1, o2 = _two_turns(healed_engine, "heal")
    p1, p2 = _two_turns(plain_engine, "plain")
    c1, c2 = _two_turns(cold_engine, "cold")
    assert o1.thinking_started and o1.text and not o1.text.startswith("<think>")
    assert healed_engine.state.healing.healed == 1
    # Without healing the turn reuses only up to the assistant turn; with healing, the whole reply too.
    assert o2.cached_tokens >= p2.cached_tokens + o1.completion_tokens - 1
    assert o2.cached_tokens > 0.85 * o2.prompt_tokens
    # Parity: healed + cached equals healed + cold (the model input is the healed one in both).
    assert o2.raw_text == c2.raw_text
