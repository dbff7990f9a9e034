"""Cache diagnoses and cache usage through the real stack (LiteLLM on the proxy port -> MLX server
on the embedded model), parsed by the official SDKs' own types: Anthropic ``diagnostics`` (beta
cache-diagnosis-2026-04-07) and ``usage.cache_creation``; Responses ``prompt_cache_diagnostics``,
prewarm and ``cache_write_tokens``; chat completions ``prompt_cache_key`` as the session."""
from __future__ import annotations

import pytest

from tests.test_e2e_stack import KEY, MODEL, Stack

pytestmark = pytest.mark.e2e

BETA = {"anthropic-beta": "cache-diagnosis-2026-04-07"}
SYSTEM = "You are a terse assistant. Answer in a few words. " * 4
TOOLS = [{"name": "read_file", "description": "Read a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_path):
    s = Stack(tmp_path_factory.mktemp("diag-stack"), str(embedded_model_path.parent))
    yield s
    s.stop()


def cache_header(headers) -> str:
    """x-mlxstack-cache as the client sees it: LiteLLM's own OpenAI routes forward a backend's
    headers prefixed ``llm_provider-``; the Anthropic pass-through forwards them as they are."""
    return headers.get("x-mlxstack-cache") or headers.get("llm_provider-x-mlxstack-cache") or \
        "missing: " + ",".join(sorted(headers.keys()))


def _total(u) -> int:
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_anthropic_diagnostics_through_4000(stack):
    from anthropic import Anthropic
    from anthropic.types import Message, RawMessageStartEvent

    client = Anthropic(base_url=stack.base, api_key=KEY)

    def ask(messages, previous, system=SYSTEM, tools=TOOLS):
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=6, system=system, tools=tools, messages=messages,
            diagnostics={"previous_message_id": previous}, extra_headers={**BETA, "x-claude-code-session-id": "diag-1"})
        m = raw.parse()
        assert isinstance(m, Message)
        return m, raw.headers

    def left(m) -> int:
        """Tokens a reply leaves for the next turn: its prompt and its reply (a stop token is not kept)."""
        return _total(m.usage) + m.usage.output_tokens - (m.stop_reason != "max_tokens")

    turn1 = [{"role": "user", "content": "Name a fruit."}]
    a, headers = ask(turn1, None)                      # opting in on the first turn: nothing to compare
    assert a.diagnostics is None
    assert a.usage.cache_creation_input_tokens == _total(a.usage) - a.usage.cache_read_input_tokens
    assert a.usage.cache_creation.ephemeral_5m_input_tokens == a.usage.cache_creation_input_tokens
    assert a.usage.cache_creation.ephemeral_1h_input_tokens == 0 and a.usage.input_tokens == 0
    assert headers["x-mlxstack-cache"].startswith("tier=")
    reply = a.content[0].text

    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Another one."}]
    b, headers = ask(turn2, a.id)                      # an append: no miss
    assert b.diagnostics is None
    assert b.usage.cache_read_input_tokens >= left(a) - 1
    assert headers["x-mlxstack-cache"].endswith("; hit")

    earlier = [{"role": "user", "content": "Name a vegetable."}, *turn2[1:]]     # an earlier message changed
    e, headers = ask(earlier, b.id)
    assert e.diagnostics.cache_miss_reason.type == "messages_changed"
    assert 0 < e.diagnostics.cache_miss_reason.cache_missed_input_tokens < left(b)
    # our own explanation names the message (chat index: the system prompt is message 0) and field
    assert "; miss messages[1].content missed=" in headers["x-mlxstack-cache"]

    c, _ = ask(turn2, b.id, system="You are a verbose assistant. " * 4)      # system changed
    assert c.diagnostics.cache_miss_reason.type == "system_changed"
    # it differs inside the first 16-token block: nothing shared but what the server reused
    reusable = min(left(b), _total(c.usage) - 1)
    assert c.diagnostics.cache_miss_reason.cache_missed_input_tokens == reusable - c.usage.cache_read_input_tokens

    d, _ = ask(turn2, b.id, tools=[{**TOOLS[0], "description": "Read one file"}])   # tools changed
    assert d.diagnostics.cache_miss_reason.type == "tools_changed"
    assert 0 < d.diagnostics.cache_miss_reason.cache_missed_input_tokens < left(b)

    f, _ = ask(turn2, "msg_unknown")
    assert f.diagnostics.cache_miss_reason.type == "previous_message_not_found"

    # a stream carries the diagnosis and the input side of usage on message_start
    events = list(client.messages.create(model=MODEL, max_tokens=6, system=SYSTEM, tools=TOOLS, messages=earlier,
                                         diagnostics={"previous_message_id": "msg_unknown"}, extra_headers=BETA,
                                         stream=True))
    start = events[0]
    assert isinstance(start, RawMessageStartEvent)
    assert start.message.diagnostics.cache_miss_reason.type == "previous_message_not_found"
    assert _total(start.message.usage) == _total(e.usage)
    assert start.message.usage.cache_read_input_tokens == _total(e.usage) - 1   # the same prompt again
    assert start.message.usage.cache_creation_input_tokens == 1


def test_responses_diagnostics_prewarm_and_cache_write_through_4000(stack):
    from openai import OpenAI
    from openai.types.beta import BetaResponseUsage

    # All through LiteLLM (4000), the comparison by id too: the id LiteLLM hands out (encrypted
    # around its managed id) is turned back into ours by the front door (LESSONS 71)
    client = OpenAI(base_url=stack.base + "/v1", api_key=KEY)
    instructions = "You answer in one short sentence. " * 6
    inp = [{"role": "user", "content": "Name a colour."}]

    def create(via=client, **kw):
        raw = via.responses.with_raw_response.create(model=MODEL, instructions=instructions, input=inp,
                                                        max_output_tokens=8, **kw)
        return raw.parse(), raw.headers

    warm, headers = create(extra_body={"prompt_cache_options": {"prewarm": True, "comparison_response_id": None}})
    w = warm.model_dump()
    assert (w["status"], w["output"], w["usage"]["output_tokens"]) == ("completed", [], 0)
    usage = BetaResponseUsage.model_validate(w["usage"])     # the SDK's usage type: cache_write_tokens required
    assert usage.input_tokens_details.cache_write_tokens == usage.input_tokens - usage.input_tokens_details.cached_tokens
    assert w["prompt_cache_diagnostics"] is None          # asked with no response to compare: nothing to say
    gone, _ = create(extra_body={"prompt_cache_options": {"comparison_response_id": "resp_unknown"}})
    assert gone.model_dump()["prompt_cache_diagnostics"] == {"type": "comparison_response_not_found"}
    assert cache_header(headers).startswith("tier=")

    warm, _ = create(extra_body={"prompt_cache_options": {"prewarm": True}})
    assert warm.id.startswith("resp_") and stack.recent()[-1]["request_id"] not in warm.id   # LiteLLM's id, not ours
    full, _ = create(extra_body={"prompt_cache_options": {"comparison_response_id": warm.id}})
    f = full.model_dump()
    assert f["prompt_cache_diagnostics"] == {"type": "cache_hit"}           # prewarm then a full hit
    assert f["usage"]["input_tokens_details"]["cached_tokens"] == f["usage"]["input_tokens"] - 1
    assert f["usage"]["input_tokens_details"]["cache_write_tokens"] == 1
    assert f["output"] and f["usage"]["output_tokens"] > 0

    changed, _ = create(extra_body={"prompt_cache_options": {"comparison_response_id": full.id}},
                        tools=[{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}])
    diag = changed.model_dump()["prompt_cache_diagnostics"]
    assert (diag["type"], diag["reason"]) == ("cache_miss", "tools_changed")
    assert 0 < diag["cache_missed_tokens"] <= diag["comparison_reusable_tokens"]


def test_chat_completions_prompt_cache_key_is_the_session_and_usage_counts_writes(stack):
    from openai import OpenAI

    client = OpenAI(base_url=stack.base + "/v1", api_key=KEY)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a number."}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=6,
                                                           prompt_cache_key="codex-key-43")
    first = raw.parse()
    assert stack.recent()[-1]["session"] == "codex-key-43"
    assert cache_header(raw.headers).startswith("tier=")
    details = first.usage.prompt_tokens_details
    assert details.cached_tokens + getattr(details, "cache_write_tokens", None) == first.usage.prompt_tokens
