"""Disk-tier files hold every cached prompt's tokens: folders 0700, files 0600 whatever the umask,
and a tier written by an older version (0755 / 0644) is tightened when it is opened
(issue 23 item 7).

Run: .venv/bin/python -m mlxstack.launcher.test_runner tests/test_disk_permissions.py -q
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from mlxstack.cache.disk import safetensors_io
from mlxstack.cache.disk.index import DiskIndex
from mlxstack.cache.disk.tier import DiskRecord, DiskTier, disk_namespace, prune_namespaces

NS = disk_namespace(model="m", template="t", layout="kv", kv_bits=0)
OTHER_NS = disk_namespace(model="other", template="t", layout="kv", kv_bits=0)


def _record(seed: int) -> DiskRecord:
    rng = np.random.default_rng(seed)
    return DiskRecord(np.arange(seed, seed + 8, dtype=np.int64), np.arange(seed, seed + 10, dtype=np.int64),
                      {"0.keys": rng.standard_normal((2, 32)).astype(np.float32)}, {"seed": seed})


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def _modes(root: Path) -> dict[str, int]:
    """Every path under ``root`` (and root itself) -> its permission bits."""
    out = {".": _mode(root)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[p.relative_to(root).as_posix()] = _mode(p)
    return out


def _assert_private(root: Path) -> dict[str, int]:
    modes = _modes(root)
    loose = {k: oct(v) for k, v in modes.items()
             if v != (0o700 if (root / k).is_dir() else 0o600)}
    assert not loose, loose
    return modes


@pytest.fixture()
def loose_umask():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("background", [False, True])
def test_a_new_tier_is_private_under_a_loose_umask(tmp_path, loose_umask, monkeypatch, background):
    temp_modes = []
    real_write = safetensors_io.write_file

    def spy(path, plan, tensors):   # the temp file before its rename
        checksum = real_write(path, plan, tensors)
        temp_modes.append(_mode(Path(path)))
        return checksum

    monkeypatch.setattr(safetensors_io, "write_file", spy)
    root = tmp_path / "fresh" / "kv"
    tier = DiskTier(root, NS, 1 << 30, background=background)
    ids = [tier.put(_record(i)) for i in range(3)]
    tier.flush()
    assert tier.load(ids[0]) is not None
    modes = _assert_private(root)
    ns = f"{NS}"
    assert {".", ns, f"{ns}/entries", f"{ns}/lock", f"{ns}/index.sqlite"} <= set(modes)
    assert f"{ns}/index.sqlite-wal" in modes                      # WAL companions are covered
    assert sum(k.endswith(".safetensors") for k in modes) == 3
    assert temp_modes == [0o600] * 3
    tier.close()
    _assert_private(root)


def test_exact_modes_even_under_a_umask_that_takes_owner_bits(tmp_path):
    old = os.umask(0o277)   # would leave 0400 / 0500 if modes came from creation alone
    try:
        tier = DiskTier(tmp_path / "kv", NS, 1 << 30, background=False)
        tier.put(_record(1))
        tier.close()
    finally:
        os.umask(old)
    _assert_private(tmp_path / "kv")


def test_a_tier_from_an_older_version_is_tightened_at_start_up(tmp_path, loose_umask):
    root = tmp_path / "kv"
    for ns in (NS, OTHER_NS):
        tier = DiskTier(root, ns, 1 << 30, background=False)
        tier.put(_record(2))
        tier.close()
    (root / NS / "healing.jsonl").write_text("{}\n")
    (root / NS / "index.sqlite-journal").write_bytes(b"")
    for p in [root, *root.rglob("*")]:          # what an older version left: 0755 / 0644
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    assert set(_modes(root).values()) == {0o755, 0o644}

    tier = DiskTier(root, NS, 1 << 30, background=False)
    assert len(tier.entries()) == 1                               # tightened, still served
    assert tier.load(tier.entries()[0].entry_id) is not None
    modes = _assert_private(root)                                  # the other namespace too
    assert f"{OTHER_NS}/entries" in modes and f"{NS}/healing.jsonl" in modes
    tier.close()


def test_tightening_leaves_links_and_foreign_folders_alone(tmp_path, loose_umask):
    outside = tmp_path / "outside.txt"
    outside.write_text("not the tier's")
    os.chmod(outside, 0o644)
    root = tmp_path / "kv"
    tier = DiskTier(root, NS, 1 << 30, background=False)
    tier.close()
    (root / NS / "link").symlink_to(outside)
    (root / "notes").mkdir()
    (root / "notes" / "n.txt").write_text("user's own folder, not a namespace")
    os.chmod(root / "notes", 0o755)
    DiskTier(root, NS, 1 << 30, background=False).close()
    assert _mode(outside) == 0o644                                 # a link is never followed
    assert _mode(root / "notes") == 0o755 and _mode(root) == 0o700


def test_the_index_alone_is_private(tmp_path, loose_umask):
    path = tmp_path / "index.sqlite"
    idx = DiskIndex(path)
    idx.close()
    assert _mode(path) == 0o600
    os.chmod(path, 0o644)
    (tmp_path / "index.sqlite-wal").write_bytes(b"")
    os.chmod(tmp_path / "index.sqlite-wal", 0o644)
    DiskIndex(path).close()
    assert _mode(path) == 0o600
    assert all(_mode(p) == 0o600 for p in tmp_path.glob("index.sqlite*"))


def test_prune_never_creates_a_readable_lock_file(tmp_path, loose_umask, monkeypatch):
    import mlxstack.cache.disk.folders as folders

    root = tmp_path / "kv"
    for ns in (NS, OTHER_NS):
        DiskTier(root, ns, 1 << 30, background=False).close()
    (root / OTHER_NS / "lock").unlink()
    monkeypatch.setattr(folders.shutil, "rmtree", lambda *a, **k: None)   # keep it to look at
    assert prune_namespaces(root, keep=NS, max_total_bytes=0) == [OTHER_NS]
    assert _mode(root / OTHER_NS / "lock") == 0o600
