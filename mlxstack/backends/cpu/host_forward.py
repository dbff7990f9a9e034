"""Decode-sized forwards of a Llama-family model on the CPU without a graph of small MLX ops.

    install(model)                  # by the CPU backend's install (backends/cpu/backend.py): True when it applies
    forward(model, tokens, cache)   # the logits, or None: not a call it takes (the caller runs model(...))

Nothing is patched onto mlx-lm's classes: the CPU backend's ``forward_rows`` / ``feed_rows``
(backends/base.py) call ``forward`` / ``feed_rows`` here, reached through runner/forward.py for
the model objects the backend was attached to; ``model(tokens, cache=...)`` is always mlx-lm's own.

On MLX's CPU backend a decode step of a small model is bound by op count, not arithmetic: each
of a layer's ~20 MLX ops (norms, projections, reshapes, RoPE, the KV write, the SwiGLU, the
residuals) is a graph node, an allocation and a dispatch, and a weight product costs more
through MLX than the same ``cblas_sgemm`` called directly (measured here: the 210 products of an
8-row SmolLM2-135M step, 65 ms as MLX matmuls, 50 ms as direct calls into the same preloaded
OpenBLAS). For calls of up to ``MAX_POSITIONS`` positions a row (a decode step, a speculative
verification, a turn's closer, a warm turn's short rest) this module runs the layer's dense
arithmetic on numpy views of the model's own weight buffers (no copy) -- products through the
optimised BLAS MLX itself uses (``blas()``) or, for up to 128 rows, a native loop that streams each
weight once (backends/cpu/native_products.py, NATIVE_PRODUCTS), norms and SwiGLU in numpy -- and keeps in MLX exactly
what carries the cache semantics:
RoPE's cos / sin (MLX's own ``fast.rope`` at the cache's offsets, once per call; the rotation is
then bit for bit MLX's), the cache's own
``update_and_fetch`` / ``make_mask`` (every cache layout -- a slab's rows, a shared prefix held
once, ragged speculative ends -- works unchanged) and the model module's attention (the native
kernel or the cascade's ops: backends/cascade.py). KV_BITS' uniform layers (mlx-lm's
``QuantizedKVCache``) are taken too: the cache's own write quantises the new K / V, and attention
reads the codes through the native kernel as the floats ``mx.dequantize`` gives back (not mlx-lm's
quantised attention, whose sums follow the call's shape). Longer calls, other architectures,
quantised or sharded weights, biases of unusual shape, sliding layers, scaled RoPE variants:
mlx-lm's forward.

Within float rounding of mlx-lm's forward (RMSNorm and SiLU are computed in float32 by numpy);
checked against it on the loaded model at install, and a model whose weights are replaced
afterwards (a new array object) falls back to mlx-lm's forward at once. Without an optimised BLAS
preloaded for MLX (system/blas.py) it is not used.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...cache.marks import mark, marked
from ..cascade import Part, attend_parts
from .native_products import MAX_ROWS as _MAX_NATIVE_ROWS

log = logging.getLogger(__name__)

MAX_POSITIONS = 16          # positions a row: decode-sized calls only (a prefill chunk stays in MLX)
def _plan_of(model: Any) -> Optional["Plan"]:
    return marked(model, "host_plan")


def _set_plan(model: Any, plan: Optional["Plan"]) -> None:
    """The model's plan (None: the host path is off for it), held beside the model (cache/marks.py):
    opt-in per instance, nothing written onto an mlx-lm object."""
    mark(model, "host_plan", plan)


def _weight(linear: Any) -> Optional[mx.array]:
    """A float32 ``nn.Linear``'s weight (None for any other layer: quantised, sharded, LoRA)."""
    if type(linear) is not nn.Linear or linear.weight.dtype != mx.float32:
        return None
    return linear.weight


def _rows(w: mx.array) -> np.ndarray:
    """A row-major numpy view of a weight (no copy)."""
    view = np.asarray(w)
    if not view.flags.c_contiguous:
        raise ValueError("a weight is not row-major contiguous")
    return view


def _linears(block: Any) -> list[Any]:
    """One transformer block's projections, in the plan's order (q, k, v, o, gate, up, down)."""
    a, m = block.self_attn, block.mlp
    return [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]


def _refs(block: Any) -> list[Any]:
    """The arrays of one transformer block the plan views (weights, biases or None, norms)."""
    linears = _linears(block)
    return ([getattr(x, "weight", None) for x in linears] + [x.get("bias") for x in linears]
            + [block.input_layernorm.weight, block.post_attention_layernorm.weight])


class _Layer:
    __slots__ = ("refs", "wq", "wk", "wv", "wo", "wg", "wu", "wd", "bias", "n_in", "n_post", "eps_in",
                 "eps_post", "rope", "scale", "heads", "kv_heads", "head_dim")


class Plan:
    """Numpy views of one model's weights (no copies) and what each layer needs."""

    def __init__(self, model: Any) -> None:
        inner = model.model
        self.layers: list[_Layer] = []
        for block in inner.layers:
            a = block.self_attn
            lay = _Layer()
            linears = _linears(block)
            ws = [_weight(x) for x in linears]
            if any(w is None for w in ws):
                raise ValueError("a projection is not a float32 nn.Linear")
            biases = [x.bias if "bias" in x else None for x in linears]
            lay.bias = [None if b is None else np.asarray(b) for b in biases]
            lay.refs = _refs(block)
            lay.wq, lay.wk, lay.wv, lay.wo, lay.wg, lay.wu, lay.wd = (_rows(w) for w in ws)
            for norm in (block.input_layernorm, block.post_attention_layernorm):
                if type(norm) is not nn.RMSNorm or norm.weight.dtype != mx.float32:
                    raise ValueError("a norm is not a float32 RMSNorm")
            lay.n_in, lay.eps_in = np.asarray(block.input_layernorm.weight), block.input_layernorm.eps
            lay.n_post, lay.eps_post = np.asarray(block.post_attention_layernorm.weight), block.post_attention_layernorm.eps
            if type(a.rope) is not nn.RoPE:
                raise ValueError(f"RoPE variant {type(a.rope).__name__}")
            lay.rope, lay.scale = a.rope, a.scale
            lay.heads, lay.kv_heads, lay.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
            self.layers.append(lay)
        if getattr(inner, "swa_idx", None) is not None:
            raise ValueError("sliding-window layers")
        if type(inner.norm) is not nn.RMSNorm or type(inner.embed_tokens) is not nn.Embedding:
            raise ValueError("final norm / embedding of another kind")
        self.embed_ref = inner.embed_tokens.weight
        self.norm_ref = inner.norm.weight
        if self.embed_ref.dtype != mx.float32:
            raise ValueError("embedding not float32")
        self.embed = np.asarray(self.embed_ref)
        self.norm, self.eps = np.asarray(self.norm_ref), inner.norm.eps
        if model.args.tie_word_embeddings:
            self.head_ref = self.embed_ref
        else:
            w = _weight(model.lm_head)
            if w is None or "bias" in model.lm_head:
                raise ValueError("lm_head is not a float32 nn.Linear without bias")
            self.head_ref = w
        self.head = _rows(self.head_ref)
        self.fa_idx = getattr(inner, "fa_idx", 0)

    def current(self, model: Any) -> bool:
        """Whether the model still holds the very weight arrays this plan views."""
        inner = model.model
        if inner.embed_tokens.weight is not self.embed_ref or inner.norm.weight is not self.norm_ref:
            return False
        if len(inner.layers) != len(self.layers):
            return False
        for block, lay in zip(inner.layers, self.layers):
            if any(a is not b for a, b in zip(_refs(block), lay.refs)):
                return False
        return model.args.tie_word_embeddings or getattr(model.lm_head, "weight", None) is self.head_ref


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[1])
    return (x * (1.0 / np.sqrt(ms + np.float32(eps)))).astype(np.float32, copy=False) * w


_sgemm: Any = None


def blas() -> Any:
    """``cblas_sgemm`` of the optimised BLAS MLX's own matmuls use in this process (the preloaded
    OpenBLAS: system/blas.py), or None. Not numpy's bundled OpenBLAS: a second thread pool that
    busy-waits beside MLX's, and under a loaded CPU (other processes on the cores) each of a step's
    210 products then waits out scheduler slices -- measured 4 s a step instead of 0.1 s."""
    global _sgemm
    if _sgemm is None:
        import ctypes

        from ...system.blas import optimized_blas_active

        fn = None
        if optimized_blas_active():
            fn = ctypes.CDLL(None).cblas_sgemm
            fn.restype = None
            fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                 ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        _sgemm = fn or False
    return _sgemm or None


_products: Any = None       # backends/cpu/native_products.py's loop, when NATIVE_PRODUCTS is on and it loaded


def _proj(x: np.ndarray, w: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
    """``x @ w.T`` (+ ``b``): ``x`` [M, K], ``w`` [N, K] row-major (an nn.Linear weight); up to
    ``native_products.MAX_ROWS`` rows through the native loop where it is on, else sgemm."""
    y = _products(x, w) if _products is not None and x.shape[0] <= _MAX_NATIVE_ROWS else _sgemm_products(x, w)
    return y if b is None else y + b


def _sgemm_products(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` through the preloaded OpenBLAS's sgemm (``blas()`` has found it)."""
    x = np.ascontiguousarray(x)
    M, K = x.shape
    N = w.shape[0]
    y = np.empty((M, N), np.float32)
    _sgemm(101, 111, 112, M, N, K, 1.0, x.ctypes.data, K, w.ctypes.data, K, 0.0, y.ctypes.data, N)
    return y


def _rotate(x: np.ndarray, table: tuple[np.ndarray, np.ndarray, bool]) -> np.ndarray:
    """RoPE on ``x`` ``[B, T, heads, head_dim]`` with ``table``'s cos / sin ``[B or 1, T, 1, dims / 2]``
    (pairs: the two halves of the rotated dims, or neighbours when ``traditional``): the products
    and sums MLX's CPU ``fast.rope`` does, one rounding each, so the result is bit for bit its own."""
    cos, sin, traditional = table
    half = cos.shape[-1]
    if traditional:
        x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    else:
        x1, x2 = x[..., :half], x[..., half:2 * half]
    o1, o2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    out = np.stack([o1, o2], axis=-1).reshape(*x.shape[:-1], 2 * half) if traditional \
        else np.concatenate([o1, o2], axis=-1)
    return out if x.shape[-1] == 2 * half else np.concatenate([out, x[..., 2 * half:]], axis=-1)


def _rope_table(rope: Any, offset: Any, rows: int, T: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """cos / sin of MLX's own RoPE at ``offset`` (an int or a per-row array) for ``T`` positions:
    ``fast.rope`` applied to (1, 0) pairs returns them exactly (1 * c - 0 * s = c, 1 * s + 0 * c = s)."""
    half = rope.dims // 2
    b = rows if isinstance(offset, mx.array) and offset.size > 1 else 1
    one, zero = mx.ones((b, 1, T, half)), mx.zeros((b, 1, T, half))
    if rope.traditional:
        probe = mx.stack([one, zero], axis=-1).reshape(b, 1, T, 2 * half)
        tab = np.asarray(rope(probe, offset=offset))
        return tab[:, 0, :, None, 0::2], tab[:, 0, :, None, 1::2], True
    tab = np.asarray(rope(mx.concatenate([one, zero], axis=-1), offset=offset))
    return tab[:, 0, :, None, :half], tab[:, 0, :, None, half:], False


def _offset_key(offset: Any) -> tuple:
    return (offset,) if isinstance(offset, int) else tuple(np.asarray(offset).reshape(-1).tolist())


def _silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    e = np.exp(-g)
    e += 1.0
    np.divide(g, e, out=g)
    g *= u
    return g


def _float_cache(c: Any) -> bool:
    """A cache layer of plain float32 K / V with mlx-lm's ``offset`` / ``update_and_fetch`` /
    ``make_mask`` semantics: mlx-lm's ``KVCache`` and ``BatchKVCache`` (its subclasses too), or a
    class that says so (``plain_kv = True``: cache/prefixed_kv.py; cache/slab.py's slab is a ``BatchKVCache``). Not a
    quantised, rotating or chunked cache (``ChunkedKVCache`` subclasses ``KVCache``: exact types)."""
    from mlx_lm.models.cache import BatchKVCache, KVCache

    kind = type(c)
    ok = kind is KVCache or isinstance(c, BatchKVCache) or getattr(kind, "plain_kv", False)
    return ok and (c.keys is None or c.keys.dtype == mx.float32)


def _quantized_cache(c: Any) -> bool:
    """mlx-lm's ``QuantizedKVCache`` itself (KV_BITS uniform) holding codes of float32 K / V: its
    (codes, scales, biases) are attended as mx.dequantize's floats (``_attend_rows``)."""
    from mlx_lm.models.cache import QuantizedKVCache

    return type(c) is QuantizedKVCache and (c.keys is None or c.keys[1].dtype == mx.float32)


def _host_cache(c: Any, lay: "_Layer") -> bool:
    """A layer the host path writes and attends: a float one, or a quantised one whose groups
    and widths fit the layer's heads (what mx.quantize takes)."""
    if _float_cache(c):
        return True
    return _quantized_cache(c) and c.bits in (2, 3, 4, 5, 6, 8) and c.group_size > 0 \
        and lay.head_dim % c.group_size == 0 and lay.head_dim * c.bits % 32 == 0


def _plan(model: Any, caches: list) -> Optional[Plan]:
    """The model's plan when every cache layer in ``caches`` (one list per row) is one the host
    path takes and the model still holds the weights the plan views; else None."""
    plan = _plan_of(model)
    if plan is None or any(c is None or len(c) != len(plan.layers) for c in caches):
        return None
    if not all(_host_cache(layer, lay) for c in caches for layer, lay in zip(c, plan.layers)):
        return None
    if not plan.current(model):
        log.warning("host forward: the model's weights were replaced; mlx-lm's forward from now on")
        _set_plan(model, None)
        return None
    return plan


def _layers(plan: Plan, h: np.ndarray, attention: Any) -> np.ndarray:
    """Every transformer block over ``h`` [positions, hidden]; ``attention(i, layer, q, k, v)``
    (projections [positions, heads * head_dim], before RoPE) returns [positions, heads * head_dim].
    Returns the final norm's output."""
    for i, lay in enumerate(plan.layers):
        x = _rms(h, lay.n_in, lay.eps_in)
        out = attention(i, lay, _proj(x, lay.wq, lay.bias[0]), _proj(x, lay.wk, lay.bias[1]),
                        _proj(x, lay.wv, lay.bias[2]))
        h = h + _proj(out, lay.wo, lay.bias[3])
        x = _rms(h, lay.n_post, lay.eps_post)
        act = _silu_mul(_proj(x, lay.wg, lay.bias[4]), _proj(x, lay.wu, lay.bias[5]))
        h = h + _proj(act, lay.wd, lay.bias[6])
    return _rms(h, plan.norm, plan.eps)


def _attend_rows(lay: _Layer, c: Any, table: tuple, mask: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                 B: int, T: int) -> np.ndarray:
    """One layer's attention for ``B`` rows of ``T`` positions on cache layer ``c``: RoPE, the
    cache's own write, the model module's attention -- or, for a ``QuantizedKVCache``, attention
    over the floats its codes dequantise to (``Part.bits``: the native kernel dequantises each
    block of codes exactly as mx.dequantize and sums by key position, so a position's K / V, and
    so its codes, do not depend on the call that computed them: LESSONS 79); [B * T, heads * head_dim]."""
    from mlx_lm.models import llama

    hd = lay.head_dim
    q = _rotate(q.reshape(B, T, lay.heads, hd), table)
    k = _rotate(k.reshape(B, T, lay.kv_heads, hd), table)
    keys, values = c.update_and_fetch(mx.array(k.transpose(0, 2, 1, 3)),
                                      mx.array(v.reshape(B, T, lay.kv_heads, hd).transpose(0, 2, 1, 3)))
    queries = mx.array(q.transpose(0, 2, 1, 3))
    if _quantized_cache(c):
        out = attend_parts(queries, [Part(keys, values, mask, None, c.bits, c.group_size)], lay.scale)
    else:
        out = llama.scaled_dot_product_attention(queries, keys, values, cache=c, scale=lay.scale, mask=mask)
    return np.asarray(out).transpose(0, 2, 1, 3).reshape(B * T, lay.heads * hd)


class _Tables:
    """RoPE tables per (RoPE parameters, offsets, positions): every layer's cache sits at the
    same offsets, and every layer has its own ``nn.RoPE`` object with the same parameters."""

    def __init__(self) -> None:
        self.seen: dict[tuple, tuple] = {}

    def get(self, rope: Any, offset: Any, rows: int, T: int) -> tuple:
        key = (rope.dims, rope.traditional, rope.base, rope.scale, T) + _offset_key(offset)
        if key not in self.seen:
            self.seen[key] = _rope_table(rope, offset, rows, T)
        return self.seen[key]


def forward(model: Any, inputs: mx.array, cache: Any, input_embeddings: Any = None) -> Optional[mx.array]:
    """The logits ``[B, T, vocab]`` of mlx-lm's ``Model.__call__``, computed on the host path;
    None when this call is not one it takes (the caller runs mlx-lm's forward)."""
    if cache is None or input_embeddings is not None or inputs.ndim != 2 \
            or not 0 < inputs.shape[1] <= MAX_POSITIONS:
        return None
    plan = _plan(model, [cache])
    if plan is None:
        return None
    from mlx_lm.models.base import create_attention_mask

    B, T = inputs.shape
    h = plan.embed[np.asarray(inputs).reshape(-1)]       # [B*T, D], a copy
    mask = create_attention_mask(inputs, cache[plan.fa_idx])
    mx.eval([c.offset for c in cache if isinstance(c.offset, mx.array)])
    tables = _Tables()

    def attention(i: int, lay: _Layer, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        c = cache[i]
        return _attend_rows(lay, c, tables.get(lay.rope, c.offset, B, T), mask, q, k, v, B, T)

    logits = _proj(_layers(plan, h, attention), plan.head, None)
    return mx.array(logits.reshape(B, T, -1))


def feed_rows(model: Any, caches: list[list[Any]], rows: list[list[int]]) -> bool:
    """Feed ``rows[i]`` (up to ``MAX_POSITIONS`` tokens) into row i's own cache layers
    ``caches[i]`` in one pass: the products for every row's positions together (one weight read,
    no padding), each row's RoPE, KV write and attention on its own cache -- no merged batch to
    build and split again. False (nothing done) when the host path does not take it; all or
    nothing: a failure puts every cache back where it was, then raises."""
    if len(rows) != len(caches) or not rows or any(not 0 < len(r) <= MAX_POSITIONS for r in rows):
        return False
    plan = _plan(model, caches)
    if plan is None or any(isinstance(layer.offset, mx.array) for c in caches for layer in c):
        return False
    from mlx_lm.models.base import create_attention_mask

    spans, at = [], 0
    for r in rows:
        spans.append((at, at + len(r)))
        at += len(r)
    masks = [create_attention_mask(mx.zeros((1, len(r))), c[plan.fa_idx]) for r, c in zip(rows, caches)]
    tables = _Tables()

    def attention(i: int, lay: _Layer, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        outs = []
        for (a, b), c, mask in zip(spans, caches, masks):
            layer = c[i]
            table = tables.get(lay.rope, layer.offset, 1, b - a)
            outs.append(_attend_rows(lay, layer, table, mask, q[a:b], k[a:b], v[a:b], 1, b - a))
        return np.concatenate(outs, axis=0)

    saved = [[(layer, layer.keys, layer.values, layer.offset) for layer in c] for c in caches]
    try:
        _layers(plan, plan.embed[np.array([t for r in rows for t in r], dtype=np.int64)], attention)
        mx.eval([x for c in caches for layer in c for x in (layer.keys, layer.values)])
    except BaseException:
        for row in saved:
            for layer, keys, values, offset in row:
                layer.keys, layer.values, layer.offset = keys, values, offset
        raise
    return True


def uninstall(model: Any) -> None:
    _set_plan(model, None)


def enabled(model: Any) -> bool:
    return _plan_of(model) is not None


def use_native_products(on: bool, timed: bool = False) -> bool:
    """The host path's products (every model of the process) through backends/cpu/native_products.py's
    loop (``on`` and it loads here; ``timed``: and it beats sgemm here at 1 and 8 rows) or
    OpenBLAS's sgemm; returns whether the loop is in use. Called by the CPU backend before ``install``
    (NATIVE_PRODUCTS; one process only, so no rank has to agree with a timing)."""
    global _products, products_timing
    from . import native_products

    _products = native_products.load() if on else None
    products_timing = ""
    if _products is not None and timed and blas() is not None:
        wins, ratios = native_products.faster(_products, _sgemm_products)
        products_timing = (f"{' / '.join(f'{r:.2f}x' for r in ratios.values())} sgemm's time at "
                           f"{' / '.join(map(str, ratios))} rows")
        log.info("native row products: %s%s", products_timing,
                 "" if wins else "; slower here, OpenBLAS keeps the products")
        if not wins:
            _products = None
    return _products is not None


def native_products_on() -> bool:
    return _products is not None


products_timing = ""        # the loop's time / sgemm's at 1 and 8 rows, when timed at load


def products_in_use() -> Any:
    """The products loop the host path uses now (None: sgemm), for ``use_products``."""
    return _products


def use_products(products: Any) -> None:
    """Put back a loop ``products_in_use`` returned (an engine built again on the same model)."""
    global _products
    _products = products


def install(model: Any) -> bool:
    """Give ``model`` the host path where it applies (an mlx-lm ``llama.Model`` of float32
    ``nn.Linear`` layers, plain RoPE, no sliding layers, on the CPU) and agrees with mlx-lm's
    forward on the loaded weights; False (nothing changed) otherwise. Its products go through
    whichever ``use_native_products`` chose for the process (checked here with that choice)."""
    return qualify(model)[0]


def qualify(model: Any) -> tuple[bool, str]:
    """``install``, with what it found: (True, what the path runs on) or (False, why not)."""
    from mlx_lm.models import llama

    if type(model) is not llama.Model:
        return False, f"not an mlx-lm Llama ({type(model).__module__}.{type(model).__name__})"
    if mx.default_device() != mx.cpu:
        return False, "MLX computes on another device"
    if blas() is None:
        log.info("host forward: no optimised BLAS preloaded for MLX here (system/blas.py); not used")
        return False, "no optimised BLAS preloaded for MLX (BLAS_PRELOAD)"
    try:
        plan = Plan(model)
    except (ValueError, AttributeError, TypeError) as exc:
        log.info("host forward: not for this model (%s)", exc)
        return False, str(exc)
    try:
        ok = _agrees(model, plan)
    except Exception as exc:  # noqa: BLE001 - a path that cannot run is simply not used
        log.warning("host forward: not used (%s)", exc)
        return False, f"{type(exc).__name__}: {exc}"
    if not ok:
        return False, "disagrees with mlx-lm's forward at load"
    _set_plan(model, plan)
    return True, f"float32 Llama, {len(plan.layers)} layers"


def _agrees(model: Any, plan: Plan) -> bool:
    """A 5-token prompt then a 2-row decode step, host path (``forward``, which must take every
    call) vs mlx-lm's forward (``model(...)``): logits and the KV written within float rounding."""
    from mlx_lm.models.cache import BatchKVCache, KVCache

    vocab = plan.embed.shape[0]
    prompt = mx.array([[1, 7, 3, 11, 5]]) % vocab
    rows = mx.array([[2, 9, 4, 6], [8, 1, 2, 3]]) % vocab
    results = []
    for host in (True, False):
        _set_plan(model, plan if host else None)
        try:
            def run(tokens: mx.array, cache: list) -> mx.array:
                out = forward(model, tokens, cache) if host else model(tokens, cache=cache)
                if out is None:
                    raise ValueError("the host path declined a decode-sized call of its own check")
                return out

            cache = [KVCache() for _ in plan.layers]
            first = run(prompt, cache)
            batch = [BatchKVCache([1, 0]) for _ in plan.layers]
            two = run(rows, batch)
            step = run(mx.array([[4], [5]]) % vocab, batch)
            results.append((first, two, step, cache[0].keys[..., :5, :], batch[-1].values))
        finally:
            _set_plan(model, None)
    for a, b in zip(*results):
        scale = max(1.0, float(mx.abs(b).max().item()))
        if not mx.allclose(a, b, rtol=1e-3, atol=1e-4 * scale).item():
            log.warning("host forward: disagrees with mlx-lm's forward; not used")
            return False
    return True
