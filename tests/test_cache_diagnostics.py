"""Cache diagnoses: fingerprints, their comparison, and each front's words for them (pure parts).

The end-to-end cases (the SDKs through LiteLLM) are in tests/test_e2e_cache_diagnostics.py.
"""
from __future__ import annotations

import base64
import dataclasses
import gc
import json
import sys
import tracemalloc

import pytest

from mlxstack.server.common.cache_diagnostics import anthropic_diagnostics, anthropic_request, openai_diagnostics
from mlxstack.server.http.errors import APIError
from mlxstack.server.openai.responses_to_chat import backend_response_id, prompt_cache_options
from mlxstack.cache.diagnosis import (BLOCK, Diagnosis, FingerprintStore, common_prefix, describe, diagnose,
                                      fingerprint, with_tokens)
from mlxstack.prompt.session_context import extract_session_context
import numpy as np

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
    blob = json.dumps([str(getattr(f, field.name)) for field in dataclasses.fields(f)])
    assert "terse" not in blob and "fruit" not in blob
    assert (f.prompt_tokens, f.tokens, len(f.blocks), f.system_count, len(f.messages)) == (80, 90, 90 // BLOCK, 1, 2)


def deep_sizeof(obj, seen=None) -> int:
    """Bytes an object holds, following containers, instance dicts and slots; each object once
    (numpy arrays: the header, and the buffer of a view)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    n = sys.getsizeof(obj)
    if isinstance(obj, np.ndarray):
        return n + (obj.nbytes if obj.base is not None else 0) + (deep_sizeof(obj.base, seen) if obj.base is not None else 0)
    if isinstance(obj, dict):
        n += sum(deep_sizeof(k, seen) + deep_sizeof(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        n += sum(deep_sizeof(x, seen) for x in obj)
    if hasattr(obj, "__dict__"):
        n += deep_sizeof(vars(obj), seen)
    for name in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, name):
            n += deep_sizeof(getattr(obj, name), seen)
    return n


def long_session(n_messages=400, n_tokens=100_000, salt=0):
    """A 100k-token, 400-message conversation's fingerprint (prompt, then a 1,000-token reply)."""
    msgs = [{"role": "system" if i == 0 else ("user" if i % 2 else "assistant"),
             "content": f"message {i} of session {salt}: " + "x" * (50 + (37 * i) % 350)} for i in range(n_messages)]
    tokens = (np.arange(n_tokens, dtype=np.int64) * 7 + salt) % 50_000
    return with_tokens(fingerprint(model="m", messages=msgs, tools=TOOLS, tokens=tokens[:-1000]), tokens)


def test_a_fingerprint_is_charged_what_it_holds():
    """100k tokens, 400 messages: the charge is within 10% of the bytes measured two ways (a deep
    sizeof that follows containers, and what tracemalloc sees allocated and kept); the old
    estimate charged 130 KB for 724 KB held, as hex strings and tuples of tuples."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    f = long_session()
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    measured = deep_sizeof(f)
    assert abs(f.nbytes - measured) <= 0.1 * measured and abs(f.nbytes - traced) <= 0.1 * traced
    assert measured < 100_000        # 8 bytes a block of 16 tokens, 64 a message, ~1 KB beside


@pytest.mark.parametrize("n_messages, n_tokens, limit", [(100, 20_000, 2_000_000), (3, 100, 300_000)])
def test_the_store_holds_at_most_its_limit_each_fingerprint_once(n_messages, n_tokens, limit):
    """N fingerprints, each under a session key and a reply id, into a store with a byte limit:
    what it holds, measured (tracemalloc: fingerprints, keys and the store's tables), stays within
    the limit; a fingerprint is one object under both keys, charged once."""
    fps = [long_session(n_messages, n_tokens, salt=k) for k in range(400)]
    keys = [[f"session:{k:032x}", f"id:msg_{k:024x}"] for k in range(400)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    store = FingerprintStore(10_000, limit)
    for k in range(400):
        store.put(keys[k], fps[k])
    fps = keys = None          # the store's references only
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert held <= limit and store.held <= limit and len(store) > 10
    newest = store.get(f"session:{399:032x}")
    assert newest is store.get(f"id:msg_{399:024x}") and newest is not None
    assert store.get(f"session:{0:032x}") is None and store.get(f"id:msg_{0:024x}") is None   # evicted together


def test_the_store_forgets_what_a_key_named_before():
    store = FingerprintStore(10, 10**6)
    a, b = previous(), fp([SYSTEM, USER], PROMPT)
    store.put(["session:s", "id:1"], a)
    one = store.held
    store.put(["session:s", "id:2"], b)              # the session's next request
    assert store.get("session:s") is b and store.get("id:1") is a and store.get("id:2") is b and len(store) == 2
    store.put(["id:1"], b)                            # a's last key: a leaves; b is held once, three keys
    assert len(store) == 1 and store.get("id:1") is b is store.get("session:s") and store.held < 2 * one
    tiny = FingerprintStore(10, 2_000)
    assert tiny.put(["session:s"], a) and not tiny.put(["session:s"], long_session(3, 5_000))
    assert tiny.get("session:s") is None and len(tiny) == 0    # an older request is no comparison


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
