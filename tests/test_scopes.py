"""Cache scopes: a tenant (the front door's word, from the client's key) and a request's
``cache_salt`` (vLLM's field) -- one scope never reuses, reports or times anything of another.

- the keys file (config/tenants.py): parsed, private, added to; keys compared in constant time;
- the front door: a tenant's key passes as the master key plus ``x-mlxstack-tenant``; a client's
  own ``x-mlxstack-tenant`` never reaches LiteLLM;
- the MLX server (real HTTP, embedded SmolLM2 and the tiny dense fixture): entries, sessions,
  healing, diagnoses, stored responses, shared prefills and the router's digests are per scope;
  the header counts only with the backend key; the disk tier keeps scopes across a restart.
The same through the real LiteLLM on 4000: tests/test_e2e_scopes.py.
"""
from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest

from mlxstack.cache.summary import TENANT_HEADER, message_digests, scope_of, sign_tenant, verify_tenant
from mlxstack.config.tenants import TenantKeys, TenantsError, add_tenant, parse_tenants, read_tenants
from mlxstack.prompt.session_context import SessionContext, scoped
from mlxstack.routing.front_door import FrontDoor
from mlxstack.routing.session_key import request_digests, request_scope, routing_session
from tests.conftest import LiveServer, engine_settings, http_json

MASTER = "sk-master-0123456789abcdef"
BACKEND = "sk-backend-0123456789abcdef"


# ------------------------------------------------------------------ pure
def test_scope_of_is_a_digest_of_tenant_and_salt_and_the_default_is_empty():
    assert scope_of("", "") == "" and scope_of(None, None) == ""
    ids = {scope_of("alice", ""), scope_of("bob", ""), scope_of("alice", "x"), scope_of("", "x"), scope_of("alicex", "")}
    assert len(ids) == 5 and all(s.startswith("s") and len(s) == 24 and "alice" not in s for s in ids)
    assert scope_of("alice", "x") == scope_of(" alice ", "x")      # the tenant's name, not its spacing
    assert scope_of("a", "b") != scope_of("a\u0000", "b")           # no two pairs spell one scope


def test_session_ids_and_digests_are_per_scope_and_a_default_id_cannot_name_a_scoped_one():
    a = scope_of("alice", "")
    assert scoped(SessionContext("chat-1", "body.session_id"), a).session_id == f"{a}/chat-1"
    assert scoped(SessionContext("chat-1", "body.session_id"), "").session_id == "chat-1"
    forged = scoped(SessionContext(f"{a}/chat-1", "body.session_id"), "")
    assert forged.session_id.startswith("sha1:")           # hashed: not alice's session
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert message_digests(msgs, a) != message_digests(msgs) and message_digests(msgs, a)[0][1] == message_digests(msgs)[0][1]
    assert request_digests(msgs, a) == message_digests(msgs, a)
    assert request_scope({"cache_salt": "x"}, {TENANT_HEADER.title(): "alice"}) == scope_of("alice", "x")
    assert request_scope({"extra_body": {"cache_salt": "x"}}, {}) == scope_of("", "x")
    assert routing_session({}, {}, msgs, a).session_id == f"{a}/" + routing_session({}, {}, msgs).session_id


def test_the_keys_file_is_parsed_private_and_added_to(tmp_path):
    assert parse_tenants('{"alice": "sk-aaaaaaaaaaaaaaaa", "bob": ["sk-bbbbbbbbbbbbbbbb", "sk-cccccccccccccccc"]}') == {
        "sk-aaaaaaaaaaaaaaaa": "alice", "sk-bbbbbbbbbbbbbbbb": "bob", "sk-cccccccccccccccc": "bob"}
    for bad, says in (("[]", "JSON object"), ('{"al ice": "sk-aaaaaaaaaaaaaaaa"}', "tenant name"),
                      ('{"a": "short"}', "at least 16"), ('{"a": "sk-aaaaaaaaaaaaaaaa", "b": "sk-aaaaaaaaaaaaaaaa"}',
                                                          "same key"), ("{", "not JSON")):
        with pytest.raises(TenantsError, match=says) as err:
            parse_tenants(bad)
        assert "sk-aaaaaaaaaaaaaaaa" not in str(err.value)          # a message never shows a key
    path = tmp_path / "tenants.json"
    key = add_tenant(path, "alice")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and key.startswith("sk-") and len(key) > 40
    second = add_tenant(path, "alice")
    assert read_tenants(path) == {key: "alice", second: "alice"}
    keys = TenantKeys(path)
    assert keys.tenant_of(key) == "alice" and keys.tenant_of(second) == "alice" and keys.tenant_of(MASTER) is None
    bob = add_tenant(path, "bob")                            # read again when the file changes
    assert keys.tenant_of(bob) == "bob" and len(keys) == 2
    os.chmod(path, 0o644)
    with pytest.raises(TenantsError, match="chmod 600"):
        read_tenants(path)
    with pytest.raises(TenantsError, match="does not exist"):
        TenantKeys(tmp_path / "missing.json")


# ------------------------------------------------------------------ the front door
def _door_call(door, headers, path="/v1/chat/completions"):
    seen = []

    async def app(scope, receive, send):
        seen.append(list(scope["headers"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    door.app = app
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    inbox = [{"type": "http.request", "body": body, "more_body": False}]
    out = []

    async def receive():
        return inbox.pop(0)

    async def send(m):
        out.append(m)
    asyncio.run(door({"type": "http", "method": "POST", "path": path, "headers": headers}, receive, send))
    return out[0]["status"], (seen[0] if seen else None)


def test_the_tenant_header_is_signed_with_the_backend_key():
    value = sign_tenant("alice", BACKEND)
    assert value.startswith("alice.") and verify_tenant(value, BACKEND) == "alice"
    assert verify_tenant(value, "sk-another-backend-key-0000") is None
    assert verify_tenant("alice", BACKEND) is None and verify_tenant(value.replace("alice", "bob"), BACKEND) is None
    assert verify_tenant("a.b.c." + value, BACKEND) is None


def test_the_front_door_names_the_tenant_and_drops_a_clients_own_claim(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_API_KEY", BACKEND)
    path = tmp_path / "tenants.json"
    alice = add_tenant(path, "alice")
    door = FrontDoor(None, master_key=MASTER, tenants=TenantKeys(path))
    spoof = (TENANT_HEADER.encode(), b"bob")
    status, headers = _door_call(door, [(b"authorization", f"Bearer {alice}".encode()), spoof])
    assert status == 200
    assert (b"authorization", f"Bearer {MASTER}".encode()) in headers and alice.encode() not in b"".join(v for _, v in headers)
    assert [v for k, v in headers if k == TENANT_HEADER.encode()] == [sign_tenant("alice", BACKEND).encode()]
    status, headers = _door_call(door, [(b"x-api-key", alice.encode())], path="/v1/messages")
    assert status == 200 and (b"x-api-key", MASTER.encode()) in headers
    assert (TENANT_HEADER.encode(), sign_tenant("alice", BACKEND).encode()) in headers
    # the master key is the default tenant: no header, and a client's own claim is dropped
    status, headers = _door_call(door, [(b"authorization", f"Bearer {MASTER}".encode()), spoof])
    assert status == 200 and not [v for k, v in headers if k == TENANT_HEADER.encode()]
    # on a route the front door does not check, a claim is dropped all the same
    status, headers = _door_call(door, [spoof], path="/health/liveliness")
    assert status == 200 and not [v for k, v in headers if k == TENANT_HEADER.encode()]
    assert _door_call(door, [(b"authorization", b"Bearer sk-nobody-0123456789")])[0] == 401


# ------------------------------------------------------------------ the MLX server
@pytest.fixture(scope="module")
def server(embedded_model_path, tmp_path_factory):
    s = LiveServer(engine_settings(embedded_model_path, mlx_api_key=BACKEND, log_root=str(tmp_path_factory.mktemp("logs")),
                                   disk_cache_dir=str(tmp_path_factory.mktemp("disk")), disk_cache_min_tokens=1))
    yield s
    s.close()


SYSTEM = "You are a careful assistant for a team that shares one server. " * 12


def chat(server, messages, tenant=None, salt=None, key=BACKEND, **extra):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if tenant is not None:
        headers[TENANT_HEADER] = sign_tenant(tenant, BACKEND)
    body = {"model": server.app.model_id, "messages": messages, "max_tokens": 6, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    status, reply, hdrs = http_json(server.base + "/v1/chat/completions", body, headers=headers)
    assert status == 200, reply
    return reply, hdrs


def cached(reply) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_scope_never_reuses_reports_or_diagnoses_a_prompt(server):
    ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a scope?"}]
    first, _ = chat(server, ask, tenant="alice")
    assert cached(first) == 0
    again, hdr = chat(server, ask, tenant="alice")                     # the same scope hits
    assert cached(again) >= first["usage"]["prompt_tokens"] - 2
    for tenant, salt in (("bob", None), (None, None), ("alice", "s1"), (None, "s1")):
        other, hdr = chat(server, ask, tenant=tenant, salt=salt)
        assert cached(other) == 0, (tenant, salt)
        assert "miss" in hdr.get("x-mlxstack-cache", "miss")
    # a salted request hits its own salt only
    assert cached(chat(server, ask, salt="s1")[0]) > 0 and cached(chat(server, ask, tenant="bob", salt="s1")[0]) == 0
    # a diagnosis naming alice's reply from bob's scope finds nothing to compare with
    headers = {"Authorization": f"Bearer {BACKEND}"}
    body = {"model": server.app.model_id, "instructions": SYSTEM, "input": "What is a scope?", "max_output_tokens": 4}
    status, r1, _ = http_json(server.base + "/v1/responses", body,
                              headers={**headers, TENANT_HEADER: sign_tenant("alice", BACKEND)})
    assert status == 200
    compare = {**body, "prompt_cache_options": {"comparison_response_id": r1["id"]}}
    status, own, _ = http_json(server.base + "/v1/responses", compare,
                               headers={**headers, TENANT_HEADER: sign_tenant("alice", BACKEND)})
    status2, other, _ = http_json(server.base + "/v1/responses", compare,
                                  headers={**headers, TENANT_HEADER: sign_tenant("bob", BACKEND)})
    assert status == status2 == 200
    assert own["prompt_cache_diagnostics"]["type"] == "cache_hit", own["prompt_cache_diagnostics"]
    assert other["prompt_cache_diagnostics"]["type"] == "comparison_response_not_found"
    counters = server.app.state.counters
    assert counters.get("exact_key_rejected_by_model_lcp") == 0


def test_an_unsigned_tenant_header_is_refused(server):
    ask = [{"role": "user", "content": "x"}]
    for value in ("alice", sign_tenant("alice", "sk-some-other-key-000000")):
        status, err, _ = http_json(server.base + "/v1/chat/completions", {"model": server.app.model_id, "messages": ask},
                                   headers={"Authorization": f"Bearer {BACKEND}", TENANT_HEADER: value})
        assert status == 403 and err["error"]["code"] == "tenant_not_signed", err


def test_the_tenant_header_counts_only_with_the_backend_key(embedded_model_path):
    s = LiveServer(engine_settings(embedded_model_path))            # no MLX_API_KEY: nothing proves the header
    try:
        ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who am I?"}]
        chat(s, ask, tenant="alice", key=None)
        assert cached(chat(s, ask, tenant="bob", key=None)[0]) > 0       # one tenant: the header is ignored
        assert {e.scope for e in s.app.state.kv.index.entries()} == {""}
        assert cached(chat(s, ask, salt="x", key=None)[0]) == 0          # a salt is the client's own word
    finally:
        s.close()


def test_sessions_healing_and_stored_responses_are_per_scope(server):
    st = server.app.state
    ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    a1, _ = chat(server, ask, tenant="carol", session_id="shared-name")
    b1, _ = chat(server, ask, tenant="dave", session_id="shared-name")
    sessions = {e.session_id for e in st.kv.index.entries()}
    assert {f"{scope_of('carol', '')}/shared-name", f"{scope_of('dave', '')}/shared-name"} <= sessions
    # healing: carol's reply, echoed by dave word for word, is not healed into dave's conversation
    assert a1["choices"][0]["message"]["content"] == b1["choices"][0]["message"]["content"]
    assert st.healing is not None and len({k for k, _ in st.healing.items()}) >= 2     # one entry per scope
    # stored responses: carol's id is a 404 for dave, on every route
    headers = {"Authorization": f"Bearer {BACKEND}"}
    status, resp, _ = http_json(server.base + "/v1/responses", {"model": server.app.model_id, "input": "Hi",
                                                                "max_output_tokens": 4},
                                headers={**headers, TENANT_HEADER: sign_tenant("carol", BACKEND)})
    assert status == 200
    rid = resp["id"]
    for method, path in (("GET", f"/v1/responses/{rid}"), ("GET", f"/v1/responses/{rid}/input_items"),
                         ("DELETE", f"/v1/responses/{rid}")):
        status, err, _ = http_json(server.base + path, method=method,
                                   headers={**headers, TENANT_HEADER: sign_tenant("dave", BACKEND)})
        assert status == 404 and err["error"]["code"] == "response_not_found", (method, path)
    status, err, _ = http_json(server.base + "/v1/responses", {"model": server.app.model_id, "input": "More",
                                                               "previous_response_id": rid, "max_output_tokens": 4},
                               headers={**headers, TENANT_HEADER: sign_tenant("dave", BACKEND)})
    assert status == 400 and err["error"]["code"] == "previous_response_not_found"
    status, mine, _ = http_json(server.base + f"/v1/responses/{rid}", method="GET",
                                headers={**headers, TENANT_HEADER: sign_tenant("carol", BACKEND)})
    assert status == 200 and mine["id"] == rid


def test_a_cache_salt_is_validated_on_every_front(server):
    headers = {"Authorization": f"Bearer {BACKEND}"}
    for path, body, param in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "cache_salt": 7}, "cache_salt"),
            ("/v1/responses", {"input": "x", "cache_salt": ""}, "cache_salt"),
            ("/v1/messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                              "extra_body": {"cache_salt": ["a"]}}, "extra_body.cache_salt")):
        status, err, _ = http_json(server.base + path, {"model": server.app.model_id, **body}, headers=headers)
        assert status == 400, (path, err)
        message = err["error"]["message"]
        assert "cache_salt" in message, (path, err)
        if path != "/v1/messages":
            assert err["error"]["param"] == param


def test_the_summary_lists_each_scope_under_its_own_digests(server):
    ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summarise scopes."}]
    chat(server, ask, tenant="erin")
    status, summary, _ = http_json(server.base + "/v1/cache/summary", headers={"Authorization": f"Bearer {BACKEND}"})
    assert status == 200
    prefixes = summary["prefixes"]
    mine = request_digests(ask, scope_of("erin", ""))
    assert mine[-1][0] in prefixes                          # the router finds erin's prefix in erin's scope
    assert request_digests(ask)[-1][0] not in prefixes and request_digests(ask, scope_of("frank", ""))[-1][0] not in prefixes


def test_the_disk_tier_keeps_each_entrys_scope_across_a_restart(embedded_model_path, tmp_path):
    settings = dict(mlx_api_key=BACKEND, disk_cache_dir=str(tmp_path / "disk"), disk_cache_min_tokens=1)
    ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Remember me."}]
    s = LiveServer(engine_settings(embedded_model_path, **settings))
    try:
        chat(s, ask, tenant="gina")
        s.app.state.disk.tier.flush(30)
    finally:
        s.close()
    s = LiveServer(engine_settings(embedded_model_path, **settings))
    try:
        assert {e.scope for e in s.app.state.kv.index.entries(include_disk=True)} == {scope_of("gina", "")}
        assert cached(chat(s, ask, tenant="hank")[0]) == 0
        assert cached(chat(s, ask)[0]) == 0
        warm, _ = chat(s, ask, tenant="gina")
        assert cached(warm) > 0 and warm["usage"]["prompt_tokens_details"].get("cached_tokens") == cached(warm)
    finally:
        s.close()
