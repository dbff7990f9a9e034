"""Block hashes for the prompt cache: pure functions, no MLX, no I/O.

A prompt's tokens are cut into fixed-size blocks; block ``i``'s hash is

    H(hash[i-1] || tokens[i*bs:(i+1)*bs] as little-endian int64)

with ``hash[-1]`` = a namespace seed (model id, adapter, template hash, extras), so two
models, adapters or chat templates can never share a key for identical token ids.
Only full blocks are hashed; the trailing remainder is left to token-level matching.

Usage:
    seed = namespace_seed("mlx-community/Qwen3-4B-4bit", template_hash=template_hash(tpl))
    chain = block_hash_chain(seed, prompt_tokens, 16)   # list[BlockHash], len == len(tokens)//16

Token ids are encoded as 8-byte signed little-endian integers: VLM image markers may be
negative or exceed 2**31, and a fixed width keeps the encoding unambiguous.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, NewType, Sequence

import numpy as np

BlockHash = NewType("BlockHash", bytes)

HashFn = Callable[..., Any]  # hashlib constructor: hash_fn(data=b"") -> object with update()/digest()

_NAMESPACE_TAG = b"mlxstack.block-hash.ns.v1\x00"
_TOKEN_DTYPE = np.dtype("<i8")
_TOKEN_BYTES = _TOKEN_DTYPE.itemsize


def _encode_field(value: Any) -> bytes:
    """Type-tagged, length-prefixed encoding: ("ab", "c") and ("a", "bc") never collide."""
    if isinstance(value, bool):  # before int: bool is an int subclass
        payload, tag = (b"1" if value else b"0"), b"?"
    elif isinstance(value, str):
        payload, tag = value.encode("utf-8"), b"s"
    elif isinstance(value, (bytes, bytearray, memoryview)):
        payload, tag = bytes(value), b"b"
    elif isinstance(value, int):
        payload, tag = str(value).encode("ascii"), b"i"
    elif isinstance(value, float):
        payload, tag = repr(value).encode("ascii"), b"f"
    elif value is None:
        payload, tag = b"", b"n"
    elif isinstance(value, (tuple, list)):
        payload, tag = b"".join(_encode_field(v) for v in value), b"t"
    else:
        raise TypeError(
            f"namespace field of type {type(value).__name__} cannot be hashed; "
            "use str, bytes, int, float, bool, None or tuples of them"
        )
    return tag + len(payload).to_bytes(8, "little") + payload


def namespace_seed(
    model_id: str,
    adapter: str = "",
    template_hash: str = "",
    extra: tuple = (),
    *,
    hash_fn: HashFn = hashlib.sha256,
) -> BlockHash:
    """Root of every hash chain for one (model, adapter, template, extras) namespace.

    Args:
        model_id: model path / repo id (what was loaded).
        adapter: LoRA adapter path or "" for none.
        template_hash: ``template_hash(chat_template)``; "" when there is no template.
        extra: further identity (e.g. image digests, kv quantisation); str/bytes/int/... tuples.
        hash_fn: hashlib constructor (default SHA-256).

    Returns:
        The seed, used as the parent hash of block 0.
    """
    h = hash_fn(_NAMESPACE_TAG)
    h.update(_encode_field((model_id, adapter, template_hash, tuple(extra))))
    return BlockHash(h.digest())


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        if isinstance(tokens, (list, tuple)):  # fromiter is ~2x faster than asarray on lists
            arr = np.fromiter(tokens, dtype=_TOKEN_DTYPE, count=len(tokens))
        else:
            arr = np.asarray(tokens, dtype=_TOKEN_DTYPE)
    except OverflowError as exc:
        raise ValueError(f"token id out of int64 range: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    return arr.tobytes()


def hash_block_tokens(
    parent: BlockHash, tokens: Sequence[int], *, hash_fn: HashFn = hashlib.sha256
) -> BlockHash:
    """Hash of one block, chained on its parent (the previous block's hash or the seed)."""
    h = hash_fn(parent)
    h.update(_token_bytes(tokens))
    return BlockHash(h.digest())


def block_hash_chain(
    seed: BlockHash,
    tokens: Sequence[int],
    block_size: int,
    *,
    hash_fn: HashFn = hashlib.sha256,
) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``tokens``; the remainder is not hashed.

    ``result[i] == hash_block_tokens(result[i-1], tokens[i*bs:(i+1)*bs])`` with
    ``result[-1] := seed``. Equal chains up to block i <=> equal tokens up to (i+1)*bs
    (within one namespace, barring SHA-256 collisions).

    Args:
        seed: ``namespace_seed(...)``.
        tokens: token ids (list, tuple or 1-D integer array).
        block_size: tokens per block (PROMPT_CACHE_BLOCK_SIZE), >= 1.

    Returns:
        ``len(tokens) // block_size`` hashes.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    buf = memoryview(_token_bytes(tokens))
    stride = block_size * _TOKEN_BYTES
    n_full = len(buf) // stride
    chain: list[BlockHash] = []
    append = chain.append
    parent = bytes(seed)
    for start in range(0, n_full * stride, stride):
        h = hash_fn(parent)
        h.update(buf[start:start + stride])
        parent = h.digest()
        append(parent)  # type: ignore[arg-type]  # BlockHash is bytes at runtime
    return chain


def template_hash(template_text: str | None) -> str:
    """Stable hex digest of a chat template (None/"" -> digest of the empty string)."""
    return hashlib.sha256((template_text or "").encode("utf-8")).hexdigest()




_SCOPE_TAG = b"mlxstack.block-hash.scope.v1\x00"


def scoped_seed(seed: BlockHash, scope: str, *, hash_fn: HashFn = hashlib.sha256) -> BlockHash:
    """The root of ``scope``'s chains under a namespace ``seed`` (the default scope "" is the seed
    itself): as vLLM's ``cache_salt``, the scope is an extra key of the first block only, so every
    later block inherits it and no block of one scope ever equals another's."""
    if not scope:
        return seed
    h = hash_fn(_SCOPE_TAG)
    h.update(_encode_field((bytes(seed), scope)))
    return BlockHash(h.digest())


__all__ = [
    "BlockHash",
    "namespace_seed",
    "hash_block_tokens",
    "block_hash_chain",
    "template_hash",
    "scoped_seed",
]
