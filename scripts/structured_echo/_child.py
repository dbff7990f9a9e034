"""What every framework child of scripts/measure_structured_echo.py shares (stdlib only: the
children run in the frameworks' own interpreter, not the project's).

A child runs one case -- one framework, one structured-output mode -- as a two-turn conversation
and prints one line ``RESULT {json}`` on stdout. Around each turn it notes the last request id the
MLX server shows in ``/v1/cache/stats`` ``recent`` (``marks``: before turn 1, after turn 1, after
turn 2), so the driver can tell which server rows each turn made without trusting the framework's
own usage numbers (most hide them)."""
from __future__ import annotations

import argparse
import json
import traceback
import urllib.request
from collections.abc import Callable
from typing import Any

ASK = "Describe a famous scientist."
MORE = "Another one."
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                  "city": {"type": "string"}},
                 "required": ["name", "age", "city"], "additionalProperties": False}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True, help="the proxy's root, e.g. http://127.0.0.1:4000")
    ap.add_argument("--key", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--mlx-url", required=True, help="the MLX server's root")
    ap.add_argument("--mlx-key", default="")
    ap.add_argument("--mode", required=True)
    ap.add_argument("--system", required=True)
    ap.add_argument("--max-tokens", type=int, default=60)
    return ap.parse_args(argv)


class Marks:
    """The MLX server's last request id, read at each turn boundary."""

    def __init__(self, mlx_url: str, mlx_key: str = "") -> None:
        self.url = mlx_url.rstrip("/") + "/v1/cache/stats"
        self.headers = {"Authorization": f"Bearer {mlx_key}"} if mlx_key else {}
        self.ids: list[str | None] = []

    def mark(self) -> None:
        req = urllib.request.Request(self.url, headers=self.headers)
        with urllib.request.urlopen(req, timeout=60) as resp:
            recent = json.load(resp).get("recent") or []
        self.ids.append(recent[-1].get("request_id") if recent else None)


def emit(result: dict) -> None:
    print("RESULT " + json.dumps(result, default=str), flush=True)


def run(framework: str, version: Callable[[], str], api: str | Callable[[str], str], body: Callable[[argparse.Namespace, Marks], dict]) -> int:
    """Run ``body(args, marks)`` (which calls ``marks.mark()`` before turn 1 and after each turn and
    returns ``{"replies": [...], "echo": "..."}``) and print its RESULT line, errors included.
    ``api``: the API the client speaks (chat, responses, messages), or a function of the mode."""
    args = parse_args()
    out: dict[str, Any] = {"framework": framework, "api": api(args.mode) if callable(api) else api, "mode": args.mode}
    try:
        out["version"] = version()
    except ImportError as err:
        emit({**out, "version": "", "skipped": f"not importable: {err}"})
        return 0
    marks = Marks(args.mlx_url, args.mlx_key)
    try:
        out.update(body(args, marks))
    except Exception as err:  # noqa: BLE001 - the driver reports it, the other cases go on
        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc()[-2000:]
    out["marks"] = marks.ids
    emit(out)
    return 0
