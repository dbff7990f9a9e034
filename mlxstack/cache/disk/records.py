"""Cache entries to disk records and back: the bridge between the RAM tier's KVState
(mx arrays, cache/kv_ops.py) and the disk tier's numpy records (cache/disk/tier.py).

    record = entry_to_record(entry)            # on the inference thread; no copy of the tensors
    tier.put(record)                           # the writer thread reads the arrays' buffers
    state = record_to_state(tier.load(id))     # or path_to_state(tier.verified_path(id), info)

Stored arrays are immutable (a hit never writes into an entry), so the writer thread can read
their buffers while the inference thread goes on. bfloat16 has no numpy dtype: it travels as its
uint16 bits and is viewed back on load.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .tier import DiskRecord
from ..kv_ops import KVState, dump_state, load_state
from ..prompt_cache import CacheEntry

BFLOAT16 = "bfloat16"


def entry_to_record(entry: CacheEntry) -> DiskRecord:
    state: KVState = entry.payload
    arrays, meta = dump_state(state)
    views, bf16 = {}, []
    for name, a in arrays.items():
        if a.dtype == mx.bfloat16:
            a = a.view(mx.uint16)
            bf16.append(name)
        views[name] = a
    mx.eval(list(views.values()))
    tensors = {name: np.asarray(memoryview(a)) for name, a in views.items()}   # zero-copy views
    meta = {"state": meta, "bfloat16": bf16, "floor": entry.floor, "pool": entry.pool,
            "session": entry.session_id, "scope": entry.scope, "ram_bytes": entry.nbytes}
    return DiskRecord(entry.key_tokens, entry.model_tokens, tensors, meta)


def arrays_to_state(arrays: dict[str, Any], meta: dict) -> KVState:
    """The KVState a record's arrays (numpy or mx; reserved ``mlxstack.*`` names skipped) describe."""
    out = {}
    for name, a in arrays.items():
        if name.startswith("mlxstack."):
            continue
        a = a if isinstance(a, mx.array) else mx.array(a)
        out[name] = a.view(mx.bfloat16) if name in meta.get("bfloat16", ()) else a
    state = load_state(out, meta["state"])
    mx.eval([v for v in out.values()])
    return state


def record_to_state(record: DiskRecord) -> KVState:
    return arrays_to_state(dict(record.tensors), record.meta)


def path_to_state(path: Path, meta: dict) -> KVState:
    """Load a verified file straight into MLX (one copy, no numpy round trip)."""
    return arrays_to_state(mx.load(str(path)), meta)
