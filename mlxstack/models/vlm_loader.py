"""Vision-language models through mlx-vlm: detection and loading.

A config is a VLM when it carries a ``vision_config`` and its ``model_type`` is a model package
that the installed mlx-vlm ships. Text-only models keep the mlx-lm path.

    loaded = load_vlm(path, name, config, settings)   # LoadedModel(is_vlm=True, processor=...)

The request path for a loaded VLM is engine/vlm_chat.py (VLMChatEngine).
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Any

from .context import context_window
from .device import is_cpu_only, upcast_for_cpu
from .loaded import LoadedModel, ModelLoadError, detect_family


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


def keep_torch_off_mps() -> None:
    """If torch is importable, stop it from using Apple's MPS backend (Metal command-buffer
    collisions with MLX crash the process, seed 001). Torch is never required."""
    if importlib.util.find_spec("torch") is None:
        return
    try:
        import torch

        torch.backends.mps.is_built = lambda: False
        torch.backends.mps.is_available = lambda: False
    except Exception:  # noqa: BLE001 - a broken torch install must not stop the server
        pass


def _text_tokenizer(processor: Any, path: Path, config: dict) -> Any:
    """The processor's tokenizer wrapped like mlx-lm's (detokenizer, eos ids, chat template)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_vlm.tokenizer_utils import load_tokenizer

    tok = getattr(processor, "tokenizer", processor)
    if getattr(tok, "chat_template", None) is None and getattr(processor, "chat_template", None):
        tok.chat_template = processor.chat_template
    eos = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    detokenizer_class = load_tokenizer(Path(path), return_tokenizer=False)
    return TokenizerWrapper(tok, detokenizer_class, eos_token_ids=eos_ids)


def load_vlm(path: Path, name: str, config: dict, settings: Any):
    """Load a VLM with mlx-vlm: LoadedModel(model=the full VLM, tokenizer=text tokenizer wrapper,
    processor=the mlx-vlm processor, is_vlm=True)."""
    keep_torch_off_mps()
    from mlx_vlm import load as vlm_load


    try:
        model, processor = vlm_load(str(path))
    except Exception as exc:  # noqa: BLE001 - one clear message for any mlx-vlm failure
        raise ModelLoadError(f"mlx-vlm could not load {path} ({type(exc).__name__}: {exc}); "
                             f"check that mlx-vlm supports model_type {config.get('model_type')!r}") from None
    if getattr(settings, "cpu_float32", False) and is_cpu_only():
        upcast_for_cpu(model)
    tokenizer = _text_tokenizer(processor, path, config)
    context = context_window(config, getattr(getattr(tokenizer, "_tokenizer", tokenizer), "model_max_length", None),
                             getattr(settings, "max_kv_size", 0))
    return LoadedModel(
        model=model, tokenizer=tokenizer, model_id=name, path=path,
        config=config, family=detect_family(config, str(path), getattr(settings, "model_family", "auto")),
        context_length=context, is_vlm=True, processor=processor,
    )
