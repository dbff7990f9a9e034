"""The disk tier behind the prompt cache (issue 11), through the real engine: a restarted engine
answers the next turn from disk with exactly the cold engine's output, for every cache kind; RAM
evictions spill instead of vanishing; a corrupt file is dropped and counted and the request is
served cold, correctly; another namespace (KV_BITS, another model) never sees the entries; a
client that hangs up mid-prefill leaves its prefilled KV for the retry; WARM_PROMPTS warm the
first request.
"""
from __future__ import annotations

import json

import pytest

from tests.conftest import build_engine, engine_settings
from tests.test_engine import job
from tests.test_model_families import SYSTEM, TURNS

pytestmark = pytest.mark.slow  # restarts and disk hits with parity on every tiny kind (docs/testing.md#tiers)

KINDS = ["dense", "hybrid", "gemma3", "llama4", "mamba2", "lfm2", "gpt_oss"]


def disk_settings(path, tmp, **kw):
    return engine_settings(path, **{"disk_cache_dir": str(tmp), "disk_cache_min_tokens": 32, **kw})


def cold_reference(path, turns, follow_user, session="disk"):
    """The same conversation on a cache-off engine (its healing store sees the same replies, so
    its model input is the same): the parity reference for the final turn."""
    cold = build_engine(engine_settings(path, prompt_cache_max_entries_global=0))
    _, messages = run_turns(cold, turns, session=session)
    return cold.run(job(messages + [{"role": "user", "content": follow_user}], max_tokens=8, session=session)[0])


def run_turns(engine, turns, session="disk", max_tokens=8):
    messages = [{"role": "system", "content": SYSTEM}]
    outs = []
    for user in turns:
        messages.append({"role": "user", "content": user})
        o = engine.run(job(list(messages), max_tokens=max_tokens, session=session)[0])
        outs.append(o)
        messages.append({"role": "assistant", "content": o.text})
    return outs, messages


@pytest.mark.parametrize("kind", KINDS)
def test_restart_then_continue_is_a_disk_hit_with_parity(tiny_kind_paths, tmp_path, kind):
    path = tiny_kind_paths(kind)
    first = build_engine(disk_settings(path, tmp_path))
    before, messages = run_turns(first, TURNS[:2])
    first.state.close()                                  # a clean stop flushes queued writes
    assert first.state.disk.tier.stats()["writes"] >= 1

    restarted = build_engine(disk_settings(path, tmp_path))
    assert restarted.state.disk.restored >= 1
    assert restarted.state.kv.index.nbytes == 0      # index read, no tensor loaded yet
    follow = messages + [{"role": "user", "content": TURNS[2]}]
    warm = restarted.run(job(follow, max_tokens=8, session="disk")[0])
    ref = cold_reference(path, TURNS[:2], TURNS[2])
    assert warm.raw_text == ref.raw_text and warm.prompt_tokens == ref.prompt_tokens
    assert warm.timings["cache_tier"] == "disk"
    assert warm.cached_tokens >= before[-1].prompt_tokens - 8, (warm.cached_tokens, before[-1].prompt_tokens)
    assert restarted.state.counters.get("hits_disk") == 1 and restarted.state.disk.load_failures == 0
    restarted.state.close()


def test_ram_evictions_spill_to_disk_and_come_back(tiny_dense_path, tmp_path):
    eng = build_engine(disk_settings(tiny_dense_path, tmp_path, prompt_cache_max_entries_global=1,
                                     disk_cache_min_tokens=10**6))   # no write-through: spills only
    a, msgs_a = run_turns(eng, TURNS[:1], session="A")
    b, _ = run_turns(eng, ["Something else entirely, a different opening question."], session="B")
    pc = eng.state.kv.index
    assert len(pc.entries()) == 1 and pc.counters.get("spills") >= 1
    assert any(e.payload is None and e.disk_id is not None for e in pc.entries(include_disk=True))
    back = eng.run(job(msgs_a + [{"role": "user", "content": TURNS[1]}], max_tokens=8, session="A")[0])
    assert back.raw_text == cold_reference(tiny_dense_path, TURNS[:1], TURNS[1], session="A").raw_text
    assert back.timings["cache_tier"] == "disk" and back.cached_tokens >= a[0].prompt_tokens - 8
    eng.state.close()


def test_a_corrupt_file_is_dropped_counted_and_never_served(tiny_dense_path, tmp_path):
    first = build_engine(disk_settings(tiny_dense_path, tmp_path))
    _, messages = run_turns(first, TURNS[:2])
    first.state.close()
    files = sorted((tmp_path).glob("*/entries/*.safetensors"))
    assert files
    for f in files:                                      # flip one payload byte near the end
        data = bytearray(f.read_bytes())
        data[-3] ^= 0xFF
        f.write_bytes(bytes(data))
    eng = build_engine(disk_settings(tiny_dense_path, tmp_path))
    follow = messages + [{"role": "user", "content": TURNS[2]}]
    out = eng.run(job(follow, max_tokens=8, session="disk")[0])
    assert out.raw_text == cold_reference(tiny_dense_path, TURNS[:2], TURNS[2]).raw_text
    assert out.timings["cache_tier"] != "disk"
    stats = eng.state.disk.stats()
    assert stats["corrupt_dropped"] >= 1 and eng.state.disk.load_failures >= 1
    assert not any(e.disk_id in {int(f.stem) for f in files} for e in eng.state.kv.index.entries(include_disk=True))
    eng.state.close()


def test_other_settings_open_another_namespace(tiny_dense_path, tiny_dense_hd64_path, tmp_path):
    first = build_engine(disk_settings(tiny_dense_hd64_path, tmp_path))
    run_turns(first, TURNS[:1])
    first.state.close()
    quantised = build_engine(disk_settings(tiny_dense_hd64_path, tmp_path, kv_bits="8"))
    other_model = build_engine(disk_settings(tiny_dense_path, tmp_path))
    assert quantised.state.disk.restored == 0 and other_model.state.disk.restored == 0
    same = build_engine(disk_settings(tiny_dense_hd64_path, tmp_path))
    assert same.state.disk.restored >= 1
    for e in (quantised, other_model, same):
        e.state.close()


# ---------------------------------------------------------------------------- nothing prefilled is lost
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_a_hang_up_mid_prefill_leaves_its_kv_for_the_retry(tiny_kind_paths, kind):
    path = tiny_kind_paths(kind)
    eng = build_engine(engine_settings(path, prefill_step_size=64))
    long_user = " ".join(f"line {i}: the parser reads token {i * 7} and checks it." for i in range(60))
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": long_user}]
    checks = {"n": 0}

    def hang_up_after_three_chunks() -> bool:
        checks["n"] += 1
        return checks["n"] > 3

    aborted = eng.run(job(msgs, max_tokens=8, cancel=hang_up_after_three_chunks, session="r")[0])
    assert aborted.aborted and aborted.finish_reason == "cancelled"
    salvaged = eng.state.counters.get("salvaged_prefill_tokens")
    assert salvaged >= 3 * 64 and salvaged % 64 == 0          # cut at a completed chunk
    retry = eng.run(job(msgs, max_tokens=8, session="r")[0])
    assert retry.cached_tokens == salvaged
    assert retry.timings["prefilled_tokens"] == retry.prompt_tokens - salvaged
    cold = build_engine(engine_settings(path, prompt_cache_max_entries_global=0))
    assert retry.raw_text == cold.run(job(msgs, max_tokens=8, session="r")[0]).raw_text


def test_warm_prompts_make_the_first_request_warm(tiny_dense_path, tmp_path):
    from tests.conftest import LiveServer, http_json

    warm_file = tmp_path / "warm.jsonl"
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First question of the day?"}]
    warm_file.write_text(json.dumps({"messages": msgs}) + "\n" + json.dumps([{"role": "bogus"}]) + "\n")
    server = LiveServer(engine_settings(tiny_dense_path, warm_prompts=str(warm_file)))
    try:
        server.app.worker.submit(lambda: None).result(timeout=60)   # the warm-up ran before this
        status, body, _ = http_json(server.base + "/v1/chat/completions", {"messages": msgs, "max_tokens": 4})
        assert status == 200
        usage = body["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
    finally:
        server.close()


# ---------------------------------------------------------------------------- other weights, same shapes
def _negate_layer0_tensor_in_place(model_dir) -> str:
    """Negate one float32 layer-0 tensor inside model.safetensors: same shapes, same file size,
    same mtime (put back, like ``touch -r``) -- a fused fine-tune written over its base."""
    import os

    import numpy as np

    f = model_dir / "model.safetensors"
    st = f.stat()
    with open(f, "r+b") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        names = sorted(k for k in header if k.startswith("model.layers.0.") and header[k].get("dtype") == "F32"
                       and len(header[k]["shape"]) == 2)
        name = "model.layers.0.self_attn.v_proj.weight" if "model.layers.0.self_attn.v_proj.weight" in names else names[0]
        start, end = header[name]["data_offsets"]
        fh.seek(8 + n + start)
        data = np.frombuffer(fh.read(end - start), dtype="<f4")
        fh.seek(8 + n + start)
        fh.write((-data).astype("<f4").tobytes())
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    return name


def test_changed_weights_with_the_same_shapes_never_reuse_stored_kv(tiny_dense_path, tmp_path):
    """Issue 23 item 1: a restart on the same DISK_CACHE_DIR after the weights changed in place
    (same names, sizes, shapes and mtime) is a miss that equals a cold run of the new weights;
    the unchanged restart before it still hits (so the miss is the fingerprint's doing)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_dense_path, model)
    disk, memo_dir = tmp_path / "kv", tmp_path / "model_cache"
    settings = disk_settings(model, disk, model_cache_dir=str(memo_dir))
    first = build_engine(settings)
    _, messages = run_turns(first, TURNS[:2])
    first.state.close()
    follow = messages + [{"role": "user", "content": TURNS[2]}]
    assert (memo_dir / "fingerprints.json").is_file()

    same = build_engine(settings)
    assert same.state.disk.restored >= 1
    hit = same.run(job(follow, max_tokens=8, session="disk")[0])
    assert hit.timings["cache_tier"] == "disk" and hit.cached_tokens > 0
    same.state.close()

    _negate_layer0_tensor_in_place(model)
    changed = build_engine(settings)
    assert changed.state.disk.restored == 0
    assert changed.state.disk.tier.directory != same.state.disk.tier.directory
    out = changed.run(job(follow, max_tokens=8, session="disk")[0])
    assert out.cached_tokens == 0 and out.timings["cache_tier"] != "disk"
    assert not changed.state.counters.get("hits_disk")
    cold = build_engine(engine_settings(model, prompt_cache_max_entries_global=0))
    ref = cold.run(job(follow, max_tokens=8, session="disk")[0])
    assert out.raw_text == ref.raw_text and out.prompt_tokens == ref.prompt_tokens
    assert ref.raw_text != hit.raw_text          # the edit does change the model's answer
    changed.state.close()
