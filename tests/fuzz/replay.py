"""Replay a recorded run (waves and restarts) on a fresh harness: what a reproducer calls."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .harness import Config, Harness
from .traffic import waves_from_json


def replay(config: Config, order: list[str], waves_json: str, tiny_kind_paths: Any, embedded: Path,
           tmp: Path, stats: Any = None) -> list[str]:
    """The findings (as text) of serving ``waves_json`` in ``order`` on ``config``; ``stats``
    (a harness.Stats) takes the run's counts, so a test can say the traffic really hit."""
    from .machine import model_path

    waves = iter(waves_from_json(waves_json))
    h = Harness(config, model_path(config.kind, tiny_kind_paths, embedded), tmp)
    try:
        for step in order:
            if step == "restart":
                h.restart()
            else:
                h.run(next(waves))
        if stats is not None:
            vars(stats).update(vars(h.stats))
        return [str(f) for f in h.findings]
    finally:
        h.close()
