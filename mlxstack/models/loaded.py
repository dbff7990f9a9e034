"""What a loaded model is, independent of the loader that built it (mlx-lm, mlx-vlm, embedded).

    loaded = LoadedModel(model, tokenizer, model_id, path, config, family, context_length)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.nn as nn


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says why and how to fix it."""


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any                 # mlx_lm TokenizerWrapper
    model_id: str                  # served name (/v1/models)
    path: Path
    config: dict
    family: str                    # qwen3 | glm4 | generic
    context_length: int
    is_vlm: bool = False
    processor: Any = None
    extra: dict = field(default_factory=dict)

    @property
    def eos_token_ids(self) -> set[int]:
        return set(getattr(self.tokenizer, "eos_token_ids", set()) or set())


def detect_family(config: dict, path: str, override: str = "auto") -> str:
    if override != "auto":
        return override
    text = (str(config.get("model_type", "")) + " " + path).lower()
    if config.get("model_type") == "gpt_oss" or "gpt-oss" in text or "gpt_oss" in text:
        return "harmony"  # GPT-OSS speaks the harmony channel format (parsing/harmony.py)
    if "glm" in text:
        return "glm4"
    if "qwen" in text:
        return "qwen3"
    return "generic"


def read_generation_config(path: Path | str | None) -> dict:
    """The model folder's ``generation_config.json`` (Hugging Face's sampling defaults), or {} when
    it has none or it cannot be read as a JSON object (runner/sampling_defaults.py decides what
    of it is used)."""
    if path is None:
        return {}
    try:
        data = json.loads((Path(path) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
