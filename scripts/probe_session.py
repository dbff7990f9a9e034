#!/usr/bin/env python3
"""Four cache scenarios, each with an asserted expectation (exit 1 if any fails):

1. continuation — a normal multi-turn chat: every warm turn reuses >= --min-reuse of its prompt.
2. drift       — OpenClaw volatile fields: each new user message carries a new message_id /
                 timestamp in its "Conversation info (untrusted metadata)" prefix (earlier
                 messages unchanged) -> the previous prompt is reused entirely; then the
                 "## Inbound Context (trusted metadata)" block disappears from the system prompt
                 -> reuse up to the block (a real change in the model input), not beyond it.
3. semantic    — a new system prompt (same session id) -> must miss: cached tokens below one
                 block (16) beyond the template header.
4. insertion   — a message inserted mid-history -> reuse up to the insertion point only
                 (<= tokens before it, and >= 90% of them).

Change points are measured, not guessed: after a scenario, a 1-token request of the history up
to the change point gives its token count.

    python scripts/probe_session.py --base-url http://127.0.0.1:8080/v1 --api-key ''
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe_common import (
    TURN_HEADERS,
    ProbeError,
    Recorder,
    add_client_args,
    assistant_echo,
    client_from_args,
    filler_paragraphs,
    nonce,
    openclaw_system_prompt,
    openclaw_user,
    pi_system_prompt,
    print_table,
    turn_rows,
)

SCENARIOS = ("continuation", "drift", "semantic", "insertion")


class Checker:
    def __init__(self) -> None:
        self.results: list[tuple[str, str, bool, str]] = []

    def check(self, scenario: str, what: str, ok: bool, detail: str) -> bool:
        self.results.append((scenario, what, ok, detail))
        return ok


def _counters(client: Any) -> dict:
    stats = client.cache_stats() or {}
    return dict(stats.get("correctness") or {})


def _measure(rec: Recorder, messages: list[dict], tag: str) -> int:
    """Prompt tokens of ``messages`` + the generation prompt (1-token request, own session)."""
    r = rec.client.chat(messages, max_tokens=1, session_id=f"measure-{tag}-{nonce(4)}")
    return r.prompt_tokens


def scenario_continuation(rec: Recorder, chk: Checker, args: Any, tag: str) -> None:
    sid = f"cont-{tag}"
    msgs = [{"role": "system", "content": pi_system_prompt(args.system_tokens, tag + "-c")},
            {"role": "user", "content": "What does a prompt cache do?"}]
    r = rec.send("continuation", "cold", msgs, session=sid)
    for i, q in enumerate(["Why does it help agents?", "Give one risk."], start=2):
        msgs = msgs + [assistant_echo(r), {"role": "user", "content": q}]
        r = rec.send("continuation", f"warm {i}", msgs, session=sid)
        t = rec.turns[-1]
        chk.check("continuation", f"turn {i} reuse >= {args.min_reuse:.0%}", t.reuse >= args.min_reuse,
                  f"cached {t.cached}/{t.prompt} = {t.reuse:.1%} ({t.match})")


def scenario_drift(rec: Recorder, chk: Checker, args: Any, tag: str) -> None:
    sid = f"drift-{tag}"
    sys_with = openclaw_system_prompt(args.system_tokens, tag=tag + "-d", inbound=True)
    sys_without = openclaw_system_prompt(args.system_tokens, tag=tag + "-d", inbound=False)
    msgs = [{"role": "system", "content": sys_with},
            {"role": "user", "content": openclaw_user("Remind me to call Bob tomorrow.", 201)}]
    r = rec.send("drift", "msg 201", msgs, session=sid)
    prev = rec.turns[-1].prompt
    msgs = msgs + [assistant_echo(r), {"role": "user", "content": openclaw_user("And email Carol.", 202)}]
    r = rec.send("drift", "msg 202 (new id/ts)", msgs, session=sid)
    t = rec.turns[-1]
    chk.check("drift", "new message_id/timestamp: previous prompt reused", t.cached >= prev - 2,
              f"cached {t.cached} vs previous prompt {prev} ({t.match})")
    prev = t.prompt
    msgs = msgs + [assistant_echo(r), {"role": "user", "content": openclaw_user("Thanks!", 203)}]
    r = rec.send("drift", "msg 203 (new id/ts)", msgs, session=sid)
    t = rec.turns[-1]
    chk.check("drift", "again: previous prompt reused", t.cached >= prev - 2,
              f"cached {t.cached} vs previous prompt {prev} ({t.match})")
    # Inbound context absent this time: a real change in the model input, inside the system prompt.
    msgs2 = [{"role": "system", "content": sys_without}] + msgs[1:] + [
        assistant_echo(r), {"role": "user", "content": openclaw_user("One more thing.", 204)}]
    rec.send("drift", "msg 204, inbound absent", msgs2, session=sid)
    t = rec.turns[-1]
    cut = sys_with.index("## Inbound Context")
    before = _measure(rec, [{"role": "system", "content": sys_with[:cut]}], tag) - 8  # ~ header/footer tokens
    chk.check("drift", "inbound context absent: reuse up to the block, not beyond",
              0.9 * before <= t.cached <= before + 24,
              f"cached {t.cached}, tokens before the block ~{before} (prompt {t.prompt}, {t.match})")


def scenario_semantic(rec: Recorder, chk: Checker, args: Any, tag: str) -> None:
    sid = f"sem-{tag}"
    msgs = [{"role": "system", "content": pi_system_prompt(args.system_tokens, tag + "-s")},
            {"role": "user", "content": "List three testing tips."}]
    rec.send("semantic", "original system", msgs, session=sid)
    new_sys = ("Poetry mode. Answer only in rhyming couplets about the sea, and never discuss code. "
               + filler_paragraphs(args.system_tokens // 2, "stanza", seed=9) + f"\nMarker {tag}.")
    msgs = [{"role": "system", "content": new_sys}, msgs[1]]
    rec.send("semantic", "new system prompt", msgs, session=sid)
    t = rec.turns[-1]
    limit = args.block_size + args.header_tokens
    chk.check("semantic", f"new system prompt misses (cached < {limit})", t.cached < limit,
              f"cached {t.cached} of {t.prompt} ({t.match})")


def scenario_insertion(rec: Recorder, chk: Checker, args: Any, tag: str) -> None:
    sid = f"ins-{tag}"
    system = {"role": "system", "content": pi_system_prompt(args.system_tokens, tag + "-i")}
    hist = [system,
            {"role": "user", "content": "We are planning a release. First, list the open bugs."},
            {"role": "assistant", "content": "Open bugs: #12 parser crash, #15 slow startup, #19 typo in docs."},
            {"role": "user", "content": "Which one is most urgent?"},
            {"role": "assistant", "content": "#12, the parser crash: it loses user data."},
            {"role": "user", "content": "Draft a short release note."}]
    rec.send("insertion", "history", hist, session=sid)
    k = 3  # insert before hist[3]
    inserted = {"role": "user", "content": "Note: bug #15 was fixed yesterday by Dana."}
    hist2 = hist[:k] + [inserted, {"role": "assistant", "content": "Noted, #15 is fixed."}] + hist[k:]
    rec.send("insertion", "message inserted", hist2, session=sid)
    t = rec.turns[-1]
    upto = _measure(rec, hist[:k], tag)  # tokens of hist[:k] + generation prompt (~3 tokens)
    chk.check("insertion", "reuse only up to the inserted message",
              0.9 * (upto - 3) <= t.cached <= upto + 4,
              f"cached {t.cached}, tokens before the insertion ~{upto - 3} (prompt {t.prompt}, {t.match})")


RUNNERS: dict[str, Callable[..., None]] = {
    "continuation": scenario_continuation, "drift": scenario_drift,
    "semantic": scenario_semantic, "insertion": scenario_insertion,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_client_args(p, max_tokens=8)
    p.add_argument("--scenario", action="append", choices=SCENARIOS,
                   help="run only this scenario (repeatable; default all four)")
    p.add_argument("--min-reuse", type=float, default=0.8, help="continuation: minimum warm reuse (default 0.8)")
    p.add_argument("--system-tokens", type=int, default=350, help="approximate system prompt size (default 350)")
    p.add_argument("--block-size", type=int, default=16, help="cache block size (default 16)")
    p.add_argument("--header-tokens", type=int, default=4,
                   help="template header tokens before the system text (<|im_start|>system\\n; default 4)")
    p.add_argument("--session-mode", choices=("body", "header", "none"), default="body",
                   help="send sessions as body session_id, x-session-affinity header, or not at all")
    p.add_argument("--markdown", action="store_true", help="markdown tables")
    p.add_argument("-v", "--verbose", action="store_true", help="print each request as it completes")
    args = p.parse_args(argv)

    client = client_from_args(args)
    rec = Recorder(client, max_tokens=args.max_tokens, verbose=args.verbose, session_mode=args.session_mode)
    chk = Checker()
    tag = nonce()
    print(f"probe_session via {client.base_url} (model {client.model}, run {tag})")
    counter_deltas: dict[str, dict] = {}
    for name in args.scenario or SCENARIOS:
        before = _counters(client)
        start = len(rec.turns)
        try:
            RUNNERS[name](rec, chk, args, tag)
        except ProbeError as exc:
            chk.check(name, "requests succeed", False, str(exc)[:500])
        after = _counters(client)
        counter_deltas[name] = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
        print(f"\n## {name}")
        print_table(TURN_HEADERS, turn_rows(rec.turns[start:]), markdown=args.markdown)
        if counter_deltas[name]:
            print(f"correctness counters moved: {counter_deltas[name]}")
    print("\n## expectations")
    print_table(["scenario", "expectation", "result", "detail"],
                [[s, w, "PASS" if ok else "FAIL", d] for s, w, ok, d in chk.results], markdown=args.markdown)
    failed = [r for r in chk.results if not r[2]]
    if failed:
        print(f"\n{len(failed)} expectation(s) failed", file=sys.stderr)
        return 1
    print("\nOK: all expectations met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
