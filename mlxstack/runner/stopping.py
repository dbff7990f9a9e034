"""Stopping: end-of-turn token ids, and a streaming stop-string matcher that releases text
only once it cannot start a stop string.

    m = StopMatcher(["</answer>"])
    out, hit = m.push("hello </ans")   # -> ("hello ", False): "</ans" is held back
    out, hit = m.push("wer> tail")     # -> ("", True): the stop string never leaks
    rest = m.flush()                    # held text at end of stream
"""
from __future__ import annotations

from typing import Any

# End-of-turn markers used by common chat templates; added to the stop set when the template uses them
# (Qwen3's <|im_end|> differs from its tokenizer eos <|endoftext|>; harmony ends with <|end|>/<|return|>).
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|return|>", "<end_of_turn>", "<|endoftext|>",
                   "<|user|>", "<|observation|>")


def stop_token_ids(tokenizer: Any, template_source: str, family: str = "generic") -> frozenset[int]:
    """Token ids that end a reply: the tokenizer's eos ids plus the template's end-of-turn tokens.

    Harmony (GPT-OSS) is the exception: ``<|end|>`` closes one message of a reply (analysis, then
    final or a call), so only ``<|return|>`` / ``<|call|>`` end it (parsing/harmony.HarmonyStopper
    guards the rest)."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or ())
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    turn_ends = ("<|return|>", "<|call|>") if family == "harmony" else TURN_END_TOKENS
    for tok in turn_ends:
        if tok in template_source and tok in vocab:
            ids.add(int(vocab[tok]))
    if family == "harmony" and "<|end|>" in vocab:
        ids.discard(int(vocab["<|end|>"]))
    return frozenset(ids)


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self._max = max((len(s) for s in self.stops), default=0)

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return buf[:cut], True
        # Hold back the longest suffix that is a proper prefix of some stop string.
        keep = 0
        for n in range(min(self._max - 1, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                keep = n
                break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
