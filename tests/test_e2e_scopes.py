"""Cache scopes through port 4000: the real LiteLLM with TENANT_KEYS_FILE, the real MLX server
behind it, the official SDKs. Tenant B sending tenant A's prompt reuses nothing (chat, Responses,
Messages); A's own repeat hits; the master key is the default tenant and cannot claim another's
scope with a header of its own; a ``cache_salt`` reaches the server through LiteLLM.
"""
from __future__ import annotations

import pytest

from mlxstack.config.tenants import add_tenant
from tests.test_e2e_stack import KEY, MODEL, Stack

pytestmark = pytest.mark.e2e
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

SYSTEM = "You are the shared assistant of a small team; every answer is one short line. " * 20


@pytest.fixture(scope="module")
def tenants(tmp_path_factory, embedded_model_path):
    tmp = tmp_path_factory.mktemp("scopes")
    path = tmp / "tenants.json"
    keys = {name: add_tenant(path, name) for name in ("alice", "bob")}
    stack = Stack(tmp, str(embedded_model_path.parent), TENANT_KEYS_FILE=str(path),
                  MLX_API_KEY="sk-backend-" + "0123456789abcdef" * 2)
    stack.keys_file = path
    yield stack, keys
    stack.stop()


def client(stack, key):
    return openai.OpenAI(base_url=stack.base + "/v1", api_key=key, max_retries=0, timeout=300)


def ask(oai, text, **extra):
    r = oai.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": text}], **extra)
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def test_a_tenant_never_reuses_another_tenants_prompt_through_4000(tenants):
    stack, keys = tenants
    alice, bob = client(stack, keys["alice"]), client(stack, keys["bob"])
    prompt, cached = ask(alice, "Where is the build log?")
    assert cached == 0 and prompt > 300
    assert ask(alice, "Where is the build log?")[1] >= prompt - 2          # her own repeat hits
    assert ask(bob, "Where is the build log?")[1] == 0                      # another tenant: cold
    assert ask(bob, "Where is the build log?")[1] >= prompt - 2             # ... and then his own hit
    master = client(stack, KEY)
    assert ask(master, "Where is the build log?", extra_headers={"x-mlxstack-tenant": "alice"})[1] == 0
    # a claim slipped into the body for LiteLLM to forward (it does) is not signed: 403, never alice's
    with pytest.raises(openai.PermissionDeniedError) as err:
        ask(master, "Where is the build log?", extra_body={"extra_headers": {"x-mlxstack-tenant": "alice"}})
    assert "tenant_not_signed" in str(err.value)
    rows = stack.recent()          # the last request served: the header-spoofing master key's, cold
    assert rows[-1]["cached_tokens"] == 0 and rows[-1]["prefilled_tokens"] == prompt


def test_a_cache_salt_reaches_the_server_through_litellm(tenants):
    stack, keys = tenants
    alice = client(stack, keys["alice"])
    prompt, _ = ask(alice, "Which branch is stable?")
    assert ask(alice, "Which branch is stable?", extra_body={"cache_salt": "review-42"})[1] == 0
    assert ask(alice, "Which branch is stable?", extra_body={"cache_salt": "review-42"})[1] >= prompt - 2
    bad = alice.with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        ask(bad, "x", extra_body={"cache_salt": 42})
    assert "cache_salt" in str(err.value)


def test_responses_and_messages_are_scoped_by_tenant_too(tenants):
    stack, keys = tenants
    alice, bob = client(stack, keys["alice"]), client(stack, keys["bob"])
    system = "Responses, not chat. " + SYSTEM          # a prompt no earlier test sent
    r1 = alice.responses.create(model=MODEL, instructions=system, input="Is the CI green?", max_output_tokens=4)
    assert r1.usage.input_tokens_details.cached_tokens == 0
    assert bob.responses.create(model=MODEL, instructions=system, input="Is the CI green?",
                                max_output_tokens=4).usage.input_tokens_details.cached_tokens == 0
    assert alice.responses.create(model=MODEL, instructions=system, input="Is the CI green?",
                                  max_output_tokens=4).usage.input_tokens_details.cached_tokens > 0
    # alice's stored response is hers: bob cannot retrieve it
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(r1.id)
    assert alice.responses.retrieve(r1.id).output_text == r1.output_text

    def messages(key):
        c = anthropic.Anthropic(base_url=stack.base, api_key=key, max_retries=0, timeout=300)
        return c.messages.create(model=MODEL, system="Messages, not chat. " + SYSTEM, max_tokens=4,
                                 messages=[{"role": "user", "content": "Who owns the release?"}]).usage

    first = messages(keys["alice"])
    assert first.cache_read_input_tokens == 0
    assert messages(keys["bob"]).cache_read_input_tokens == 0                 # x-api-key: bob's scope
    assert messages(keys["alice"]).cache_read_input_tokens > 0


def test_a_wrong_key_is_refused_and_the_keys_file_is_read_again_when_it_changes(tenants):
    stack, keys = tenants
    with pytest.raises(openai.AuthenticationError):
        ask(client(stack, "sk-not-a-tenant-0123456789"), "hi")
    carol = add_tenant(stack.keys_file, "carol")                              # no restart
    assert ask(client(stack, carol), "Where is the build log?")[1] == 0
