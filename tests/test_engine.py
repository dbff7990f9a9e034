"""ChatEngine end to end on tiny real models: multi-turn parity with the cache on vs off,
hybrid snapshots, watchdog and cancellation never storing partial state, stop strings."""
from __future__ import annotations

import pytest

from mlxstack.engine.chat import ChatJob
from mlxstack.runner.generate import SamplingParams
from tests.conftest import build_engine, engine_settings

SYSTEM = "You are a careful coding agent. " * 12
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def job(messages, *, max_tokens=10, tools=None, stop=(), session="s1", cancel=lambda: False, thinking=False):
    out: list[str] = []
    j = ChatJob(
        request_id="t", messages=messages, tools=tools, enable_thinking=thinking,
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens), stop=list(stop),
        body={"session_id": session}, headers={}, emit=out.append, is_cancelled=cancel,
    )
    return j, out


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def engines(request, tiny_dense_path, tiny_hybrid_path):
    path = tiny_dense_path if request.param == "dense" else tiny_hybrid_path
    warm = build_engine(engine_settings(path))
    cold = build_engine(engine_settings(path, prompt_cache_max_entries_global=0))
    return request.param, warm, cold


def conversation(engine, turns, tools=None):
    """Drive a multi-turn chat, echoing each reply back as history; returns outcomes."""
    messages = [{"role": "system", "content": SYSTEM}]
    outcomes = []
    for user in turns:
        messages.append({"role": "user", "content": user})
        j, _ = job(list(messages), tools=tools)
        o = engine.run(j)
        outcomes.append(o)
        messages.append({"role": "assistant", "content": o.text})
    return outcomes


def test_multi_turn_parity_cache_on_vs_off(engines):
    kind, warm, cold = engines
    turns = ["Explain what a KV cache is.", "And why does reuse matter?", "Summarise in one line."]
    w = conversation(warm, turns)
    c = conversation(cold, turns)
    assert [o.raw_text for o in w] == [o.raw_text for o in c]
    assert all(o.cached_tokens == 0 for o in c)
    assert w[0].cached_tokens == 0
    for o in w[1:]:
        assert o.cached_tokens > 0.6 * o.prompt_tokens, (kind, o.match_type, o.cached_tokens, o.prompt_tokens)
        assert o.timings["prefilled_tokens"] == o.prompt_tokens - o.cached_tokens
    if kind == "hybrid":
        # Recurrent state is only ever reused at an entry's exact depth: the closed previous turn
        # (a prefix of this prompt) or a snapshot -- never a cut-back (lcp / supersequence).
        assert {o.match_type for o in w[1:]} <= {"prefix", "snapshot", "session"}
    assert warm.state.counters.get("exact_key_rejected_by_model_lcp") == 0


def test_tool_loop_parity(engines):
    kind, warm, cold = engines
    history = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Open README.md"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "read_file", "arguments": "{\"path\": \"README.md\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "# Project\nA server."},
    ]
    outs = {}
    for name, eng in (("warm", warm), ("cold", cold)):
        first, _ = job(list(history), tools=TOOLS, session=f"tool-{kind}")
        o1 = eng.run(first)
        second_msgs = history + [{"role": "assistant", "content": o1.text},
                                 {"role": "user", "content": "Now summarise it."}]
        second, _ = job(second_msgs, tools=TOOLS, session=f"tool-{kind}")
        outs[name] = (o1, eng.run(second))
    assert outs["warm"][0].raw_text == outs["cold"][0].raw_text
    assert outs["warm"][1].raw_text == outs["cold"][1].raw_text
    assert outs["warm"][1].cached_tokens > 0.6 * outs["warm"][1].prompt_tokens


def test_watchdog_abort_keeps_the_prompt_kv_and_nothing_else(tiny_dense_path):
    eng = build_engine(engine_settings(tiny_dense_path, generation_watchdog_seconds=0.000001))
    j, _ = job([{"role": "user", "content": "hello there"}], max_tokens=50)
    o = eng.run(j)
    assert o.finish_reason == "length" and o.aborted
    # the KV it computed stays (nothing prefilled is thrown away) ...
    (entry,) = eng.state.kv.index.entries()
    assert entry.depth >= o.prompt_tokens
    # ... but no conversation state: no turn record, no healing entry
    assert len(eng.state.turns) == 0 and len(eng.state.healing) == 0
    assert eng.state.counters.get("watchdog_aborts") == 1


def test_cancelled_mid_stream_stops_within_a_token_and_keeps_only_the_kv(tiny_dense_path):
    eng = build_engine(engine_settings(tiny_dense_path))
    emitted: list[str] = []
    j, emitted = job([{"role": "user", "content": "count to one hundred"}], max_tokens=60,
                     cancel=lambda: len(emitted) >= 3)
    o = eng.run(j)
    assert o.aborted and o.completion_tokens <= 4 + 1
    assert len(eng.state.turns) == 0 and len(eng.state.healing) == 0
    assert eng.state.counters.get("disconnects") == 1
    retry, _ = job([{"role": "user", "content": "count to one hundred"}], max_tokens=8)
    again = eng.run(retry)
    assert again.cached_tokens == again.prompt_tokens - 1   # the whole prompt (one token is always fed)


def test_stop_string_never_leaks(tiny_dense_path):
    eng = build_engine(engine_settings(tiny_dense_path))
    j, _ = job([{"role": "user", "content": "say something"}], max_tokens=20)
    full = eng.run(j).text
    assert len(full) > 6
    stop = full[3:6]
    j2, streamed = job([{"role": "user", "content": "say something"}], max_tokens=20, stop=[stop])
    o = eng.run(j2)
    assert stop not in o.text and o.text == full[:full.index(stop)]
    assert "".join(streamed) == o.text and o.finish_reason == "stop"


def test_implicit_session_id_is_stable_as_a_short_conversation_grows(tiny_dense_path):
    eng = build_engine(engine_settings(tiny_dense_path))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ids = []
    for follow_up in ("more", "and more"):
        j, _ = job(list(messages), max_tokens=3)
        j.body = {}  # no explicit session id: derived from the opening tokens
        o = eng.run(j)
        ids.append(o.session_id)
        messages += [{"role": "assistant", "content": o.text}, {"role": "user", "content": follow_up}]
    other, _ = job([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "bye"}], max_tokens=3)
    other.body = {}
    assert ids[0] == ids[1] != eng.run(other).session_id


def test_request_whose_client_already_left_is_dropped_without_running(tiny_dense_path):
    from mlxstack.engine.chat import ClientGone

    eng = build_engine(engine_settings(tiny_dense_path))
    j, _ = job([{"role": "user", "content": "hello"}], cancel=lambda: True)
    with pytest.raises(ClientGone):
        eng.run(j)
    assert len(eng.state.kv.index) == 0 and eng.state.counters.get("requests") == 0


def test_norm_safety_check_falls_back_to_original_tokens(tiny_dense_path):
    inbound = "## Inbound Context (trusted metadata)\n```json\n" + '{"k": "' + "v" * 400 + '"}\n```\n'
    messages = [{"role": "system", "content": "Be brief.\n" + inbound}, {"role": "user", "content": "hi"}]
    off = build_engine(engine_settings(tiny_dense_path))
    on = build_engine(engine_settings(tiny_dense_path, cache_norm_safety_check=True))
    p_off, p_on = off.prepare(job(messages)[0]), on.prepare(job(messages)[0])
    assert len(p_off.key_tokens) < 0.9 * len(p_off.model_tokens)   # canonicalisation removed a lot
    assert p_on.key_tokens == p_on.model_tokens                        # guarded: original tokens as key
    assert on.state.counters.get("cache_key_safety_fallback") == 1


def test_billing_header_is_stripped_from_the_model_input(tiny_dense_path):
    billing = "x-anthropic-billing-header: cc_version=2.0.1; cc_entrypoint=cli; cch=9f8e7d;"
    messages = [{"role": "system", "content": billing + "\nYou are Claude Code."}, {"role": "user", "content": "hi"}]
    on = build_engine(engine_settings(tiny_dense_path)).prepare(job(messages)[0])
    off = build_engine(engine_settings(tiny_dense_path, strip_billing_header=False)).prepare(job(messages)[0])
    assert "x-anthropic-billing-header" not in on.model_text and "You are Claude Code." in on.model_text
    assert "cch=9f8e7d" in off.model_text


def test_run_serves_its_request_through_an_engine_core_of_one_slot(tiny_dense_path, monkeypatch):
    """``ChatEngine.run`` has no loop of its own (LESSONS 90): its request is admitted, prefilled
    and decoded by the engine core's steps, every decode token through the decode group."""
    from mlxstack.runner.batch import DecodeGroup

    eng = build_engine(engine_settings(tiny_dense_path, speculative="off"))
    steps, decoded = eng.alone.steps, []
    real = DecodeGroup.step
    monkeypatch.setattr(DecodeGroup, "step", lambda group: decoded.append(len(group.seqs)) or real(group))
    o = eng.run(job([{"role": "user", "content": "Count to five."}], max_tokens=6)[0])
    assert o.completion_tokens == 6 and o.finish_reason == "length"
    assert eng.alone.max_sequences == 1 and eng.alone.idle() and eng.alone.steps - steps == 6
    assert decoded == [1] * 6          # the prefill joins the batch in the first step; a token read back a step


def test_watchdog_abandons_a_long_prefill_between_chunks(tiny_dense_path):
    eng = build_engine(engine_settings(tiny_dense_path, prefill_step_size=8, generation_watchdog_seconds=0.000001))
    j, streamed = job([{"role": "user", "content": "word " * 200}], max_tokens=5)
    o = eng.run(j)
    assert o.aborted and o.finish_reason == "length" and o.completion_tokens == 0 and streamed == []
    assert len(eng.state.kv.index) == 0


@pytest.mark.parametrize("partition", [True, False])
def test_session_partitioning_serves_the_sessions_own_entry_and_counts_whose_entry_served(tiny_dense_path, partition):
    """A and B share the system prompt. A's side request matches A's entry and B's (newer) equally
    deep: partitioning serves it from A's own, without it B's takes the hit; the reuse is the same."""
    eng = build_engine(engine_settings(tiny_dense_path, cache_session_partitioning=partition))
    system = {"role": "system", "content": SYSTEM}
    outcomes = []
    for session, text in (("A", "Alpha: list the files."), ("B", "Beta: count the lines."),
                          ("A", "Gamma: name the tests.")):
        j, _ = job([system, {"role": "user", "content": text}], session=session, max_tokens=4)
        outcomes.append(eng.run(j))
    first, b_turn, side = outcomes
    assert first.cached_tokens == 0 and b_turn.cached_tokens > 16 and side.cached_tokens == b_turn.cached_tokens
    entries = {e.entry_id: e for e in eng.state.kv.index.entries()}
    a_entry, b_entry = sorted(entries)[:2]
    c = eng.state.counters
    if partition:
        assert (c.get("own_session_hits"), c.get("other_session_hits"), c.get("own_session_preferred")) == (1, 1, 1)
        assert (entries[a_entry].hits, entries[b_entry].hits) == (2, 0)   # B's hit on A's entry, then A's own
    else:
        assert (c.get("own_session_hits"), c.get("other_session_hits"), c.get("own_session_preferred")) == (0, 2, 0)
        assert (entries[a_entry].hits, entries[b_entry].hits) == (1, 1)
    assert eng.state.counters.get("exact_key_rejected_by_model_lcp") == 0
