"""A tiny random-weight model with a 128k window that ends its replies, for real agent clients.

    .venv/bin/python scripts/real_clients/long_window_model.py [OUT_DIR]   # prints the folder
    MODEL_PATH=$(that folder) .venv/bin/python start_llm.py

Claude Code (~12k tokens of tools and system prompt), Codex (~10k) and OpenClaw (~15k) do not fit
the embedded SmolLM2's 8k window. This is the 2-layer qwen3 test fixture (Qwen3-style template with
thinking and tools, SmolLM2 tokenizer) with ``max_position_embeddings`` raised to 131072 and an
untied output head wired to end replies after a few tokens: a plain random model almost never
samples ``<|im_end|>``, so every reply would run to the token limit, which Codex treats as a failed
turn (``response.incomplete``). Replies are gibberish; every request, cache hit and token count is
real, and prefill runs at ~1,000 tok/s on two CPU cores.

How the head ends replies (two hidden dimensions set aside, zero in every other row):
- dimension ``EOS_DIM``: only the ``<|im_end|>`` output row reads it (``EOS_GAIN``); its value comes
  from the layers alone, so ``<|im_end|>`` wins at a data-dependent point of the reply;
- dimension ``NEWLINE_DIM``: the newline tokens that end every generation prompt write ``-NEWLINE_MARK``
  into it and the ``<|im_end|>`` row reads it (``NEWLINE_GAIN``), so a reply is never empty.
Measured with mlx-lm on 10 prompts x thinking on/off: greedy replies of 1-24 tokens, 1-20 at
temperature 0.7, none empty; on the real clients' 9k-15k-token prompts, 4-90 tokens.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_DIR = Path.home() / ".cache" / "mlxstack-clients" / "tiny-long-window"
CONTEXT_WINDOW = 131072
MARKER = "long_window.json"
EOS_DIM, NEWLINE_DIM = 0, 1
EOS_GAIN, NEWLINE_GAIN, NEWLINE_MARK = 8.0, 4.0, 4.0
NEWLINE_TOKENS = ("\n", "\n\n")


def _recipe(context_window: int) -> dict:
    return {"version": 1, "context_window": context_window, "eos_gain": EOS_GAIN, "newline_gain": NEWLINE_GAIN,
            "newline_mark": NEWLINE_MARK}


def build_long_window_model(path: Path = DEFAULT_DIR, context_window: int = CONTEXT_WINDOW) -> Path:
    """Build (or reuse) the model folder at ``path``; returns it. The folder name is the model id."""
    import mlx.core as mx
    from tokenizers import Tokenizer

    from tests.fixtures.tiny_models import build_tiny_dense, tokenizer_source_dir

    path = Path(path)
    recipe = _recipe(context_window)
    try:
        if json.loads((path / MARKER).read_text()) == recipe:
            return path
    except (OSError, ValueError):
        pass
    shutil.rmtree(path, ignore_errors=True)  # a stale or half-written build: start from the fixture
    build_tiny_dense(path, tokenizer_source_dir())
    config = json.loads((path / "config.json").read_text())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    newlines = [tok.encode(s, add_special_tokens=False).ids for s in NEWLINE_TOKENS]
    if eos is None or any(len(ids) != 1 for ids in newlines):
        raise RuntimeError(f"bug: fixture tokenizer lost <|im_end|> ({eos}) or single-token newlines ({newlines})")

    weights = mx.load(str(path / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    embed = embed.at[:, EOS_DIM].multiply(0.0).at[:, NEWLINE_DIM].multiply(0.0)
    head = embed  # output rows start as the (tied) embeddings, minus the two reserved dimensions
    for (t,) in newlines:
        embed = embed.at[t, NEWLINE_DIM].add(-NEWLINE_MARK)
    head = head.at[eos, :].multiply(0.0).at[eos, EOS_DIM].add(EOS_GAIN).at[eos, NEWLINE_DIM].add(NEWLINE_GAIN)
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    # RoPE positions are computed, not learned: a larger window changes no weight.
    config.update(max_position_embeddings=context_window, tie_word_embeddings=False)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / MARKER).write_text(json.dumps(recipe) + "\n")
    return path


if __name__ == "__main__":
    print(build_long_window_model(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
