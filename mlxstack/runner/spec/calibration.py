"""What a speculative step costs on this machine, measured once at load (SPEC_CALIBRATE=auto).

    table = calibrate(engine.decode_model, rows=(1, 8))   # {(rows, width): plain steps}
    costs = StepCosts(prior=COST_PER_POSITION, table=table)

A step that feeds ``width`` positions a row costs more than a plain one by an amount that is a
property of the path the forward takes here -- the native products loop and the host path on a
CPU (one more position for one row: ~0.1 of a step, for 8 rows ~0.35), mlx's kernels on a GPU
(almost nothing) -- so a constant guessed on one machine drafts too much on the next or too
little. This times the decode model's own forward (whatever path ``install`` gave it: the same
call a decode step makes) at 1 and ``width`` positions over a short context, for one row and for
a batch, and hands the ratios to ``StepCosts`` as its prior: the width chooser's costs before any
step was timed, and for ranks in lockstep -- which never decide from wall times -- its only ones
(there it is skipped: each rank would time its own). Models whose caches cannot be cut back
(recurrent state, rotating windows) are not timed: the constant prior stays.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..mlx_stream import generation_stream
from ..forward import forward

__all__ = ["calibrate", "WIDTHS"]

WIDTHS = (2, 4, 8, 13)        # 1 + drafts: up to SPEC_MAX_DRAFT's default 12 (host path: <= 16)
CONTEXT = 32                  # tokens in the scratch cache (the attention is a small part of a decode step here)


def calibrate(model: Any, rows: Sequence[int] = (1, 8), widths: Sequence[int] = WIDTHS, repeats: int = 2,
              clock: Callable[[], float] = time.perf_counter) -> dict[tuple[int, int], float]:
    """{(rows, width): the forward's time over a plain one's} (the smallest of ``repeats`` + 1 ratios
    of a wide forward to the plain one timed just before it, after a warm-up; non-decreasing in
    width, at most ``width``); {} where a cache layer cannot be cut back."""
    table: dict[tuple[int, int], float] = {}
    for r in rows:
        cache = make_prompt_cache(model)
        if not all(getattr(c, "is_trimmable", lambda: False)() for c in cache):
            return {}
        with mx.stream(generation_stream()):
            mx.eval(forward(model, mx.ones((r, CONTEXT), dtype=mx.int32), cache))

            def once(width: int) -> float:
                start = clock()
                mx.eval(forward(model, mx.ones((r, width), dtype=mx.int32), cache))
                took = clock() - start
                for c in cache:
                    c.trim(width)
                return took

            once(1)
            last = 1.0
            for w in sorted(widths):
                once(w)                                    # warm-up: this width's graph
                # each wide forward timed right after a plain one, the smallest ratio kept: a busy
                # machine (another process, a stack starting beside this one) slows both of a pair,
                # where one plain timing then several wide ones would price speculation at several
                # plain steps -- and a prior that says "never" is never measured again
                ratios = []
                for _ in range(repeats + 1):
                    plain = once(1)
                    ratios.append(once(w) / plain if plain > 0 else 1.0)
                # never below a narrower width's figure, never above w plain steps (w separate
                # forwards would do the same work)
                last = min(float(w), max(last, min(ratios)))
                table[(r, w)] = round(last, 3)
    return table
