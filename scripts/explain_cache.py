#!/usr/bin/env python3
"""Why the cache reused what it reused, request by request, from the request logs.

    .venv/bin/python scripts/explain_cache.py                        # the newest session under LOG_ROOT
    .venv/bin/python scripts/explain_cache.py --session demo-drift   # that session (all days; a prefix will do)
    .venv/bin/python scripts/explain_cache.py --all                  # every session, oldest first
    .venv/bin/python scripts/explain_cache.py --log-root /tmp/logs --day 2026-05-01 --all

Per request: time, API (chat, responses, messages), prompt tokens, tokens reused from the cache,
tokens written to it, the tier that served the prefix (ram, disk, none) and the explanation: hit,
or for a miss the first part that differs from the session's previous request (system prompt,
tools, message N and its field -- content, tool_calls, images, a volatile field the canonical key
normalises --, a setting, the previous reply) with the tokens it cost. The records are the
server's own (``LOG_ROOT/<day>/cache-session-<id>.log``, ENABLE_REQUEST_LOGGING; see
mlxstack/observability/request_log.py); the words are mlxstack/observability/cache_explain.py's,
the dashboard's "Why the cache reused what it did" panel says the same.

Exit status: 0; 2 when no log (or no such session) is found.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from mlxstack.observability.cache_explain import session_lines  # noqa: E402
from mlxstack.observability.request_log import log_files, read_records  # noqa: E402


def default_log_root() -> Path:
    from mlxstack.config.settings import load_settings

    return load_settings().log_root_path


def sessions(root: Path, day: str | None = None) -> dict[str, list[dict]]:
    """Session -> its records (every day's file), in the order their first request came."""
    out: dict[str, list[dict]] = {}
    for path in log_files(root):
        if day and path.parent.name != day:
            continue
        for rec in read_records(path):
            out.setdefault(rec.get("session") or "", []).append(rec)
    return dict(sorted(out.items(), key=lambda kv: min(r.get("ts") or 0 for r in kv[1])))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log-root", type=Path, help="LOG_ROOT (default: the settings' LOG_ROOT)")
    ap.add_argument("--session", help="a session id, or the start of one")
    ap.add_argument("--day", help="only this day's folder (YYYY-MM-DD)")
    ap.add_argument("--all", action="store_true", help="every session")
    args = ap.parse_args(argv)

    root = args.log_root or default_log_root()
    found = sessions(root, args.day)
    if not found:
        print(f"no request logs under {root} (ENABLE_REQUEST_LOGGING, LOG_ROOT)", file=sys.stderr)
        return 2
    if args.session:
        chosen = [s for s in found if s.startswith(args.session[:16])]
        if not chosen:
            print(f"no session {args.session!r} under {root}; sessions: {', '.join(found)}", file=sys.stderr)
            return 2
    elif args.all:
        chosen = list(found)
    else:  # the session whose last request is the newest
        chosen = [max(found, key=lambda s: max(r.get("ts") or 0 for r in found[s]))]
    for i, session in enumerate(chosen):
        if i:
            print()
        print("\n".join(session_lines(found[session])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
