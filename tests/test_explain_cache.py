"""scripts/explain_cache.py on request logs a real server wrote (embedded SmolLM2, in process).

One Anthropic Messages session of 4 turns whose system prompt's date line changes at turn 3 and
stays changed, a Responses request and a chat completion in sessions of their own (the chat one
reusing the template's default system prompt the Responses one stored). The script's
lines are compared whole: time from the record, everything else from what the API answered
(prompt, reused = cache_read / cached_tokens, written = cache_creation / cache_write_tokens) and
the comparison rule of cache/diagnosis.py (a turn that continues the previous one has all of the
previous prompt and reply in common; a system prompt that differs inside the first 16-token block
shares nothing the digests can vouch for but what the server reused).
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxstack.observability.cache_explain import HEADER
from tests.conftest import LiveServer, engine_settings, http_json

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful assistant.\nToday is 2026-05-01."
DRIFTED = "You are a helpful assistant.\nToday is 2026-05-02."
MAX_TOKENS = 8   # every reply is cut by max_tokens: all of its tokens are in the next turn's reach


@pytest.fixture(scope="module")
def logged(embedded_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("explain-logs")
    server = LiveServer(engine_settings(None, log_root=str(root), enable_request_logging="true"))
    try:
        turns = []
        conversation = [{"role": "user", "content": "Name a fruit."}]
        for turn in range(1, 5):
            status, body, headers = http_json(
                f"{server.base}/v1/messages",
                {"model": MODEL, "system": SYSTEM if turn < 3 else DRIFTED, "messages": conversation,
                 "max_tokens": MAX_TOKENS},
                headers={"x-claude-code-session-id": "explain-drift"})
            assert status == 200, body
            assert body["stop_reason"] == "max_tokens"
            turns.append((body["usage"], headers["x-mlxstack-cache"]))
            conversation += [{"role": "assistant", "content": body["content"][0]["text"]},
                             {"role": "user", "content": f"Another one, number {turn + 1}."}]
        status, resp, _ = http_json(f"{server.base}/v1/responses",
                                    {"model": MODEL, "input": "Say hi.", "max_output_tokens": 4,
                                     "prompt_cache_key": "xp-responses"})
        assert status == 200, resp
        status, chat, _ = http_json(f"{server.base}/v1/chat/completions",
                                    {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
                                     "max_tokens": 4, "prompt_cache_key": "xp-chat"})
        assert status == 200, chat
        assert server.app.state.request_logger.flush()
        yield root, turns, resp["usage"], chat["usage"]
    finally:
        server.close()


def explain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "explain_cache.py"), *args], capture_output=True,
                          text=True, timeout=120)


def records(root: Path, session: str) -> list[dict]:
    from mlxstack.observability.request_log import log_files, read_records

    return [r for p in log_files(root) for r in read_records(p) if r["session"] == session]


def clock(rec: dict) -> str:
    return time.strftime("%H:%M:%S", time.localtime(rec["ts"]))


def test_a_session_turn_by_turn_with_the_drifting_system_prompt(logged):
    root, turns, _, _ = logged
    recs = records(root, "explain-drift")
    assert [r["api"] for r in recs] == ["messages"] * 4
    usage = [u for u, _ in turns]
    prompt = [u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] for u in usage]
    read = [u["cache_read_input_tokens"] for u in usage]
    written = [u["cache_creation_input_tokens"] for u in usage]
    left = [p + MAX_TOKENS for p in prompt]          # prompt and reply: what the next turn can reuse
    # turn 3 parts from turn 2 inside the first block (the date line): only what the server reused is shared
    missed = left[1] - max(16, read[2])
    assert 0 < read[2] < left[1] and missed > 0
    assert [h for _, h in turns] == [
        f"tier=none; reused=0/{prompt[0]}; match=miss; first",
        f"tier=ram; reused={read[1]}/{prompt[1]}; match=prefix; hit",
        f"tier=ram; reused={read[2]}/{prompt[2]}; match=lcp; miss system missed={missed} at=16",
        f"tier=ram; reused={read[3]}/{prompt[3]}; match=prefix; hit"]
    assert all(u["input_tokens"] == 0 for u in usage)        # no breakpoints: every token not read is written
    assert [w + r for w, r in zip(written, read)] == prompt

    out = explain("--log-root", str(root), "--session", "explain-drift")
    assert out.returncode == 0, out.stderr
    day = time.strftime("%Y-%m-%d", time.localtime(recs[0]["ts"]))
    assert out.stdout.splitlines() == [
        f"session explain-drift (4 requests, {day})",
        HEADER,
        f"{clock(recs[0])}  messages  {prompt[0]:>7} {0:>7} {prompt[0]:>7}  none  first request of its session",
        f"{clock(recs[1])}  messages  {prompt[1]:>7} {read[1]:>7} {written[1]:>7}  ram   "
        f"hit: continues the previous request ({left[0]} tokens in common)",
        f"{clock(recs[2])}  messages  {prompt[2]:>7} {read[2]:>7} {written[2]:>7}  ram   "
        f"miss: system prompt changed; {missed} of {left[1]} reusable tokens not reused, the prompts part at token 16",
        f"{clock(recs[3])}  messages  {prompt[3]:>7} {read[3]:>7} {written[3]:>7}  ram   "
        f"hit: continues the previous request ({left[2]} tokens in common)"]
    assert HEADER == "time      api        prompt  reused written  tier  explanation"
    # the record carries the diagnosis the line is made of
    assert recs[2]["cache"]["cache_diagnosis"] == {"status": "miss", "where": "system", "message": None,
                                                   "field": None, "missed": missed, "common": 16,
                                                   "previous": left[1]}


def test_every_session_and_each_api(logged):
    root, _, resp_usage, chat_usage = logged
    out = explain("--log-root", str(root), "--all")
    assert out.returncode == 0, out.stderr
    blocks = out.stdout.split("\n\n")
    assert [b.splitlines()[0].split(" (")[0] for b in blocks] == [
        "session explain-drift", "session xp-responses", "session xp-chat"]
    r, c = records(root, "xp-responses")[0], records(root, "xp-chat")[0]
    n_resp, n_chat = resp_usage["input_tokens"], chat_usage["prompt_tokens"]
    assert resp_usage["input_tokens_details"]["cache_write_tokens"] == n_resp
    assert blocks[1].splitlines()[1:] == [
        HEADER, f"{clock(r)}  responses {n_resp:>7} {0:>7} {n_resp:>7}  none  first request of its session"]
    # the chat request opens with the template's default system prompt, as the Responses one did:
    # its first request reuses that prefix from the other session's entry
    reused = chat_usage["prompt_tokens_details"]["cached_tokens"]
    assert 16 <= reused < n_chat and chat_usage["prompt_tokens_details"]["cache_write_tokens"] == n_chat - reused
    assert blocks[2].splitlines()[1:] == [
        HEADER, f"{clock(c)}  chat      {n_chat:>7} {reused:>7} {n_chat - reused:>7}  ram   first request of its session"]
    # no --session / --all: the session with the newest request
    newest = explain("--log-root", str(root))
    assert newest.stdout.splitlines() == blocks[2].strip().splitlines()


def test_no_logs_or_no_such_session_exit_2(logged, tmp_path):
    root = logged[0]
    missing = explain("--log-root", str(root), "--session", "nobody")
    assert missing.returncode == 2 and "no session 'nobody'" in missing.stderr
    empty = explain("--log-root", str(tmp_path))
    assert empty.returncode == 2 and missing.stdout == empty.stdout == ""
