"""Make a draft model from a target by keeping its first N decoder layers (same tokenizer, same
embeddings and head): a quick DRAFT_MODEL when no smaller model of the family is at hand.

    .venv/bin/python scripts/make_draft_model.py --layers 8 --out /tmp/draft   # embedded SmolLM2
    .venv/bin/python scripts/make_draft_model.py --model ~/models/Qwen3-8B --layers 6 --out ~/models/q-draft
    DRAFT_MODEL=/tmp/draft SPECULATIVE=auto python3 install_and_run.py

A pruned model drafts well only where the early layers already know the next token (copied text,
boilerplate); a real small model of the same family (Qwen3-0.6B for Qwen3-8B) drafts better.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def prune(src: Path, out: Path, layers: int) -> Path:
    """Copy ``src`` to ``out`` keeping decoder layers 0..layers-1 (``model.layers.<i>.`` weights)."""
    import mlx.core as mx

    config = json.loads((src / "config.json").read_text())
    key = next((k for k in LAYER_KEYS if k in config), None)
    if key is None:
        raise SystemExit(f"{src}/config.json names no layer count ({', '.join(LAYER_KEYS)})")
    if not 0 < layers < int(config[key]):
        raise SystemExit(f"--layers must be between 1 and {int(config[key]) - 1} (the model has {config[key]})")
    out.mkdir(parents=True, exist_ok=True)
    weights: dict = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    kept = {}
    for name, value in weights.items():
        parts = name.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            if i + 1 < len(parts) and parts[i + 1].isdigit() and int(parts[i + 1]) >= layers:
                continue
        kept[name] = value
    mx.save_safetensors(str(out / "model.safetensors"), kept)
    config[key] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target model folder (default: the embedded SmolLM2)")
    ap.add_argument("--layers", type=int, required=True, help="decoder layers to keep (the first N)")
    ap.add_argument("--out", required=True, help="folder to write the draft model to")
    args = ap.parse_args()
    if args.model:
        src = Path(args.model).expanduser()
    else:
        from mlxstack.config.settings import load_settings
        from mlxstack.models.embedded_model import ensure_embedded_model

        src = Path(ensure_embedded_model(load_settings().model_cache_path))
    print(prune(src, Path(args.out).expanduser(), args.layers))


if __name__ == "__main__":
    main()
