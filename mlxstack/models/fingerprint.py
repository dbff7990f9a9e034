"""A model's identity for stored KV: same files and same numerics -> same fingerprint.

    fp = model_fingerprint(loaded.path, upcast=settings.cpu_float32)

KV state depends on the weights, the tokenizer (which ids mean what) and how the weights are
computed with (CPU float32 upcast or not, the MLX version), so all of them are hashed; file
modification times are not (a copied folder stays warm).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

_SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "chat_template.jinja", "model.safetensors.index.json")


def model_fingerprint(path: Path, *, upcast: bool, mlx_version: str = "") -> str:
    """sha256 over the small files' bytes and each weight file's name and size."""
    path = Path(path)
    h = hashlib.sha256(b"mlxstack-model-fingerprint-v1\0")
    for name in _SMALL_FILES:
        f = path / name
        if f.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    weights = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    for w in weights:
        h.update(json.dumps([w.name, w.stat().st_size]).encode())
    if not mlx_version:
        import mlx.core as mx

        mlx_version = getattr(mx, "__version__", "")
    h.update(json.dumps({"upcast": bool(upcast), "mlx": mlx_version}).encode())
    return h.hexdigest()
