"""Model loading: embedded SmolLM2 (default), a local folder, or a Hugging Face repo id.

    loaded = load_model(settings)   # LoadedModel(model, tokenizer, model_id, ...)

On CPU-only MLX (Linux) weights are dequantized/upcast to float32 when ``CPU_FLOAT32`` is on:
the CPU kernels for quantized and half-precision matmuls are far slower than an f32 BLAS sgemm.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable


from ..config.settings import Settings
from .context import context_window
from .device import is_cpu_only, upcast_for_cpu
from .loaded import LoadedModel, ModelLoadError, detect_family
from .vlm_loader import is_vlm_config, load_vlm

log = logging.getLogger(__name__)


class TqdmProgress:
    """A ``progress(message, fraction)`` callback drawing a tqdm bar (percent, ETA) on stderr.

    The bar is created on the first call, so an already converted model prints nothing. Each
    new message also goes to ``say`` (the server log) for logs that are not a terminal.
    """

    def __init__(self, desc: str, say: Callable[[str], None] | None = None) -> None:
        self.desc = desc
        self.say = say
        self._bar: Any = None
        self._last_msg = ""

    def __call__(self, message: str, fraction: float) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=100, desc=self.desc, unit="%", mininterval=0.5,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}")
        self._bar.n = round(100 * fraction, 1)
        self._bar.set_postfix_str(message, refresh=False)
        self._bar.refresh()
        # Only the first "converting weights" line goes to the log; the bar shows the rest.
        head = message.split(" ")[0] + " " + (message.split(" ")[1] if " " in message else "")
        if self.say is not None and head != self._last_msg:
            self._last_msg = head
            with self._bar.external_write_mode():  # keep the log line off the bar's line
                self.say(f"{self.desc}: {message} ({100 * fraction:.0f}%)")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def resolve_model_path(settings: Settings, progress: Callable[[str], None] | None = None) -> tuple[Path, str]:
    """(local folder, served model name). Converts the embedded GGUF on first use."""
    if not settings.model_path:
        from .embedded_model import embedded_model_name, ensure_embedded_model

        bar = TqdmProgress(f"preparing {embedded_model_name()}", say=progress)
        try:
            path = ensure_embedded_model(settings.model_cache_path, float32=settings.cpu_float32, progress=bar)
        finally:
            bar.close()
        return Path(path), embedded_model_name()
    candidate = Path(settings.model_path).expanduser()
    if candidate.exists():
        if not (candidate / "config.json").exists():
            raise ModelLoadError(f"MODEL_PATH={settings.model_path!r} has no config.json; point it at an MLX model folder.")
        return candidate, candidate.name
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(settings.model_path, local_files_only=True)
        return Path(local), settings.model_path.rstrip("/").split("/")[-1]
    except Exception as exc:  # noqa: BLE001 - any hub failure becomes one clear message
        raise ModelLoadError(
            f"MODEL_PATH={settings.model_path!r} is neither a local folder nor a cached Hugging Face repo "
            f"({type(exc).__name__}). This machine is offline: download it elsewhere "
            "(huggingface-cli download <repo>) or point MODEL_PATH at a local folder. "
            "Leave MODEL_PATH empty to use the embedded SmolLM2 model."
        ) from None


def load_model(settings: Settings, progress: Callable[[str], None] | None = None) -> LoadedModel:
    say = progress or (lambda msg: log.info(msg))
    say("preparing model files")
    path, name = resolve_model_path(settings, progress)
    config = json.loads((path / "config.json").read_text())
    if is_vlm_config(config):
        return load_vlm(path, name, config, settings)
    say(f"loading {name} from {path}")
    from mlx_lm import load as mlx_load

    model, tokenizer = mlx_load(str(path))
    if settings.cpu_float32 and is_cpu_only() and upcast_for_cpu(model):
        say("CPU: weights upcast to float32 for BLAS prefill")
    context = context_window(config, getattr(getattr(tokenizer, "_tokenizer", tokenizer), "model_max_length", None),
                             settings.max_kv_size)
    return LoadedModel(
        model=model, tokenizer=tokenizer, model_id=name, path=path, config=config,
        family=detect_family(config, str(path), settings.model_family), context_length=context,
    )


def hf_offline_env() -> None:
    """Never reach for a hub at run time (this stack runs offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
