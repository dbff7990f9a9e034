"""Replies before their turn's closing forward (engine/core.py ``_end``): while other rows
still decode, a finished reply goes out at once and its turn (last token + the template's closer)
is closed and stored later -- with every other that ends before the batch empties, in one
forward -- or as soon as a new request is admitted (its lookup must see every reply sent). What
the cache holds afterwards is exactly what closing at once stores."""
from __future__ import annotations

from concurrent.futures import Future

import pytest

from mlxstack.runner.batch import batching_support
from mlxstack.engine.core import EngineCore
from tests.conftest import build_engine, engine_settings
from tests.test_engine import job

pytestmark = pytest.mark.slow  # 8-row batches on the embedded model, ~1.5 min here (docs/testing.md#tiers)

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
SHORT = [SYSTEM, {"role": "user", "content": "Name a colour."}]
LONG = [SYSTEM, {"role": "user", "content": "Describe the sea at night in detail."}]


def _admit(sched, messages, max_tokens, session):
    fut = Future()
    fut.set_running_or_notify_cancel()
    sched.admit(job(messages, max_tokens=max_tokens, session=session)[0], fut)
    return fut


def _next_turn(messages, reply):
    return messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And another?"}]


def test_a_reply_goes_out_before_its_turn_closes_and_the_next_turn_hits_as_deep(embedded_model_path):
    alone = build_engine(engine_settings(embedded_model_path))
    first = alone.run(job(SHORT, max_tokens=3, session="a")[0])
    second = alone.run(job(_next_turn(SHORT, first.text), max_tokens=3, session="a")[0])
    long_alone = alone.run(job(LONG, max_tokens=24, session="b")[0])
    assert second.cached_tokens > first.prompt_tokens        # the closed turn is reused

    eng = build_engine(engine_settings(embedded_model_path))
    sched = EngineCore(eng, 8, 512, batching=batching_support(eng)[0])
    assert sched.group.dense
    short, long_ = _admit(sched, SHORT, 3, "a"), _admit(sched, LONG, 24, "b")
    while not short.done():
        sched.step()
    entries = len(eng.state.kv.index)
    assert len(sched.group) == 1 and not long_.done()        # the long one still decodes
    assert [s.job.body["session_id"] for s in sched.closing] == ["a"] and sched.replied_early == 1
    assert short.result().text == first.text and short.result().completion_tokens == 3

    again = _admit(sched, _next_turn(SHORT, first.text), 3, "a")   # admitting stores the pending turn
    assert sched.closing == [] and len(eng.state.kv.index) == entries + 1
    while not sched.idle():
        sched.step()
    assert again.result().cached_tokens == second.cached_tokens
    assert again.result().text == second.text
    assert long_.result().text == long_alone.text
    assert sched.failed == 0


def test_turns_that_end_in_different_steps_close_in_one_forward(embedded_model_path):
    """Three rows ending in three different steps while a fourth decodes: none waits for a
    closing forward; all four close together once the batch is empty, and each next turn hits
    as deep as closing at once leaves it."""
    alone = build_engine(engine_settings(embedded_model_path))
    convos = [[SYSTEM, {"role": "user", "content": f"Count to {n}."}] for n in (3, 5, 7, 9)]
    budgets = [2, 4, 6, 16]
    firsts = [alone.run(job(m, max_tokens=b, session=f"s{i}")[0]) for i, (m, b) in enumerate(zip(convos, budgets))]
    seconds = [alone.run(job(_next_turn(m, f.text), max_tokens=2, session=f"s{i}")[0])
               for i, (m, f) in enumerate(zip(convos, firsts))]

    eng = build_engine(engine_settings(embedded_model_path))
    sched = EngineCore(eng, 8, 512, batching=batching_support(eng)[0])
    futs = [_admit(sched, m, b, f"s{i}") for i, (m, b) in enumerate(zip(convos, budgets))]
    closed_before = None
    while not sched.idle():
        sched.step()
        if futs[2].done() and closed_before is None:
            closed_before = sched.closed_together
            assert len(sched.closing) == 3 and not futs[3].done()
    assert sched.closing == [] and sched.replied_early == 3
    assert sched.closed_together - closed_before == 4          # one forward for the four turns
    assert [f.result().text for f in futs] == [f.text for f in firsts]
    for i, (m, f) in enumerate(zip(convos, firsts)):
        nxt = eng.run(job(_next_turn(m, f.text), max_tokens=2, session=f"s{i}")[0])
        assert (nxt.cached_tokens, nxt.text) == (seconds[i].cached_tokens, seconds[i].text)


def test_prompt_cache_off_or_a_lone_row_replies_after_its_store_as_before(embedded_model_path):
    eng = build_engine(engine_settings(embedded_model_path, prompt_cache_max_entries_global=0))
    sched = EngineCore(eng, 8, 512, batching=batching_support(eng)[0])
    futs = [_admit(sched, SHORT, 2, "a"), _admit(sched, LONG, 8, "b")]
    while not sched.idle():
        sched.step()
    assert sched.replied_early == 0 and all(f.result().text for f in futs)
