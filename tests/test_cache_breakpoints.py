"""Client cache breakpoints as stored-entry boundaries (issue 43): Anthropic ``cache_control`` and
Responses ``prompt_cache_breakpoint`` make the server keep an entry -- for a hybrid model, whose
recurrent layers cannot be cut back, a snapshot -- at exactly the token where the marked block
ends, with the lifetime asked (within CACHE_TTL_MAX_SECONDS). Through the MLX server's HTTP door
on the tiny hybrid model: the next request that branches at the mark reuses exactly up to it and
answers what a cold server answers; without the mark it reuses nothing (the turn's entries lie
past the branch: hybrid_trim_miss)."""
from __future__ import annotations

import pytest

from mlxstack.cache.lcp import lcp
from mlxstack.cache.prompt_cache import POOL_KV, POOL_SNAPSHOT, PromptCache, PromptCacheConfig
from tests.conftest import LiveServer, engine_settings, http_json

SYSTEM = "You are a careful assistant. Answer briefly."
DOC = "Reference notes: " + " ".join(f"item {i} is filed under shelf {i % 7}." for i in range(40)) + "\n"
ASKS = ["Which shelf holds item 12?", "Tell me the shelf of item 30.", "Is item 5 on shelf 5?"]


@pytest.fixture(scope="module")
def servers(tiny_kind_paths):
    path = tiny_kind_paths("hybrid")
    warm = LiveServer(engine_settings(path, cache_ttl_max_seconds=86400, speculative="off"))
    cold = LiveServer(engine_settings(path, prompt_cache_max_entries_global=0, speculative="off",
                                      max_concurrent_sequences=1))
    yield warm, cold
    warm.close()
    cold.close()


def anthropic(doc_mark: dict | None, ask: str, doc: str = DOC) -> dict:
    block = {"type": "text", "text": doc, **({"cache_control": doc_mark} if doc_mark else {})}
    return {"model": "m", "max_tokens": 8, "temperature": 0, "system": SYSTEM,
            "messages": [{"role": "user", "content": [block, {"type": "text", "text": ask}]}]}


def post(server, path: str, body: dict) -> dict:
    model = http_json(server.base + "/v1/models")[1]["data"][0]["id"]
    status, reply, _ = http_json(server.base + path, {**body, "model": model}, timeout=120)
    assert status == 200, reply
    return reply


def mark_position(server, ask: str, doc: str = DOC) -> int:
    """Where the marked block ends in the prompt's tokens: the rendered prompt cut after the
    block's text, tokenised, matched token by token with the whole."""
    tok = server.app.loaded.tokenizer
    text = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": doc + ask}],
                                   tokenize=False, add_generation_prompt=True)
    whole = tok.encode(text, add_special_tokens=False)
    end = text.index(doc) + len(doc)
    return lcp(tok.encode(text[:end], add_special_tokens=False), whole)


def prompt_tokens(server) -> int:
    """The last request's prompt tokens (the server's stats row)."""
    return http_json(server.base + "/v1/cache/stats")[1]["recent"][-1]["prompt_tokens"]


def counter(server, name: str) -> int:
    return http_json(server.base + "/v1/cache/stats")[1]["correctness"].get(name, 0)


def test_a_branch_at_a_cache_control_mark_reuses_exactly_up_to_it(servers):
    warm, cold = servers
    mark = mark_position(warm, ASKS[0])
    first = post(warm, "/v1/messages", anthropic({"type": "ephemeral", "ttl": "1h"}, ASKS[0]))
    n_first = prompt_tokens(warm)
    # nothing read; stored up to the breakpoint (1h: kept an hour), the tokens after it are input
    assert first["usage"]["cache_read_input_tokens"] == 0
    assert first["usage"]["cache_creation_input_tokens"] == mark
    assert first["usage"]["input_tokens"] == n_first - mark
    assert first["usage"]["cache_creation"] == {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": mark}
    snaps = [e for e in warm.app.state.kv.index.entries(POOL_SNAPSHOT) if e.depth == mark]
    assert len(snaps) == 1 and snaps[0].ttl == 3600.0
    misses = counter(warm, "hybrid_trim_miss")

    second = post(warm, "/v1/messages", anthropic({"type": "ephemeral", "ttl": "1h"}, ASKS[1]))
    n_second = prompt_tokens(warm)
    assert second["usage"]["cache_read_input_tokens"] == mark
    assert second["usage"]["cache_creation_input_tokens"] == 0       # the breakpoint was read, not written
    assert second["usage"]["input_tokens"] == n_second - mark
    assert second["content"] == post(cold, "/v1/messages", anthropic(None, ASKS[1]))["content"]
    assert counter(warm, "hybrid_trim_miss") == misses


def test_without_the_mark_the_branch_reuses_nothing(servers):
    warm, cold = servers
    doc = DOC.replace("Reference", "Other")    # a prompt no earlier test stored
    post(warm, "/v1/messages", anthropic(None, ASKS[0], doc))
    misses = counter(warm, "hybrid_trim_miss")
    second = post(warm, "/v1/messages", anthropic(None, ASKS[2], doc))
    n_second = prompt_tokens(warm)
    # the stored turn and its snapshots (end of history, prompt[:-1]) lie past the branch
    assert second["usage"]["cache_read_input_tokens"] == 0
    assert second["usage"]["cache_creation_input_tokens"] == n_second   # no breakpoints: every stored token
    assert second["usage"]["input_tokens"] == 0
    assert counter(warm, "hybrid_trim_miss") == misses + 2   # the key lookup and the broad one after it
    assert second["content"] == post(cold, "/v1/messages", anthropic(None, ASKS[2], doc))["content"]


def test_a_responses_prompt_cache_breakpoint_with_its_ttl(servers):
    warm, cold = servers
    doc = DOC.replace("Reference", "Responses")

    def body(ask: str, mark: bool = True) -> dict:
        part = {"type": "input_text", "text": doc, **({"prompt_cache_breakpoint": {"mode": "explicit"}} if mark else {})}
        return {"instructions": SYSTEM, "max_output_tokens": 8, "temperature": 0,
                "prompt_cache_options": {"ttl": "12h"},
                "input": [{"role": "user", "content": [part, {"type": "input_text", "text": ask}]}]}

    mark = mark_position(warm, ASKS[0], doc)
    first = post(warm, "/v1/responses", body(ASKS[0]))
    n_first = prompt_tokens(warm)
    details = first["usage"]["input_tokens_details"]
    # every new token is written; 12h asked and allowed (CACHE_TTL_MAX_SECONDS 24h here)
    assert details == {"cached_tokens": 0, "cache_write_tokens": n_first,
                       "cache_write_tokens_details": {"ttl_30m_tokens": 0, "ttl_12h_tokens": n_first}}
    second = post(warm, "/v1/responses", body(ASKS[1]))
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == mark
    assert second["output"][-1]["content"] == post(cold, "/v1/responses", body(ASKS[1], mark=False))["output"][-1]["content"]
    entries = [e for e in warm.app.state.kv.index.entries(POOL_SNAPSHOT) if e.depth == mark]
    assert [e.ttl for e in entries] == [43200.0]


def test_an_entry_lives_its_own_lifetime():
    """An entry's own ttl (a client's breakpoint) replaces its pool's: kept past the pool's
    lifetime, evicted once idle past its own."""
    now = [0.0]
    cache = PromptCache(PromptCacheConfig(block_size=4, ttl_seconds=10.0), seed=b"s" * 8, clock=lambda: now[0])
    short = cache.insert(list(range(8)), list(range(8)), "a", nbytes=1, pool=POOL_KV)
    long = cache.insert(list(range(100, 108)), list(range(100, 108)), "b", nbytes=1, pool=POOL_KV, ttl=30.0)
    now[0] = 20.0
    assert cache.lookup(list(range(8)) + [9], list(range(8)) + [9]).entry is None
    assert cache.get(short.entry_id) is None
    hit = cache.lookup(list(range(100, 108)) + [9], list(range(100, 108)) + [9])
    assert hit.entry is long and hit.depth == 8
    now[0] = 51.0    # idle 31 s since that hit
    assert cache.lookup(list(range(100, 108)) + [9], list(range(100, 108)) + [9]).entry is None
    assert cache.eviction_log[-1] == (long.entry_id, "ttl")
