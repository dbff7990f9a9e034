"""A plain KV cache whose first tokens are a prefix held elsewhere, by reference.

    layer = PrefixedKVCache((keys, values, n), tail_keys, tail_values, tail_len)
    layer.update_and_fetch(k, v)     # appends to the tail; returns the tail
    layer.shared_prefix()            # (prefix keys, values, None, True) for the attention hook

A row that leaves a decode batch whose rows share a prefix (cache/slab.py) is handed back
as one of these instead of a copy of prefix + tail: eight sub-agents finishing together would
otherwise copy the shared system prompt eight times just to close their turns and store them. The
model attends prefix + tail through backends/cascade.py (the mask the model builds covers
both: ``full_mask`` True, split at the prefix). ``offset`` counts every token (prefix included),
as a ``KVCache``'s does. Stored, it is a rooted plain-KV state (cache/layer_kinds.py
``PrefixedKind``): the prefix by reference, the tail copied.
"""
from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, create_attention_mask


class PrefixedKVCache:
    step = 256
    plain_kv = True     # plain K / V with KVCache's semantics (backends/cpu/host_forward.py takes it)

    def __init__(self, prefix: tuple[Any, Any, int] | None = None, keys: Any = None, values: Any = None,
                 tail: int = 0) -> None:
        self.prefix = prefix                     # (keys, values, n): the first n tokens, by reference
        self.keys, self.values = keys, values    # the tail buffer (room past ``tail``)
        self.offset = (prefix[2] if prefix else 0) + tail

    @property
    def n_prefix(self) -> int:
        return self.prefix[2] if self.prefix else 0

    def shared_prefix(self) -> tuple[Any, Any, None, bool] | None:
        if not self.prefix or not self.prefix[2]:
            return None
        rk, rv, n = self.prefix
        return rk[..., :n, :], rv[..., :n, :], None, True

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        t = self.offset - self.n_prefix
        m = keys.shape[2]
        if self.keys is None or t + m > self.keys.shape[2]:
            grow = ((m + self.step - 1) // self.step) * self.step
            shape = lambda a: (*a.shape[:2], grow, a.shape[3])  # noqa: E731
            new_k, new_v = mx.zeros(shape(keys), keys.dtype), mx.zeros(shape(values), values.dtype)
            if self.keys is not None:
                new_k = mx.concatenate([self.keys[..., :t, :], new_k], axis=2)
                new_v = mx.concatenate([self.values[..., :t, :], new_v], axis=2)
            self.keys, self.values = new_k, new_v
        self.keys[..., t:t + m, :] = keys
        self.values[..., t:t + m, :] = values
        self.offset += m
        return self.keys[..., :t + m, :], self.values[..., :t + m, :]

    def tail(self, upto: int | None = None) -> tuple[Any, Any]:
        """The tail's valid keys / values (up to absolute depth ``upto``), as views."""
        t = (self.offset if upto is None else upto) - self.n_prefix
        if self.keys is None or t <= 0:
            return None, None
        return self.keys[..., :t, :], self.values[..., :t, :]

    def whole(self) -> KVCache:
        """A plain ``KVCache`` holding prefix + tail (one copy)."""
        c = KVCache()
        if self.offset:
            rk, rv, n = self.prefix if self.prefix else (None, None, 0)
            tk, tv = self.tail()
            ks = [a for a in (rk[..., :n, :] if n else None, tk) if a is not None]
            vs = [a for a in (rv[..., :n, :] if n else None, tv) if a is not None]
            c.keys, c.values = mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)
            c.offset = self.offset
        return c

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset - self.n_prefix, n)
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def state(self) -> list[Any]:
        """The arrays this layer owns (mlx-lm's ``state``: what a caller evaluates after a chunk)."""
        return [a for a in (self.keys, self.values) if a is not None]

    @property
    def nbytes(self) -> int:
        own = 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
        return own
