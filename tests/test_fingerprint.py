"""Model identity for the disk tier (issue 23 item 1): the fingerprint follows every weight byte,
every file that changes the computation and the model-code versions; a memo keyed on
(device, inode, size, mtime_ns, ctime_ns) spares a restart from re-reading the weights.

Run: .venv/bin/python -m mlxstack.launcher.test_runner tests/test_fingerprint.py -q
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from mlxstack.models import fingerprint as fpm

VERSIONS = {"mlx": "1", "mlx-metal": "1", "mlx-lm": "1", "mlx-vlm": "1"}
WEIGHT_BYTES = 3 << 20     # above MEMO_MIN_BYTES: memoised


def _model(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (root / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (root / "model-00001-of-00002.safetensors").write_bytes(bytes(range(256)) * (WEIGHT_BYTES // 256))
    (root / "model-00002-of-00002.safetensors").write_bytes(b"\x07" * WEIGHT_BYTES)
    return root


def _fp(path: Path, memo: Path | None = None, **kw) -> str:
    return fpm.model_fingerprint(path, upcast=kw.pop("upcast", False), memo_path=memo,
                                 versions=kw.pop("versions", VERSIONS), **kw)


def _edit_in_place_keeping_mtime(f: Path, offset: int) -> None:
    """Flip one byte without changing the size, then put the old times back (``touch -r``)."""
    st = f.stat()
    with open(f, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns


@pytest.fixture()
def hash_reads(monkeypatch):
    """Paths handed to the hash function (every byte of a file read for the fingerprint)."""
    seen: list[str] = []
    real = fpm._sha256_file

    def counting(path):
        seen.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(fpm, "_sha256_file", counting)
    return seen


def test_one_weight_byte_with_the_same_size_and_mtime_changes_it(tmp_path):
    model = _model(tmp_path / "m")
    before = _fp(model)
    _edit_in_place_keeping_mtime(model / "model-00002-of-00002.safetensors", WEIGHT_BYTES // 2)
    assert _fp(model) != before


def test_memo_hit_reads_no_weight_file(tmp_path, hash_reads):
    model, memo = _model(tmp_path / "m"), tmp_path / "cache" / "fingerprints.json"
    cold = fpm.fingerprint_model(model, upcast=False, memo_path=memo, versions=VERSIONS)
    assert sorted(n for n in hash_reads if n.endswith(".safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert cold.hashed_bytes >= 2 * WEIGHT_BYTES and cold.memo_hits == 0
    hash_reads.clear()
    warm = fpm.fingerprint_model(model, upcast=False, memo_path=memo, versions=VERSIONS)
    assert warm.digest == cold.digest
    assert not [n for n in hash_reads if n.endswith(".safetensors")], hash_reads   # only small files
    assert warm.memo_hits == 2 and warm.hashed_bytes < fpm.MEMO_MIN_BYTES
    assert warm.digest == _fp(model)                  # the memo never changes the answer


def test_memo_file_is_private_and_survives_garbage(tmp_path):
    model, memo = _model(tmp_path / "m"), tmp_path / "cache" / "fingerprints.json"
    old = os.umask(0o022)
    try:
        _fp(model, memo)
    finally:
        os.umask(old)
    assert stat.S_IMODE(memo.stat().st_mode) == 0o600
    assert stat.S_IMODE(memo.parent.stat().st_mode) == 0o700
    memo.write_text("{not json")
    assert _fp(model, memo) == _fp(model)
    assert json.loads(memo.read_text())["version"] == fpm.MEMO_VERSION


@pytest.mark.parametrize("change", ["in_place_same_mtime", "replaced_by_copy", "grown"])
def test_changed_file_invalidates_its_memo_entry(tmp_path, hash_reads, change):
    model, memo = _model(tmp_path / "m"), tmp_path / "fingerprints.json"
    target = model / "model-00001-of-00002.safetensors"
    before = _fp(model, memo)
    if change == "in_place_same_mtime":      # only st_ctime_ns tells: users cannot set it
        _edit_in_place_keeping_mtime(target, 123)
    elif change == "replaced_by_copy":       # `cp -p other target`: new bytes, old mtime and size
        other = tmp_path / "other.safetensors"
        other.write_bytes(b"\x09" * WEIGHT_BYTES)
        os.utime(other, ns=(target.stat().st_atime_ns, target.stat().st_mtime_ns))
        os.replace(other, target)
    else:
        with open(target, "ab") as fh:
            fh.write(b"\0")
    hash_reads.clear()
    after = _fp(model, memo)
    assert after != before
    assert hash_reads.count(target.name) == 1
    assert "model-00002-of-00002.safetensors" not in hash_reads   # the other shard stays memoised
    assert after == _fp(model)                                   # == a fresh hash without memo


def test_a_stale_memo_entry_is_never_trusted(tmp_path):
    """A memo written for other bytes at the same stat (a forged or stale memo) is only used when
    every stat field matches; rewriting the file changes ctime, so it is hashed again."""
    model, memo = _model(tmp_path / "m"), tmp_path / "fingerprints.json"
    _fp(model, memo)
    data = json.loads(memo.read_text())
    real = os.path.realpath(model / "model-00002-of-00002.safetensors")
    data["files"][real]["sha256"] = "0" * 64
    memo.write_text(json.dumps(data))
    assert _fp(model, memo) != _fp(model)      # the memo is trusted on a stat match (by design)...
    _edit_in_place_keeping_mtime(model / "model-00002-of-00002.safetensors", 5)
    assert _fp(model, memo) == _fp(model)      # ...and ignored once the file was written


def test_versions_and_numerics_are_included(tmp_path):
    model = _model(tmp_path / "m")
    base = _fp(model)
    for pkg in VERSIONS:
        assert _fp(model, versions={**VERSIONS, pkg: "2"}) != base, pkg
    assert _fp(model, upcast=True) != base
    installed = fpm.runtime_versions()
    assert set(installed) == {"mlx", "mlx-metal", "mlx-lm", "mlx-vlm"}
    assert installed["mlx-lm"] and installed["mlx"]
    assert fpm.model_fingerprint(model, upcast=False) == _fp(model, versions=installed)


@pytest.mark.parametrize("name", [
    "preprocessor_config.json", "processor_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.json", "chat_template.jinja",
    "generation_config.json", "modeling_custom.py", "adapters.safetensors", "adapter_config.json",
    "model.safetensors.index.json", "sub/extra_config.json",
])
def test_every_file_that_changes_the_computation_is_included(tmp_path, name):
    model = _model(tmp_path / "m")
    base = _fp(model)
    f = model / name
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(b"A" * 100)
    added = _fp(model)
    assert added != base, f"adding {name} must change the fingerprint"
    _edit_in_place_keeping_mtime(f, 50)
    assert _fp(model) != added, f"changing {name} must change the fingerprint"


@pytest.mark.parametrize("name", ["README.md", ".gitattributes", ".cache/huggingface/download/x.metadata",
                                  "LICENSE", "__pycache__/modeling_custom.cpython-312.pyc", "figure.png"])
def test_documents_and_download_bookkeeping_are_not(tmp_path, name):
    model = _model(tmp_path / "m")
    base = _fp(model)
    f = model / name
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("anything")
    assert _fp(model) == base


def test_large_weights_no_mlx_loader_reads_count_by_name_and_size(tmp_path, monkeypatch, hash_reads):
    monkeypatch.setattr(fpm, "LARGE_UNREAD_BYTES", 1 << 20)
    model = _model(tmp_path / "m")
    (model / "pytorch_model.bin").write_bytes(b"\1" * (2 << 20))
    (model / "consolidated.safetensors").write_bytes(b"\1" * (2 << 20))
    base = _fp(model)
    assert "pytorch_model.bin" not in hash_reads and "consolidated.safetensors" not in hash_reads
    (model / "pytorch_model.bin").write_bytes(b"\1" * (2 << 20) + b"\0")
    assert _fp(model) != base


def test_symlinked_snapshot_hashes_like_the_real_folder_and_memoises_the_blob(tmp_path, hash_reads):
    """A Hugging Face snapshot is a folder of symlinks into blobs/: the content counts, and the
    memo is keyed on the blob's real path."""
    real = _model(tmp_path / "real")
    snap = tmp_path / "snapshot"
    snap.mkdir()
    for f in real.iterdir():
        (snap / f.name).symlink_to(f)
    memo = tmp_path / "fingerprints.json"
    assert _fp(snap, memo) == _fp(real)
    hash_reads.clear()
    _fp(real, memo)
    assert not [n for n in hash_reads if n.endswith(".safetensors")]


def test_memo_forgets_deleted_files(tmp_path):
    memo = tmp_path / "fingerprints.json"
    a, b = _model(tmp_path / "a"), _model(tmp_path / "b")
    _fp(a, memo)
    for f in a.iterdir():
        f.unlink()
    a.rmdir()
    _fp(b, memo)
    keys = json.loads(memo.read_text())["files"]
    assert keys and all(k.startswith(os.path.realpath(b)) for k in keys)


def test_many_shards_hash_on_threads_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(fpm, "MEMO_MIN_BYTES", 1 << 10)    # 64 KiB total: the threaded path
    model = _model(tmp_path / "m")
    serial = [fpm._sha256_file(str(p)) for p in sorted(model.glob("*.safetensors"))]
    assert fpm._hash_all([str(p) for p in sorted(model.glob("*.safetensors"))], [WEIGHT_BYTES] * 2) == serial
