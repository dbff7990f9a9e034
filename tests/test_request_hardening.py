"""Issue 10, the engine's side: nothing one request does can poison the next, a ``<think>`` the
client wrote never reclassifies the reply, healing restores only this conversation's own reply
(never text a stop string cut, never another chat's reasoning), strict templates never see a
message list they refuse, and the request fields that used to vanish are implemented
(logprobs, penalties, logit_bias, tool_choice, response_format). Real tiny models throughout;
replies a random model cannot produce come from the scripted decode of test_prefix_stability.
"""
from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlxstack.cache.kv_ops import LiveCache
from mlxstack.runner.generate import feed, last_logits
from mlxstack.runner.sampling import Sampler, SamplingParams
from tests.conftest import LiveServer, build_engine, engine_settings, http_json
from tests.test_engine import SYSTEM, TOOLS, job
from tests.fixtures.scripted import ScriptedReplies
from tests.test_prefix_stability import _swap, say, variant
from tests.fixtures.tiny_models import CHAT_TEMPLATE


@pytest.fixture
def script(monkeypatch):
    return ScriptedReplies().install(monkeypatch)


@pytest.fixture(scope="module")
def dense(tiny_dense_path):
    return build_engine(engine_settings(tiny_dense_path))


def sampled(engine, seed):
    j, _ = job([{"role": "user", "content": "Tell me something."}], max_tokens=12, session=f"s{seed}")
    j.params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=12, seed=seed)
    return engine.run(j).raw_text


# ---------------------------------------------------------------------------- (1) random state
def test_a_failed_sampler_leaves_the_next_request_identical_to_a_fresh_engine(tiny_dense_path):
    fresh = build_engine(engine_settings(tiny_dense_path))
    used = build_engine(engine_settings(tiny_dense_path))
    expected = sampled(fresh, 7)
    # a request whose sampler cannot even be built (a logit_bias id far outside int32) fails ...
    j, _ = job([{"role": "user", "content": "x"}], max_tokens=4)
    j.params = SamplingParams(temperature=1.0, logit_bias={2**40: 1.0}, max_tokens=4)
    with pytest.raises(Exception):  # MLX raises RuntimeError(std::bad_cast) building the bias
        used.run(j)
    # ... someone else reseeds MLX's global generator, and unseeded requests draw from the OS ...
    mx.random.seed(12345)
    sampled(used, None)
    # ... and the seeded request still answers byte for byte what a fresh engine answers.
    assert sampled(used, 7) == expected
    assert sampled(used, 8) != expected  # the seed matters (sanity)


def test_seeded_requests_over_http_survive_bad_sampling_fields(tiny_dense_path):
    fresh, used = LiveServer(engine_settings(tiny_dense_path)), LiveServer(engine_settings(tiny_dense_path))
    try:
        body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 10,
                "temperature": 0.8, "seed": 42}
        ref = http_json(fresh.base + "/v1/chat/completions", body)[1]["choices"][0]["message"]["content"]
        for bad in ({"top_k": 10**9}, {"min_p": float("nan")}, {"temperature": float("inf")}, {"seed": -1}):
            raw = json.dumps({**body, **bad}).encode()   # NaN/Infinity as Python's json writes them
            status, err, _ = http_json(used.base + "/v1/chat/completions", raw)
            assert status == 400, (bad, err)
        for _ in range(2):
            status, got, _ = http_json(used.base + "/v1/chat/completions", body)
            assert status == 200 and got["choices"][0]["message"]["content"] == ref
    finally:
        fresh.close()
        used.close()


# ---------------------------------------------------------------------------- (4) <think> in the prompt
def test_a_think_tag_in_client_text_never_reclassifies_the_reply(dense):
    for text in ("Explain this file:\n<think>\nnot closed", "A tool result mentions <think> and </think><think>"):
        msgs = [{"role": "user", "content": text}]
        j, _ = job(msgs, thinking=False, max_tokens=6)
        o = dense.run(j)
        assert o.thinking_started is False, text
        j, _ = job(msgs + [{"role": "assistant", "content": "ok"}, {"role": "tool", "content": "<think>"}],
                   thinking=False, max_tokens=4)
        assert dense.run(j).thinking_started is False
    j, _ = job([{"role": "user", "content": "hi"}], thinking=True, max_tokens=4)
    assert dense.run(j).thinking_started is True  # the template's own <think> still counts


# ---------------------------------------------------------------------------- (5) healing
def test_text_cut_by_a_stop_string_is_never_healed_back(tiny_dense_path, script):
    eng = build_engine(engine_settings(tiny_dense_path))
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Solve it step by step."}]
    say(script, eng, "Thought: read the file.\nObservation: it says 42.")
    j, _ = job(list(history), max_tokens=40, stop=["\nObservation:"], session="react")
    o = eng.run(j)
    assert o.text == "Thought: read the file." and o.finish_reason == "stop"
    follow = history + [{"role": "assistant", "content": o.text}, {"role": "user", "content": "Observation: 42"}]
    text = eng.prepare(job(follow, session="react")[0]).model_text
    assert "it says 42" not in text and "Thought: read the file.<|im_end|>" in text


def test_healing_is_bound_to_the_exact_history_not_the_canonical_one(tiny_dense_path, script):
    eng = build_engine(engine_settings(tiny_dense_path))

    def chat(block: str) -> list[dict]:
        user = f"## Inbound Context (trusted metadata)\n```json\n{{\"channel\": \"{block}\"}}\n```\n\nWhat now?"
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    # chat A: the reply carries reasoning the client strips
    say(script, eng, "<think>\nsecret plan of chat A\n</think>\n\nDone.")
    a = eng.run(job(chat("telegram"), thinking=False, max_tokens=40, session="A")[0])
    assert "secret plan" in a.raw_text
    # chat B differs only in the inbound block (normalised away in the cache key) and echoes "Done."
    b = chat("discord") + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "next"}]
    assert "secret plan" not in eng.prepare(job(b, session="B")[0]).model_text
    # chat A itself is healed
    a2 = chat("telegram") + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "next"}]
    assert "secret plan of chat A" in eng.prepare(job(a2, session="A")[0]).model_text


# ---------------------------------------------------------------------------- (6) strict templates
STRICT = _swap(CHAT_TEMPLATE, "{%- if tools %}",
               "{%- if messages | selectattr('role', 'equalto', 'user') | list | length == 0 %}"
               "{{- raise_exception('No user query found in messages.') }}{%- endif %}\n{%- if tools %}")


def test_session_id_path_never_renders_a_list_the_template_refuses(tmp_path, tiny_dense_path):
    eng = build_engine(engine_settings(variant(tmp_path, tiny_dense_path, "strict", STRICT)))
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Refactor the parser."}]
    o1 = eng.run(job(list(first), max_tokens=4, session="cc-1")[0])
    # Claude Code after /compact: same session id, a new first user message
    compacted = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summary of earlier work."}]
    o2 = eng.run(job(compacted, max_tokens=4, session="cc-1")[0])
    o3 = eng.run(job(compacted + [{"role": "assistant", "content": o2.text}, {"role": "user", "content": "go"}],
                     max_tokens=4, session="cc-1")[0])
    assert o1.prompt_tokens and o2.prompt_tokens and o3.cached_tokens > 0


# ---------------------------------------------------------------------------- (9) fields that used to vanish
@pytest.mark.slow
def test_logprobs_are_the_models_own_distribution(embedded_server):
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 3}
    status, out, _ = http_json(embedded_server.base + "/v1/chat/completions", body)
    assert status == 200, out
    entries = out["choices"][0]["logprobs"]["content"]
    assert 1 <= len(entries) <= out["usage"]["completion_tokens"]
    for e in entries:
        tops = e["top_logprobs"]
        assert len(tops) == 3 and [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert e["token"] == tops[0]["token"] and e["logprob"] == pytest.approx(tops[0]["logprob"]) and e["logprob"] <= 0
    # the first entry equals log-softmax of the model's own logits after the prompt
    eng = embedded_server.app.engine
    prep = eng.prepare(job(body["messages"])[0])
    live = LiveCache(eng.new_cache().layers)
    feed(eng.loaded.model, live, prep.model_tokens[:-1], 512)
    logits = last_logits(eng.loaded.model, live, prep.model_tokens[-1])
    lp = logits - mx.logsumexp(logits)
    assert entries[0]["logprob"] == pytest.approx(float(mx.max(lp).item()), abs=1e-4)
    streamed = [json.loads(l[6:]) for l in _sse(embedded_server, {**body, "stream": True}) if l.startswith("data: {")]
    lp_frames = [f for f in streamed if f["choices"] and f["choices"][0].get("logprobs")]
    assert len(lp_frames) == 1
    got = lp_frames[0]["choices"][0]["logprobs"]["content"]
    # the same tokens and ranking; the values within float rounding: the streamed request is a
    # cache hit whose last token is fed on its own, not inside the cold prefill (LESSONS 23)
    assert [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in got] == \
        [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in entries]
    for g, e in zip(got, entries):
        assert g["logprob"] == pytest.approx(e["logprob"], abs=1e-4)
        assert [t["logprob"] for t in g["top_logprobs"]] == pytest.approx([t["logprob"] for t in e["top_logprobs"]], abs=1e-4)


def _sse(server, body):
    import urllib.request

    req = urllib.request.Request(server.base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read().decode().split("\n\n")


def test_penalties_and_logit_bias_move_the_argmax():
    logits = mx.array([0.0, 5.0, 4.0, 1.0])
    greedy = lambda **kw: int(Sampler(SamplingParams(temperature=0.0, **kw), [], 4).sample(logits).item())  # noqa: E731
    assert greedy() == 1
    assert greedy(logit_bias={1: -100.0}) == 2
    assert greedy(logit_bias={3: 10.0}) == 3
    s = Sampler(SamplingParams(temperature=0.0, frequency_penalty=2.0), [], 4)
    first = s.sample(logits)
    s.accept(first)                        # token 1 seen once: 5 - 2 = 3 < 4
    assert (int(first.item()), int(s.sample(logits).item())) == (1, 2)
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.5), [], 4)
    s.accept(s.sample(logits))             # 5 - 0.5 = 4.5 > 4: presence alone does not flip it
    assert int(s.sample(logits).item()) == 1
    # top_k >= vocabulary and min_p / top_p at their edges are no-ops, never errors
    for kw in ({"top_k": 10**6}, {"min_p": 1.0}, {"top_p": 1.0}):
        tok = Sampler(SamplingParams(temperature=1.0, seed=1, **kw), [], 4).sample(logits)
        assert 0 <= int(tok.item()) < 4


def test_tool_choice_required_and_named_force_a_call(tiny_dense_path, script):
    eng = build_engine(engine_settings(tiny_dense_path))
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Open README.md"}]
    j, _ = job(msgs, tools=TOOLS, max_tokens=40)
    j.tool_choice = {"type": "function", "function": {"name": "read_file"}}
    forced = '<tool_call>\n{"name": "read_file", "arguments": '
    say(script, eng, '{"path": "README.md"}}\n</tool_call>')
    o = eng.run(j)
    assert o.text.startswith(forced)
    from mlxstack.parsing.output import split_reply

    calls = split_reply(o.text, tools=TOOLS).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("read_file", {"path": "README.md"})]
    j, _ = job(msgs, tools=TOOLS, max_tokens=3)
    j.tool_choice = "required"
    o = eng.run(j)
    assert o.raw_text.startswith('<tool_call>\n{"name": "')   # the call was forced ...
    assert (o.text, o.finish_reason) == ("", "length")          # ... and, cut, never shown as text


def test_tool_choice_none_bans_the_call_token_and_returns_no_calls(tiny_dense_path):
    eng = build_engine(engine_settings(tiny_dense_path))
    call_id = eng.loaded.tokenizer.get_vocab()["<tool_call>"]
    j, _ = job([{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=3)
    j.tool_choice = "none"
    assert eng._logit_bias(j) == {call_id: -1e9}
    from mlxstack.server.openai.chat_reply import completion_body

    o = eng.run(j)
    o.text = 'x <tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call>'   # as if it slipped through
    body = completion_body("c1", "m", o, tools=TOOLS, family="qwen3", enable_thinking=False, parse_tools=False)
    msg = body["choices"][0]["message"]
    assert "tool_calls" not in msg and "<tool_call>" in msg["content"]


def test_json_mode_starts_the_reply_with_a_brace_and_counts_invalid_replies(tiny_dense_path, script):
    eng = build_engine(engine_settings(tiny_dense_path))
    j, _ = job([{"role": "user", "content": "Give me JSON."}], thinking=True, max_tokens=30)
    j.response_format = {"type": "json_object"}
    say(script, eng, '"ok": true}')
    o = eng.run(j)
    assert o.text.startswith("</think>\n\n{") and json.loads(o.text.split("</think>\n\n", 1)[1]) == {"ok": True}
    assert eng.state.counters.get("json_mode_invalid") == 0
    say(script, eng, "not json at all")
    eng.run(j)
    assert eng.state.counters.get("json_mode_invalid") == 1


# ---------------------------------------------------------------------------- (13) stores capped in bytes
def test_stores_are_capped_in_bytes():
    from mlxstack.cache.sessions import SessionIndex, SessionTurnStore
    from mlxstack.prompt.healing import HealingStore

    turns = SessionTurnStore(max_bytes=2000)
    for i in range(20):
        assert turns.update(f"s{i}", [{"role": "user", "content": "x" * 150}])
    assert turns.nbytes <= 2000 and len(turns) == turns.nbytes // turns._records["s19"].nbytes
    assert turns.get("s0") is None and turns.get("s19") is not None          # oldest went first
    assert not turns.update("huge", [{"role": "user", "content": "y" * 5000}])
    heal = HealingStore(max_entries=10**6, max_bytes=4000)
    for i in range(50):
        heal.remember(f"h{i}", "c", None, "z" * 200)
    assert heal.nbytes <= 4000 and len(heal) < 50
    index = SessionIndex(max_sessions=3)
    for i in range(5):
        index.record(f"s{i}", i, 10)
    assert len(index) == 3 and index.candidates("s0") == [] and index.candidates("s4") == [4]
