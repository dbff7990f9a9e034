"""The scheduler decides on plain data (scheduler/: no MLX, no model): these drive it with plain
requests and check each step's plan exactly."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from mlxstack.scheduler.admission import applies, committed_bytes, need_bytes, room
from mlxstack.scheduler.plan import InFlight, Scheduler, StepPlan, left
from mlxstack.scheduler.policy import GROWTH, choose_short, growth, remaining

PKG = Path(__file__).resolve().parents[1] / "mlxstack"


def req(name: str, prompt: int, start: int = 0, pos: int = -1, follows=None, prefill_only=False, depth=None):
    return SimpleNamespace(name=name, prep=SimpleNamespace(model_tokens=list(range(prompt))), start=start, pos=pos,
                           follows=follows, job=SimpleNamespace(prefill_only=prefill_only),
                           live=SimpleNamespace(depth=start if depth is None else depth))


def names(plan: StepPlan) -> tuple:
    return tuple(r.name for r in plan.short) if plan.short else (plan.prefill.name if plan.prefill else None)


def test_the_scheduler_imports_no_mlx_and_no_other_mlxstack_layer_with_it():
    code = ("import sys, pkgutil, importlib, mlxstack.scheduler as s\n"
            "for m in pkgutil.walk_packages(s.__path__, 'mlxstack.scheduler.'): importlib.import_module(m.name)\n"
            "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('mlx', 'mlx_lm', 'mlx_vlm', 'llguidance'))\n"
            "ours = sorted({n.split('.')[1] for n in sys.modules if n.startswith('mlxstack.') and n.count('.') >= 1})\n"
            "print(bad, ours)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent).stdout.strip()
    assert out == "[] ['cache', 'scheduler']", out


def test_round_robin_over_long_prompts_and_a_drop_keeps_the_turn():
    s = Scheduler(prefill_budget=64, prefills_together=False)
    a, b, c = req("a", 500), req("b", 500), req("c", 500)
    for r in (a, b, c):
        s.enter(r)
    assert [names(s.schedule()) for _ in range(4)] == ["a", "b", "c", "a"]
    s.drop(a)                                  # a finished: b is next, not c
    assert names(s.schedule()) == "b"
    assert s.steps == 5 and s.short_batches == 0


def test_a_short_remainder_goes_first_but_never_twice_in_a_row_while_a_long_one_waits():
    s = Scheduler(prefill_budget=64, prefills_together=False)
    long_, short1, short2 = req("long", 500), req("s1", 40), req("s2", 30)
    for r in (long_, short1, short2):
        s.enter(r)
    first = s.schedule()
    assert names(first) == "s2" and first.budget == 64          # the smallest that one chunk finishes
    s.drop(short2)
    assert names(s.schedule()) == "long"            # then the long one's chunk
    assert names(s.schedule()) == "s1"


def test_short_remainders_prefill_together_within_the_padded_budget():
    s = Scheduler(prefill_budget=100, prefills_together=True)
    rs = [req("a", 30, start=10, depth=10), req("b", 45, start=20, depth=20), req("c", 400), req("d", 60, start=25, depth=25)]
    for r in rs:
        s.enter(r)
    plan = s.schedule()
    # remainders 20, 25, 400, 35: a and b fit (2 x 25 = 50), d would make 3 x 35 = 105 > 100
    assert names(plan) == ("a", "b") and s.short_batches == 1
    assert [r.name for r in s.prefilling] == ["c", "d"]
    assert names(s.schedule()) == "c"               # after short work out of turn: the long one
    assert names(s.schedule()) == "d"               # then the short one that one chunk finishes


def test_followers_prefill_only_and_abandoned_requests_never_join_a_shared_forward():
    s = Scheduler(prefill_budget=100, prefills_together=True)
    leader = req("lead", 40)
    gone_, out = req("gone", 30, pos=5), req("out", 10)
    rs = [leader, req("f", 40, follows=(leader, 20)), req("only", 10, prefill_only=True), gone_, req("fresh", 30)]
    for r in rs:
        s.enter(r)
    # the hang-ups a plan reads: of requests that started feeding, and of the preempted rows
    assert [r.name for r in s.hearing((out,))] == ["gone", "out"]
    plan = s.schedule(InFlight(stopped=frozenset({id(gone_)})))
    assert names(plan) == ("lead", "fresh")


def test_with_a_prefixed_row_an_empty_request_prefills_on_its_own():
    s = Scheduler(prefill_budget=100, prefills_together=True)
    rs = [req("p", 30, start=10, depth=10), req("q", 30, start=5, depth=5), req("empty", 20)]
    for r in rs:
        s.enter(r)
    plan = s.schedule(InFlight(prefixed=frozenset({id(rs[0])})))
    assert names(plan) == ("p", "q")
    assert [r.name for r in s.prefilling] == ["empty"]


def test_a_request_waiting_for_its_leader_is_skipped_by_round_robin():
    s = Scheduler(prefill_budget=16, prefills_together=False)
    leader = req("lead", 300)
    for r in (leader, req("f", 300, follows=(leader, 200)), req("x", 300)):
        s.enter(r)
    assert [names(s.schedule()) for _ in range(4)] == ["lead", "x", "lead", "x"]


def test_reset_forgets_everything_waiting():
    s = Scheduler(prefill_budget=16, prefills_together=True)
    s.enter(req("a", 100))
    s.reset()
    plan = s.schedule()
    assert plan == StepPlan(step=1) and s.prefilling == []


def test_policy_and_admission_arithmetic():
    assert remaining(100, 30, -1) == 70 and remaining(100, 30, 60) == 40
    assert left(req("a", 100, start=30, pos=60)) == 40
    assert growth(1000, 10) == GROWTH and growth(100, 90) == 10 and growth(100, 120) == 0
    assert choose_short([20, 0, 25, 400, 35], 100) == [0, 2]
    assert need_bytes(per_token=10, per_seq=7, uncached=50, growth=256) == 10 * 306 + 7
    assert committed_bytes(held=1000, per_token=10, ahead_tokens=5) == 1050
    assert room(budget=5000, committed=3000, need=2500) == -500
    assert applies(5000, others_in_flight=True, replicated=False) is True
    assert applies(0, True, False) is False                         # no budget
    assert applies(5000, False, False) is False                     # alone: always runs
    assert applies(5000, True, True) is False                       # several ranks decide alike


# ---------------------------------------------------------------------------- the plan's row moves
def row(name: str, prio: int, tail=False, shielded=False, preempted_at=0.0):
    return SimpleNamespace(name=name, job=SimpleNamespace(priority=prio, prefill_only=False), tail=tail,
                           shielded=shielded, preempted_at=preempted_at,
                           prep=SimpleNamespace(model_tokens=list(range(10))), start=0, pos=-1, follows=None,
                           live=SimpleNamespace(depth=0))


def moved(plan: StepPlan) -> tuple:
    return tuple(tuple(r.name for r in rs) for rs in (plan.end, plan.preempt, plan.resume)) + (plan.urgent,)


def test_the_plan_moves_rows_for_an_urgent_prompt_and_back_once_it_is_gone():
    """An urgent prompt waiting to prefill: the less urgent decode rows beyond ``beside`` leave (the
    least urgent first, the last to join among equals; never a row whose last prompt token rides in
    the next step, never one shielded); a preempted row whose client left ends; once nothing more
    urgent is in flight the preempted rows come back, most urgent first, as rows free up."""
    s = Scheduler(prefill_budget=64, prefills_together=False, aging_s=30.0)
    a, b, c, d = row("a", 1), row("b", 2), row("c", 2, tail=True), row("d", 2, shielded=True)
    urgent = row("u", 0)
    s.enter(urgent)
    flight = InFlight(decoding=(a, b, c, d), max_rows=4, prioritised=True, beside=1, aging_s=30.0, now=100.0)
    plan = s.schedule(flight)
    assert moved(plan) == ((), ("a", "b"), (), 0) and plan.prefill is urgent
    s.drop(urgent)
    a.preempted_at = b.preempted_at = 100.0
    x = row("x", 1, preempted_at=90.0)   # its client left
    back = InFlight(decoding=(c, d), preempted=(a, b, x), max_rows=4, prioritised=True, beside=1, now=101.0,
                    stopped=frozenset({id(x)}))
    assert moved(s.schedule(back)) == (("x",), (), ("a", "b"), 2)
    one_row = InFlight(decoding=(c, d, row("e", 1)), preempted=(b, a), max_rows=4, prioritised=True, beside=1,
                       now=101.0)
    assert moved(s.schedule(one_row)) == ((), (), ("a",), 1)      # one free row: the more urgent
    assert moved(s.schedule(InFlight(decoding=(a, b), max_rows=4))) == ((), (), (), None)  # off
