#!/usr/bin/env python3
"""PI-shaped agentic session replay: the primary "did my warm turn hit?" harness.

Replays: a long developer prompt with tools (read_file, bash, edit); a tool-call / tool-result
loop (assistant turns echo what the server returned, reasoning stripped, plus harness-made tool
calls); a retry of the same turn; a new user turn; the last user message edited. Prints per turn:
prompt tokens, cached tokens, uncached tokens, TTFT and match type (from the MLX server's
/v1/cache/stats when reachable, else hit/miss from usage).

Exit code 1 when the reuse (cached/prompt) of any warm turn (turn >= 2) is below --min-reuse.

    python scripts/pi_like_probe.py                                   # through LiteLLM :4000
    python scripts/pi_like_probe.py --base-url http://127.0.0.1:8080/v1 --api-key ''
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe_common import (
    TURN_HEADERS,
    ProbeError,
    Recorder,
    add_client_args,
    client_from_args,
    nonce,
    print_table,
    replay_pi,
    turn_rows,
)

# Measured on the embedded SmolLM2-135M (see README): warm turns reuse 0.87-1.00 of the prompt;
# the lowest is the turn after the longest tool result (250-token file). 0.8 leaves a margin.
DEFAULT_MIN_REUSE = 0.8


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_client_args(p, max_tokens=16)
    p.add_argument("--min-reuse", type=float, default=DEFAULT_MIN_REUSE,
                   help=f"minimum cached/prompt on every warm turn (default {DEFAULT_MIN_REUSE})")
    p.add_argument("--system-tokens", type=int, default=1200, help="approximate size of the developer prompt (default 1200)")
    p.add_argument("--session", default=None, help="session id sent as session_id (default: a fresh random id)")
    p.add_argument("--session-mode", choices=("body", "header", "none"), default="body",
                   help="send the session as body session_id, x-session-affinity header, or not at all")
    p.add_argument("--tag", default=None, help="text put into the prompt so runs do not hit each other's cache "
                                               "(default: random; pass a fixed value to replay identically)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--json", action="store_true", help="print the turns as JSON instead of a table")
    p.add_argument("-v", "--verbose", action="store_true", help="print each turn as it completes")
    args = p.parse_args(argv)

    client = client_from_args(args)
    tag = args.tag if args.tag is not None else nonce()
    session = args.session or f"pi-{tag}"
    rec = Recorder(client, max_tokens=args.max_tokens, verbose=args.verbose, session_mode=args.session_mode)
    try:
        turns = replay_pi(rec, sys_tokens=args.system_tokens, tag=tag, session=session)
    except ProbeError as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([dict(t.__dict__, uncached=t.uncached, reuse=round(t.reuse, 4)) for t in turns], indent=2))
    else:
        print(f"PI-shaped replay via {client.base_url} (model {client.model}, session {session}, "
              f"stats {'on' if client._stats_ok else 'unavailable'})")
        print_table(TURN_HEADERS, turn_rows(turns), markdown=args.markdown)
    warm = [t for t in turns if t.warm]
    bad = [t for t in warm if t.reuse < args.min_reuse]
    total_p = sum(t.prompt for t in warm)
    total_c = sum(t.cached for t in warm)
    print(f"\nwarm turns: {len(warm)}, reuse {total_c}/{total_p} = {total_c / max(1, total_p):.1%}, "
          f"min {min((t.reuse for t in warm), default=0):.1%} (threshold {args.min_reuse:.0%})")
    stats = client.cache_stats()
    if stats:
        print(f"correctness counters: {stats.get('correctness')}")
        if any((stats.get("correctness") or {}).values()):
            print("WARN: a correctness counter is non-zero")
    if bad:
        for t in bad:
            print(f"FAIL: turn {t.turn} ({t.label}) reuse {t.reuse:.1%} < {args.min_reuse:.0%} "
                  f"(prompt {t.prompt}, cached {t.cached}, match {t.match})", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
