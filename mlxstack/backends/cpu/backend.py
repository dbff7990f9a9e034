"""The CPU backend: MLX's CPU backend made op-light for small models (docs/cpu-backend.md).

    backend = CpuBackend()                     # ``select`` (backends/__init__.py) picks it (CPU_BACKEND=auto)
    report = backend.install(loaded, settings)
    logits = backend.forward_rows(model, tokens, cache)    # None: not a call the host path takes

Its install turns on, each where it applies and measures or checks right here (the settings
CPU_KERNELS, NATIVE_ATTENTION, HOST_FORWARD, NATIVE_PRODUCTS; CPU_BACKEND=off turns all of it off):

- ``cpu_kernels``: attention and SiLU with a fast exp (kernels.py, fast_math.py) -- module hooks
  on mlx-lm's ``scaled_dot_product_attention`` / ``swiglu``, the one part that stays a hook;
- ``native_attention``: decode attention in one native call (native_attention.py);
- ``host_forward``: decode-sized forwards of float32 Llama-family models on numpy views of their
  weights (host_forward.py), served by ``forward_rows`` / ``feed_rows`` -- nothing patched on the
  model's class;
- ``native_products``: the host path's weight products in a native loop (native_products.py);
- ``turboquant_coder``: with KV_QUANT_SCHEME=turboquant and the host path on, decode-sized K / V
  coded in numpy (turboquant_host.py) instead of a graph of small MLX ops.

With several ranks (``DISTRIBUTED``) the kernels are agreed by a collective (every rank installs),
the native call is left out of pipeline stages, and the host path is not used.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Optional

import mlx.core as mx

from ..cascade import installed as cascade_modules
from ..base import Backend, BackendReport
from ...cache import turboquant
from . import host_forward, native_build, native_products, turboquant_host
from .kernels import agreed_modes, install_cpu_kernels, native_attention_on

log = logging.getLogger(__name__)


def _on_cpu(device: Any) -> bool:
    return getattr(device, "type", device) == mx.cpu


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self) -> None:
        self.host_calls = 0       # forwards the host path computed (``forward_rows`` not None)
        self.rows_fed = 0         # ``feed_rows`` passes it took
        self._model: Callable[[], Any] = lambda: None    # the loaded model it was installed for (weak)
        self._modes = ("off", "off")                     # (kernels, native) as installed
        self._products: Optional[Callable[..., Any]] = None
        self._tq: Optional[turboquant_host.HostCoder] = None   # TurboQuant's decode-sized coder, when installed

    # ------------------------------------------------------------------ the interface
    def applies(self, model: Any, device: Any) -> tuple[bool, str]:
        if _on_cpu(device):
            return True, "MLX computes on the CPU"
        return False, f"MLX computes on {device}, not the CPU"

    def settings_key(self, settings: Any) -> tuple:
        return ("cpu", settings.cpu_kernels, settings.native_attention, settings.host_forward,
                settings.native_products, settings.distributed)

    def forward_rows(self, model: Any, inputs: Any, cache: Any) -> Any:
        out = host_forward.forward(model, inputs, cache)
        if out is not None:
            self.host_calls += 1
        return out

    def feed_rows(self, model: Any, caches: list[list[Any]], rows: list[list[int]]) -> bool:
        took = host_forward.feed_rows(model, caches, rows)
        if took:
            self.rows_fed += 1
        return took

    def exact_positions(self, model: Any) -> Optional[int]:
        """The host path's call size where all of it is row-invariant: its products in the native
        loop (a row's dot products in one fixed order whatever the rows), its attention in the
        native kernel (each row alone, the softmax's sum in lanes by key position: LESSONS 79),
        norms / SwiGLU / RoPE per row. With OpenBLAS's sgemm or MLX's attention ops, None."""
        if host_forward.enabled(model) and host_forward.products_in_use() is not None and native_attention_on():
            return host_forward.MAX_POSITIONS
        return None

    def install(self, loaded: Any, settings: Any) -> BackendReport:
        key = self.settings_key(settings)
        if self.report is not None and self.installed_key == key and self._model() is loaded.model:
            self._apply()            # another engine in this process may have set other hooks since
            return self.report
        device = mx.default_device()
        group = loaded.extra.get("group")
        kernels = settings.cpu_kernels
        native = "off" if settings.distributed == "pipeline" else settings.native_attention
        if group is not None:    # every rank the same forward: rank 0's choice, the native call only where all have it
            kernels, native = agreed_modes(group, kernels, native)
        on = install_cpu_kernels(kernels, native=native)
        features = {"cascade_attention": f"on ({cascade_modules()} model modules)",
                    "cpu_kernels": self._kernels_said(on, settings, group, device),
                    "native_attention": self._native_said(on, native, settings, group, device)}
        features.update(self._host(loaded, settings, on, group))
        # with the host path, TurboQuant's decode-sized coding too (whatever this engine's KV_BITS:
        # the coder is the process's, and every engine on this backend codes alike)
        self._tq = None
        if features["host_forward"].startswith("on"):
            # the native call where native kernels may run and it builds and agrees, else numpy
            self._tq = turboquant_host.HostCoder(turboquant_host.load() if native != "off" else None)
        features["turboquant_coder"] = self._coder_said(native)
        turboquant.use_coder(self._tq)
        self._modes = (kernels, native)
        self._products = host_forward.products_in_use()
        self._model = weakref.ref(loaded.model)
        self.installed_key = key
        self.report = BackendReport(self.name, features)
        return self.report

    # ------------------------------------------------------------------ helpers
    def _apply(self) -> None:
        kernels, native = self._modes
        install_cpu_kernels(kernels, native=native)
        host_forward.use_products(self._products)
        turboquant.use_coder(self._tq)

    def _coder_said(self, native: str) -> str:
        if self._tq is None:
            return "off: needs host_forward on"
        if self._tq.native is not None:
            return "on (KV_QUANT_SCHEME=turboquant: decode-sized calls native)"
        why = f"NATIVE_ATTENTION={native}" if native == "off" else (
            native_build.problem(turboquant_host.NATIVE) or "native kernels not in use")
        return f"on (KV_QUANT_SCHEME=turboquant: decode-sized calls in numpy; {why})"

    @staticmethod
    def _kernels_said(on: bool, settings: Any, group: Any, device: Any) -> str:
        if group is not None:
            said = f"rank 0's choice, CPU_KERNELS={settings.cpu_kernels}"
            return f"on ({said})" if on else f"off: {said}"
        if settings.cpu_kernels == "on":
            return "on (CPU_KERNELS=on)"
        if settings.cpu_kernels == "off":
            return "off: CPU_KERNELS=off"
        if on:
            return "on (a fast exp measured faster than MLX's here)"
        if not _on_cpu(device):
            return f"off: MLX computes on {device}"
        return "off: MLX's own exp is as fast here (measured)"

    @staticmethod
    def _native_said(on: bool, native: str, settings: Any, group: Any, device: Any) -> str:
        if native_attention_on():
            return "on" + (" (compiled at load: build it ahead with `mlxstack build-native`)"
                           if native_build.compiled_here else "")
        if settings.native_attention == "off":
            return "off: NATIVE_ATTENTION=off"
        if settings.distributed == "pipeline":
            return "off: DISTRIBUTED=pipeline (a per-layer evaluation would stall the stages)"
        if not on:
            return "off: needs cpu_kernels on"
        if not _on_cpu(device):
            return f"off: MLX computes on {device}"
        if group is not None and native == "off":
            return "off: not built and checked on every rank"
        return f"off: {native_build.problem('native decode attention') or 'not available here'}"

    def _host(self, loaded: Any, settings: Any, on: bool, group: Any) -> dict[str, str]:
        """HOST_FORWARD and NATIVE_PRODUCTS: (feature -> what happened)."""
        from mlx_lm.models import llama

        why = ""
        if settings.host_forward == "off":
            why = "HOST_FORWARD=off"
        elif not on:
            why = "needs cpu_kernels on"
        elif group is not None:
            why = "one process only (DISTRIBUTED)"
        elif loaded.is_vlm or type(loaded.model) is not llama.Model:
            model = loaded.model
            why = f"not an mlx-lm Llama ({type(model).__module__}.{type(model).__name__})"
        if why:
            return {"host_forward": f"off: {why}", "native_products": "off: needs host_forward on"}
        products = host_forward.use_native_products(settings.native_products != "off",
                                                     timed=settings.native_products == "auto")
        ok, said = host_forward.qualify(loaded.model)
        if not ok:
            return {"host_forward": f"off: {said}", "native_products": "off: needs host_forward on"}
        if products:
            loop = "on" + (f" ({host_forward.products_timing})" if host_forward.products_timing else "")
        elif settings.native_products == "off":
            loop = "off: NATIVE_PRODUCTS=off"
        elif not native_products.fast_here():
            loop = "off: this CPU lacks AVX2 / FMA (OpenBLAS's sgemm)"
        elif native_build.problem("native row products"):
            loop = f"off: {native_build.problem('native row products')}"
        else:
            loop = "off: slower than OpenBLAS's sgemm here (timed at load)"
        return {"host_forward": f"on ({said})", "native_products": loop}
