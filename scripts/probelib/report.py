"""Plain and markdown tables."""
from __future__ import annotations


import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


REPO_ROOT = Path(__file__).resolve().parents[2]   # scripts/probelib/x.py -> the repository
DEFAULT_PROXY_URL = "http://127.0.0.1:4000/v1"
DEFAULT_MLX_URL = "http://127.0.0.1:8080"
EMBEDDED_MODEL_DIR = "SmolLM2-135M-Instruct-f32"


# ----------------------------------------------------------------------------- output
def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return "" if v is None else str(v)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, markdown: bool = False,
                file: Any = None) -> None:
    file = file or sys.stdout
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells if i < len(r)]) for i, h in enumerate(headers)]
    if markdown:
        print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |", file=file)
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=file)
        for r in cells:
            print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |", file=file)
    else:
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths)), file=file)
        print("  ".join("-" * w for w in widths), file=file)
        for r in cells:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)), file=file)
    file.flush()


