"""Segmented (cached) tokenisation equals plain encoding, and falls back when it would not."""
from __future__ import annotations

import random

from mlx_lm import load

from mlxstack.prompt.tokenize import SegmentedEncoder


def _texts(seed: int = 0):
    rng = random.Random(seed)
    words = ["hello", " world", "\n", "\n\n", "  ", "def f(x):", "1234567", "é", "<think>", "</think>",
             "<|im_start|>", "<|im_end|>", "user", "assistant", "<tool_call>", "{\"a\": 1}", " ", "\t"]
    for _ in range(200):
        yield "".join(rng.choice(words) for _ in range(rng.randrange(1, 40)))


def test_segmented_equals_plain_on_the_qwen_style_fixture(tiny_dense_path):
    _, tok = load(str(tiny_dense_path))
    enc = SegmentedEncoder(tok, verify_first=0, verify_every=10**9)
    for text in _texts():
        assert enc.encode(text) == list(tok.encode(text, add_special_tokens=False)), repr(text)
    assert enc.enabled


def test_history_pieces_come_from_the_cache(embedded_model_path):
    _, tok = load(str(embedded_model_path))
    enc = SegmentedEncoder(tok)
    turn1 = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    enc.encode(turn1)
    hits = enc.piece_hits
    enc.encode(turn1 + "<|im_start|>assistant\nHello!<|im_end|>\n")
    assert enc.piece_hits > hits


class _Quirky:
    """A tokenizer whose added token eats the following space (rstrip): pieces differ."""

    def get_added_vocab(self):
        return {"<s>": 0}

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text.replace("<s> ", "\x00").replace("<s>", "\x00")]


def test_mismatch_turns_the_fast_path_off():
    enc = SegmentedEncoder(_Quirky())
    assert enc.encode("a<s> b") == _Quirky().encode("a<s> b")
    assert not enc.enabled
