"""What a backend is: the one object that decides how a loaded model's forwards are computed.

    backend = select(settings, loaded, device)   # backends/__init__.py: the CPU backend where it applies
    report = backend.install(loaded, settings)   # what it turned on and why (logged, /health)
    attach(loaded.model, backend)                # runner/forward.py: forwards reach it from then on

The composition root (engine/factory.py) does these three steps once per engine; the runner calls
``forward_rows`` / ``feed_rows`` through runner/forward.py for the model objects the backend was
attached to, and runs ``model(inputs, cache=cache)`` itself whenever they decline (None / False).
Nothing here is patched onto mlx-lm's classes.

``select`` lives in the package's ``__init__`` (the one door the engine uses: ``from ..backends
import select``) rather than here, so that the backends built on this module (mlx.py,
cpu/backend.py) never import a module that imports them: no import circle, even through a
function (tests/test_boundaries.py). The engine and the scheduler never import backends/cpu
(tests/test_layers.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class BackendReport:
    """What a backend turned on and why: ``features`` maps a feature to "on (...)" or "off: why"."""
    name: str
    features: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        """One log line: ``backend cpu: cascade_attention=on; host_forward=off: ...``."""
        parts = "; ".join(f"{k}={v}" for k, v in self.features.items())
        return f"backend {self.name}" + (f": {parts}" if parts else "")

    def as_dict(self) -> dict[str, Any]:
        """For /health: ``{"name": ..., "features": {...}}``."""
        return {"name": self.name, "features": dict(self.features)}


class Backend:
    """The interface every backend keeps (the defaults: MLX's own forward for every call)."""

    name = "base"
    report: Optional[BackendReport] = None
    installed_key: Optional[tuple] = None     # ``settings_key`` of the settings it was installed with

    def applies(self, model: Any, device: Any) -> tuple[bool, str]:
        """(whether this backend can serve ``model`` on ``device`` (an ``mx.Device``), why / why not)."""
        return True, "MLX's own forward runs on any device"

    def settings_key(self, settings: Any) -> Optional[tuple]:
        """What of ``settings`` shapes this backend's install: an engine built again on the same
        loaded model with an equal key reuses the installed backend (None: install again)."""
        return None

    def install(self, loaded: Any, settings: Any) -> BackendReport:
        """Turn on what this backend does for ``loaded`` (models/loaded.py) under ``settings``;
        returns (and keeps as ``report``) what it turned on and why. Idempotent."""
        self.report = BackendReport(self.name)
        return self.report

    def forward_rows(self, model: Any, inputs: Any, cache: Any) -> Any:
        """The logits of ``model(inputs, cache=cache)`` computed by this backend, or None when it
        does not take this call (the caller then runs the model's own forward)."""
        return None

    def feed_rows(self, model: Any, caches: list[list[Any]], rows: list[list[int]]) -> bool:
        """Feed ``rows[i]``'s tokens into ``caches[i]`` for every row in one pass; False when not
        taken (nothing done: the caller feeds them through the forward)."""
        return False

    def exact_positions(self, model: Any) -> Optional[int]:
        """The most positions a row that ``model``'s forwards through this backend may carry
        while every position's K / V come out bit for bit the same whatever the call -- its
        length, the other rows beside it, a slab row's padding, a prefix held once (batch
        invariance); None when some call's shape changes them (MLX's own kernels: a product's
        rounding follows its row count, LESSONS 23). Under KV quantisation (either scheme) the
        engine feeds prompts in calls of at most this many positions, so a hit holds what a cold
        run holds (LESSONS 79)."""
        return None
