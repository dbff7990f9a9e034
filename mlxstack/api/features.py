"""Wire optional layers into a loaded App (each one a small module of its own)."""
from __future__ import annotations

from typing import Any


def install_features(app: Any) -> None:
    """Called once the model is loaded, on the inference thread."""
    return None
