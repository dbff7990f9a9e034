"""Continuous batching (issue 12): many requests in flight on the one inference thread, each with
its whole cache pipeline. The proof is parity with running alone: every sequence's greedy output
in a batched run equals its output when run by itself -- sequences starting from different cached
depths, one of them hanging up mid-batch, seeded sampling keeping its own stream -- and cache
reuse per request is the same as sequentially. Driven step by step through the real Scheduler
(engine/core.py), and concurrently over real HTTP.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import Future

import pytest

from mlxstack.runner.batch import batching_support
from mlxstack.engine.core import EngineCore
from mlxstack.scheduler.policy import choose_short, next_round_robin
from mlxstack.runner.sampling import SamplingParams
from tests.conftest import LiveServer, build_engine, engine_settings
from tests.test_engine import job

pytestmark = pytest.mark.slow  # batched decode parity on every tiny kind and the embedded model, ~1.5 min here (docs/testing.md#tiers)

SYSTEM = "You are a coding agent. Keep answers short and precise. " * 3
PROMPTS = ["Explain the parser.", "List three test commands for this repository please.",
           "Why does caching matter for agents?", "Summarise the README in one sentence.",
           "What is a KV cache? Answer in detail, with an example from a chat session."]


def convo(user: str, history: list[dict] | None = None) -> list[dict]:
    return (history or [{"role": "system", "content": SYSTEM}]) + [{"role": "user", "content": user}]


def run_batched(engine, jobs, budget=64, max_sequences=8, cancel_after=None):
    """Admit every job at once and step the real scheduler until all finish (on this thread)."""
    sched = EngineCore(engine, max_sequences, budget, batching=batching_support(engine)[0])
    futures = []
    for j in jobs:
        f = Future()
        f.set_running_or_notify_cancel()
        sched.admit(j, f)
        futures.append(f)
    sizes, members = [], []
    while not sched.idle():
        sched.step()
        sizes.append(sched.last_batch)
        members.append(len(sched.group))
    run_batched.members = members
    run_batched.sched = sched
    return [f.result() for f in futures], sizes


@pytest.fixture(scope="module")
def dense(tiny_dense_path):
    return tiny_dense_path


def test_batching_is_detected_per_model(tiny_kind_paths):
    for kind in ("dense", "gemma3", "gpt_oss", "mamba2", "lfm2", "hybrid"):
        assert batching_support(build_engine(engine_settings(tiny_kind_paths(kind)))) == (True, ""), kind
    ok, why = batching_support(build_engine(engine_settings(tiny_kind_paths("llama4"))))
    assert not ok and "no batched form" in why                      # ChunkedKVCache: mlx-lm has none


def test_batched_outputs_equal_solo_outputs_from_different_cached_depths(dense):
    solo_engine = build_engine(engine_settings(dense))
    batch_engine = build_engine(engine_settings(dense))
    # warm both engines with the same earlier turns, so requests start at different cached depths
    histories = {}
    for i, p in enumerate(PROMPTS[:3]):
        for eng in (solo_engine, batch_engine):
            o = eng.run(job(convo(p), max_tokens=6, session=f"s{i}")[0])
        histories[i] = convo(p) + [{"role": "assistant", "content": o.text}]
    requests = [(convo("And then?", histories[0]), "s0"), (convo("Go on.", histories[1]), "s1"),
                (convo(PROMPTS[3]), "s3"), (convo("More detail please.", histories[2]), "s2"),
                (convo(PROMPTS[4]), "s4")]
    solo = [solo_engine.run(job(m, max_tokens=14, session=s)[0]) for m, s in requests]
    batched, sizes = run_batched(batch_engine, [job(m, max_tokens=14, session=s)[0] for m, s in requests])
    assert [o.raw_text for o in batched] == [o.raw_text for o in solo]
    assert [o.cached_tokens for o in batched] == [o.cached_tokens for o in solo]    # reuse unchanged
    assert len({o.cached_tokens for o in batched}) >= 3                              # different depths
    assert max(sizes) == 5                                                           # all decoded together
    assert batch_engine.state.counters.get("store_failures") == 0


def test_a_hang_up_mid_batch_removes_only_that_sequence(dense):
    solo_engine = build_engine(engine_settings(dense))
    batch_engine = build_engine(engine_settings(dense))
    solo = [solo_engine.run(job(convo(p), max_tokens=12, session=f"h{i}")[0]) for i, p in enumerate(PROMPTS[:4])]
    jobs = [job(convo(p), max_tokens=12, session=f"h{i}")[0] for i, p in enumerate(PROMPTS[:4])]
    emitted: list[str] = []
    jobs[1].emit = emitted.append
    jobs[1].is_cancelled = lambda: len(emitted) >= 3
    out, _ = run_batched(batch_engine, jobs)
    assert out[1].aborted and out[1].finish_reason == "cancelled" and out[1].completion_tokens <= 5
    assert [out[i].raw_text for i in (0, 2, 3)] == [solo[i].raw_text for i in (0, 2, 3)]


def test_seeded_sampling_keeps_its_own_stream_in_a_batch(dense):
    eng = build_engine(engine_settings(dense))

    def sampled(i, seed):
        j, _ = job(convo(PROMPTS[i]), max_tokens=12, session=f"r{i}")
        j.params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, max_tokens=12, seed=seed)
        return j

    alone = [eng.run(sampled(i, 100 + i)).raw_text for i in range(3)]
    together, _ = run_batched(build_engine(engine_settings(dense)), [sampled(i, 100 + i) for i in range(3)])
    assert [o.raw_text for o in together] == alone


def test_a_short_request_waits_at_most_one_chunk_of_a_long_prefill(dense):
    eng = build_engine(engine_settings(dense))
    long_user = " ".join(f"item {i}: check the parser output for token {i * 3}." for i in range(120))
    sched = EngineCore(eng, 8, 64, batching=True)
    long_f, short_f = Future(), Future()
    for f in (long_f, short_f):
        f.set_running_or_notify_cancel()
    sched.admit(job(convo(long_user), max_tokens=4, session="long")[0], long_f)
    sched.step()                                   # the long prompt's first chunk
    sched.step()
    short = job(convo("hi"), max_tokens=4, session="short")[0]
    sched.admit(short, short_f)
    steps = 0
    while not short_f.done() and not any(s.job is short for s in sched.group.seqs):
        sched.step()
        steps += 1
    assert steps == 1                              # its own (only) chunk goes before the long one's next
    sched.step()
    assert long_f.done() is False and sched.prefilling[0].pos > 128   # then the long one moves on
    while not sched.idle():
        sched.step()
    assert long_f.result().prompt_tokens > 1000 and short_f.result().completion_tokens == 4


def test_short_warm_prefills_go_through_one_forward_with_parity(dense):
    """Warm follow-ups (a few new tokens each, from different cached depths) and one cold short
    prompt (an empty cache) admitted together: one batched prefill, all decode from the next
    step, every output equal to its solo run, reuse unchanged."""
    solo_engine, batch_engine = build_engine(engine_settings(dense)), build_engine(engine_settings(dense))
    histories = {}
    for i, p in enumerate(PROMPTS[:3]):
        for eng in (solo_engine, batch_engine):
            o = eng.run(job(convo(p), max_tokens=5 + i, session=f"w{i}")[0])
        histories[i] = convo(p) + [{"role": "assistant", "content": o.text}]
    requests = [(convo("And then?", histories[0]), "w0"), (convo("Go on, in detail.", histories[1]), "w1"),
                (convo("More.", histories[2]), "w2"),
                ([{"role": "user", "content": PROMPTS[3]}], "w3")]
    solo = [solo_engine.run(job(m, max_tokens=12, session=s)[0]) for m, s in requests]
    batched, sizes = run_batched(batch_engine, [job(m, max_tokens=12, session=s)[0] for m, s in requests],
                                 budget=512)
    assert run_batched.sched.short_batches == 1
    assert run_batched.members[0] == 4 and sizes[0] == 4          # all decoding after the first step
    assert [o.raw_text for o in batched] == [o.raw_text for o in solo]
    assert [o.cached_tokens for o in batched] == [o.cached_tokens for o in solo]
    assert batched[3].cached_tokens == 0 and min(o.cached_tokens for o in batched[:3]) > 0
    assert len({o.cached_tokens for o in batched[:3]}) == 3
    assert batch_engine.state.counters.get("store_failures") == 0


def test_choose_short_fits_the_padded_batch_in_the_budget():
    assert choose_short([10, 20, 5], 64) == [0, 1, 2]               # 3 x 20 = 60
    assert choose_short([10, 30, 5], 64) == [0, 1]                  # in order: 2 x 30 fits, 3 x 30 = 90 does not
    assert choose_short([10, 70, 5], 64) == [0, 2]                  # one remainder alone over the budget waits
    assert choose_short([100, 8, 8], 64) == [1, 2]                  # the long one waits its turn
    assert choose_short([0, 4], 64) == [1]                          # nothing left to feed: not chosen
    assert choose_short([], 64) == []


def test_short_batches_and_a_long_prefill_alternate(dense):
    eng = build_engine(engine_settings(dense))
    long_user = " ".join(f"item {i}: check the parser output for token {i * 3}." for i in range(60))
    sched = EngineCore(eng, 8, 128, batching=True)
    futures = [Future() for _ in range(4)]
    for f in futures:
        f.set_running_or_notify_cancel()
    sched.admit(job(convo(long_user), max_tokens=3, session="L")[0], futures[0])
    sched.step()
    long_seq = sched.prefilling[0]
    shorts = [job(convo(f"hi {i}"), max_tokens=3, session=f"S{i}")[0] for i in range(3)]
    for j, f in zip(shorts[:2], futures[1:3]):
        sched.admit(j, f)
    before = long_seq.pos
    sched.step()                                   # the two shorts, together
    assert sched.short_batches == 1 and long_seq.pos == before and len(sched.group) == 2
    sched.admit(shorts[2], futures[3])
    sched.step()                                   # the long one's chunk (the last short alone cannot batch)
    assert long_seq.pos > before
    while not sched.idle():
        sched.step()
    assert all(f.result().completion_tokens == 3 for f in futures)


@pytest.mark.parametrize("slack", [256, 1])
def test_sequences_join_and_leave_a_running_batch_with_parity(dense, monkeypatch, slack):
    """Members arrive while others decode and finish at different times: rows are freed and
    reused, the slab grows (2 -> 4 -> 8 rows) and shrinks again, and (slack 1) drops the columns
    leavers used after every leave; every output equals its solo run."""
    from mlxstack.runner import batch

    monkeypatch.setattr(batch, "COMPACT_SLACK", slack)
    compactions = []
    real_compact = batch.SlabKVCache.compact
    monkeypatch.setattr(batch.SlabKVCache, "compact",
                        lambda self, active, s=256: compactions.append(real_compact(self, active, s)) or compactions[-1])
    solo_engine, batch_engine = build_engine(engine_settings(dense)), build_engine(engine_settings(dense))
    prompts = [f"{p} (variant {i})" for i, p in enumerate(PROMPTS + PROMPTS[:2])]
    lengths = [4, 18, 9, 14, 6, 20, 11]
    solo = [solo_engine.run(job(convo(p), max_tokens=n, session=f"j{i}")[0])
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    sched = EngineCore(batch_engine, 8, 64, batching=True)
    futures, rows_seen = [], set()
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        f = Future()
        f.set_running_or_notify_cancel()
        sched.admit(job(convo(p), max_tokens=n, session=f"j{i}")[0], f)
        futures.append(f)
        for _ in range(3):                        # a few steps before the next one arrives
            sched.step()
            if sched.group.slab is not None:
                rows_seen.add(sched.group.slab[0].rows)
    while not sched.idle():
        sched.step()
        if sched.group.slab is not None:
            rows_seen.add(sched.group.slab[0].rows)
    assert [f.result().raw_text for f in futures] == [o.raw_text for o in solo]
    assert [f.result().completion_tokens for f in futures] == [o.completion_tokens for o in solo]
    assert 4 in rows_seen and len(rows_seen) >= 2
    assert sched.group.slab is None and not sched.group.row
    assert (max(compactions) > 0) if slack == 1 else (max(compactions, default=0) == 0)


def test_slab_rows_place_take_and_rebuild_exactly():
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxstack.cache.slab import SlabKVCache

    def own(n, seed):
        c = KVCache()
        k = mx.random.normal((1, 2, n, 4), key=mx.random.key(seed))
        c.update_and_fetch(k, k * 2)
        return c

    a, b, c = own(5, 1), own(9, 2), own(3, 3)
    slab = SlabKVCache.empty(4)
    slab.place(0, a.keys, a.values, a.offset)
    slab.place(2, b.keys, b.values, b.offset)        # longer than the shared index: rows shift right
    slab.place(1, c.keys, c.values, c.offset)
    assert slab._idx == 9 and slab.left_padding.tolist()[:3] == [4, 6, 0] and slab.offset.tolist()[:3] == [5, 3, 9]
    for row, src in ((0, a), (1, c), (2, b)):
        got = slab.take(row)
        assert got.offset == src.offset
        assert mx.array_equal(got.keys, src.keys[..., :src.offset, :]).item()
        assert mx.array_equal(got.values, src.values[..., :src.offset, :]).item()
    small = slab.rebuilt(2, [2, 1])
    assert small.rows == 2 and small._idx == 9 and small.left_padding.tolist() == [0, 6]
    assert mx.array_equal(small.take(1).keys, c.keys[..., :3, :]).item()
    with pytest.raises(ValueError):
        slab.place(3, None, None, 0)
    # row 2 (the longest) leaves: the columns only it used are dropped, the others read the same
    assert slab.compact([0, 1], slack=256) == 0                   # not worth a copy yet
    assert slab.compact([0, 1], slack=1) == 4
    assert slab._idx == 5 and slab.left_padding.tolist()[:2] == [0, 2]
    assert mx.array_equal(slab.take(0).keys, a.keys[..., :5, :]).item()
    assert mx.array_equal(slab.take(1).values, c.values[..., :3, :]).item()


def test_shortest_fitting_remainder_goes_first_only_when_a_longer_one_waits():
    from mlxstack.scheduler.policy import shortest_fitting

    assert shortest_fitting([900, 40, 12], 256) == 2                  # the smallest that one chunk finishes
    assert shortest_fitting([900, 300], 256) is None                 # nothing fits: round-robin
    assert shortest_fitting([40, 12], 256) is None                   # all fit: round-robin serves them
    assert shortest_fitting([900, 0, 30], 256) == 2                  # nothing left to feed is not a candidate
    assert shortest_fitting([], 256) is None


def test_round_robin_is_fair():
    order, last = [], -1
    for _ in range(7):
        last = next_round_robin(3, last)
        order.append(last)
    assert order == [0, 1, 2, 0, 1, 2, 0]
    assert next_round_robin(0, 5) == 0


@pytest.mark.parametrize("kind", ["gemma3", "gpt_oss", "mamba2", "lfm2", "hybrid"])
def test_windowed_and_recurrent_kinds_decode_batched_with_parity(tiny_kind_paths, kind):
    """Sliding windows (BatchRotatingKVCache) and recurrent / conv state (batched ArraysCache) decode
    in one forward: members join at different steps and depths, the window rotates mid-batch, one
    leaves early; every output equals its solo run, and the next turn reuses what they stored."""
    path = tiny_kind_paths(kind)
    solo_engine, batch_engine = build_engine(engine_settings(path)), build_engine(engine_settings(path))
    long_user = " ".join(f"step {i}: read the file and report." for i in range(12))
    prompts = [PROMPTS[0], long_user, PROMPTS[2], PROMPTS[4]]
    lengths = [20, 40, 6, 30]
    solo = [solo_engine.run(job(convo(p), max_tokens=n, session=f"k{i}")[0])
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    sched = EngineCore(batch_engine, 8, 64, batching=True)
    assert sched.group.batching and not sched.group.dense
    futures, sizes = [], []
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        f = Future()
        f.set_running_or_notify_cancel()
        sched.admit(job(convo(p), max_tokens=n, session=f"k{i}")[0], f)
        futures.append(f)
        for _ in range(2):
            sched.step()
            sizes.append(sched.last_batch)
    while not sched.idle():
        sched.step()
        sizes.append(sched.last_batch)
    out = [f.result() for f in futures]
    assert [o.raw_text for o in out] == [o.raw_text for o in solo]
    assert max(sizes) >= 3                                          # a batched forward, 3+ rows
    assert max(o.timings["batch_size_max"] for o in out) >= 3
    assert sched.group.slab is None and not sched.group.row
    assert batch_engine.state.counters.get("store_failures") == 0
    follow = [convo("Go on.", convo(p) + [{"role": "assistant", "content": o.text}]) for p, o in zip(prompts, solo)]
    again_solo = [solo_engine.run(job(m, max_tokens=8, session=f"k{i}")[0]) for i, m in enumerate(follow)]
    again = [batch_engine.run(job(m, max_tokens=8, session=f"k{i}")[0]) for i, m in enumerate(follow)]
    assert [o.cached_tokens for o in again] == [o.cached_tokens for o in again_solo]
    assert [o.raw_text for o in again] == [o.raw_text for o in again_solo]


def test_chunked_attention_interleaves_unbatched_with_parity(tiny_kind_paths):
    path = tiny_kind_paths("llama4")
    solo_engine, batch_engine = build_engine(engine_settings(path)), build_engine(engine_settings(path))
    solo = [solo_engine.run(job(convo(p), max_tokens=10, session=f"c{i}")[0]) for i, p in enumerate(PROMPTS[:3])]
    out, sizes = run_batched(batch_engine, [job(convo(p), max_tokens=10, session=f"c{i}")[0]
                                            for i, p in enumerate(PROMPTS[:3])])
    assert [o.raw_text for o in out] == [o.raw_text for o in solo]
    assert set(sizes) <= {0, 1}                    # never a batched forward for this kind ...
    assert all(o.timings["batch_size_max"] == 1 for o in out)
    assert max(run_batched.members) == 3          # ... yet all three decode in the same steps


def test_concurrent_http_streams_through_the_scheduler(dense):
    server = LiveServer(engine_settings(dense, max_concurrent_sequences=4))
    try:
        assert server.app.worker.core is not None
        bodies = [{"messages": convo(p), "max_tokens": 10, "temperature": 0, "stream": True} for p in PROMPTS[:4]]
        results: dict[int, str] = {}

        def call(i):
            req = urllib.request.Request(server.base + "/v1/chat/completions", data=json.dumps(bodies[i]).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                frames = [json.loads(f[6:]) for f in resp.read().decode().split("\n\n") if f.startswith("data: {")]
            results[i] = "".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f["choices"])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        solo = build_engine(engine_settings(dense))
        for i, p in enumerate(PROMPTS[:4]):
            o = solo.run(job(convo(p), max_tokens=10)[0])
            from mlxstack.parsing.output import split_reply

            assert results[i] == split_reply(o.text).content
        stats = json.loads(urllib.request.urlopen(server.base + "/v1/cache/stats", timeout=10).read())
        assert stats["scheduler"]["max_sequences"] == 4 and stats["scheduler"]["batched"] is True
        assert max(r.get("batch_size_max", 1) for r in stats["recent"]) >= 2
        # speculation's cost model, measured: the 4-row batch's plain steps timed (milliseconds)
        assert set(stats["speculation"]) == {"plain_step_ms", "speculative_cost", "calibrated_cost",
                                             "prior_cost_per_position"}
        assert stats["speculation"]["plain_step_ms"]["4"] > 0
    finally:
        server.close()


def test_turns_finishing_together_close_in_one_forward_with_parity(dense):
    """Sequences that finish in the same decode step feed their closers (last sampled token + the
    template's turn closer) in one batched forward; the entries they store serve the next turn
    exactly as the one-by-one close does: same cached depth, same replies."""
    solo_engine, batch_engine = build_engine(engine_settings(dense)), build_engine(engine_settings(dense))
    first = [convo(p) for p in PROMPTS[:3]]
    solo1 = [solo_engine.run(job(m, max_tokens=8, session=f"c{i}")[0]) for i, m in enumerate(first)]
    batched1, _ = run_batched(batch_engine, [job(m, max_tokens=8, session=f"c{i}")[0] for i, m in enumerate(first)],
                              budget=512)                             # one short batch: all join at once
    assert [o.raw_text for o in batched1] == [o.raw_text for o in solo1]
    assert all(o.finish_reason == "length" for o in batched1)           # all three ended in one step
    assert run_batched.sched.closed_together == 3
    second = [m + [{"role": "assistant", "content": o.text}, {"role": "user", "content": "Go on."}]
              for m, o in zip(first, solo1)]
    solo2 = [solo_engine.run(job(m, max_tokens=8, session=f"c{i}")[0]) for i, m in enumerate(second)]
    batched2 = [batch_engine.run(job(m, max_tokens=8, session=f"c{i}")[0]) for i, m in enumerate(second)]
    assert [o.cached_tokens for o in batched2] == [o.cached_tokens for o in solo2]
    assert min(o.cached_tokens for o in batched2) > 0
    assert [o.raw_text for o in batched2] == [o.raw_text for o in solo2]
    assert batch_engine.state.counters.get("store_failures") == 0


def test_the_worker_admits_everything_queued_at_once(dense):
    """Requests that arrive while the inference thread is busy are all admitted at its next
    iteration, so their short prefills share one forward (not one admission per step)."""
    from mlxstack.engine.worker import InferenceWorker

    eng = build_engine(engine_settings(dense))
    worker = InferenceWorker(max_queued=16)
    worker.core = EngineCore(eng, 8, 256, batching=True)
    worker.start()
    gate = threading.Event()
    try:
        blocker = worker.submit(gate.wait)              # holds the thread while the jobs queue up
        futures = [worker.submit_chat(job(convo(p), max_tokens=4, session=f"q{i}")[0])
                   for i, p in enumerate(PROMPTS[:4])]
        gate.set()
        blocker.result(30)
        outs = [f.result(120) for f in futures]
    finally:
        worker.stop()
    assert worker.core.short_batches == 1          # all four prefilled in one forward
    assert all(o.completion_tokens == 4 for o in outs)


def _staggered(worker, n, gap_s, tag):
    """``n`` chat requests submitted ``gap_s`` apart (agents coming back a few ms apart)."""
    futures = []
    for i, p in enumerate(PROMPTS[:n]):
        futures.append(worker.submit_chat(job(convo(p), max_tokens=3, session=f"{tag}{i}")[0]))
        time.sleep(gap_s)
    return [f.result(120) for f in futures]


def test_requests_that_come_back_together_are_gathered_into_one_prefill(dense):
    """ARRIVAL_WINDOW_MS: after a busy spell that decoded 4 rows at once, the idle worker that
    wakes for the first of 4 requests arriving 5 ms apart waits for the other 3 (within the
    window), so the 4 prefill in one forward; with no window, the first starts alone. A spell
    of one row never makes the next request wait."""
    from mlxstack.engine.worker import InferenceWorker

    eng = build_engine(engine_settings(dense))
    for window, gathered, batches in ((0.25, 3, 1), (0.0, 0, None)):
        worker = InferenceWorker(max_queued=16, arrival_window_s=window)
        worker.core = EngineCore(eng, 8, 256, batching=True)
        worker.start()
        try:
            worker.core.batch_peak = 4                  # the last busy spell: 4 rows at once
            before = worker.core.short_batches
            outs = _staggered(worker, 4, 0.005, f"w{window}")
            assert worker.gathered == gathered and all(o.completion_tokens == 3 for o in outs)
            if batches is not None:
                assert worker.core.short_batches - before == batches
            assert worker.core.batch_peak == 4 or window == 0.0
            worker.core.batch_peak = 1                  # then one client alone: no wait
            worker.submit_chat(job(convo(PROMPTS[0]), max_tokens=1, session=f"solo{window}")[0]).result(120)
            assert worker.gathered == gathered
        finally:
            worker.stop()


def test_bench_batch_kinds_rows_match_alone_at_full_size():
    """benchmarks/bench_batch_kinds.py at the embedded model's width (576 hidden, 9/3 heads; 6 layers
    here instead of 30, so gemma3's 5-sliding-1-global pattern and lfm2's conv + attention mix are
    both present) in four layouts: each row of a batched step equals its sequence stepped alone."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_batch_kinds", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_batch_kinds.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for kind in ("llama", "gemma3_text", "lfm2", "mamba2"):
        r = bench.run(kind, context=24, rows=3, steps=1, layers=6)
        assert r["max_logit_diff"] < 1e-3, (kind, r)
        assert r["single_tok_s"] > 0 and r["batched_tok_s"] > 0


def test_no_forward_when_every_pending_token_is_its_rows_last(dense, monkeypatch):
    """Rows that all reach max_tokens together: the step that would feed their last sampled
    tokens only reads them back (nothing would use that forward: the closer feeds the last token
    itself) -- one batched forward a token, not one more; replies and the next turn's hit unchanged."""
    solo_engine, batch_engine = build_engine(engine_settings(dense)), build_engine(engine_settings(dense))
    first = [convo(p) for p in PROMPTS[:3]]
    solo = [solo_engine.run(job(m, max_tokens=8, session=f"n{i}")[0]) for i, m in enumerate(first)]
    model_cls = type(batch_engine.loaded.model)
    real = model_cls.__call__
    widths = []

    def counted(self, inputs, *a, **k):
        if inputs.shape[0] >= 3:                # the batch: 3 rows (the slab holds 4), not the 2-row probe
            widths.append(inputs.shape[1])
        return real(self, inputs, *a, **k)

    monkeypatch.setattr(model_cls, "__call__", counted)
    batched, _ = run_batched(batch_engine, [job(m, max_tokens=8, session=f"n{i}")[0] for i, m in enumerate(first)],
                             budget=512)
    monkeypatch.setattr(model_cls, "__call__", real)
    assert [o.raw_text for o in batched] == [o.raw_text for o in solo]
    assert all(o.finish_reason == "length" and o.completion_tokens == 8 for o in batched)
    # the rests' forward, 8 decode forwards (the last prompt token, then tokens 1..7), the closers'
    assert widths.count(1) == 8 and run_batched.sched.closed_together == 3
    second = [m + [{"role": "assistant", "content": o.text}, {"role": "user", "content": "Go on."}]
              for m, o in zip(first, solo)]
    again_solo = [solo_engine.run(job(m, max_tokens=8, session=f"n{i}")[0]) for i, m in enumerate(second)]
    again = [batch_engine.run(job(m, max_tokens=8, session=f"n{i}")[0]) for i, m in enumerate(second)]
    assert [o.cached_tokens for o in again] == [o.cached_tokens for o in again_solo]
    assert [o.raw_text for o in again] == [o.raw_text for o in again_solo]
