"""Vision-language models through mlx-vlm: detection and loading.

A config is a VLM when it carries a ``vision_config`` and its ``model_type`` is a model package
that the installed mlx-vlm ships. Text-only models keep the mlx-lm path.
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Any


@lru_cache(maxsize=1)
def supported_vlm_types() -> frozenset[str]:
    spec = importlib.util.find_spec("mlx_vlm")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    models = Path(list(spec.submodule_search_locations)[0]) / "models"
    return frozenset(p.name for p in models.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def is_vlm_config(config: dict) -> bool:
    model_type = str(config.get("model_type", "")).replace("-", "_")
    return "vision_config" in config and model_type in supported_vlm_types()


def load_vlm(path: Path, name: str, config: dict, settings: Any):
    raise NotImplementedError("VLM loading lands with the vision issue")
