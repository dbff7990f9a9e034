"""Disk tier storage layer: checked safetensors files, sqlite index, LRU by bytes, crash safety.

Run: .venv/bin/python -m mlxstack.launcher.test_runner tests/test_disk_tier.py -q
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mlxstack.cache.disk import safetensors_io
from mlxstack.cache.disk.config import (
    AUTO_CAP_BYTES,
    auto_disk_budget,
    plan_disk_cache,
    resolve_disk_cache_dir,
)
from mlxstack.cache.disk.tier import (
    DiskRecord,
    DiskTier,
    DiskTierBusy,
    disk_namespace,
    prune_namespaces,
)
from mlxstack.cache.disk.safetensors_io import CorruptFile
from mlxstack.config.settings import REPO_ROOT, load_settings

NS = disk_namespace(model="m", template="t", layout="kv", kv_bits=0)


def _record(seed: int, n: int = 64, *, meta: dict | None = None) -> DiskRecord:
    """Deterministic record: content is a function of (seed, n) so any reader can check it."""
    rng = np.random.default_rng(seed)
    return DiskRecord(
        key_tokens=np.arange(seed, seed + 20, dtype=np.int64),
        model_tokens=np.arange(seed, seed + 24, dtype=np.int64),
        tensors={"0.keys": rng.standard_normal((2, n)).astype(np.float32),
                 "0.values": rng.standard_normal((2, n)).astype(np.float32)},
        meta=meta if meta is not None else {"seed": seed, "n": n},
    )


def _same_record(a: DiskRecord, b: DiskRecord) -> bool:
    if a.meta != b.meta or sorted(a.tensors) != sorted(b.tensors):
        return False
    pairs = [(a.key_tokens, b.key_tokens), (a.model_tokens, b.model_tokens)]
    pairs += [(a.tensors[k], b.tensors[k]) for k in a.tensors]
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in pairs)


def _files(tier: DiskTier) -> list[str]:
    return sorted(p.name for p in tier.entries_dir.iterdir())


def _tier(root: Path, max_bytes: int = 1 << 30, **kw) -> DiskTier:
    kw.setdefault("background", False)
    kw.setdefault("clock", itertools.count(1000).__next__)
    return DiskTier(root, NS, max_bytes, **kw)


# ---------------------------------------------------------------------------- round trip
def _all_dtypes() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f32[0, :4] = [np.nan, -0.0, np.inf, -np.inf]
    f32.view(np.uint32)[1, 0] = 0x7FC01234  # a NaN with a payload must survive bit for bit
    return {
        "f32": f32,
        "f16": rng.standard_normal((4, 2, 3)).astype(np.float16),
        "bf16_bits": rng.integers(0, 1 << 16, size=(7,), dtype=np.uint16),
        "u32_packed": rng.integers(0, 1 << 32, size=(2, 9), dtype=np.uint32),
        "i64": rng.integers(-(1 << 62), 1 << 62, size=(5,), dtype=np.int64),
        "f64": rng.standard_normal(3),
        "i32": rng.integers(-(1 << 31), 1 << 31, size=(3,), dtype=np.int32),
        "i8": rng.integers(-128, 128, size=(5,), dtype=np.int8),
        "u8": rng.integers(0, 256, size=(11,), dtype=np.uint8),
        "bool": rng.integers(0, 2, size=(3,)).astype(bool),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float16),
        "transposed": np.arange(12, dtype=np.float32).reshape(3, 4).T,        # not C-contiguous
        "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),                # stored little-endian
    }


def test_round_trip_is_bit_exact_for_every_dtype(tmp_path: Path):
    tensors = _all_dtypes()
    record = DiskRecord(np.array([5, -3, -4, 9]), np.array([5, 6, 7, 8, 9]), tensors,
                        {"layout": ["kv", "kv"], "offsets": [5, 5], "min_depth": 0, "pool": "kv"})
    tier = _tier(tmp_path)
    entry_id = tier.put(record)
    tier.close()
    tier = _tier(tmp_path)  # fresh process state: the load comes from the file
    got = tier.load(entry_id)
    assert got is not None and got.meta == record.meta
    assert got.key_tokens.tolist() == [5, -3, -4, 9] and got.key_tokens.dtype == np.int64
    assert got.model_tokens.tolist() == [5, 6, 7, 8, 9]
    assert sorted(got.tensors) == sorted(tensors)
    for name, want in tensors.items():
        have = got.tensors[name]
        assert have.shape == want.shape, name
        assert have.dtype == want.dtype.newbyteorder("="), name
        assert have.tobytes() == np.ascontiguousarray(want.astype(want.dtype.newbyteorder("="))).tobytes(), name
    assert tier.stats()["loads"] == 1 and tier.stats()["load_bytes"] == tier.entries()[0].nbytes
    tier.close()


def test_queued_entry_is_listed_and_served_from_memory(tmp_path: Path, monkeypatch):
    gate = threading.Event()
    real_write = safetensors_io.write_file

    def gated_write(*args):
        gate.wait(10)
        return real_write(*args)

    monkeypatch.setattr(safetensors_io, "write_file", gated_write)
    tier = _tier(tmp_path, background=True)
    record = _record(1)
    entry_id = tier.put(record)
    [info] = tier.entries()
    assert (info.entry_id, info.durable, tier.stats()["queue_depth"]) == (entry_id, False, 1)
    got = tier.load(entry_id)
    assert _same_record(got, record) and tier.stats()["loads_from_queue"] == 1
    assert _files(tier) == [] or all(".tmp-" in f for f in _files(tier))
    gate.set()
    assert tier.flush(10)
    assert tier.entries()[0].durable and _files(tier) == [f"{entry_id}.safetensors"]
    assert tier.stats()["queue_depth"] == 0 and tier.stats()["writes"] == 1
    tier.close()


def test_file_is_plain_safetensors_that_mlx_loads(tmp_path: Path):
    import mlx.core as mx

    tensors = {k: v for k, v in _all_dtypes().items() if k not in ("f64",)}  # mlx CPU f64 aside
    tier = _tier(tmp_path)
    entry_id = tier.put(DiskRecord(np.array([1, 2]), np.array([1, 2, 3]), tensors, {"kind": "kv"}))
    path = tier.entries_dir / f"{entry_id}.safetensors"
    arrays, metadata = mx.load(str(path), return_metadata=True)
    assert json.loads(metadata["mlxstack.meta"]) == {"kind": "kv"}
    assert metadata["checksum"].startswith("crc32:") and len(metadata["checksum"]) == 14
    assert np.array(arrays["mlxstack.model_tokens"]).tolist() == [1, 2, 3]
    for name, want in tensors.items():
        have = np.array(arrays[name])
        assert have.shape == want.shape and have.tobytes() == np.ascontiguousarray(
            want.astype(want.dtype.newbyteorder("="))).tobytes(), name
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert (8 + header_len) % 8 == 0  # payload 8-byte aligned
    from safetensors.numpy import load_file  # the reference reader agrees too

    assert load_file(str(path))["f16"].tobytes() == tensors["f16"].tobytes()
    assert tier.verified_path(entry_id) == path and tier.stats()["loads"] == 1
    tier.close()


def test_verified_path_is_only_given_for_durable_verified_files(tmp_path: Path, monkeypatch):
    gate = threading.Event()
    real_write = safetensors_io.write_file
    monkeypatch.setattr(safetensors_io, "write_file", lambda *a: (gate.wait(10), real_write(*a))[1])
    tier = _tier(tmp_path, background=True)
    entry_id = tier.put(_record(1))
    assert tier.verified_path(entry_id) is None and tier.stats()["load_misses"] == 0  # queued: use load()
    gate.set()
    assert tier.flush(10)
    assert tier.verified_path(entry_id) == tier.entries_dir / f"{entry_id}.safetensors"
    assert tier.verified_path(99) is None and tier.stats()["load_misses"] == 1
    tier.close()


# ---------------------------------------------------------------------------- safetensors_io (pure)
def test_plan_orders_wide_dtypes_first_so_every_tensor_is_aligned():
    plan = safetensors_io.plan_file({"a": np.zeros(3, np.uint8), "b": np.zeros(1, np.int64),
                                     "c": np.zeros(3, np.float16), "d": np.zeros(2, np.float32)}, {})
    assert [(s.name, s.start, s.end) for s in plan.slots] == [("b", 0, 8), ("d", 8, 16), ("c", 16, 22), ("a", 22, 25)]
    assert plan.payload_len == 25 and (8 + plan.header_len) % 8 == 0


@pytest.mark.parametrize("tensors,error,needle", [
    ({"x": np.zeros(2, np.complex64)}, ValueError, "complex64"),
    ({"x": np.array(["a"], dtype=object)}, ValueError, "object"),
    ({"x": [1.0, 2.0]}, TypeError, "numpy.ndarray"),
    ({"__metadata__": np.zeros(1, np.float32)}, ValueError, "__metadata__"),
])
def test_plan_rejects_what_safetensors_cannot_hold(tensors, error, needle):
    with pytest.raises(error, match=needle):
        safetensors_io.plan_file(tensors, {})


def _header(entries: dict) -> bytes:
    return json.dumps(entries).encode()


@pytest.mark.parametrize("header,payload_len,needle", [
    (b"not json", 0, "not JSON"),
    (_header({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}), 12, "torn or padded"),
    (_header({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}), 8, "does not fill"),
    (_header({"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}), 8, "unknown dtype"),
    (_header({"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
              "y": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}}), 6, "gap or overlap"),
    (_header({"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
              "y": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}), 4, "gap or overlap"),
    (_header({"x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}), 0, "bad shape"),
    (_header({"x": {"dtype": "U8"}}), 0, "malformed"),
    (_header({"__metadata__": {"a": 1}}), 0, "str -> str"),
])
def test_parse_header_rejects_malformed_headers(header, payload_len, needle):
    with pytest.raises(CorruptFile, match=needle):
        safetensors_io.parse_header(header, payload_len)


# ---------------------------------------------------------------------------- namespaces
def test_namespaces_never_read_each_other(tmp_path: Path):
    ns_a = disk_namespace(model="a", template="t", layout="kv", kv_bits=0)
    ns_b = disk_namespace(model="a", template="t", layout="kv", kv_bits=8)
    assert ns_a != ns_b and ns_a == disk_namespace(kv_bits=0, layout="kv", template="t", model="a")
    a = DiskTier(tmp_path, ns_a, 1 << 30, background=False)
    b = DiskTier(tmp_path, ns_b, 1 << 30, background=False)
    id_a = a.put(_record(1))
    id_b = b.put(_record(2))
    assert id_a == id_b == 1  # ids are per namespace: the same id names different records
    assert [e.meta["seed"] for e in a.entries()] == [1] and [e.meta["seed"] for e in b.entries()] == [2]
    assert _same_record(b.load(1), _record(2)) and _same_record(a.load(1), _record(1))
    assert b.load(2) is None and b.stats()["load_misses"] == 1
    a.close(), b.close()
    b = DiskTier(tmp_path, ns_b, 1 << 30, background=False)
    assert [e.meta["seed"] for e in b.entries()] == [2]
    b.close()


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden", "x" * 129, "ns with space"])
def test_unsafe_namespace_names_are_refused(tmp_path: Path, bad):
    with pytest.raises(ValueError, match="disk_namespace"):
        DiskTier(tmp_path, bad, 1 << 20)


def test_second_tier_on_the_same_namespace_is_refused_until_the_first_closes(tmp_path: Path):
    first = _tier(tmp_path)
    with pytest.raises(DiskTierBusy, match="DISK_CACHE_DIR"):
        _tier(tmp_path)
    first.close()
    _tier(tmp_path).close()


# ---------------------------------------------------------------------------- restart
def test_restart_lists_entries_from_the_index_without_reading_tensor_files(tmp_path: Path, monkeypatch):
    tier = _tier(tmp_path)
    ids = [tier.put(_record(s)) for s in (1, 2, 3)]
    tier.touch(ids[0])  # LRU order now 2, 3, 1 and it must survive the restart
    before = tier.entries()
    tier.close()
    # Same-size garbage in every tensor file, and any tensor read fails loudly: start-up must
    # rebuild everything from the index.
    for entry_id in ids:
        path = tmp_path / NS / "entries" / f"{entry_id}.safetensors"
        path.write_bytes(b"\xff" * path.stat().st_size)

    def no_reads(*_a, **_k):
        raise AssertionError("start-up read a tensor file")

    monkeypatch.setattr(safetensors_io, "read_file", no_reads)
    tier = _tier(tmp_path)
    after = tier.entries()
    assert [e.entry_id for e in after] == [ids[1], ids[2], ids[0]]
    for old, new in zip(sorted(before, key=lambda e: e.entry_id), sorted(after, key=lambda e: e.entry_id)):
        assert (new.entry_id, new.nbytes, new.created, new.last_used, new.meta, new.durable) == (
            old.entry_id, old.nbytes, old.created, old.last_used, old.meta, True)
        assert new.key_tokens.tolist() == old.key_tokens.tolist()
        assert new.model_tokens.tolist() == old.model_tokens.tolist()
    stats = tier.stats()
    assert (stats["entries"], stats["bytes"], stats["corrupt_dropped"]) == (3, sum(e.nbytes for e in after), 0)
    monkeypatch.undo()
    assert tier.load(ids[0]) is None  # the garbage is caught by the checksum on load
    assert tier.stats()["corrupt_dropped"] == 1 and tier.drain_removed() == [ids[0]]
    tier.close()


def test_restart_serves_the_same_records_and_new_ids_do_not_reuse_old_ones(tmp_path: Path):
    tier = _tier(tmp_path)
    ids = [tier.put(_record(s)) for s in (1, 2)]
    tier.close()
    tier = _tier(tmp_path)
    assert [_same_record(tier.load(i), _record(s)) for i, s in zip(ids, (1, 2))] == [True, True]
    assert tier.put(_record(3)) == 3
    tier.close()


# ---------------------------------------------------------------------------- LRU by bytes
def test_lru_eviction_exact_order_and_byte_totals(tmp_path: Path):
    sizes = {}
    scratch = DiskTier(tmp_path / "scratch", NS, 1 << 30, background=False)
    for seed, n in [(1, 100), (2, 200), (3, 300), (4, 50), (5, 260)]:
        sizes[seed] = scratch.entries()[-1].nbytes if scratch.put(_record(seed, n)) else None
    scratch.close()
    # Room for seeds 1+2+3 exactly, not one byte more.
    tier = _tier(tmp_path / "real", max_bytes=sizes[1] + sizes[2] + sizes[3])
    e1, e2, e3 = (tier.put(_record(s, n)) for s, n in [(1, 100), (2, 200), (3, 300)])
    assert tier.stats()["bytes"] == sizes[1] + sizes[2] + sizes[3] and tier.stats()["evictions"] == 0
    assert tier.load(e1) is not None  # hit: 1 becomes most recent -> order 2, 3, 1
    e4 = tier.put(_record(4, 50))     # evicts 2 only (the least recently used)
    assert [e.entry_id for e in tier.entries()] == [e3, e1, e4]
    assert tier.stats()["bytes"] == sizes[3] + sizes[1] + sizes[4] and tier.drain_removed() == [e2]
    tier.touch(e3)                    # order 1, 4, 3
    e5 = tier.put(_record(5, 260))    # evicting 1 alone leaves it 160 bytes short: 1, then 4
    assert [e.entry_id for e in tier.entries()] == [e3, e5]
    assert tier.drain_removed() == [e1, e4] and tier.stats()["evictions"] == 3
    assert tier.stats()["bytes"] == sizes[3] + sizes[5]
    assert _files(tier) == sorted([f"{e3}.safetensors", f"{e5}.safetensors"])
    assert sum((tier.entries_dir / f).stat().st_size for f in _files(tier)) == tier.stats()["bytes"]
    tier.close()


def test_record_larger_than_the_budget_is_refused_and_evicts_nothing(tmp_path: Path):
    tier = _tier(tmp_path)
    small = tier.put(_record(1, 10))
    size = tier.entries()[0].nbytes
    tier.close()
    tier = _tier(tmp_path, max_bytes=size + 1000)
    assert tier.put(_record(2, 10_000)) is None
    assert [e.entry_id for e in tier.entries()] == [small] and _files(tier) == [f"{small}.safetensors"]
    stats = tier.stats()
    assert (stats["refused_too_big"], stats["evictions"], stats["writes"]) == (1, 0, 0)
    tier.close()


def test_smaller_budget_at_restart_evicts_least_recently_used(tmp_path: Path):
    tier = _tier(tmp_path)
    ids = [tier.put(_record(s)) for s in (1, 2, 3)]
    size = tier.entries()[0].nbytes
    tier.touch(ids[0])
    tier.close()
    tier = _tier(tmp_path, max_bytes=2 * size)
    assert [e.entry_id for e in tier.entries()] == [ids[2], ids[0]]
    assert tier.stats()["evictions"] == 1 and _files(tier) == sorted(f"{i}.safetensors" for i in (ids[0], ids[2]))
    tier.close()


def test_explicit_remove_deletes_file_and_row(tmp_path: Path):
    tier = _tier(tmp_path)
    ids = [tier.put(_record(s)) for s in (1, 2)]
    tier.remove(ids[0])
    assert [e.entry_id for e in tier.entries()] == [ids[1]] and _files(tier) == [f"{ids[1]}.safetensors"]
    assert tier.drain_removed() == [] and tier.load(ids[0]) is None
    tier.close()
    tier = _tier(tmp_path)
    assert [e.entry_id for e in tier.entries()] == [ids[1]]
    tier.close()


# ---------------------------------------------------------------------------- corruption
def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("reader", ["load", "verified_path"])
@pytest.mark.parametrize("where", ["payload_first", "payload_last", "header_shape", "checksum"])
def test_flipped_byte_is_deleted_counted_and_never_served(tmp_path: Path, where, reader):
    tier = _tier(tmp_path)
    keep = tier.put(_record(1))
    victim = tier.put(_record(2))
    path = tier.entries_dir / f"{victim}.safetensors"
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + header_len]
    offset = {
        "payload_first": 8 + header_len,
        "payload_last": len(raw) - 1,
        "header_shape": 8 + header.index(b'"shape":[2,') + len(b'"shape":['),  # 2 -> 3: still valid JSON
        "checksum": 8 + header.index(b"crc32:") + len(b"crc32:") + 7,
    }[where]
    _flip(path, offset)
    assert getattr(tier, reader)(victim) is None
    stats = tier.stats()
    assert (stats["corrupt_dropped"], stats["entries"], stats["loads"]) == (1, 1, 0)
    assert _files(tier) == [f"{keep}.safetensors"] and tier.drain_removed() == [victim]
    assert _same_record(tier.load(keep), _record(1))
    tier.close()
    tier = _tier(tmp_path)
    assert [e.entry_id for e in tier.entries()] == [keep]
    tier.close()


def test_truncated_file_is_dropped_on_load(tmp_path: Path):
    tier = _tier(tmp_path)
    victim = tier.put(_record(1))
    path = tier.entries_dir / f"{victim}.safetensors"
    os.truncate(path, path.stat().st_size - 5)
    assert tier.load(victim) is None
    assert tier.stats()["corrupt_dropped"] == 1 and _files(tier) == [] and tier.entries() == []
    tier.close()


def test_torn_or_missing_files_are_dropped_at_start_up(tmp_path: Path):
    tier = _tier(tmp_path)
    torn, missing, whole = (tier.put(_record(s)) for s in (1, 2, 3))
    tier.close()
    os.truncate(tmp_path / NS / "entries" / f"{torn}.safetensors", 100)
    (tmp_path / NS / "entries" / f"{missing}.safetensors").unlink()
    tier = _tier(tmp_path)
    stats = tier.stats()
    assert [e.entry_id for e in tier.entries()] == [whole]
    assert (stats["corrupt_dropped"], stats["missing_dropped"]) == (1, 1)
    assert _files(tier) == [f"{whole}.safetensors"]
    tier.close()
    tier = _tier(tmp_path)  # the dropped rows are gone from the index, not dropped again
    assert (tier.stats()["corrupt_dropped"], tier.stats()["missing_dropped"]) == (0, 0)
    tier.close()


def test_temp_leftovers_and_orphan_files_are_removed_at_start_up(tmp_path: Path):
    tier = _tier(tmp_path)
    kept = tier.put(_record(1))
    tier.close()
    entries = tmp_path / NS / "entries"
    (entries / "7.safetensors.tmp-12345").write_bytes(b"half a file")
    (entries / "9.safetensors").write_bytes((entries / f"{kept}.safetensors").read_bytes())  # no row
    tier = _tier(tmp_path)
    stats = tier.stats()
    assert (stats["stale_temp_removed"], stats["orphan_files_removed"]) == (1, 1)
    assert _files(tier) == [f"{kept}.safetensors"] and [e.entry_id for e in tier.entries()] == [kept]
    tier.close()


def test_failed_write_drops_the_entry_and_the_writer_keeps_going(tmp_path: Path, monkeypatch):
    real_write = safetensors_io.write_file
    calls = itertools.count()

    def full_disk_once(path, plan, tensors):
        if next(calls) == 0:
            Path(path).write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        return real_write(path, plan, tensors)

    monkeypatch.setattr(safetensors_io, "write_file", full_disk_once)
    tier = _tier(tmp_path, background=True)
    failed = tier.put(_record(1))
    ok = tier.put(_record(2))
    assert tier.flush(10)
    stats = tier.stats()
    assert (stats["write_errors"], stats["writes"], stats["entries"], stats["queue_depth"]) == (1, 1, 1, 0)
    assert [e.entry_id for e in tier.entries()] == [ok] and tier.drain_removed() == [failed]
    assert _files(tier) == [f"{ok}.safetensors"] and stats["bytes"] == tier.entries()[0].nbytes
    tier.close()


# ---------------------------------------------------------------------------- put validation
@pytest.mark.parametrize("record,error,needle", [
    (DiskRecord(np.arange(3), np.arange(3), {}, {"x": object()}), TypeError, "not JSON serializable"),
    (DiskRecord(np.arange(3), np.arange(3), {}, {"x": float("nan")}), ValueError, "JSON"),
    (DiskRecord(np.arange(3), np.arange(3), {"mlxstack.x": np.zeros(1)}, {}), ValueError, "reserved"),
    (DiskRecord(np.zeros((2, 2)), np.arange(3), {}, {}), ValueError, "1-D"),
    (DiskRecord(np.arange(3), np.arange(3), {"c": np.zeros(1, np.complex64)}, {}), ValueError, "bfloat16"),
])
def test_put_rejects_caller_bugs_with_a_clear_error(tmp_path: Path, record, error, needle):
    tier = _tier(tmp_path)
    with pytest.raises(error, match=needle):
        tier.put(record)
    assert tier.entries() == [] and tier.stats()["bytes"] == 0
    tier.close()


# ---------------------------------------------------------------------------- background writer
def test_full_queue_drops_the_write_without_blocking(tmp_path: Path, monkeypatch):
    gate = threading.Event()
    real_write = safetensors_io.write_file
    monkeypatch.setattr(safetensors_io, "write_file", lambda *a: (gate.wait(10), real_write(*a))[1])
    tier = _tier(tmp_path, background=True, max_queue=2)
    first, second = tier.put(_record(1)), tier.put(_record(2))
    t0 = time.perf_counter()
    third = tier.put(_record(3))
    put_seconds = time.perf_counter() - t0
    assert (first, second, third) == (1, 2, None)
    assert tier.stats()["dropped_writes"] == 1 and tier.stats()["queue_depth"] == 2
    assert put_seconds < 5  # the writer is parked on the gate for 10 s: put did not wait for it
    gate.set()
    assert tier.flush(10)
    assert [e.entry_id for e in tier.entries()] == [1, 2] and tier.stats()["writes"] == 2
    tier.close()


def test_eviction_of_an_entry_being_written_leaves_no_file(tmp_path: Path, monkeypatch):
    started, gate = threading.Event(), threading.Event()
    real_write = safetensors_io.write_file

    def slow_write(*a):
        started.set()
        gate.wait(10)
        return real_write(*a)

    monkeypatch.setattr(safetensors_io, "write_file", slow_write)
    tier = _tier(tmp_path, background=True)
    victim = tier.put(_record(1))
    assert started.wait(10)
    tier.remove(victim)  # while its bytes are being written
    gate.set()
    assert tier.flush(10)
    assert tier.entries() == [] and _files(tier) == [] and tier.stats()["queue_depth"] == 0
    tier.close()
    assert _tier(tmp_path).entries() == []


_KILL_CHILD = r"""
import sys
import numpy as np
from pathlib import Path
from mlxstack.cache.disk.tier import DiskRecord, DiskTier

def rec(seed, n):
    return DiskRecord(np.arange(seed, seed + 8), np.arange(seed, seed + 10),
                      {"x": np.arange(n, dtype=np.uint32) * np.uint32(seed)}, {"seed": seed, "n": n})

tier = DiskTier(Path(sys.argv[1]), sys.argv[2], 2 << 30)
tier.put(rec(1, 1000)); tier.put(rec(2, 1000)); tier.flush()
print("ready", flush=True)
seed = 3
while True:
    tier.put(rec(seed, 16 << 20)); tier.flush()   # 64 MiB each
    seed += 1
"""


def _kill_child_mid_write(root: Path) -> list[Path]:
    """Run the writer child, SIGKILL it as soon as a temp file has bytes; return the temp
    files left behind (empty if the write happened to finish between the check and the kill)."""
    entries_dir = root / NS / "entries"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, str(root), NS],
                             stdout=subprocess.PIPE, env=env, cwd=str(REPO_ROOT))
    try:
        assert child.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            temps = [p for p in entries_dir.iterdir() if ".tmp-" in p.name]
            if temps and temps[0].stat().st_size > 0:
                child.send_signal(signal.SIGKILL)
                break
        child.wait(10)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    return [p for p in entries_dir.iterdir() if ".tmp-" in p.name]


def test_kill_minus_9_during_a_write_serves_only_complete_entries(tmp_path: Path):
    for attempt in range(3):  # 64 MiB writes: the kill lands mid-write on the first try in practice
        root = tmp_path / str(attempt)
        leftovers = _kill_child_mid_write(root)
        if leftovers:
            break
    assert len(leftovers) == 1, "never killed the child in the middle of a write"
    torn_id = int(leftovers[0].name.split(".")[0])
    tier = DiskTier(root, NS, 2 << 30, background=False)
    listed = [e.entry_id for e in tier.entries()]
    assert listed == list(range(1, torn_id)) and torn_id >= 3
    assert tier.stats()["stale_temp_removed"] == 1 and not any(".tmp-" in f for f in _files(tier))
    for entry_id in listed:
        got = tier.load(entry_id)
        seed, n = got.meta["seed"], got.meta["n"]
        assert seed == entry_id and got.tensors["x"].tobytes() == (np.arange(n, dtype=np.uint32) * np.uint32(seed)).tobytes()
    assert tier.stats()["corrupt_dropped"] == 0
    tier.close()


def test_concurrent_put_load_touch_stats_from_several_threads(tmp_path: Path):
    scratch = _tier(tmp_path / "scratch")
    scratch.put(_record(1))
    budget = 4 * scratch.entries()[0].nbytes + 100  # about four entries: constant evictions
    scratch.close()
    tier = DiskTier(tmp_path, NS, budget, background=True, max_queue=4)
    stop = threading.Event()
    errors: list[BaseException] = []
    bad: list[int] = []
    seeds = itertools.count(1)

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 -- surfaced by the main thread below
                errors.append(exc)
        return run

    def putter():
        while not stop.is_set():
            tier.put(_record(next(seeds)))

    def loader():
        while not stop.is_set():
            for info in tier.entries():
                got = tier.load(info.entry_id)
                if got is not None and not _same_record(got, _record(info.meta["seed"])):
                    bad.append(info.entry_id)
                tier.touch(info.entry_id)

    def reader():
        while not stop.is_set():
            s = tier.stats()
            assert s["entries"] >= 0 and s["bytes"] <= tier.max_bytes

    threads = [threading.Thread(target=guard(f)) for f in (putter, putter, loader, reader)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(10)
    assert tier.flush(10)
    assert errors == [] and bad == []
    stats = tier.stats()
    on_disk = sum((tier.entries_dir / f).stat().st_size for f in _files(tier))
    assert stats["bytes"] == sum(e.nbytes for e in tier.entries()) == on_disk
    assert _files(tier) == sorted(f"{e.entry_id}.safetensors" for e in tier.entries())
    assert stats["corrupt_dropped"] == stats["missing_dropped"] == stats["write_errors"] == 0
    assert stats["writes"] > 10 and stats["evictions"] > 0 and stats["queue_depth"] == 0
    assert stats["loads"] > 0 and stats["loads_from_queue"] > 0  # both read paths were exercised
    tier.close()
    reopened = DiskTier(tmp_path, NS, budget, background=False)
    assert [e.entry_id for e in reopened.entries()] == [e.entry_id for e in tier.entries()]
    reopened.close()


# ---------------------------------------------------------------------------- namespaces on disk
def test_prune_namespaces_removes_least_recent_other_namespaces_but_not_live_ones(tmp_path: Path):
    names = [disk_namespace(model=m) for m in ("old", "mid", "live", "current")]
    for i, name in enumerate(names):
        t = DiskTier(tmp_path, name, 1 << 30, background=False)
        t.put(_record(i, 1000))
        t.close()
        for p in (tmp_path / name).iterdir():
            os.utime(p, (1000 + i, 1000 + i))
    live = DiskTier(tmp_path, names[2], 1 << 30, background=False)  # held: never pruned
    per_ns = sum(p.stat().st_size for p in (tmp_path / names[0]).rglob("*") if p.is_file())
    removed = prune_namespaces(tmp_path, keep=names[3], max_total_bytes=2 * per_ns + per_ns // 2)
    assert removed == [names[0], names[1]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[2], names[3]])
    live.close()


# ---------------------------------------------------------------------------- settings helpers
@pytest.mark.parametrize("value,expected", [
    ("auto", "BASE/kv"), (" AUTO ", "BASE/kv"), ("", None), ("off", None), ("OFF", None), ("none", None),
    ("false", None), ("0", None), ("/abs/kv", "/abs/kv"), ("rel/kv", "REPO/rel/kv"),
])
def test_resolve_disk_cache_dir(value, expected):
    got = resolve_disk_cache_dir(value, auto_base=Path("/BASE"), repo_root=Path("/REPO"))
    want = None if expected is None else Path(expected if expected.startswith("/") else "/" + expected)
    assert got == want


def test_resolve_disk_cache_dir_expands_home():
    assert resolve_disk_cache_dir("~/kv", auto_base=Path("/b"), repo_root=Path("/r")) == Path.home() / "kv"


@pytest.mark.parametrize("free,used,expected", [
    (100 << 30, 0, 25 << 30),                  # 25% of free
    (80 << 30, 20 << 30, 25 << 30),            # the tier's own bytes count as available
    (1 << 40, 0, AUTO_CAP_BYTES),              # capped at 64 GiB
    (0, 0, 0),
    (-5, 4000, 1000),
])
def test_auto_disk_budget(free, used, expected):
    assert auto_disk_budget(free, used) == expected


def test_plan_disk_cache_from_settings(tmp_path: Path):
    assert plan_disk_cache(load_settings(env={"DISK_CACHE_DIR": ""})) is None
    assert plan_disk_cache(load_settings(env={"DISK_CACHE_DIR": "off"})) is None
    plan = plan_disk_cache(load_settings(env={"DISK_CACHE_DIR": str(tmp_path / "kv"),
                                              "DISK_CACHE_MAX_BYTES": "12345", "DISK_CACHE_MIN_TOKENS": "64"}))
    assert (plan.directory, plan.max_bytes, plan.min_tokens) == (tmp_path / "kv", 12345, 64)
    auto = plan_disk_cache(load_settings(env={"MODEL_CACHE_DIR": str(tmp_path), "DISK_CACHE_MAX_BYTES": "0"}))
    assert auto.directory == tmp_path / "kv" and auto.min_tokens == 1024
    assert 0 < auto.max_bytes <= AUTO_CAP_BYTES
    defaults = load_settings(env={})
    assert (defaults.disk_cache_dir, defaults.disk_cache_max_bytes, defaults.disk_cache_min_tokens) == ("auto", 0, 1024)
