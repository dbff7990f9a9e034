"""Cache diagnoses: fingerprints, their comparison, and each front's words for them (pure parts).

The end-to-end cases (the SDKs through LiteLLM) are in tests/test_e2e_cache_diagnostics.py.
"""
from __future__ import annotations

import base64
import json

import pytest

from mlxstack.server.common.cache_diagnostics import anthropic_diagnostics, anthropic_request, openai_diagnostics
from mlxstack.server.http.errors import APIError
from mlxstack.server.openai.responses_to_chat import backend_response_id, prompt_cache_options
from mlxstack.cache.diagnosis import (BLOCK, Diagnosis, common_prefix, describe, diagnose, fingerprint,
                                      with_tokens)
from mlxstack.prompt.session_context import extract_session_context

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Name a fruit."}
REPLY = {"role": "assistant", "content": "Apple."}
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
PROMPT = list(range(100, 180))     # 80 prompt tokens
ANSWER = list(range(500, 510))     # 10 reply tokens


def fp(messages, tokens, **kw):
    return fingerprint(model=kw.pop("model", "m"), messages=messages, tools=kw.pop("tools", TOOLS), tokens=tokens, **kw)


def previous():
    return with_tokens(fp([SYSTEM, USER], PROMPT), PROMPT + ANSWER)


def test_fingerprint_holds_hashes_and_counts_never_text():
    f = previous()
    blob = json.dumps([str(v) for v in vars(f).values()])
    assert "terse" not in blob and "fruit" not in blob
    assert (f.prompt_tokens, f.tokens, len(f.blocks), f.system_count, len(f.messages)) == (80, 90, 90 // BLOCK, 1, 2)


def test_common_prefix_is_exact_when_all_match_else_whole_blocks():
    prev = previous()
    assert common_prefix(prev, PROMPT + ANSWER + [1, 2, 3]) == 90           # an append: all of it
    changed = PROMPT[:37] + [9] + PROMPT[38:] + ANSWER
    assert common_prefix(prev, changed) == 32                                 # block 2 (tokens 32-47) differs
    assert common_prefix(prev, PROMPT) == 80                                  # shorter: 5 whole blocks


def test_append_is_no_miss():
    cur_tokens = PROMPT + ANSWER + list(range(900, 920))
    cur = fp([SYSTEM, USER, REPLY, {"role": "user", "content": "Another."}], cur_tokens)
    d = diagnose(previous(), cur, cur_tokens, cached=90, cache_on=True)
    assert d == Diagnosis("hit", common=90, previous=90)
    assert (anthropic_diagnostics(d), openai_diagnostics(d), describe(d)) == (None, {"type": "cache_hit"}, "hit")


@pytest.mark.parametrize("change, where, message, field", [
    ({"model": "other"}, "model", None, None),
    ({"system": "You are verbose."}, "system", None, None),
    ({"tools": []}, "tools", None, None),
    ({"user": "Name a vegetable."}, "messages", 1, "content"),
])
def test_first_divergence_and_the_tokens_it_cost(change, where, message, field):
    system = {"role": "system", "content": change.get("system", SYSTEM["content"])}
    user = {"role": "user", "content": change.get("user", USER["content"])}
    # the change lands in the prompt's third block: 32 tokens still shared
    tokens = PROMPT[:40] + [7] * 40 + ANSWER + [1, 2]
    cur = fp([system, user, REPLY, {"role": "user", "content": "More."}], tokens, model=change.get("model", "m"),
             tools=change.get("tools", TOOLS))
    d = diagnose(previous(), cur, tokens, cached=32, cache_on=True)
    assert d == Diagnosis("miss", where, message, field, missed=90 - 32, common=32, previous=90)
    wire = {"model": "model_changed", "system": "system_changed", "tools": "tools_changed",
            "messages": "messages_changed"}[where]
    assert anthropic_diagnostics(d) == {"cache_miss_reason": {"type": wire, "cache_missed_input_tokens": 58}}
    openai_reason = {"model": "model_changed", "tools": "tools_changed"}.get(where, "input_changed")
    assert openai_diagnostics(d) == {"type": "cache_miss", "reason": openai_reason, "cache_missed_tokens": 58,
                                     "comparison_reusable_tokens": 90}


def test_a_volatile_field_the_canonical_key_ignores_is_named_as_such():
    old = {"role": "user", "content": "Name a fruit. [ts 10:01]"}
    new = {"role": "user", "content": "Name a fruit. [ts 10:02]"}
    canon = {"role": "user", "content": "Name a fruit. [ts]"}
    prev = fingerprint(model="m", messages=[SYSTEM, old], canonical=[SYSTEM, canon], tokens=PROMPT)
    tokens = PROMPT[:70] + [3] * 10
    cur = fingerprint(model="m", messages=[SYSTEM, new], canonical=[SYSTEM, canon], tokens=tokens)
    d = diagnose(prev, cur, tokens, cached=64, cache_on=True)
    assert (d.status, d.where, d.message, d.field, d.missed) == ("miss", "messages", 1, "content (volatile)", 79 - 64)
    assert describe(d) == "miss messages[1].content (volatile) missed=15 at=64"


def test_a_setting_that_differs_while_the_messages_match():
    tokens = PROMPT[:48] + [5] * 32
    cur = fp([SYSTEM, USER], tokens, settings={"reasoning": [True, "high", None]})
    d = diagnose(previous(), cur, tokens, cached=48, cache_on=True)
    assert (d.where, d.missed) == ("settings.reasoning", 79 - 48)
    # Anthropic names model / system / tools / messages only: a changed setting is "unavailable"
    assert anthropic_diagnostics(d) == {"cache_miss_reason": {"type": "unavailable"}}
    assert openai_diagnostics(d)["reason"] == "reasoning_effort_changed"


def test_a_divergence_the_server_still_served_is_not_a_miss_of_those_tokens():
    tokens = PROMPT[:40] + [7] * 40 + ANSWER
    cur = fp([{"role": "system", "content": "changed"}, USER], tokens)
    # another entry held the new prompt: all 89 reusable tokens were reused
    assert diagnose(previous(), cur, tokens, cached=89, cache_on=True).status == "hit"
    # with the cache off, the comparison alone decides
    assert diagnose(previous(), cur, tokens, cached=0, cache_on=False).missed == 89 - 32


def test_an_unchanged_prompt_the_server_did_not_reuse_is_unavailable():
    tokens = PROMPT + ANSWER + [1, 2]
    cur = fp([SYSTEM, USER, REPLY, USER], tokens)
    d = diagnose(previous(), cur, tokens, cached=0, cache_on=True)     # the entry was evicted
    assert d == Diagnosis("unavailable", common=90, previous=90)
    assert anthropic_diagnostics(d) == {"cache_miss_reason": {"type": "unavailable"}}
    assert openai_diagnostics(d) == {"type": "unavailable"}


def test_prewarm_then_the_same_prompt_is_a_full_hit():
    warm = fp([SYSTEM, USER], PROMPT)            # prewarm stores the prompt only
    d = diagnose(warm, fp([SYSTEM, USER], PROMPT), PROMPT, cached=79, cache_on=True)
    assert d == Diagnosis("hit", common=80, previous=79)


def test_unknown_ids_and_first_turns():
    d = diagnose(None, previous(), PROMPT, cached=0, cache_on=True)
    assert anthropic_diagnostics(d) == {"cache_miss_reason": {"type": "previous_message_not_found"}}
    assert openai_diagnostics(d) == {"type": "comparison_response_not_found"}
    first = Diagnosis("none")
    assert (anthropic_diagnostics(first), openai_diagnostics(first), describe(None)) == (None, None, "first")


def test_the_request_fields_that_ask():
    assert anthropic_request({}, {}) == (False, None)
    assert anthropic_request({"diagnostics": {"previous_message_id": None}}, {}) == (True, None)
    assert anthropic_request({"diagnostics": {"previous_message_id": "msg_1"}}, {}) == (True, "msg_1")
    with pytest.raises(APIError, match="previous_message_id"):
        anthropic_request({"diagnostics": {"previous_message_id": 7}}, {})
    assert prompt_cache_options({}) is None
    assert prompt_cache_options({"prompt_cache_options": {"comparison_response_id": "resp_1", "prewarm": True}}) == {
        "mode": "implicit", "ttl": "30m", "comparison_response_id": "resp_1", "prewarm": True, "diagnose": True,
        "compare_to": "resp_1"}
    # an id LiteLLM's Responses route handed out carries ours inside
    managed = "resp_" + base64.b64encode(b"litellm:custom_llm_provider:hosted_vllm;model_id:abc;response_id:resp_9").decode()
    assert backend_response_id(managed) == "resp_9"
    assert backend_response_id("resp_plain") == "resp_plain"
    assert prompt_cache_options({"prompt_cache_options": {"ttl": "12h"}})["diagnose"] is False
    with pytest.raises(APIError, match="ttl"):
        prompt_cache_options({"prompt_cache_options": {"ttl": "1d"}})


def test_prompt_cache_key_is_a_session_key_on_every_api():
    ctx = extract_session_context({"prompt_cache_key": "codex-7"}, {}, ())
    assert (ctx.session_id, ctx.source) == ("codex-7", "body.prompt_cache_key")
    # an explicit session id still wins
    assert extract_session_context({"session_id": "s", "prompt_cache_key": "k"}, {}, ()).session_id == "s"
