"""Issue 23, items 3 and 4: a failure fails exactly the requests it touches, and nothing else.

Faults are injected at every step of the inference loop (mlxstack/config/faults.py): admission,
prefill chunk, batched prefill, slab join / leave, decode forward, sampler, detokenizer, store,
disk write, disk load. For each: the touched requests fail (their futures get the error; over HTTP
a 500 with an OpenAI error body, or a stream that ends with an error event and [DONE]), every other
request returns exactly the tokens it returns without the fault (several in one decode batch), the
next request is served, and a failed request leaves nothing in the prompt cache or session index.
Real tiny models; the scheduler is driven step by step on this thread, and a real server over HTTP.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import Future

import pytest

from mlxstack.config import faults
from mlxstack.engine.chat import ChatJob
from mlxstack.engine.core import EngineCore
from mlxstack.runner.sampling import SamplingParams
from tests.conftest import LiveServer, build_engine, engine_settings

SHORT = ["Hi there, number one.", "Tell me about caches.", "What is a slab?", "Say something nice."]
MEDIUM = " ".join(f"step {i}: read the log." for i in range(14))          # ~100 tokens: a few chunks
LONG = " ".join(f"item {i}: check the parser." for i in range(40))       # ~360 tokens: six chunks of 64


def msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def fjob(rid: str, text: str, max_tokens: int = 10) -> ChatJob:
    out: list[str] = []
    j = ChatJob(request_id=rid, messages=msgs(text), tools=None, enable_thinking=False,
                params=SamplingParams(temperature=0.0, max_tokens=max_tokens), stop=[],
                body={"session_id": f"sess-{rid}"}, headers={}, emit=out.append)
    j.emitted = out  # type: ignore[attr-defined]
    return j


def drive(sched: EngineCore, jobs: list[ChatJob], later: dict[int, list[ChatJob]] | None = None) -> dict:
    """Admit ``jobs`` (and ``later[n]`` after step n), step until idle; request id -> outcome or error."""
    futures: dict[str, Future] = {}

    def admit(j: ChatJob) -> None:
        f: Future = Future()
        f.set_running_or_notify_cancel()
        sched.admit(j, f)
        futures[j.request_id] = f

    for j in jobs:
        admit(j)
    later = dict(later or {})
    steps = 0
    while not sched.idle() or later:
        if steps in later:
            for j in later.pop(steps):
                admit(j)
        if not sched.idle():
            sched.step()
        steps += 1
        assert steps < 500, "the scheduler never went idle"
    assert all(f.done() for f in futures.values()), "a future was left unresolved"
    return {rid: (f.exception() or f.result()) for rid, f in futures.items()}


@pytest.fixture(scope="module")
def dense(tiny_dense_path):
    return tiny_dense_path


@pytest.fixture(scope="module")
def reference(dense):
    """Each request's output run alone on a clean engine (no faults): request text -> outcome."""
    eng = build_engine(engine_settings(dense))
    memo: dict[tuple[str, int], object] = {}

    def ref(text: str, max_tokens: int = 10):
        if (text, max_tokens) not in memo:
            j = fjob("ref", text, max_tokens)
            memo[(text, max_tokens)] = (eng.run(j), "".join(j.emitted))
        return memo[(text, max_tokens)]
    return ref


def entry_tokens(engine) -> set[tuple[int, ...]]:
    return {tuple(int(t) for t in e.model_tokens) for e in engine.state.kv.index.entries()}


def check(engine, jobs: list[ChatJob], out: dict, failed: set[str], reference, sched: EngineCore | None = None) -> None:
    """Touched requests failed, the others are exact, nothing of a failed one is stored, the
    scheduler is empty, and the next request on it is served exactly."""
    assert {rid for rid, o in out.items() if isinstance(o, BaseException)} == failed, out
    for j in jobs:
        if j.request_id in failed:
            assert engine.state.sessions.candidates(f"sess-{j.request_id}") == []     # no session record
            assert engine.state.turns.get(f"sess-{j.request_id}") is None             # no turn history
            continue
        ref, ref_text = reference(j.messages[0]["content"], j.params.max_tokens)
        assert out[j.request_id].raw_text == ref.raw_text, j.request_id               # exact tokens
        assert "".join(j.emitted) == ref_text                                          # exact stream
    # the cache holds exactly what a clean run of the survivors leaves
    clean = build_engine(engine_settings(engine.settings.model_path))
    for j in jobs:
        if j.request_id not in failed:
            clean.run(fjob(j.request_id, j.messages[0]["content"], j.params.max_tokens))
    assert entry_tokens(engine) == entry_tokens(clean)
    assert engine.state.counters.get("store_failures") == 0
    if sched is not None:
        assert sched.idle() and not sched.futures and len(sched.group) == 0 and sched.group.slab is None
        nxt = fjob("next", "And one more thing?", 8)
        again = drive(sched, [nxt])["next"]
        assert again.raw_text == reference("And one more thing?", 8)[0].raw_text


def new_sched(dense, budget: int = 64, batching: bool = True):
    eng = build_engine(engine_settings(dense))
    return eng, EngineCore(eng, 8, budget, batching=batching)


# ------------------------------------------------------------------------------ per point
def test_admission_fault_fails_only_that_request(dense, reference):
    eng, sched = new_sched(dense)
    jobs = [fjob(f"r{i}", t) for i, t in enumerate(SHORT)]
    with faults.injected("admission@r1"):
        out = drive(sched, jobs)
    assert isinstance(out["r1"], faults.InjectedFault)
    check(eng, jobs, out, {"r1"}, reference, sched)


def test_prefill_chunk_fault_fails_only_that_request(dense, reference):
    eng, sched = new_sched(dense)
    jobs = [fjob("r0", SHORT[0]), fjob("r1", LONG), fjob("r2", SHORT[2]), fjob("r3", SHORT[3])]
    with faults.injected("prefill_chunk@r1:2"):               # its second chunk, others decoding
        out = drive(sched, jobs)
    check(eng, jobs, out, {"r1"}, reference, sched)
    assert max(run.timings["batch_size_max"] for rid, run in out.items() if rid != "r1") >= 2


def test_batched_prefill_fault_fails_only_its_members(dense, reference):
    eng, sched = new_sched(dense)
    jobs = [fjob("r0", SHORT[0]), fjob("r1", SHORT[1]), fjob("r2", LONG), fjob("r3", MEDIUM)]
    with faults.injected("prefill_batch@r0"):                # r0 and r1 are prefilled together
        out = drive(sched, jobs)
    assert sched.short_batches >= 1
    check(eng, jobs, out, {"r0", "r1"}, reference, sched)


def test_slab_join_fault_rolls_the_join_back(dense, reference):
    """Sequences join one at a time; the third one's join fails after the slab was rebuilt to
    four rows: the group is put back as it was, only that one fails."""
    eng, sched = new_sched(dense)
    jobs = [fjob(f"r{i}", f"{MEDIUM} ({i})", 14) for i in range(4)]
    with faults.injected("slab_join@r2"):
        out = drive(sched, jobs)
    assert sched.group.rollbacks == 1 and sched.group.resets == 0
    check(eng, jobs, out, {"r2"}, reference, sched)


def test_slab_join_fault_of_a_batched_prefill_into_a_running_batch(dense, reference):
    """Two sequences decode in a slab; two more prefilled together join it (adopt): their join
    fails after the slab grew, they fail, the first two go on exactly."""
    eng, sched = new_sched(dense)
    first = [fjob("r0", SHORT[0], 16), fjob("r1", SHORT[1], 16)]
    second = [fjob("r2", SHORT[2]), fjob("r3", SHORT[3])]
    with faults.injected("slab_join@r2"):
        out = drive(sched, first, later={2: second})
    assert sched.group.rollbacks == 1
    check(eng, first + second, out, {"r2", "r3"}, reference, sched)


def test_slab_leave_fault_fails_only_the_leaver(dense, reference):
    eng, sched = new_sched(dense)
    jobs = [fjob("r0", SHORT[0], 14), fjob("r1", SHORT[1], 4), fjob("r2", SHORT[2], 14), fjob("r3", SHORT[3], 14)]
    with faults.injected("slab_leave@r1"):
        out = drive(sched, jobs)
    assert sched.group.rollbacks == 1 and sched.group.resets == 0
    check(eng, jobs, out, {"r1"}, reference, sched)


def test_decode_forward_fault_fails_the_batch_and_nothing_else(dense, reference):
    """The shared forward fails: its members fail, the batch is dropped (the group is empty and
    consistent), a request still prefilling meanwhile joins afterwards and is exact."""
    eng, sched = new_sched(dense)
    jobs = [fjob("r0", SHORT[0]), fjob("r1", SHORT[1]), fjob("r2", SHORT[2]), fjob("r3", LONG)]
    with faults.injected("decode_forward:2"):
        out = drive(sched, jobs)
    assert sched.group.resets == 1
    check(eng, jobs, out, {"r0", "r1", "r2"}, reference, sched)


def test_decode_forward_fault_unbatched_fails_only_that_row(dense, reference):
    """Without a batched form each member has its own forward: one failing fails one request."""
    eng, sched = new_sched(dense, batching=False)
    jobs = [fjob(f"r{i}", t) for i, t in enumerate(SHORT)]
    with faults.injected("decode_forward@r1:2"):
        out = drive(sched, jobs)
    check(eng, jobs, out, {"r1"}, reference, sched)


@pytest.mark.parametrize("point", ["sampler", "detokenizer"])
def test_per_row_fault_fails_only_that_row(dense, reference, point):
    eng, sched = new_sched(dense)
    jobs = [fjob(f"r{i}", t, 12) for i, t in enumerate(SHORT)]
    with faults.injected(f"{point}@r2:3"):
        out = drive(sched, jobs)
    assert isinstance(out["r2"], faults.InjectedFault)
    assert min(o.timings["batch_size_max"] for rid, o in out.items() if rid != "r2") == 4   # one batch
    assert sched.group.resets == 0
    check(eng, jobs, out, {"r2"}, reference, sched)


def test_store_fault_leaves_no_half_written_entry(dense, reference):
    """A store failing after the entry went in removes it (and its session record); the reply
    itself still goes out, counted in store_failures."""
    eng, sched = new_sched(dense)
    jobs = [fjob(f"r{i}", t) for i, t in enumerate(SHORT)]
    with faults.injected("store@r1"):
        out = drive(sched, jobs)
    assert not any(isinstance(o, BaseException) for o in out.values())
    assert out["r1"].raw_text == reference(SHORT[1])[0].raw_text
    assert eng.state.counters.get("store_failures") == 1
    assert eng.state.sessions.candidates("sess-r1") == []
    clean = build_engine(engine_settings(dense))
    for j in jobs:
        if j.request_id != "r1":
            clean.run(fjob(j.request_id, j.messages[0]["content"]))
    assert entry_tokens(eng) == entry_tokens(clean)


def test_a_fatal_error_is_not_swallowed_by_the_scheduler(dense):
    """Only an Exception is a request's failure; anything else is for the worker (it dies,
    truthfully: tests/test_watchdog.py)."""
    eng, sched = new_sched(dense)
    with faults.injected("sampler@r1:2:fatal"), pytest.raises(faults.InjectedFatal):
        drive(sched, [fjob(f"r{i}", t) for i, t in enumerate(SHORT)])


def test_recover_fails_every_request_in_flight_and_serves_the_next(dense, reference):
    """An exception that escapes step() (a bug anywhere) leaves the scheduler's state untrusted:
    recover() fails every request in flight, empties it, and the next request is exact."""
    eng, sched = new_sched(dense)
    futures = []
    for i, t in enumerate(SHORT):
        f: Future = Future()
        f.set_running_or_notify_cancel()
        sched.admit(fjob(f"r{i}", t), f)
        futures.append(f)
    sched.step()
    sched.step()
    assert len(sched.group) == 4
    assert sched.recover(RuntimeError("boom")) == 4
    assert all("boom" in str(f.exception()) for f in futures)
    assert sched.idle() and sched.group.slab is None and not sched.futures
    assert drive(sched, [fjob("n", SHORT[0])])["n"].raw_text == reference(SHORT[0])[0].raw_text


# ------------------------------------------------------------------------------ disk tier
def _disk_engine(dense, folder):
    return build_engine(engine_settings(dense, disk_cache_dir=str(folder), disk_cache_min_tokens=1))


def test_disk_write_fault_leaves_no_torn_file(dense, reference, tmp_path):
    eng = _disk_engine(dense, tmp_path)
    with faults.injected("disk_write"):
        out = eng.run(fjob("r0", SHORT[0]))
        eng.state.disk.tier.flush(30)
    assert out.raw_text == reference(SHORT[0])[0].raw_text
    tier = eng.state.disk.tier
    assert tier.stats()["write_errors"] == 1
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and ".tmp" in p.name]
    for info in tier.entries():                       # whatever the tier lists verifies
        assert tier.verified_path(info.entry_id) is not None
    again = eng.run(fjob("r0b", SHORT[0]))            # the RAM copy still serves the same prompt
    assert again.raw_text == out.raw_text and again.cached_tokens > 0
    eng.state.close()
    restarted = _disk_engine(dense, tmp_path)         # a restart serves no torn entry
    assert restarted.run(fjob("r0c", SHORT[0])).raw_text == out.raw_text
    restarted.state.close()


def test_disk_load_fault_falls_back_to_a_cold_prefill(dense, reference, tmp_path):
    """A disk hit whose load fails is a miss (counted), never a failed request."""
    first = _disk_engine(dense, tmp_path)
    turn1 = first.run(fjob("r0", SHORT[0]))
    first.state.close()
    eng = _disk_engine(dense, tmp_path)
    assert eng.state.kv.index.disk_only() >= 1
    with faults.injected("disk_load"):
        out = eng.run(fjob("r1", SHORT[0]))
        assert faults.fired("disk_load") == 1
    assert out.raw_text == turn1.raw_text == reference(SHORT[0])[0].raw_text
    assert out.cached_tokens == 0 and eng.state.counters.get("disk_load_failures") == 1
    assert eng.run(fjob("r2", SHORT[0])).raw_text == turn1.raw_text    # and the next one hits RAM
    eng.state.close()


# ------------------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def servers(dense):
    """Two live servers: prefill chunks of 512 (four short requests prefill and join together) and
    of 16 (each prefills on its own, in chunks, and joins alone)."""
    made = {chunk: LiveServer(engine_settings(dense, max_concurrent_sequences=4, prefill_chunk_tokens=chunk))
            for chunk in (512, 16)}
    yield made
    for server in made.values():
        server.close()


def _call(base: str, text: str, stream: bool, max_tokens: int) -> tuple[int, object]:
    body = {"messages": msgs(text), "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, raw = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    if not stream:
        return status, json.loads(raw)
    return status, [f[6:] for f in raw.split("\n\n") if f.startswith("data: ")]


def _content(status: int, answer: object, stream: bool) -> str | None:
    """The reply's content, or None for a failure (checked to be well formed)."""
    if status != 200:
        assert status == 500 and set(answer["error"]) >= {"message", "type", "code"}, answer
        return None
    if not stream:
        return answer["choices"][0]["message"]["content"] or ""
    assert answer[-1] == "[DONE]", answer
    events = [json.loads(d) for d in answer[:-1]]
    if "error" in events[-1]:                              # failed after the stream began
        assert set(events[-1]["error"]) >= {"message", "type"} and all("error" not in e for e in events[:-1])
        return None
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


@pytest.mark.parametrize("chunk,spec,n_failed", [
    (512, "admission:2", 1),
    (16, "prefill_chunk:5", 1),
    (512, "prefill_batch", 4),          # all four share the batched prefill: all are touched
    (16, "slab_join:3", 1),             # the third to join, into a slab of two
    (16, "slab_leave", None),           # the first leave step: every member leaving in it
    (512, "decode_forward:3", 4),       # the shared forward: its members fail
    (512, "sampler:6", 1),
    (512, "detokenizer:6", 1),
])
def test_http_fault_fails_only_the_touched_requests(servers, reference, chunk, spec, n_failed):
    from mlxstack.parsing.output import split_reply

    server = servers[chunk]
    texts = [f"{t} ({spec})" for t in SHORT]   # prompts no earlier test left in the server's cache
    tokens = [8, 10, 12, 14]                  # leaves on different steps
    expected = [split_reply(reference(t, n)[0].text).content for t, n in zip(texts, tokens)]
    gate = threading.Event()
    results: dict[int, tuple[int, object]] = {}
    with faults.injected(spec):
        blocker = server.app.worker.submit(gate.wait)   # all four queue up: one batch
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, _call(server.base, texts[i], i % 2 == 0, tokens[i]))) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while server.app.worker.queue_depth < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        gate.set()
        blocker.result(30)
        for t in threads:
            t.join(120)
        assert faults.fired() >= 1
        if n_failed is None:                  # as many as the hit that fired named (request ids)
            n_failed = sum(len(k.split(",")) for k in faults.touched())
            assert n_failed >= 1
    got = [_content(*results[i], i % 2 == 0) for i in range(4)]
    assert sum(g is None for g in got) == n_failed, results
    assert all(g == e for g, e in zip(got, expected) if g is not None)
    status, answer = _call(server.base, SHORT[0], False, 6)            # the next request answers
    assert status == 200 and _content(status, answer, False) == split_reply(reference(SHORT[0], 6)[0].text).content
    sched = server.app.worker.core
    assert sched.idle() and not sched.futures and server.app.worker.alive
    assert urllib.request.urlopen(server.base + "/health", timeout=10).status == 200


def test_http_stream_that_fails_mid_way_ends_with_an_error_event_then_done(servers, reference):
    server = servers[512]
    with faults.injected("detokenizer:3"):
        status, events = _call(server.base, "A stream that breaks.", True, 10)
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "request id" in error["message"]
    assert any(json.loads(e).get("choices") for e in events[:-2])     # it had started streaming
    status, answer = _call(server.base, "A stream that breaks.", True, 10)
    assert _content(status, answer, True) is not None                    # the same request, unfaulted


# ------------------------------------------------------------------------------ the concrete trigger
class PaddedLogits:
    """The model with padding ids appended to its logits (a config vocab_size larger than the
    tokenizer, as Gemma 3's 262,208 vs 262,145), each far above every real logit."""

    def __init__(self, model, pad: int = 8) -> None:
        self.inner, self.pad = model, pad

    def __call__(self, tokens, cache=None, **kw):
        import mlx.core as mx

        out = self.inner(tokens, cache=cache, **kw)
        return mx.concatenate([out, mx.full((*out.shape[:-1], self.pad), 1e4, dtype=out.dtype)], axis=-1)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_ids_past_the_tokenizer_are_never_sampled(dense, reference):
    """A logits width past the tokenizer's size: those ids are never sampled (mlx-lm's SPM
    detokenizer would index its token map out of range), alone or batched; the output is the
    unpadded model's, token for token."""
    eng = build_engine(engine_settings(dense))
    eng.loaded.model = PaddedLogits(eng.loaded.model)
    assert eng.logit_width() == eng.token_count + 8 and eng.sampled_width() == eng.token_count
    alone = eng.run(fjob("p", SHORT[0]))
    assert alone.raw_text == reference(SHORT[0])[0].raw_text
    sched = EngineCore(eng, 8, 64, batching=True)
    out = drive(sched, [fjob(f"r{i}", t) for i, t in enumerate(SHORT)])
    assert [o.raw_text for o in out.values()] == [reference(t)[0].raw_text for t in SHORT]
    # a logit_bias naming such an id is refused (HTTP: 400 first, server/common/validation.py)
    bad = fjob("b", SHORT[0])
    bad.params = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={eng.token_count + 2: 5.0})
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        eng.run(bad)


def test_logit_bias_is_validated_against_the_tokenizer_not_the_config():
    from types import SimpleNamespace

    from mlxstack.server.app import model_vocab_size
    from mlxstack.server.http.errors import APIError
    from mlxstack.server.common.validation import parse_chat_request
    from mlxstack.config.settings import load_settings

    class Tok:
        def __len__(self):
            return 262_145

    gemma = SimpleNamespace(config={"text_config": {"vocab_size": 262_208}}, tokenizer=Tok())
    assert model_vocab_size(gemma) == 262_145
    assert model_vocab_size(SimpleNamespace(config={"vocab_size": 100}, tokenizer=Tok())) == 100
    body = {"model": "m", "messages": msgs("hi"), "logit_bias": {"262150": 3}}
    with pytest.raises(APIError) as err:
        parse_chat_request(body, load_settings(env={}), vocab_size=model_vocab_size(gemma))
    assert err.value.status == 400 and "262150" in str(err.value)
