"""The MLX models installed on this machine: what ``mlxstack models`` lists.

    for entry in installed_models(settings):   # ModelEntry(name, source, path, family, size, context, quant)

Three places hold models: MODELS_DIR (each subfolder with a config.json), the Hugging Face hub cache
(each repo whose snapshot has a config.json and .safetensors weights -- an MLX-loadable repo; other
repos there, tokenizers or PyTorch-only weights, are left out) and the embedded model converted under
MODEL_CACHE_DIR. Reading files only: whether a server serves one is the caller's question.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config.settings import Settings
from .context import _from_config
from .hub import hub_cache_dir


@dataclass(frozen=True)
class ModelEntry:
    name: str            # what MODEL_PATH takes: a repo id, a MODELS_DIR folder name, or a path
    served_as: str       # the model id a server loaded from it answers with
    source: str          # models_dir | hub | embedded
    path: Path
    family: str          # config.json's model_type
    size_bytes: int
    context: int | None  # max_position_embeddings or its equivalent
    quantization: str    # "4-bit g64", or the weights' dtype


def installed_models(settings: Settings) -> list[ModelEntry]:
    out: list[ModelEntry] = []
    if settings.models_dir:
        root = Path(settings.models_dir).expanduser()
        for folder in sorted(root.iterdir()) if root.is_dir() else ():
            if (folder / "config.json").is_file():
                out.append(_entry(folder.name, folder.name, "models_dir", folder))
    for repo, snapshot in hub_repos(hub_cache_dir()):
        out.append(_entry(repo, repo.split("/")[-1], "hub", snapshot))
    cache = settings.model_cache_path
    for folder in sorted(cache.iterdir()) if cache.is_dir() else ():
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
            out.append(_entry("(embedded)", folder.name.removesuffix("-f32"), "embedded", folder))
    return out


def hub_repos(cache: Path) -> list[tuple[str, Path]]:
    """(repo id, snapshot folder) for each MLX-loadable model repo of the hub cache: the snapshot
    ``refs/main`` names, else the newest one."""
    found = []
    for repo_dir in sorted(cache.glob("models--*")) if cache.is_dir() else ():
        repo = repo_dir.name.removeprefix("models--").replace("--", "/")
        snapshots = repo_dir / "snapshots"
        ref = repo_dir / "refs" / "main"
        snapshot = snapshots / ref.read_text().strip() if ref.is_file() else None
        if snapshot is None or not snapshot.is_dir():
            candidates = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
            snapshot = candidates[-1] if candidates else None
        if snapshot is not None and (snapshot / "config.json").is_file() and any(snapshot.rglob("*.safetensors")):
            found.append((repo, snapshot))
    return found


def _entry(name: str, served_as: str, source: str, folder: Path) -> ModelEntry:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    family = str(config.get("model_type") or (config.get("text_config") or {}).get("model_type") or "?")
    return ModelEntry(name=name, served_as=served_as, source=source, path=folder, family=family,
                      size_bytes=folder_size(folder), context=_from_config(config), quantization=quantization(config))


def folder_size(folder: Path) -> int:
    """Bytes on disk of the files a folder names (a hub snapshot's links followed to their blobs,
    each blob counted once)."""
    seen: set[Path] = set()
    total = 0
    for path in folder.rglob("*"):
        try:
            real = path.resolve()
            if real in seen or not real.is_file():
                continue
            seen.add(real)
            total += real.stat().st_size
        except OSError:
            continue
    return total


def quantization(config: dict) -> str:
    """``4-bit g64`` from mlx-lm's ``quantization`` block (or ``quantization_config``), else the
    weights' dtype (``torch_dtype`` / ``dtype``), else ``?``."""
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if isinstance(q, dict) and q.get("bits"):
            group = f" g{q['group_size']}" if q.get("group_size") else ""
            mode = f" {q['mode']}" if q.get("mode") and q.get("mode") != "affine" else ""
            return f"{q['bits']}-bit{group}{mode}"
        if isinstance(q, dict) and q.get("quant_method"):
            return str(q["quant_method"])
    for scope in (config, config.get("text_config") or {}):
        dtype = scope.get("torch_dtype") or scope.get("dtype") if isinstance(scope, dict) else None
        if dtype:
            return str(dtype)
    return "?"


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
