"""Recorded-shape replays through LiteLLM (port "4000") on the real stack: PI, OpenClaw and
Claude Code request bodies (tests/fixtures/agent_shapes.py) must get well-formed answers and
keep the KV cache warm from one turn to the next.

One stack (MLX server on the embedded SmolLM2 + real LiteLLM) for the whole module; replies
are kept to a few tokens (2-core CPU).
"""
from __future__ import annotations

import json
import urllib.request

import pytest

from tests.fixtures import agent_shapes as shapes
from tests.test_e2e_stack import KEY, MODEL, Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_path):
    s = Stack(tmp_path_factory.mktemp("shapes"), str(embedded_model_path.parent))
    yield s
    s.stop()


def stream_chat(stack: Stack, body: dict, headers: dict | None = None) -> dict:
    """POST a streaming chat request; fold the SSE chunks into one message plus usage."""
    req = urllib.request.Request(stack.base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                                          **(headers or {})})
    content, reasoning, finish, usage, frames = [], [], None, None, 0
    with urllib.request.urlopen(req, timeout=180) as resp:
        assert resp.status == 200
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            frames += 1
            assert chunk["object"] == "chat.completion.chunk", chunk
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                reasoning.append(delta.get("reasoning_content") or "")
                finish = choice.get("finish_reason") or finish
    return {"content": "".join(content), "reasoning": "".join(reasoning), "finish_reason": finish,
            "usage": usage, "frames": frames}


def last_row(stack: Stack, session_prefix: str) -> dict:
    rows = [r for r in stack.recent() if r["session"].startswith(session_prefix[:16])]
    assert rows, (session_prefix, stack.recent()[-3:])
    return rows[-1]


# ---------------------------------------------------------------------------------------------- PI


@pytest.mark.parametrize("echo_reasoning", [False, True], ids=["content-only", "reasoning_content"])
def test_pi_tool_loop_warm_turns(stack, echo_reasoning):
    sid = f"pi-{'rc' if echo_reasoning else 'plain'}"
    # A resumed session: the model already called `read` and got the file back.
    messages = [
        shapes.pi_user("What does README.md say?"),
        shapes.pi_assistant(None, reasoning="I should read the file first." if echo_reasoning else None,
                            tool_calls=[("call_pi_1", "read", {"path": "README.md"})]),
        shapes.pi_tool_result("call_pi_1", "# mlxstack\nA local MLX server behind LiteLLM."),
    ]
    previous_prompt = 0
    for turn, follow_up in enumerate(("Summarise it in five words.", "Now in three.", "")):
        out = stream_chat(stack, shapes.pi_body(MODEL, messages, session_id=sid, reasoning_effort="high"))
        usage = out["usage"]
        assert out["frames"] >= 2 and out["finish_reason"] in ("stop", "length", "tool_calls"), out
        assert usage["prompt_tokens"] > previous_prompt and usage["completion_tokens"] > 0
        row = last_row(stack, sid)
        assert row["session"].startswith(sid) and row["prompt_tokens"] == usage["prompt_tokens"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached == row["cached_tokens"]
        if turn:
            # The whole previous prompt is reused (and usually the echoed reply too).
            assert cached >= previous_prompt, (turn, row)
        previous_prompt = usage["prompt_tokens"]
        if not follow_up:
            break
        # PI echoes what it received: text parts, reasoning only in the variant that keeps it.
        messages += [shapes.pi_assistant(out["content"] or None,
                                         reasoning=(out["reasoning"] or None) if echo_reasoning else None),
                     shapes.pi_user(follow_up)]


# ---------------------------------------------------------------------------------------------- OpenClaw


def test_openclaw_orchestrator_stays_warm_across_a_subagent_detour(stack):
    orchestrator = "agent:main:telegram:direct:5551234"
    post = lambda msgs, key, sub=False: stack.post("/v1/chat/completions", *_openclaw(msgs, key, sub))

    # Each NEW inbound message carries its own message_id / timestamp; old ones are re-sent as they were.
    messages = [shapes.openclaw_user("Can you check tomorrow's weather in Lisbon?", 1842, 12)]
    status, reply, _ = post(messages, orchestrator)
    assert status == 200, reply
    first = reply["usage"]["prompt_tokens"]
    # The orchestrator spawns a sub-agent (tool call + the gateway's acknowledgement).
    messages += [
        {"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""},
        shapes.openclaw_user("Thanks, take your time.", 1843, 13),
    ]
    status, reply, _ = post(messages, orchestrator)
    assert status == 200, reply
    before_detour = reply["usage"]
    assert before_detour["prompt_tokens_details"]["cached_tokens"] >= first
    recorded_msgs = 1 + len(messages)  # the session's turn record: that request's system + messages
    messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""})

    # Detour: the sub-agent is its own session with its own system prompt.
    sub_key = "agent:main:subagent:weather-lisbon"
    sub_msgs = [{"role": "user", "content": "Task: find tomorrow's weather forecast for Lisbon."}]
    status, sub_reply, _ = post(sub_msgs, sub_key, True)
    assert status == 200, sub_reply
    assert last_row(stack, sub_key)["session"].startswith(sub_key[:16])

    # Back to the orchestrator: the report arrives as a new message (its stats line is volatile).
    messages.append(shapes.openclaw_subagent_report("weather-lisbon", "Sunny, 21°C, light wind.", 45, 12.3))
    status, reply, _ = post(messages, orchestrator)
    assert status == 200, reply
    message = reply["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    after = reply["usage"]
    row = last_row(stack, orchestrator)
    assert row["session"].startswith(orchestrator[:16])
    # The orchestrator's KV survived the sub-agent: its whole previous prompt is reused ...
    assert after["prompt_tokens_details"]["cached_tokens"] >= before_detour["prompt_tokens"], row
    # ... and its turn record was not clobbered: every message of the previous turn is stable.
    assert row["stable_prefix_msgs"] == recorded_msgs, row


def _openclaw(messages, key, subagent):
    body, headers = shapes.openclaw_body(MODEL, messages, session_key=key, subagent=subagent)
    return body, KEY, headers


# ---------------------------------------------------------------------------------------------- Claude Code


def test_claude_code_messages_tool_loop_warm_with_rotating_cch(stack):
    messages = [
        shapes.claude_code_first_user("Read README.md and tell me what it is."),
        {"role": "assistant", "content": [
            {"type": "text", "text": "I'll read the file."},
            {"type": "tool_use", "id": "toolu_01A", "name": "Read", "input": {"file_path": "/repo/README.md"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "# mlxstack\nA local MLX server."}]},
    ]
    body, headers = shapes.claude_code_body(MODEL, messages, cch="fa690")
    status, reply, _ = stack.post("/v1/messages", body, headers=headers)
    assert status == 200, reply
    assert reply["type"] == "message" and reply["role"] == "assistant"
    assert reply["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    assert all(b["type"] in ("text", "thinking", "tool_use") for b in reply["content"])
    row1 = stack.recent()[-1]
    assert row1["session"].startswith(shapes.CLAUDE_CODE_SESSION[:16])

    # Turn 2: echo the reply, then another tool_use / tool_result round; the billing line's cch
    # is different on every request.
    messages += [
        shapes.anthropic_reply_as_history(reply),
        {"role": "user", "content": [{"type": "text", "text": "Also check the licence file."}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_01B", "name": "Bash", "input": {"command": "head -3 LICENSE"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01B", "content": "MIT License\n\nCopyright (c) 2026"}]},
    ]
    body, headers = shapes.claude_code_body(MODEL, messages, cch="0aaa9")
    status, reply2, _ = stack.post("/v1/messages", body, headers=headers)
    assert status == 200, reply2
    assert reply2["type"] == "message" and reply2["content"]
    row2 = stack.recent()[-1]
    assert row2["session"] == row1["session"]
    # The billing line sits at token ~10 and changed: still the whole first prompt is reused,
    # which can only be because the line is not in the model input at all.
    assert row2["cached_tokens"] >= row1["prompt_tokens"], (row1, row2)
    assert row2["match_type"] != "miss"
