"""Placing sessions on backends: message digests and the cache summary (cache/summary.py), the
router's session ids (routing/session_key.py), placement decisions (routing/placement.py), and the
LiteLLM hook's filter against real MLX servers (routing/litellm_hook.py)."""
from __future__ import annotations


import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from mlxstack.cache.hashing import namespace_seed
from mlxstack.cache.prompt_cache import PromptCache, PromptCacheConfig
from mlxstack.cache.sessions import SessionTurnStore
from mlxstack.cache.summary import build_summary, message_digests, message_fingerprint
from mlxstack.routing.placement import BackendView, Placement, place, shared_chars
from mlxstack.prompt.session_context import SessionContext
from mlxstack.routing.session_key import opening_session_id, request_digests, routing_session
from tests.conftest import LiveServer, engine_settings, http_json

SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 12}


# --- message digests -------------------------------------------------------------------------------
def test_fingerprint_is_what_both_sides_see():
    assert message_fingerprint({"role": "user", "content": "hi"}) == '["user", "hi", [], null, null]'
    same = [
        ({"role": "developer", "content": "x"}, {"role": "system", "content": "x"}),
        ({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
         {"role": "user", "content": "ab"}),
        ({"role": "assistant", "content": "ok", "reasoning_content": "long thoughts"}, {"role": "assistant", "content": "ok"}),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "read", "arguments": '{"path": "a.py", "n": 1}'}}]},
         {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function", "function": {
             "name": "read", "arguments": '{"n":1,"path":"a.py"}'}}]}),
    ]
    for a, b in same:
        assert message_fingerprint(a) == message_fingerprint(b), (a, b)
    different = [
        ({"role": "user", "content": "a"}, {"role": "assistant", "content": "a"}),
        ({"role": "tool", "content": "r", "tool_call_id": "1"}, {"role": "tool", "content": "r", "tool_call_id": "2"}),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}]},
         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAB"}}]}),
    ]
    for a, b in different:
        assert message_fingerprint(a) != message_fingerprint(b), (a, b)


def test_digests_chain_message_boundaries():
    m = [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chain = message_digests(m)
    assert [len(d) for d, _ in chain] == [32, 32, 32] and len({d for d, _ in chain}) == 3
    assert [c for _, c in chain] == [len(message_fingerprint(m[0])), len(message_fingerprint(m[0])) + 30,
                                     len(message_fingerprint(m[0])) + 30 + len(message_fingerprint(m[2]))]
    assert message_digests(m[:2]) == chain[:2]                                      # a prefix's chain is a prefix
    assert message_digests([m[1]])[0][0] != chain[1][0]                             # position matters (chained)
    assert message_digests([]) == []


# --- session ids -----------------------------------------------------------------------------------
def test_explicit_ids_are_the_servers_own():
    msgs = [SYSTEM, {"role": "user", "content": "hi"}]
    assert routing_session({"session_id": "abc"}, {}, msgs) == SessionContext("abc", "body.session_id")
    assert routing_session({"extra_body": {"conversation_id": 7}}, {}, msgs) == SessionContext(
        "7", "body.extra_body.conversation_id")
    assert routing_session({}, {"X-Session-Affinity": "aff-1", "x-session-id": "s"}, msgs) == SessionContext(
        "aff-1", "header.x-session-affinity")
    assert routing_session({}, {"x-claude-code-session-id": "cc-9"}, msgs) == SessionContext(
        "cc-9", "header.x-claude-code-session-id")
    user_id = "user_ab12_account_cd34_session_5f0e8a9c-1111-2222-3333-444455556666"
    assert routing_session({"metadata": {"user_id": user_id}}, {}, msgs) == SessionContext(
        "5f0e8a9c-1111-2222-3333-444455556666", "body.metadata.user_id")


def test_implicit_id_is_stable_over_a_conversation_and_ignores_volatile_metadata():
    turn1 = [SYSTEM, {"role": "user", "content": "Fix the bug in a.py"}]
    turn2 = turn1 + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Now b.py"}]
    turn3 = turn2 + [{"role": "assistant", "content": "Done too."}, {"role": "user", "content": "Thanks"}]
    sid = routing_session({}, {}, turn2)
    assert sid.source == "message-prefix" and sid.session_id.startswith("msg:") and len(sid.session_id) == 28
    assert routing_session({}, {}, turn3) == sid
    assert sid.session_id == "msg:" + message_digests(turn2[:3])[-1][0][:24]    # the opening and its reply
    # a first turn has no reply yet: its id is its opening's (the engine stores its records under turn2's)
    assert routing_session({}, {}, turn1).session_id == "msg:" + message_digests(turn1)[-1][0][:24]
    assert routing_session({}, {}, [SYSTEM, {"role": "user", "content": "Fix the bug in c.py"}]) != \
        routing_session({}, {}, turn1)
    # two conversations that open alike part at their first reply: never one session
    other = turn1 + [{"role": "assistant", "content": "Which bug?"}, {"role": "user", "content": "Now b.py"}]
    assert routing_session({}, {}, other) != sid
    # a JSON reply the client parsed and re-serialised (JSON.stringify drops the spaces) is the same reply
    j1 = turn1 + [{"role": "assistant", "content": '{"name": "Ada", "age": 36}'}, turn2[-1]]
    j2 = turn1 + [{"role": "assistant", "content": '{"name":"Ada","age":36}'}, turn2[-1]]
    assert routing_session({}, {}, j1) == routing_session({}, {}, j2) != routing_session({}, {}, turn2)
    # reasoning the client kept or dropped is not part of the reply's digest
    kept = turn1 + [{"role": "assistant", "content": "Done.", "reasoning_content": "easy"}, turn2[-1]]
    assert routing_session({}, {}, kept) == sid
    # OpenClaw's per-message metadata block changes every turn; the canonical form does not
    block = 'Conversation info (untrusted metadata):\n```json\n{"message_id": "%s", "sender": "ann"}\n```\nhello'
    a = routing_session({}, {}, [SYSTEM, {"role": "user", "content": block % "m-1"}])
    b = routing_session({}, {}, [SYSTEM, {"role": "user", "content": block % "m-2"}])
    assert a == b
    assert opening_session_id([]) == "msg:empty"


# --- placement -------------------------------------------------------------------------------------
A, B, C = "http://a:1", "http://b:2", "http://c:3"
DIGESTS = [("d-system", 400), ("d-user", 450)]


def test_a_pinned_session_stays_while_its_backend_lives():
    views = [BackendView(A, True, load=9, prefixes={}), BackendView(B, True, load=0, prefixes={"d-system": 400})]
    assert place(A, views, DIGESTS) == Placement(A, "pinned")


def test_a_new_session_goes_to_the_deepest_prefix_unless_that_backend_is_much_busier():
    views = [BackendView(A, True, load=0), BackendView(B, True, load=2, prefixes={"d-system": 400}),
             BackendView(C, True, load=1, prefixes={"d-other": 900})]
    assert place(None, views, DIGESTS) == Placement(B, "prefix", 400)
    busy = [BackendView(A, True, load=0), BackendView(B, True, load=3, prefixes={"d-system": 400})]
    assert place(None, busy, DIGESTS) == Placement(A, "least-load", 0)
    small = [BackendView(A, True, load=1), BackendView(B, True, load=0, prefixes={"d-system": 400})]
    assert place(None, small, DIGESTS, min_shared_chars=401) == Placement(B, "least-load", 400)
    deeper = [BackendView(A, True, prefixes={"d-system": 400}), BackendView(B, True, prefixes={"d-user": 450})]
    assert place(None, deeper, DIGESTS) == Placement(B, "prefix", 450)


def test_sessions_sharing_a_system_prompt_spread_once_the_holder_is_ahead():
    """Every session of an agent shares its system prompt: the holder takes new ones until it
    has max_session_gap more sessions than the emptiest backend, which then pays the prefix once."""
    held = {"d-system": 400}
    views = lambda a_sessions, b_prefixes: [BackendView(A, True, sessions=a_sessions, prefixes=held),  # noqa: E731
                                            BackendView(B, True, sessions=0, prefixes=b_prefixes)]
    assert place(None, views(2, {}), DIGESTS) == Placement(A, "prefix", 400)
    assert place(None, views(3, {}), DIGESTS) == Placement(B, "least-load", 0)
    assert place(None, views(3, held), DIGESTS) == Placement(B, "prefix", 400)       # both hold it: the emptier
    # a deeper prefix on a holder past the gap loses to the shallower one within it
    gap = [BackendView(A, True, sessions=5, prefixes={"d-user": 450}), BackendView(B, True, sessions=2, prefixes=held)]
    assert place(None, gap, DIGESTS) == Placement(B, "prefix", 400)
    assert place(None, gap, DIGESTS, max_session_gap=3) == Placement(A, "prefix", 450)


def test_least_load_ties_go_to_fewer_sessions_then_configuration_order():
    assert place(None, [BackendView(A, True, 1, 0), BackendView(B, True, 0, 5), BackendView(C, True, 0, 2)], []) == \
        Placement(C, "least-load")
    assert place(None, [BackendView(A, True, 0, 1), BackendView(B, True, 0, 1)], []) == Placement(A, "least-load")


def test_a_dead_backend_moves_its_session_and_no_live_backend_is_none():
    views = [BackendView(A, False, prefixes={"d-user": 450}), BackendView(B, True, 1), BackendView(C, True, 0)]
    assert place(A, views, DIGESTS) == Placement(C, "least-load", 0, moved_from=A)
    assert place(B, [BackendView(A, False), BackendView(B, False)], DIGESTS) is None
    assert shared_chars(DIGESTS, {"d-user": 450, "d-system": 400}) == 450 and shared_chars(DIGESTS, {}) == 0


# --- the summary ----------------------------------------------------------------------------------
def _state():
    cache = PromptCache(PromptCacheConfig(block_size=4, max_entries=8), namespace_seed("m"))
    return SimpleNamespace(kv=SimpleNamespace(index=cache), turns=SessionTurnStore(), cache_budget=1000)


def test_summary_lists_the_prefixes_of_sessions_whose_kv_is_held():
    state = _state()
    held = [SYSTEM, {"role": "user", "content": "held"}]
    gone = [SYSTEM, {"role": "user", "content": "evicted"}]
    state.turns.update("s-held", held)
    state.turns.update("s-gone", gone)
    entry = state.kv.index.insert(list(range(10)), list(range(10)), object(), nbytes=100, session_id="s-held")
    body = build_summary(state, model_id="m", ready=True, queue_depth=2, busy=True, now=5.0)
    assert body["prefixes"] == dict(message_digests(held))          # s-gone has no entry: not listed
    assert (body["entries"], body["bytes"], body["tokens"], body["sessions"], body["budget_bytes"]) == (1, 100, 10, 1, 1000)
    assert (body["queue_depth"], body["busy"], body["running"], body["ready"], body["time"], body["block_size"]) == (
        2, True, 1, True, 5.0, 4)
    assert build_summary(state, model_id="m", ready=True, queue_depth=0, busy=True, running=5)["running"] == 5
    assert body["heads"] == [{"tokens": 10, "head": entry.block_hashes[-1].hex()[:32], "session": "s-held", "in_ram": True}]
    assert body["namespace"] == bytes(namespace_seed("m")).hex()[:32]
    json.dumps(body)                                                  # served as JSON as it is
    state.turns.update("s-held", held + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}])
    again = build_summary(state, model_id="m", ready=True, queue_depth=0, busy=False)
    assert set(again["prefixes"]) == {d for d, _ in message_digests(state.turns.get("s-held"))}
    loading = build_summary(None, model_id="loading", ready=False, queue_depth=0, busy=False, now=1.0)
    assert (loading["ready"], loading["prefixes"], loading["entries"]) == (False, {}, 0)


# --- live: the server's summary and the hook's placement -------------------------------------------
@pytest.mark.slow
def test_live_summary_holds_the_digests_the_router_computes(embedded_server):
    msgs = [SYSTEM, {"role": "user", "content": "Name one prime number."}]
    status, _, _ = http_json(embedded_server.base + "/v1/chat/completions",
                             {"messages": msgs, "max_tokens": 4, "session_id": "summary-live"})
    assert status == 200
    status, body, _ = http_json(embedded_server.base + "/v1/cache/summary")
    assert status == 200 and body["object"] == "cache.summary" and body["ready"] is True
    assert all(body["prefixes"].get(d) == c for d, c in request_digests(msgs))
    assert body["model"] == "SmolLM2-135M-Instruct" and body["entries"] >= 1 and body["bytes"] > 0


@pytest.fixture
def two_servers(tiny_dense_path, tmp_path):
    servers = [LiveServer(engine_settings(tiny_dense_path, log_root=str(tmp_path / f"logs{i}"), default_max_tokens=4))
               for i in range(2)]
    yield servers
    for s in servers:
        if not getattr(s, "closed", False):
            s.close()


def _deployments(servers):
    return [{"model_name": "tiny", "litellm_params": {"model": "hosted_vllm/tiny", "api_base": s.base + "/v1", "api_key": "none"},
             "model_info": {"id": f"dep-{i}", "mlx_backend": s.base}} for i, s in enumerate(servers)]


def test_hook_pins_sessions_places_sub_agents_on_the_prefix_holder_and_moves_off_a_dead_backend(two_servers, monkeypatch):
    monkeypatch.setenv("ROUTING", "cache_aware")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # importing litellm must not go to the network
    from mlxstack.routing.litellm_hook import MlxRoutingHook, backend_url

    hook = MlxRoutingHook()
    deps = _deployments(two_servers)
    a, b = (s.base for s in two_servers)

    def route(messages, session=None, retry=0):
        data = {"model": "tiny", "messages": messages, "metadata": {}, **({"session_id": session} if session else {})}
        asyncio.run(hook.async_pre_call_hook(None, None, data, "completion"))
        data["metadata"]["attempted_retries"] = retry
        chosen = asyncio.run(hook.async_filter_deployments("tiny", deps, messages, request_kwargs=data))
        assert len(chosen) == 1
        url = backend_url(chosen[0])
        status, _, _ = http_json(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        assert status == 200
        return url

    s1 = {"role": "system", "content": "Orchestrator rules. " * 30}
    s2 = {"role": "system", "content": "A different product entirely. " * 20}
    first = route([s1, {"role": "user", "content": "plan the work"}])
    other = route([s2, {"role": "user", "content": "unrelated"}])
    assert (first, other) == (a, b)                                   # idle tie -> fewer sessions -> order
    # three sub-agents sharing the orchestrator's system prompt join its backend, not the idlest
    subs = [route([s1, {"role": "user", "content": f"sub-task {i}"}]) for i in range(3)]
    assert subs == [a, a, a]
    assert hook.counts["prefix"] == 3 and hook.counts["least-load"] == 2
    # turns stay pinned: the first turn's success pins the id its reply gives the conversation
    opening = [s2, {"role": "user", "content": "unrelated"}]
    reply = SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="x", tool_calls=None))])
    call = {"messages": opening, "litellm_call_id": "c-2", "metadata": {}}
    hook.attempts["c-2"] = ([b], 0.0)
    pinned = hook.pin_next_turn(call, reply)
    turn2 = opening + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]
    assert pinned == routing_session({}, {}, turn2).session_id
    # one conversation under two pins (its opening's and its next turn's) counts once in placement
    assert hook.openings == {pinned: routing_session({}, {}, opening).session_id}
    assert hook._view(b, {"ready": True}, time.monotonic()).sessions == 1
    assert route(turn2) == b and hook.counts["pinned"] == 1
    assert hook.pin_next_turn({**call, "messages": turn2}, reply) is None     # not a first turn
    named = {"messages": opening, "litellm_call_id": "c-2",                   # a session header the hook saw
             "metadata": {"session_id": "translate-1", "mlxstack_session_source": "header:x-session-affinity"}}
    assert hook.pin_next_turn(named, reply) is None and len(hook.openings) == 1
    # a client that echoes its first reply otherwise than it came is still placed by its opening's pin
    otherwise = opening + [{"role": "assistant", "content": "."}, {"role": "user", "content": "more"}]
    assert route(otherwise) == b and hook.counts["pinned"] == 2
    # backend b dies: its session moves to a on the next turn and stays there
    two_servers[1].close()
    two_servers[1].closed = True
    assert route(turn2 + [{"role": "assistant", "content": "y"}, {"role": "user", "content": "again"}], retry=1) == a
    assert hook.counts["moved"] == 1
    assert route(turn2 + [{"role": "assistant", "content": "y"}, {"role": "user", "content": "again"},
                          {"role": "assistant", "content": "z"}, {"role": "user", "content": "last"}]) == a
    assert hook.counts["moved"] == 1 and hook.counts["pinned"] == 3
