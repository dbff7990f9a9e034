#!/usr/bin/env python3
"""Diff consecutive turns of a session from the per-request logs to pinpoint where the cache key
diverged: first differing token index in the model tokens (what the model computed on) and in
the key tokens (canonical, scrubbed), with the surrounding text on both sides.

Logs: ``LOG_ROOT/<date>/cache-session-<id>.log``, one JSON object per line (request_id, ts,
session, model_text, model_tokens, key_tokens / key_same_as_model, key_text, cache{...}).
Lines that are not JSON or miss fields are skipped, not fatal.

Text around a divergence comes from the tokenizer when ``--tokenizer PATH`` is given (a folder
with tokenizer.json, loaded with the ``tokenizers`` package), else from a character diff of
``model_text`` / ``key_text``.

    python scripts/diff_turns.py                       # newest session file under logs/
    python scripts/diff_turns.py --session pi-abc123   # that session (all dates)
    python scripts/diff_turns.py --file logs/2026-03-30/cache-session-x.log --tokenizer ~/.cache/mlxstack/SmolLM2-135M-Instruct-f32
    python scripts/diff_turns.py --list                # sessions and turn counts
    python scripts/diff_turns.py --self-test           # synthetic logs, no server needed

Exit code: 0; 1 with ``--fail-on-loss`` when a turn reused fewer tokens than it shared with the
previous turn (minus one block); 2 when no log is found; self-test: 1 on failure.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe_common import REPO_ROOT, print_table, setting

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


# ----------------------------------------------------------------------------- reading
def read_log(path: Path) -> Iterator[dict]:
    """Records of one session log, defensively: bad lines and non-objects are skipped."""
    try:
        fh = open(path, encoding="utf-8", errors="replace")
    except OSError:
        return
    with fh:
        for line in fh:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                yield normalise(rec)


def _tokens(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) for t in value):
        return value
    return None


def normalise(rec: dict) -> dict:
    """Fill the fields this script uses, whatever the log version wrote."""
    cache = rec.get("cache") if isinstance(rec.get("cache"), dict) else {}
    model_tokens = _tokens(rec.get("model_tokens"))
    key_tokens = _tokens(rec.get("key_tokens"))
    if key_tokens is None and rec.get("key_same_as_model"):
        key_tokens = model_tokens
    model_text = rec.get("model_text") if isinstance(rec.get("model_text"), str) else None
    key_text = rec.get("key_text") if isinstance(rec.get("key_text"), str) else None
    if key_text is None and rec.get("key_same_as_model"):
        key_text = model_text
    ts = rec.get("ts")
    return {
        "request_id": str(rec.get("request_id", "?")),
        "ts": float(ts) if isinstance(ts, (int, float)) else 0.0,
        "time": str(rec.get("time", "")),
        "session": str(rec.get("session", "")),
        "model_tokens": model_tokens,
        "key_tokens": key_tokens,
        "model_text": model_text,
        "key_text": key_text,
        "match_type": cache.get("match_type", rec.get("match_type", "")),
        "prompt_tokens": cache.get("prompt_tokens", rec.get("prompt_tokens")),
        "cached_tokens": cache.get("cached_tokens", rec.get("cached_tokens")),
        "stable_prefix_msgs": cache.get("stable_prefix_msgs", rec.get("stable_prefix_msgs")),
        "key_delta_chars": cache.get("key_delta_chars", rec.get("key_delta_chars")),
        "roles": rec.get("message_roles") or [],
    }


def log_root(arg: str | None) -> Path:
    root = Path(arg or setting("LOG_ROOT", "logs") or "logs").expanduser()
    return root if root.is_absolute() else REPO_ROOT / root


def session_files(root: Path, session: str | None = None) -> list[Path]:
    pattern = f"cache-session-{_UNSAFE.sub('_', session[:16])}.log" if session else "cache-session-*.log"
    files = list(root.glob(f"*/{pattern}")) + list(root.glob(pattern))
    return sorted(set(files), key=lambda p: (p.stat().st_mtime, str(p)))


def load_records(files: Sequence[Path], session: str | None = None) -> list[dict]:
    recs = [r for f in files for r in read_log(f)]
    if session:
        recs = [r for r in recs if not r["session"] or r["session"] == session[:16] or r["session"] == session]
    return sorted(recs, key=lambda r: r["ts"])


# ----------------------------------------------------------------------------- diffing
def first_diff(a: Sequence[Any] | None, b: Sequence[Any] | None) -> int | None:
    """Index of the first differing element; len(shorter) if one is a prefix; None if unknown."""
    if a is None or b is None:
        return None
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _char_context(text: str | None, idx: int, width: int) -> str:
    if text is None:
        return "(no text logged)"
    lo, hi = max(0, idx - width), min(len(text), idx + width)
    return (("…" if lo else "") + text[lo:idx] + "⟦" + text[idx:hi] + ("…" if hi < len(text) else "")) \
        .replace("\n", "\\n")


def _token_context(tokens: Sequence[int], idx: int, width: int, decode: Callable[[list[int]], str]) -> str:
    lo, hi = max(0, idx - width), min(len(tokens), idx + width)
    return (decode(list(tokens[lo:idx])) + "⟦" + decode(list(tokens[idx:hi]))).replace("\n", "\\n")


@dataclass
class PairDiff:
    prev: dict
    cur: dict
    model_idx: int | None
    key_idx: int | None
    text_idx: int | None
    key_text_idx: int | None

    @property
    def appended(self) -> bool:
        prev = self.prev["model_tokens"]
        return self.model_idx is not None and prev is not None and self.model_idx >= len(prev)


def diff_pair(prev: dict, cur: dict) -> PairDiff:
    return PairDiff(prev, cur, first_diff(prev["model_tokens"], cur["model_tokens"]),
                    first_diff(prev["key_tokens"], cur["key_tokens"]),
                    first_diff(prev["model_text"], cur["model_text"]),
                    first_diff(prev["key_text"], cur["key_text"]))


def describe(d: PairDiff, *, width: int = 60, tok_width: int = 12,
             decode: Callable[[list[int]], str] | None = None) -> list[str]:
    p, c = d.prev, d.cur
    out = [f"--- {p['request_id']} ({p['time']}) -> {c['request_id']} ({c['time']}) session {c['session']}",
           f"    prompt {p['prompt_tokens']} -> {c['prompt_tokens']}; this turn cached {c['cached_tokens']} "
           f"({c['match_type']}), stable msgs {c['stable_prefix_msgs']}, key delta chars {c['key_delta_chars']}"]
    prev_len = len(p["model_tokens"]) if p["model_tokens"] is not None else None
    if d.model_idx is None:
        out.append("    model tokens: not logged")
    elif d.appended:
        out.append(f"    model tokens: pure append (previous {prev_len} tokens all shared)")
    else:
        out.append(f"    model tokens: diverge at index {d.model_idx} of {prev_len} (previous) / "
                   f"{len(c['model_tokens'])} (this turn)")
    prev_key = p["key_tokens"]
    if d.key_idx is not None and prev_key is not None and d.key_idx >= len(prev_key):
        out.append(f"    key tokens:   pure append (previous {len(prev_key)} key tokens all shared)")
    elif d.key_idx is not None and d.key_idx != d.model_idx:
        out.append(f"    key tokens:   diverge at index {d.key_idx}")
    elif d.key_idx is not None:
        out.append("    key tokens:   same divergence point")
    if d.appended:
        return out
    for label, idx, pt, ct, ptok, ctok in (
        ("original", d.text_idx, p["model_text"], c["model_text"], p["model_tokens"], c["model_tokens"]),
        ("canonical", d.key_text_idx, p["key_text"], c["key_text"], p["key_tokens"], c["key_tokens"]),
    ):
        tidx = d.model_idx if label == "original" else d.key_idx
        if decode is not None and tidx is not None and ptok is not None and ctok is not None and tidx < max(len(ptok), len(ctok)):
            out.append(f"    {label:9s} before: {_token_context(ptok, tidx, tok_width, decode)}")
            out.append(f"    {label:9s} now:    {_token_context(ctok, tidx, tok_width, decode)}")
        elif idx is not None and pt is not None and ct is not None and idx < max(len(pt), len(ct)):
            out.append(f"    {label:9s} before (char {idx}): {_char_context(pt, idx, width)}")
            out.append(f"    {label:9s} now    (char {idx}): {_char_context(ct, idx, width)}")
        elif label == "canonical" and pt is None:
            out.append("    canonical: key text not logged (key equal to model tokens or not recorded)")
    return out


def load_decoder(path: str | None) -> Callable[[list[int]], str] | None:
    if not path:
        return None
    p = Path(path).expanduser()
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))
        return lambda ids: tok.decode(ids, skip_special_tokens=False)
    except Exception as exc:  # noqa: BLE001
        print(f"note: tokenizer not loaded ({exc}); using character offsets", file=sys.stderr)
        return None


# ----------------------------------------------------------------------------- self-test
def _synthetic(tmp: Path) -> Path:
    day = tmp / "2026-03-30"
    day.mkdir(parents=True)
    base = list(range(100, 200))
    t1 = {"v": 1, "request_id": "aaa", "ts": 1.0, "time": "t1", "session": "s1", "model_text": "SYS hello world",
          "model_tokens": base, "key_tokens": None, "key_same_as_model": True,
          "cache": {"match_type": "miss", "prompt_tokens": 100, "cached_tokens": 0}}
    t2 = dict(t1, request_id="bbb", ts=2.0, time="t2", model_text="SYS hello world and more",
              model_tokens=base + [7, 8, 9], cache={"match_type": "prefix", "prompt_tokens": 103, "cached_tokens": 100})
    t3 = dict(t1, request_id="ccc", ts=3.0, time="t3", model_text="SYS hellO world and more",
              model_tokens=base[:50] + [999] + base[51:] + [7, 8, 9], key_same_as_model=False,
              key_tokens=base + [7, 8, 9], key_text="SYS hello world and more",
              cache={"match_type": "lcp", "prompt_tokens": 103, "cached_tokens": 2})
    path = day / "cache-session-s1.log"
    with open(path, "w") as fh:
        fh.write(json.dumps(t2) + "\n")             # out of order on purpose
        fh.write("not json\n{\"truncated line\n")   # garbage is skipped
        fh.write(json.dumps(t1) + "\n")
        fh.write(json.dumps(t3) + "\n")
    return tmp


def self_test() -> int:
    failures: list[str] = []

    def expect(cond: bool, what: str) -> None:
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory() as td:
        root = _synthetic(Path(td))
        files = session_files(root, "s1")
        recs = load_records(files, "s1")
        expect([r["request_id"] for r in recs] == ["aaa", "bbb", "ccc"], "records sorted by ts, garbage skipped")
        d12, d23 = diff_pair(recs[0], recs[1]), diff_pair(recs[1], recs[2])
        expect(d12.appended and d12.model_idx == 100, "turn 2 is a pure append")
        expect(d23.model_idx == 50 and not d23.appended, "turn 3 diverges at token 50")
        expect(d23.key_idx == 103, "turn 3 key tokens unchanged (prefix of length 103)")
        expect(d23.text_idx == 8, "char divergence at 8")
        lines = describe(d23, decode=lambda ids: " ".join(map(str, ids)))
        text = "\n".join(lines)
        expect("diverge at index 50" in text, "describe names the index")
        expect("⟦999" in text, "token context marks the new token")
        lines = describe(d23)
        expect(any("hell⟦O world" in ln for ln in lines), "char context shows the edit")
        loss = losses([d12, d23], block=16)
        expect(len(loss) == 1 and loss[0].cur["request_id"] == "ccc", "reuse loss flagged on turn 3")
        expect(main(["--log-root", td, "--session", "s1"]) == 0, "main runs on synthetic logs")
        expect(main(["--log-root", td, "--session", "s1", "--fail-on-loss"]) == 1, "--fail-on-loss exits 1")
        expect(main(["--log-root", td, "--session", "nope"]) == 2, "missing session exits 2")
    for f in failures:
        print(f"SELF-TEST FAIL: {f}", file=sys.stderr)
    print("self-test", "FAILED" if failures else "passed")
    return 1 if failures else 0


def losses(diffs: Sequence[PairDiff], block: int = 16) -> list[PairDiff]:
    """Turns whose cached tokens fell short of what they shared with the previous turn (minus a block)."""
    out = []
    for d in diffs:
        shared = d.model_idx
        cached = d.cur.get("cached_tokens")
        if shared is not None and isinstance(cached, int) and cached < shared - block:
            out.append(d)
    return out


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-root", default=None, help="log directory (default: LOG_ROOT from env/.env, else logs/)")
    p.add_argument("--session", default=None, help="session id (first 16 characters name the file)")
    p.add_argument("--file", action="append", default=None, help="a session log file (repeatable)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder/json to decode tokens around a divergence")
    p.add_argument("--context", type=int, default=60, help="characters of context each side (default 60)")
    p.add_argument("--token-context", type=int, default=12, help="tokens of context each side (default 12)")
    p.add_argument("--last", type=int, default=0, help="only the last N turn pairs")
    p.add_argument("--list", action="store_true", help="list session files and turn counts")
    p.add_argument("--block-size", type=int, default=16, help="block size for --fail-on-loss (default 16)")
    p.add_argument("--fail-on-loss", action="store_true",
                   help="exit 1 if a turn reused fewer tokens than it shared with the previous turn (minus a block)")
    p.add_argument("--json", action="store_true", help="print the divergence per pair as JSON")
    p.add_argument("--self-test", action="store_true", help="run on synthetic logs and check the results")
    args = p.parse_args(argv)

    if args.self_test:
        return self_test()
    root = log_root(args.log_root)
    if args.list:
        rows = []
        for f in session_files(root):
            recs = list(read_log(f))
            rows.append([str(f.relative_to(root)) if f.is_relative_to(root) else str(f), len(recs),
                         recs[-1]["session"] if recs else "", recs[-1]["time"] if recs else ""])
        print_table(["file", "turns", "session", "last"], rows)
        return 0 if rows else 2
    if args.file:
        files = [Path(f) for f in args.file]
    else:
        files = session_files(root, args.session)
        if not args.session and files:
            files = [f for f in files if f.name == files[-1].name]  # the newest session, all dates
    recs = load_records(files, args.session if not args.file else None)
    if not recs:
        print(f"no session log records found (root {root}, session {args.session!r}, files {args.file})", file=sys.stderr)
        return 2
    diffs = [diff_pair(a, b) for a, b in zip(recs, recs[1:])]
    if args.last:
        diffs = diffs[-args.last:]
    decode = load_decoder(args.tokenizer)
    if args.json:
        print(json.dumps([{"prev": d.prev["request_id"], "cur": d.cur["request_id"], "model_index": d.model_idx,
                           "key_index": d.key_idx, "char_index": d.text_idx, "appended": d.appended,
                           "cached_tokens": d.cur["cached_tokens"], "match_type": d.cur["match_type"]}
                          for d in diffs], indent=2))
    else:
        print(f"{len(recs)} turns from {', '.join(str(f) for f in files)}")
        for d in diffs:
            print("\n".join(describe(d, width=args.context, tok_width=args.token_context, decode=decode)))
    lost = losses(diffs, args.block_size)
    if lost:
        for d in lost:
            print(f"reuse loss: {d.cur['request_id']} cached {d.cur['cached_tokens']} but shared {d.model_idx} "
                  "model tokens with the previous turn", file=sys.stderr)
        if args.fail_on_loss:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
