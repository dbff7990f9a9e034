"""Agent-aware priority (scheduler/priority.py, engine/core.py): the most urgent request takes the
next row, less urgent decode rows make way for it and resume exactly where they were, waiting
raises urgency. The policy is checked on plain numbers; the engine part on the real EngineCore
with a tiny random-weight model, where the proof is parity: every reply -- the urgent one, the
preempted ones (greedy and seeded) -- token for token what it is when served alone.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import Future

import pytest

from mlxstack.engine.core import EngineCore, PriorityPolicy
from mlxstack.runner.batch import batching_support
from mlxstack.runner.sampling import SamplingParams
from mlxstack.prompt import urgency
from mlxstack.scheduler import priority
from mlxstack.scheduler.status import RequestStatus
from tests.conftest import LiveServer, build_engine, engine_settings
from tests.test_engine import job


# ---------------------------------------------------------------------------- the policy
def test_explicit_priority_wins_then_header_then_the_client_shape():
    sub = [{"role": "system", "content": "You are an agent for Claude Code, Anthropic's official CLI."},
           {"role": "user", "content": "find the parser"}]
    topic = [{"role": "system", "content": [{"type": "text", "text": "Analyze if this message indicates a new "
                                             "conversation topic. Reply in JSON."}]},
             {"role": "user", "content": "hi"}]
    claw = [{"role": "system", "content": "You are OpenClaw.\n# Subagent Context\nYou were spawned."}]
    plain = [{"role": "user", "content": "hello"}]
    assert urgency.resolve(None, None, plain) == (0, "default")
    assert urgency.resolve(None, None, sub) == (1, "claude-code-subagent")
    assert urgency.resolve(None, None, claw) == (1, "openclaw-subagent")
    assert urgency.resolve(None, None, topic) == (2, "claude-code-topic")
    assert urgency.resolve(None, " -3 ", sub) == (-3, "header")
    assert urgency.resolve(5, "-3", sub) == (5, "request")
    assert urgency.resolve(None, "", sub) == (1, "claude-code-subagent")     # an empty header says nothing
    # a marker in the user's own text is not a client's shape
    assert urgency.resolve(None, None, [{"role": "user", "content": "You are an agent for Claude Code"}]) == (0, "default")


@pytest.mark.parametrize("value,where,message", [
    ("high", "priority", "'priority' must be an integer (lower goes first)"),
    (1.5, "priority", "'priority' must be an integer (lower goes first)"),
    (True, "priority", "'priority' must be an integer (lower goes first)"),
    (1001, "priority", "'priority' must be between -1000 and 1000"),
    ("x", urgency.HEADER, "'x-mlxstack-priority' must be an integer (lower goes first)"),
])
def test_a_bad_priority_is_refused_with_its_name(value, where, message):
    with pytest.raises(ValueError) as err:
        urgency.parse(value, where)
    assert str(err.value) == message


def test_admission_takes_the_most_urgent_and_waiting_raises_urgency():
    # (priority, seconds waited); aging 30 s per level
    assert priority.most_urgent([(1, 5.0), (0, 1.0), (2, 50.0)], 30.0) == 1
    assert priority.most_urgent([(1, 5.0), (0, 1.0), (2, 70.0)], 30.0) == 2     # 2 - 70/30 < 0
    assert priority.most_urgent([(1, 5.0), (1, 9.0)], 30.0) == 1                 # equals: the older first
    assert priority.most_urgent([(1, 5.0), (1, 9.0)], 0.0) == 1                  # no aging: still FIFO
    assert priority.effective(2, 45.0, 30.0) == 0.5
    assert priority.effective(2, 45.0, 0.0) == 2.0


def test_the_least_urgent_rows_beyond_the_allowance_make_way():
    rows = [1, 2, 1, 0, 1, 2]
    assert priority.to_preempt(rows, None, 2) == []
    assert priority.to_preempt(rows, 0, 2) == [1, 4, 5]        # the 2s, then the last 1 to join; keeps rows 0, 2
    assert priority.to_preempt(rows, 0, 0) == [0, 1, 2, 4, 5]
    assert priority.to_preempt(rows, 1, 0) == [1, 5]
    assert priority.to_preempt(rows, 0, 5) == []


def test_the_rows_beside_an_urgent_one_are_what_measured_steps_afford():
    # step_s[m - 1]: a decode step of m members, measured (seconds); share 0.8 of the speed alone
    gpu = (0.050, 0.052, 0.055, 0.055, 0.060, 0.060, 0.060, 0.070)
    assert priority.beside_rows(gpu, 0.8, 0) == 6            # 8 members: 0.050 / 0.070 = 0.71 < 0.8
    assert priority.beside_rows(gpu, 0.7, 0) == 7
    cpu = (0.051, 0.105, 0.070, 0.070, 0.079, 0.079, 0.079, 0.079)
    assert priority.beside_rows(cpu, 0.8, 0) == 0
    assert priority.beside_rows(cpu, 0.8, 2) == 2            # PRIORITY_DECODE_ROWS stays the floor
    assert priority.beside_rows(cpu, 0.6, 0) == 7            # 0.051 / 0.079 = 0.65
    assert priority.beside_rows((0.05, None, 0.05), 0.8, 1) == 2   # never timed: not counted
    assert priority.beside_rows((None, 0.05, 0.05), 0.8, 1) == 1   # the step alone never timed: the floor
    assert priority.beside_rows(gpu, 0.0, 3) == 3 and priority.beside_rows((), 0.8, 0) == 0


def test_a_step_size_counts_by_its_fastest_of_eight_timed_steps():
    from mlxstack.runner.spec.step_costs import StepCosts

    costs = StepCosts()
    for t in (0.164, 0.050, 0.170, 0.051, 0.160, 0.052, 0.150):     # a busy machine slows single steps
        costs.record(rows=1, width=1, seconds=t)
    assert costs.plain_step(1) is None                              # seven: not yet
    costs.record(rows=1, width=1, seconds=0.140)
    assert costs.plain_step(1) == 0.050 and costs.plain[1] > 0.1     # the fastest, not the moving average
    costs.record(rows=8, width=2, seconds=0.010)                    # a wider step is not a plain one
    assert costs.plain_step(8) is None and costs.fastest == {1: 0.050}


def test_the_plan_chooses_the_rows_beside_once_per_urgent_level():
    from types import SimpleNamespace as NS

    from mlxstack.scheduler.plan import InFlight, Scheduler

    def row(prio):
        return NS(job=NS(priority=prio), tail=False, shielded=False)

    bg = tuple(row(1) for _ in range(4))
    sched = Scheduler(64, True, aging_s=30.0)
    cheap, dear = (0.05,) * 8, (0.05, 0.1, 0.1, 0.1, 0.2, 0.2, 0.2, 0.2)
    flight = dict(decoding=bg, max_rows=8, prioritised=True, share=0.8, now=1.0)
    assert sched.schedule(InFlight(step_s=cheap, **flight)).preempt == ()
    sched.prefilling = [NS(job=NS(priority=0), prep=NS(model_tokens=[1, 2]), start=0, pos=-1, follows=None,
                           queued_at=1.0, live=NS(depth=0))]
    plan = sched.schedule(InFlight(step_s=cheap, **flight))
    assert plan.urgent == 0 and plan.preempt == ()           # steps of 5 cost what one does: all stay
    # the costs drift mid-way: the choice made when the urgent request came stands (no flapping)
    assert sched.schedule(InFlight(step_s=dear, **flight)).preempt == ()
    sched.prefilling = []
    sched.schedule(InFlight(step_s=dear, **flight))    # it is done
    sched.prefilling = [NS(job=NS(priority=0), prep=NS(model_tokens=[1, 2]), start=0, pos=-1, follows=None,
                           queued_at=1.0, live=NS(depth=0))]
    plan = sched.schedule(InFlight(step_s=dear, **flight))
    assert len(plan.preempt) == 4                            # the next urgent request: chosen anew


def test_preempted_rows_come_back_most_urgent_first_and_aged_ones_beside_an_urgent_request():
    pre = [(2, 1.0), (1, 2.0), (1, 10.0)]
    # nothing more urgent in flight: as many as there are free rows, the most urgent (then oldest) first
    assert priority.to_resume(pre, None, 0, 2, 2, 30.0) == [2, 1]
    assert priority.to_resume(pre, None, 0, 2, 5, 30.0) == [2, 1, 0]
    # beside an urgent (0) request: up to ``beside`` less urgent rows in all
    assert priority.to_resume(pre, 0, 1, 2, 5, 30.0) == [2]
    assert priority.to_resume(pre, 0, 2, 2, 5, 30.0) == []
    # one that waited past a level is no longer less urgent: it comes back anyway
    assert priority.to_resume([(1, 31.0), (1, 2.0)], 0, 2, 2, 5, 30.0) == [0]


# ---------------------------------------------------------------------------- the engine
SYSTEM = "You are a coding agent working in a repository. Keep answers short. " * 2
BACKGROUND = ["Explain the parser.", "List three test commands for this repository please.",
              "Why does caching matter for agents?", "Summarise the README in one sentence."]


def _job(user: str, prio: int, max_tokens: int, seed: int | None = None, session: str = "s"):
    j, _ = job([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
               max_tokens=max_tokens, session=session)
    if seed is not None:
        j.params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, max_tokens=max_tokens, seed=seed)
    j.priority = prio
    return j


class Driver:
    """The worker's admission (engine/worker.py ``_admit``) on this thread, step by step: a backlog
    of (job, future, submitted), admitted by ``pick_next`` / ``room_for`` before every step."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.backlog: list = []
        self.members: list[int] = []

    def submit(self, j) -> Future:
        f: Future = Future()
        self.backlog.append((j, f, time.perf_counter()))
        return f

    def turn(self) -> None:
        core = self.core
        while self.backlog:
            now = time.perf_counter()
            i = core.pick_next([(j.priority, now - t) for j, _, t in self.backlog])
            if not core.room_for(self.backlog[i][0].priority):
                break
            j, f, t = self.backlog.pop(i)
            f.set_running_or_notify_cancel()
            core.admit(j, f, queued_at=t)
        if not core.idle():
            core.step()
            self.members.append(len(core.group))

    def until_idle(self, limit: int = 2000) -> None:
        for _ in range(limit):
            if self.core.idle() and not self.backlog:
                return
            self.turn()
        raise AssertionError("the engine did not finish")


def _alone(path, j):
    return build_engine(engine_settings(path)).run(j)


@pytest.fixture(scope="module")
def dense(tiny_dense_path):
    return tiny_dense_path


def _full_batch(dense, beside: int):
    """Four background rows (greedy and seeded) decoding a few tokens in a full batch of 4, with
    PRIORITY_DECODE_ROWS ``beside``; each reply alone, and an urgent question with its reply alone."""
    background = [lambda i=i: _job(BACKGROUND[i], 1, 40, seed=(7 + i if i % 2 else None), session=f"b{i}")
                  for i in range(4)]
    urgent = lambda: _job("Quick: what is 2+2?", 0, 12, session="u")   # noqa: E731
    alone = [_alone(dense, mk()).raw_text for mk in background]
    urgent_alone = _alone(dense, urgent()).raw_text
    eng = build_engine(engine_settings(dense))
    core = EngineCore(eng, 4, 64, batching=batching_support(eng)[0], policy=PriorityPolicy(True, beside, 30.0))
    drv = Driver(core)
    futures = [drv.submit(mk()) for mk in background]
    while len(core.group) < 4:
        drv.turn()
    for _ in range(3):
        drv.turn()                                   # every background row has decoded a few tokens
    return eng, core, drv, futures, list(core.group.seqs), alone, urgent, urgent_alone


def test_an_urgent_request_preempts_less_urgent_rows_and_every_reply_is_what_it_is_alone(dense):
    eng, core, drv, futures, rows, alone, urgent, urgent_alone = _full_batch(dense, beside=1)
    assert core.preemptions == 0 and [s.status for s in rows] == [RequestStatus.DECODING] * 4
    uf = drv.submit(urgent())
    drv.turn()
    # the full batch made room: its least urgent row, the last to join among equals, then (in the
    # step) every less urgent row beyond the one allowed beside the urgent request
    assert [s is r for s, r in zip(core.preempted, (rows[3], rows[1], rows[2]))] == [True] * 3
    assert core.preemptions == 3 and len(core.preempted) == 3
    assert [s.status for s in core.preempted] == [RequestStatus.PREEMPTED] * 3
    assert [s.preemptions for s in rows] == [0, 1, 1, 1]
    while not uf.done():
        drv.turn()
        assert len(core.group) <= 2                  # the urgent row and one beside it
        assert len(core.preempted) in (0, 3)
    assert uf.result().raw_text == urgent_alone
    assert not any(f.done() for f in futures[1:])   # the preempted rows waited
    drv.until_idle()
    assert core.resumed == 3 and core.preempted == [] and core.preemptions == 3
    assert [f.result().raw_text for f in futures] == alone
    assert all(s.status is RequestStatus.FINISHED for s in rows)
    assert eng.state.counters.get("store_failures") == 0


def test_a_batch_whose_every_row_makes_way_is_set_aside_whole_and_comes_back_without_a_copy(dense, monkeypatch):
    """Beside nothing (PRIORITY_DECODE_ROWS 0): the full batch's least urgent row leaves first to
    free a row (a copy of its KV), then every other row leaves at once -- the batch is set aside
    as it is (slab, rows, members: no copy) while the urgent request decodes alone on its own
    cache, and comes back whole once it is done. Every reply is what it is alone."""
    from mlxstack.cache.slab import SlabKVCache
    from mlxstack.runner.kv_bytes import resident_bytes

    taken = []
    real_take = SlabKVCache.take
    monkeypatch.setattr(SlabKVCache, "take", lambda self, row, whole=False: taken.append(row) or
                        real_take(self, row, whole))
    eng, core, drv, futures, rows, alone, urgent, urgent_alone = _full_batch(dense, beside=0)
    taken.clear()
    uf = drv.submit(urgent())
    drv.turn()
    group = core.group
    assert core.preemptions == 4 and group.pauses == 1 and group.paused is not None
    assert [s is r for s, r in zip(group.paused.seqs, rows[:3])] == [True] * 3   # the three left at once
    assert core.preempted[0] is rows[3] and len(taken) == len(group.kv_idx)      # one row copied out, once a layer
    paused_bytes = resident_bytes([group.paused_slab])
    assert paused_bytes > 0 and eng.state.live_kv_bytes >= paused_bytes         # counted while set aside
    while not uf.done():
        drv.turn()
        assert len(core.group) <= 1 and len(core.preempted) in (0, 4)
    assert uf.result().raw_text == urgent_alone
    assert len(taken) == len(group.kv_idx)           # nothing copied while the urgent row decoded
    drv.until_idle()
    assert group.unpaused == 1 and group.paused is None and core.resumed == 4
    assert [f.result().raw_text for f in futures] == alone
    assert eng.state.counters.get("store_failures") == 0


@pytest.mark.parametrize("machine,plain,kept", [
    # a batch of 8 costs 1.2x one row (a GPU, Apple Silicon): every row goes on beside the urgent one
    ("gpu", {1: 0.050, 2: 0.052, 4: 0.055, 8: 0.060}, 4),
    # a step's cost grows with its rows (this CPU's figures): none may stay, the background pauses
    ("cpu", {1: 0.051, 2: 0.105, 4: 0.070, 8: 0.079}, 0),
])
def test_the_rows_beside_an_urgent_request_are_those_the_measured_steps_afford(dense, monkeypatch, machine, plain,
                                                                               kept):
    """PRIORITY_DECODE_SHARE: less urgent rows stay beside the urgent one while a decode step of that
    many rows was measured to keep its tokens at the share of their speed alone (frozen costs: the
    table is what the decode group measured, its updates switched off)."""
    from mlxstack.runner.spec.step_costs import StepCosts

    background = [lambda i=i: _job(BACKGROUND[i], 1, 40, seed=(7 + i if i % 2 else None), session=f"b{i}")
                  for i in range(4)]
    urgent = lambda: _job("Quick: what is 2+2?", 0, 12, session="u")   # noqa: E731
    alone = [_alone(dense, mk()).raw_text for mk in background]
    urgent_alone = _alone(dense, urgent()).raw_text

    monkeypatch.setattr(StepCosts, "record", lambda self, rows, width, seconds: None)
    eng = build_engine(engine_settings(dense))
    costs = eng.speculation.costs
    costs.fastest = dict(plain)
    costs.seen = {(r, 1): 8 for r in plain}
    costs.seen[(2, 1)] = 7 if machine == "cpu" else 8    # timed too few times: not counted
    core = EngineCore(eng, 8, 64, batching=batching_support(eng)[0], policy=PriorityPolicy(True, 0, 30.0, 0.8))
    drv = Driver(core)
    futures = [drv.submit(mk()) for mk in background]
    while len(core.group) < 4:
        drv.turn()
    drv.turn()
    assert core.group.step_times(8) == tuple(plain[r] for r in (1, 4, 4, 4, 8, 8, 8, 8))   # rows the forward computes
    assert costs.plain_step(2) == (None if machine == "cpu" else plain[2])
    uf = drv.submit(urgent())
    while not uf.done():
        drv.turn()
        assert len(core.preempted) == 4 - kept
    assert core.preemptions == 4 - kept and uf.result().raw_text == urgent_alone
    drv.until_idle()
    assert core.resumed == 4 - kept and [f.result().raw_text for f in futures] == alone


def test_without_priorities_the_urgent_request_waits_for_a_row(dense):
    eng = build_engine(engine_settings(dense))
    core = EngineCore(eng, 2, 64, batching=batching_support(eng)[0], policy=PriorityPolicy(False, 1, 30.0))
    drv = Driver(core)
    futures = [drv.submit(_job(BACKGROUND[i], 1, 16, session=f"b{i}")) for i in range(2)]
    while len(core.group) < 2:
        drv.turn()
    uf = drv.submit(_job("Quick: what is 2+2?", 0, 6, session="u"))
    drv.turn()
    assert core.preemptions == 0 and len(drv.backlog) == 1        # no room, none made
    drv.until_idle()
    assert core.preemptions == 0 and uf.result().raw_text == _alone(dense, _job("Quick: what is 2+2?", 0, 6)).raw_text
    assert all(f.done() for f in futures)


def test_a_preempted_row_whose_client_left_ends_while_it_waits(dense):
    eng = build_engine(engine_settings(dense))
    core = EngineCore(eng, 2, 64, batching=batching_support(eng)[0], policy=PriorityPolicy(True, 0, 30.0))
    drv = Driver(core)
    gone = {"left": False}
    jobs = [_job(BACKGROUND[i], 1, 40, session=f"b{i}") for i in range(2)]
    jobs[1].is_cancelled = lambda: gone["left"]
    futures = [drv.submit(j) for j in jobs]
    while len(core.group) < 2:
        drv.turn()
    drv.turn()
    uf = drv.submit(_job("Quick: what is 2+2?", 0, 30, session="u"))
    drv.turn()
    assert core.preemptions == 2 and len(core.preempted) == 2   # beside 0: the urgent request decodes alone
    gone["left"] = True
    drv.turn()
    assert len(core.preempted) == 1 and futures[1].done() and futures[1].result().finish_reason == "cancelled"
    drv.until_idle()
    assert uf.result().raw_text == _alone(dense, _job("Quick: what is 2+2?", 0, 30)).raw_text
    assert futures[0].result().raw_text == _alone(dense, _job(BACKGROUND[0], 1, 40)).raw_text
    assert core.resumed == 1


def test_a_preempted_row_that_waited_past_a_level_comes_back_beside_the_urgent_one(dense):
    eng = build_engine(engine_settings(dense))
    core = EngineCore(eng, 2, 64, batching=batching_support(eng)[0], policy=PriorityPolicy(True, 0, 30.0))
    drv = Driver(core)
    bf = drv.submit(_job(BACKGROUND[0], 1, 30, session="b0"))
    while len(core.group) < 1:
        drv.turn()
    drv.turn()
    uf = drv.submit(_job("Quick: what is 2+2?", 0, 30, session="u"))
    drv.turn()
    assert core.preemptions == 1 and len(core.preempted) == 1
    seq = core.preempted[0]
    seq.preempted_at -= 31.0                         # as if it had waited 31 s (aging: 30 s a level)
    drv.turn()
    assert core.preempted == [] and seq.shielded and seq.status is RequestStatus.DECODING
    drv.until_idle()
    assert core.preemptions == 1                     # came back by waiting: not preempted again
    assert bf.result().raw_text == _alone(dense, _job(BACKGROUND[0], 1, 30)).raw_text
    assert uf.result().raw_text == _alone(dense, _job("Quick: what is 2+2?", 0, 30)).raw_text


# ---------------------------------------------------------------------------- the HTTP fronts
def _post(port: int, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_fronts_take_a_priority_and_refuse_a_bad_one(dense):
    server = LiveServer(engine_settings(dense))
    try:
        msgs = [{"role": "user", "content": "hi"}]
        code, body = _post(server.port, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2,
                                                                  "priority": "urgent"})
        assert code == 400 and body["error"]["param"] == "priority"
        assert body["error"]["message"] == "'priority' must be an integer (lower goes first)"
        code, body = _post(server.port, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2},
                           {urgency.HEADER: "soon"})
        assert code == 400 and body["error"]["message"] == "'x-mlxstack-priority' must be an integer (lower goes first)"
        code, body = _post(server.port, "/v1/messages", {"messages": msgs, "max_tokens": 2},
                           {urgency.HEADER: "2000"})
        assert code == 400 and body["type"] == "error" and "between -1000 and 1000" in body["error"]["message"]
        code, body = _post(server.port, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2,
                                                                  "priority": -5})
        assert code == 200 and body["choices"][0]["message"]["role"] == "assistant"
    finally:
        server.close()


def test_with_a_backlog_behind_a_full_batch_the_urgent_request_decodes_alone(dense):
    eng = build_engine(engine_settings(dense))
    core = EngineCore(eng, 2, 64, batching=batching_support(eng)[0], policy=PriorityPolicy(True, 0, 30.0))
    drv = Driver(core)
    futures = [drv.submit(_job(BACKGROUND[i % 4], 1, 24, session=f"b{i}")) for i in range(4)]
    while len(core.group) < 2:
        drv.turn()
    drv.turn()
    uf = drv.submit(_job("Quick: what is 2+2?", 0, 20, session="u"))
    drv.turn()
    assert core.preemptions == 2 and len(drv.backlog) == 2       # the backlog waits behind the preempted rows
    while not uf.done():
        drv.turn()
        assert len(core.group) <= 1 and len(drv.backlog) == 2
    drv.until_idle()
    assert core.resumed == 2 and all(f.done() for f in futures)
    assert [f.result().raw_text for f in futures] == [_alone(dense, _job(BACKGROUND[i % 4], 1, 24)).raw_text
                                                      for i in range(4)]


def test_an_urgent_request_overtakes_one_parked_for_memory_and_every_reply_is_what_it_is_alone(dense):
    """A budget that holds the decoding background row A (as measured in flight) and the short
    urgent question U, not A and the long background prompt B: B is parked for memory; U, more
    urgent than every parked request, is admitted past it (LESSONS 91) and replies while B still
    waits; B starts once A's memory is free. Every reply is what it is alone."""
    from mlxstack.scheduler.admission import need_bytes
    from mlxstack.scheduler.policy import growth

    a = lambda: _job(BACKGROUND[0], 1, 24, session="ba")                                      # noqa: E731
    b = lambda: _job(BACKGROUND[1] + " Explain every step in detail." * 24, 1, 8, session="bb")  # noqa: E731
    u = lambda: _job("Quick: what is 2+2?", 0, 6, session="u")                                # noqa: E731
    alone = {k: _alone(dense, mk()) for k, mk in (("a", a), ("b", b), ("u", u))}

    eng = build_engine(engine_settings(dense))
    core = EngineCore(eng, 4, 64, batching=batching_support(eng)[0], policy=PriorityPolicy(True, 1, 30.0))
    drv = Driver(core)
    fa = drv.submit(a())
    while len(core.group) < 1:
        drv.turn()
    per_token, per_seq = core._per_token()
    need = {k: need_bytes(per_token, per_seq, o.prompt_tokens, growth(mk().params.max_tokens, 0))
            for (k, o), mk in zip(alone.items(), (a, b, u))}
    eng.state.cache_budget = core.committed_bytes() + need["u"] + 8 * per_token   # A as held, and U
    assert need["b"] > need["u"] + 8 * per_token
    fb = drv.submit(b())
    drv.turn()
    parked = core.parked
    assert parked is not None and len(parked.prep.model_tokens) == alone["b"].prompt_tokens   # B
    assert parked.status is RequestStatus.PARKED and not core.has_room(1) and core.has_room(0)
    fu = drv.submit(u())
    drv.turn()
    assert drv.backlog == [] and core.parked is parked                 # U started past the parked B
    while not fu.done():
        drv.turn()
        assert (core.parked is parked or fu.done()) and not fb.done()  # B waits until U's memory is free
    assert fu.result().raw_text == alone["u"].raw_text and not fa.done()
    drv.until_idle()
    assert [fa.result().raw_text, fb.result().raw_text] == [alone["a"].raw_text, alone["b"].raw_text]
    assert core.parked_total == 1 and core.waiting_memory == [] and core.preemptions == 0


@pytest.mark.parametrize("prioritised", [True, False])
def test_the_users_entry_outlives_its_sub_agents_under_the_entry_limit(dense, prioritised):
    """The user's turn (priority 0) is stored first, then three sub-agents' turns (priority 1) on a
    cache of three entries: with priorities a sub-agent's entry makes room and the user's next
    turn reuses its whole first prompt; without them the user's entry, the oldest, went first."""
    eng = build_engine(engine_settings(dense, prompt_cache_max_entries_global=3,
                                       priority_scheduling=prioritised))
    first = _job("The user's own question about the build.", 0, 4, session="user")
    out = eng.run(first)
    for i in range(3):
        eng.run(_job(f"Sub-agent task number {i}: survey a module.", 1, 4, session=f"agent{i}"))
    kept = sorted(e.session_id for e in eng.state.kv.index.entries())
    assert len(kept) == 3
    assert ("user" in kept) is prioritised, kept
    again, _ = job([{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "The user's own question about the build."},
                    {"role": "assistant", "content": out.raw_text}, {"role": "user", "content": "And then?"}],
                   max_tokens=4, session="user")
    reused = eng.run(again).cached_tokens
    assert (reused >= out.prompt_tokens) is prioritised, (reused, out.prompt_tokens)
