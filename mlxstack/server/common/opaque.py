"""Our own state in a field the client echoes back unchanged (pure).

A Responses reasoning item's ``encrypted_content`` and an Anthropic thinking block's ``signature``
carry the reasoning text, so the next turn renders the same tokens even when the client never
echoes the text itself (Codex; Claude Code with ``thinking.display: "omitted"``). The value is a
versioned prefix plus base64 of the text -- not encryption and not a signature: the client
already holds the text it was streamed.

    blob = encode_opaque("mlxstack.reasoning.v1:", "plan", urlsafe=True)
    decode_opaque("mlxstack.reasoning.v1:", blob, urlsafe=True) == "plan"
    decode_opaque("mlxstack.reasoning.v1:", "gAAAA...", urlsafe=True) is None   # another server's
"""
from __future__ import annotations

import base64
import binascii
from typing import Any


def encode_opaque(prefix: str, text: str, *, urlsafe: bool) -> str:
    """``prefix`` + base64 of ``text`` (UTF-8); the URL-safe alphabet when ``urlsafe``."""
    raw = text.encode("utf-8")
    encoded = base64.urlsafe_b64encode(raw) if urlsafe else base64.b64encode(raw)
    return prefix + encoded.decode("ascii")


def decode_opaque(prefix: str, value: Any, *, urlsafe: bool) -> str | None:
    """The text inside a value from ``encode_opaque`` with the same prefix; None for anything else
    (another prefix, not a string, not base64, not UTF-8). The standard alphabet is decoded
    strictly (``validate=True``); the URL-safe one as ``base64.urlsafe_b64decode`` does."""
    if not isinstance(value, str) or not value.startswith(prefix):
        return None
    try:
        data = value[len(prefix):].encode("ascii")
        raw = base64.urlsafe_b64decode(data) if urlsafe else base64.b64decode(data, validate=True)
        return raw.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


__all__ = ["decode_opaque", "encode_opaque"]
