"""Model loading: embedded SmolLM2 (default), a local folder, or a Hugging Face repo id.

    loaded = load_model(settings)   # LoadedModel(model, tokenizer, model_id, ...)

On CPU-only MLX (Linux) weights are dequantized/upcast to float32 when ``CPU_FLOAT32`` is on:
the CPU kernels for quantized and half-precision matmuls are far slower than an f32 BLAS sgemm.
Loading only: how the forwards are computed (the CPU backend's kernels and host path, the cascade
attention) is the backend's, chosen and installed by engine/factory.py (backends/).
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
    return local_model_folder(settings.model_path, "MODEL_PATH",
                              "Leave MODEL_PATH empty to use the embedded SmolLM2 model.", settings, progress)


def local_model_folder(value: str, variable: str, hint: str, settings: Settings | None = None,
                       say: Callable[[str], None] | None = None) -> tuple[Path, str]:
    """(folder, name) for a local MLX folder, a folder of MODELS_DIR by its name, or a Hugging Face
    repo id: from the local hub cache, else downloaded (MODEL_FETCH) into it."""
    from . import hub

    candidate = Path(value).expanduser()
    models_dir = Path(settings.models_dir).expanduser() if settings is not None and settings.models_dir else None
    if not candidate.exists() and models_dir is not None and not candidate.is_absolute() \
            and (models_dir / value / "config.json").is_file():
        candidate = models_dir / value
    if candidate.exists():
        if not (candidate / "config.json").exists():
            raise ModelLoadError(f"{variable}={value!r} has no config.json; point it at an MLX model folder.")
        return candidate, candidate.name
    name = value.rstrip("/").split("/")[-1]
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(value, local_files_only=True, cache_dir=str(hub.hub_cache_dir()))
        return Path(local), name
    except Exception as exc:  # noqa: BLE001 - any hub failure becomes one clear message
        why = type(exc).__name__
    fetch = settings is not None and settings.model_fetch
    if fetch and hub.looks_like_repo_id(value):
        try:
            return hub.fetch(value.strip(), say=say), name
        except hub.FetchError as exc:
            raise ModelLoadError(f"{variable}={value!r} is no local folder and not in the hub cache: {exc}") from None
    if not hub.looks_like_repo_id(value):
        raise ModelLoadError(f"{variable}={value!r} is neither a local folder nor a Hugging Face repo id (owner/name)"
                             f"{f' nor a folder of MODELS_DIR={settings.models_dir}' if models_dir else ''}. {hint}")
    raise ModelLoadError(
        f"{variable}={value!r} is not in the local Hugging Face cache ({hub.hub_cache_dir()}; {why}) and "
        f"MODEL_FETCH=false: download it with 'mlxstack pull {value}', set MODEL_FETCH=true, or point {variable} "
        f"at a local folder. {hint}")


def load_model(settings: Settings, progress: Callable[[str], None] | None = None,
               files_ready: Callable[[], None] | None = None,
               joined: Callable[[], None] | None = None) -> LoadedModel:
    """``files_ready``: called once the model's folder exists (serve.py starts the other local
    ranks there, so they never convert the embedded model at the same time). ``joined``: called
    once this rank's MLX group has formed (DISTRIBUTED; serve.py: stop signals are handled from
    then on)."""
    say = progress or (lambda msg: log.info(msg))
    say("preparing model files")
    path, name = resolve_model_path(settings, progress)
    config = json.loads((path / "config.json").read_text())
    distributed = settings.distributed != "off"
    if files_ready is not None and not distributed:
        files_ready()
    if is_vlm_config(config):
        if distributed:
            raise ModelLoadError(f"DISTRIBUTED={settings.distributed}: vision-language models are served by one "
                                 "process only (mlx-vlm has no sharding here); use DISTRIBUTED=off.")
        return load_vlm(path, name, config, settings)
    say(f"loading {name} from {path}")
    from mlx_lm import load as mlx_load

    model, tokenizer = mlx_load(str(path), lazy=distributed)
    # upcast before a split: mlx-lm's dequantize would swap a sharded layer for a plain one
    if settings.cpu_float32 and is_cpu_only() and upcast_for_cpu(model):
        say("CPU: weights upcast to float32 for BLAS prefill")
    extra: dict = {}
    if distributed:
        extra["group"] = _shard(model, config, name, settings, say, files_ready, joined)
    context = context_window(config, getattr(getattr(tokenizer, "_tokenizer", tokenizer), "model_max_length", None),
                             settings.max_kv_size)
    return LoadedModel(
        model=model, tokenizer=tokenizer, model_id=name, path=path, config=config,
        family=detect_family(config, str(path), settings.model_family), context_length=context, extra=extra,
    )


def _shard(model: Any, config: dict, name: str, settings: Settings, say: Callable[[str], None],
           files_ready: Callable[[], None] | None, joined: Callable[[], None] | None = None) -> Any:
    """Check the split (refused in one line before any other rank starts, where the rank count is
    known here), join the ranks' group, keep this rank's part of the (still lazy) weights."""
    import mlx.core as mx

    from .sharding import differing_settings, distributed_group, facts_from_config, refusal, shard, shared_settings

    facts = facts_from_config(config, name, model)
    why = refusal(settings.distributed, settings.distributed_local_ranks, facts) \
        if settings.distributed_local_ranks else None
    if why:
        raise ModelLoadError(why)
    if files_ready is not None:
        files_ready()
    group = distributed_group(settings)
    if joined is not None:
        joined()
    why = refusal(settings.distributed, group.size(), facts)
    if why:
        raise ModelLoadError(why)
    alike = {**shared_settings(settings), "the model's config.json": json.dumps(config, sort_keys=True)}
    differ = differing_settings(group, alike)
    if differ:
        raise ModelLoadError(f"DISTRIBUTED: rank {group.rank()}'s settings differ from rank 0's in {', '.join(differ)}; "
                             "every rank must run with the same values (give every host the same .env and model)")
    shard(model, settings.distributed, group)
    mx.eval(model.parameters())
    say(f"rank {group.rank()} of {group.size()}: {settings.distributed} parallel part loaded")
    return group


def load_draft_model(settings: Settings, target: LoadedModel, say: Callable[[str], None] | None = None) -> Any:
    """The draft model for speculative decoding (``DRAFT_MODEL``; engine/factory.py decides whether
    one is used). Refused at start, with why, when its tokenizer is not the target's: drafts are
    token ids, verified by the target as they are."""
    say = say or (lambda msg: log.info(msg))
    path, name = local_model_folder(settings.draft_model.strip(), "DRAFT_MODEL",
                                    "Leave DRAFT_MODEL empty for prompt-lookup drafts only.", settings, say)
    config = json.loads((path / "config.json").read_text())
    if is_vlm_config(config):
        raise ModelLoadError(f"DRAFT_MODEL={settings.draft_model!r} is a vision-language model; a draft model "
                             "must be a text model with the target's tokenizer.")
    from mlx_lm import load as mlx_load
    from mlx.utils import tree_flatten

    model, tokenizer = mlx_load(str(path))
    why = tokenizer_mismatch(target.tokenizer, tokenizer)
    if why:
        raise ModelLoadError(
            f"DRAFT_MODEL={settings.draft_model!r} does not share the tokenizer of {target.model_id} ({why}); "
            "drafts are token ids, so the draft model must use the same vocabulary -- pick a smaller model "
            "of the same family, or leave DRAFT_MODEL empty.")
    if settings.cpu_float32 and is_cpu_only():
        upcast_for_cpu(model)

    def params(m: Any) -> int:
        return sum(v.size for _, v in tree_flatten(m.parameters()))

    n = params(model)
    cost = n / max(1, params(target.model))
    say(f"draft model {name}: {n / 1e6:.1f}M parameters, one draft token ~{cost:.2f} of a target step")
    return LoadedModel(model=model, tokenizer=tokenizer, model_id=name, path=path, config=config,
                       family=detect_family(config, str(path)), context_length=target.context_length,
                       extra={"cost": cost})


def tokenizer_mismatch(target: Any, draft: Any) -> str:
    """Why two tokenizers cannot share token ids ('' when they can): the same token -> id map."""
    a = target.get_vocab() if hasattr(target, "get_vocab") else None
    b = draft.get_vocab() if hasattr(draft, "get_vocab") else None
    if a is None or b is None:
        return "a tokenizer without a vocabulary to compare"
    if len(a) != len(b):
        return f"{len(b)} tokens vs {len(a)}"
    differ = [t for t, i in a.items() if b.get(t) != i]
    if differ:
        return f"{len(differ)} tokens map to other ids, e.g. {differ[0]!r}"
    return ""


def hf_offline_env() -> None:
    """Never reach for a hub at run time: no library call made while serving may reach the network.
    Where this sets the switch itself (the user set neither variable), it says so in the environment,
    so a model fetch at load (models/hub.py, MODEL_FETCH) may lift it for its own duration; a switch
    the user set stays on for that too."""
    from .hub import OFFLINE_DEFAULTED

    if not os.environ.get("HF_HUB_OFFLINE") and not os.environ.get("TRANSFORMERS_OFFLINE"):
        os.environ[OFFLINE_DEFAULTED] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
