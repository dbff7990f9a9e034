"""A model's identity for stored KV: same bytes, same model code, same numerics -> same
fingerprint; anything else -> another disk namespace.

    fp = model_fingerprint(loaded.path, upcast=settings.cpu_float32,
                           memo_path=settings.model_cache_path / "fingerprints.json")

Stored KV is a function of the weights, the model code (mlx, mlx-lm, mlx-vlm, mlx-metal
versions; custom ``*.py`` in the folder) and the numerics (CPU float32 upcast). A stored prompt is
accepted on a token match, so anything that changes the computation for the same tokens must
change the fingerprint -- a fused LoRA written over its base keeps every file's name and size.

What is hashed (full SHA-256 of the content, per file):
- every file in the folder and its sub-folders, except hidden ones (``.cache/`` of a Hugging Face
  download, ``.gitattributes``), ``__pycache__``/``*.pyc``, documents and images (``*.md``,
  ``README*``, ``LICENSE*``, pictures): weights, adapters, configs, tokenizer files, processor
  files, chat templates, custom code. Adding or removing a file changes it too.
- except large (> 64 MiB) weight files in formats no MLX loader reads (``*.bin``, ``*.pth``,
  ``*.gguf``, ``consolidated.safetensors``, ...): their name and size only.

Why the full content and not the header plus sampled blocks: measured SHA-256 at 1.6 GB/s on one
core of the dev box (SHA-NI; Apple silicon has SHA-2 instructions too), so a 17 GB model costs
~11 s of one core once, or ~3 s with the 4 hashing threads used here when the disk keeps up --
the same order as loading the weights, which reads them all anyway -- and never again while the
files stay the same, thanks to the memo. Sampled blocks are cheap to fool: a LoRA fused into a few
projections, or one changed norm vector, lands between samples.

The memo (``fingerprints.json``, 0600, replaced atomically) maps each file's real path to its
digest with the (device, inode, size, mtime_ns, ctime_ns) it had when hashed. A file whose stat
differs is hashed again. ``st_ctime_ns`` changes on every in-place write, rename onto the path or
chmod, and no user can set it (``touch -r`` and ``cp -p`` restore mtime only), so an edit that
hides behind a preserved mtime is still seen. Files under 1 MiB are hashed at every start (cheap)
and not memoised; the memo keeps at most ``MEMO_MAX_ENTRIES`` files and forgets deleted ones.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..system.secrets import make_private_dir, write_private_file

log = logging.getLogger("mlxstack.models")

FORMAT = b"mlxstack-model-fingerprint-v2\0"
MEMO_VERSION = 1
MEMO_NAME = "fingerprints.json"
MEMO_MIN_BYTES = 1 << 20          # smaller files are hashed at every start, not memoised
MEMO_MAX_ENTRIES = 1024
READ_CHUNK = 8 << 20
HASH_THREADS = 4
LARGE_UNREAD_BYTES = 64 << 20
RUNTIME_PACKAGES = ("mlx", "mlx-metal", "mlx-lm", "mlx-vlm")

# Weight formats no MLX loader reads (mlx-lm: model*.safetensors; mlx-vlm: *.safetensors but
# consolidated.safetensors): name + size only when large (a Mistral repo ships both, 2x the bytes).
_UNREAD_WEIGHT_SUFFIXES = (".bin", ".pth", ".pt", ".gguf", ".onnx", ".onnx_data", ".h5", ".msgpack",
                           ".ckpt", ".ot", ".tflite", ".mlmodel")
_UNREAD_WEIGHT_NAMES = ("consolidated.safetensors",)
_IGNORED_SUFFIXES = (".md", ".pyc", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp")
_IGNORED_PREFIXES = ("README", "LICENSE", "LICENCE", "NOTICE", "USE_POLICY")


@dataclass(frozen=True, slots=True)
class Fingerprint:
    digest: str
    files: int            # files that entered the digest
    hashed_bytes: int     # bytes read and hashed now (0 on a full memo hit but small files)
    memo_hits: int        # files whose digest came from the memo
    seconds: float


def model_fingerprint(path: Path, *, upcast: bool, memo_path: Path | None = None,
                      versions: dict[str, str] | None = None) -> str:
    """The hex digest of :func:`fingerprint_model`."""
    return fingerprint_model(path, upcast=upcast, memo_path=memo_path, versions=versions).digest


def fingerprint_model(path: Path, *, upcast: bool, memo_path: Path | None = None,
                      versions: dict[str, str] | None = None) -> Fingerprint:
    """Hash the folder (see the module docstring). ``versions`` defaults to the installed
    mlx / mlx-metal / mlx-lm / mlx-vlm; ``memo_path`` None hashes every file every time."""
    t0 = time.perf_counter()
    root = Path(path)
    files = _model_files(root)
    memo = _load_memo(memo_path) if memo_path is not None else {}
    parts: dict[str, list] = {}
    jobs: list[tuple[str, str, os.stat_result]] = []      # (relative name, real path, stat before)
    hits = 0
    for rel, real, st in files:
        if _size_only(rel, st.st_size):
            parts[rel] = ["size-only", st.st_size]
            continue
        cached = memo.get(real)
        if cached is not None and cached.get("stat") == _stat_key(st):
            parts[rel] = ["sha256", st.st_size, cached["sha256"]]
            hits += 1
        else:
            jobs.append((rel, real, st))
    fresh: dict[str, dict] = {}
    hashed = 0
    for (rel, real, st), digest in zip(jobs, _hash_all([real for _, real, _ in jobs], [st.st_size for *_, st in jobs])):
        parts[rel] = ["sha256", st.st_size, digest]
        hashed += st.st_size
        if st.st_size >= MEMO_MIN_BYTES:
            after = os.stat(real)
            if _stat_key(after) == _stat_key(st):
                fresh[real] = {"stat": _stat_key(st), "sha256": digest}
            else:  # written while we read it: use the digest now, hash again next start
                log.warning("model file %s changed while it was hashed", real)
    if memo_path is not None and fresh:
        _save_memo(memo_path, fresh)
    h = hashlib.sha256(FORMAT)
    for rel in sorted(parts):
        h.update(json.dumps([rel, *parts[rel]]).encode() + b"\n")
    h.update(json.dumps({"upcast": bool(upcast), "versions": runtime_versions() if versions is None else versions},
                        sort_keys=True).encode())
    fp = Fingerprint(h.hexdigest(), len(parts), hashed, hits, time.perf_counter() - t0)
    log.info("model fingerprint %s: %d files, %.1f MiB hashed, %d from the memo, %.2f s",
             fp.digest[:12], fp.files, fp.hashed_bytes / 2**20, fp.memo_hits, fp.seconds)
    return fp


def runtime_versions() -> dict[str, str]:
    """Installed versions of the packages whose code computes the KV ('' when absent)."""
    out = {}
    for name in RUNTIME_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = ""
    return out


# ---------------------------------------------------------------------------- which files
def _ignored(name: str) -> bool:
    return (name.startswith(".") or name == "__pycache__" or name.lower().endswith(_IGNORED_SUFFIXES)
            or (name.upper().startswith(_IGNORED_PREFIXES) and Path(name).suffix.lower() in ("", ".txt", ".rst")))


def _size_only(rel: str, size: int) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return size > LARGE_UNREAD_BYTES and (name.endswith(_UNREAD_WEIGHT_SUFFIXES) or name in _UNREAD_WEIGHT_NAMES)


def _model_files(root: Path) -> list[tuple[str, str, os.stat_result]]:
    """(posix path relative to ``root``, real path, stat of the real file), sorted; symlinked
    files (a Hugging Face snapshot) are followed."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _ignored(d))
        for name in sorted(filenames):
            if _ignored(name):
                continue
            full = os.path.join(dirpath, name)
            real = os.path.realpath(full)
            try:
                st = os.stat(real)
            except FileNotFoundError:   # a dangling link
                continue
            if not os.path.isfile(real):
                continue
            out.append((Path(full).relative_to(root).as_posix(), real, st))
    return out


# ---------------------------------------------------------------------------- hashing
def _sha256_file(path: str) -> str:
    """SHA-256 of one file's bytes (tests wrap this to count reads)."""
    h = hashlib.sha256()
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _hash_all(paths: list[str], sizes: list[int]) -> list[str]:
    """Digests in order; large sets on a few threads (hashlib releases the GIL)."""
    workers = min(HASH_THREADS, os.cpu_count() or 1, len(paths))
    if workers <= 1 or sum(sizes) < 64 * MEMO_MIN_BYTES:
        return [_sha256_file(p) for p in paths]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fingerprint") as pool:
        return list(pool.map(_sha256_file, paths))


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


# ---------------------------------------------------------------------------- memo
def _load_memo(memo_path: Path) -> dict[str, dict]:
    try:
        data = json.loads(Path(memo_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != MEMO_VERSION or not isinstance(data.get("files"), dict):
        return {}
    return {k: v for k, v in data["files"].items()
            if isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("stat"), list)}


def _save_memo(memo_path: Path, fresh: dict[str, dict]) -> None:
    """Merge ``fresh`` into the memo on disk (re-read now: another process may have written it),
    forget files that no longer exist, keep the newest ``MEMO_MAX_ENTRIES``; 0600, atomic."""
    memo_path = Path(memo_path)
    try:
        files = _load_memo(memo_path)
        now = time.time()
        for rec in fresh.values():
            rec["seen"] = now
        files.update(fresh)
        files = {k: v for k, v in files.items() if os.path.exists(k)}
        newest = sorted(files.items(), key=lambda kv: kv[1].get("seen", 0), reverse=True)[:MEMO_MAX_ENTRIES]
        make_private_dir(memo_path.parent)
        write_private_file(memo_path, json.dumps({"version": MEMO_VERSION, "files": dict(newest)}, sort_keys=True))
    except OSError as exc:   # a read-only cache dir costs a re-hash next start, nothing else
        log.warning("model fingerprint memo %s not written: %s", memo_path, exc)
