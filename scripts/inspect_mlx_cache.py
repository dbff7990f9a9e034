#!/usr/bin/env python3
"""Print the MLX server's live prompt cache from ``GET /v1/cache/stats``: entries, tokens, bytes vs
budget, hits by match type, misses, evictions, correctness counters (flagged when non-zero), one
row per entry, and per-layer cache types / offsets when the server exposes ``entry_list[].layers``.

    python scripts/inspect_mlx_cache.py                          # http://MLX_HOST:MLX_PORT (default :8080)
    python scripts/inspect_mlx_cache.py --url http://127.0.0.1:8080 --recent 10
    python scripts/inspect_mlx_cache.py --json                   # raw JSON
    python scripts/inspect_mlx_cache.py --watch 2                # refresh every 2 s

Exit code: 0; 1 with ``--fail-on-correctness`` when a correctness counter is non-zero;
2 when the endpoint cannot be read.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe_common import default_mlx_url, print_table


def human(n: float | None) -> str:
    if not isinstance(n, (int, float)):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fetch(url: str, api_key: str = "", timeout: float = 10.0) -> dict:
    stats_url = url.rstrip("/")
    if not stats_url.endswith("/cache/stats"):
        stats_url = stats_url.removesuffix("/v1") + "/v1/cache/stats"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(stats_url, headers=headers), timeout=timeout) as resp:
        return json.load(resp)


def render(stats: dict, recent: int = 10) -> int:
    """Print the report; returns the sum of the correctness counters."""
    if stats.get("ready") is False:
        print("server is loading its model (no cache yet)")
        return 0
    budget = stats.get("budget_bytes") or 0
    used = stats.get("bytes") or 0
    pct = f" ({used / budget:.1%})" if budget else ""
    print(f"model {stats.get('model', '?')}  cache {'on' if stats.get('enabled', True) else 'OFF'}  "
          f"entries {stats.get('entries')} / {stats.get('max_entries', '?')} "
          f"(snapshots {stats.get('snapshot_entries', 0)})  tokens {stats.get('tokens')}  "
          f"bytes {human(used)} / {human(budget)}{pct}  block {stats.get('block_size', '?')}  "
          f"sessions {stats.get('sessions', '?')}  queue {stats.get('queue_depth', '?')}")
    hits = stats.get("hits") or {}
    total_hits = sum(v for v in hits.values() if isinstance(v, (int, float)))
    misses = stats.get("misses") or 0
    req = total_hits + misses
    print(f"hits {total_hits} ({', '.join(f'{k} {v}' for k, v in sorted(hits.items())) or 'none'})  "
          f"misses {misses}  hit rate {total_hits / req:.1%}" if req else f"hits 0  misses {misses}",
          f" evictions {stats.get('evictions', 0)}")
    counters = stats.get("counters") or {}
    if counters.get("cached_tokens") is not None:
        cached, prefilled = counters.get("cached_tokens", 0), counters.get("prefilled_tokens", 0)
        tot = cached + prefilled
        print(f"tokens from cache {cached}, prefilled {prefilled}" + (f" ({cached / tot:.1%} reused)" if tot else ""))
    corr = stats.get("correctness") or {}
    bad = sum(v for v in corr.values() if isinstance(v, (int, float)))
    print("correctness: " + "  ".join(f"{k}={v}{' <-- NON-ZERO' if v else ''}" for k, v in corr.items()))
    evict = {k: v for k, v in counters.items() if k.startswith("evictions_")}
    if evict:
        print("evictions by reason: " + ", ".join(f"{k[10:]} {v}" for k, v in sorted(evict.items())))

    entries = stats.get("entry_list") or []
    if entries:
        print()
        print_table(["id", "pool", "tokens", "bytes", "hits", "trim", "session", "age_s"],
                    [[e.get("id"), e.get("pool"), e.get("tokens"), human(e.get("bytes")), e.get("hits"),
                      "y" if e.get("trimmable") else "n", e.get("session"), e.get("age_s")] for e in entries])
        for e in entries:
            layers = e.get("layers")
            if not layers:
                continue
            print(f"\nentry {e.get('id')} layers:")
            if isinstance(layers, list):
                rows = []
                for i, layer in enumerate(layers):
                    if isinstance(layer, dict):
                        rows.append([layer.get("index", i), layer.get("type", "?"), layer.get("offset", "-"),
                                     human(layer.get("bytes")) if layer.get("bytes") is not None else "-"])
                    else:
                        rows.append([i, str(layer), "-", "-"])
                print_table(["layer", "type", "offset", "bytes"], rows)
            else:
                print(f"  {json.dumps(layers)[:2000]}")
    rows = (stats.get("recent") or [])[-recent:] if recent else []
    if rows:
        print()
        print_table(["request", "session", "prompt", "cached", "prefilled", "match", "ttft_s", "prefill_tok/s", "finish"],
                    [[r.get("request_id"), r.get("session"), r.get("prompt_tokens"), r.get("cached_tokens"),
                      r.get("prefilled_tokens"), r.get("match_type"), r.get("ttft_s"), r.get("prefill_tok_s"),
                      r.get("finish_reason")] for r in rows])
    return int(bad)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", "--base-url", dest="url", default=None,
                   help="MLX server base URL (default http://MLX_HOST:MLX_PORT from env/.env, i.e. http://127.0.0.1:8080)")
    p.add_argument("--api-key", default=None, help="Bearer key if the endpoint needs one (default: none needed)")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.add_argument("--recent", type=int, default=10, help="recent request rows to show (default 10, 0 = none)")
    p.add_argument("--watch", type=float, default=0.0, help="refresh every N seconds (Ctrl-C to stop)")
    p.add_argument("--fail-on-correctness", action="store_true", help="exit 1 when a correctness counter is non-zero")
    args = p.parse_args(argv)
    url = args.url or default_mlx_url()
    key = args.api_key if args.api_key is not None else ""
    while True:
        try:
            stats = fetch(url, key)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            print(f"cannot read {url} /v1/cache/stats: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(stats, indent=2))
            bad = sum(v for v in (stats.get("correctness") or {}).values() if isinstance(v, (int, float)))
        else:
            if args.watch:
                print("\033[2J\033[H", end="")
            bad = render(stats, args.recent)
        if not args.watch:
            return 1 if (bad and args.fail_on_correctness) else 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(main())
