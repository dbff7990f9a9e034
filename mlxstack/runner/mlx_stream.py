"""The MLX stream generation runs on (mlx-lm's thread-local generation stream)."""
from __future__ import annotations

from mlx_lm.generate import generation_stream as _generation_stream


def generation_stream():
    return _generation_stream
