#!/usr/bin/env python3
"""OpenClaw-shaped integration harness, through the LiteLLM proxy (port 4000) by default.

A script, not a pytest module (``__test__ = False``). Checks, each printed PASS/FAIL:
- sessions by body ``session_id`` and by ``x-session-affinity`` header: warm turns reuse the cache;
- every user message carries a new "Conversation info (untrusted metadata)" prefix
  (message_id, timestamp): the previous prompt is still reused in full;
- the system prompt is split at ``<!-- OPENCLAW_CACHE_BOUNDARY -->`` with a per-turn date part: a
  new date reuses everything before the boundary (the date is a real change for the model);
- ``## Inbound Context (trusted metadata)`` present / absent: reuse up to the block;
- a sub-agent detour: a sub-agent session runs, then its "Stats: runtime 45s • tokens 1.2k (in 1k /
  out 200)" report goes back to the orchestrator, whose warm turn still reuses its history;
- reasoning settings (``thinking: low``, ``reasoning_effort``, ``reasoning: {effort}``,
  ``enable_thinking: false``), streaming and not: responses are well-formed.

    python scripts/test_openclaw_integration.py                         # :4000 with LITELLM_MASTER_KEY
    python scripts/test_openclaw_integration.py --base-url http://127.0.0.1:8080/v1 --api-key ''
"""
from __future__ import annotations

__test__ = False  # not a pytest module

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe_common import (
    OPENCLAW_BOUNDARY,
    ChatResult,
    Client,
    ProbeError,
    add_client_args,
    assistant_echo,
    client_from_args,
    nonce,
    openclaw_subagent_report,
    openclaw_system_prompt,
    openclaw_user,
    pi_system_prompt,
    print_table,
)


class Harness:
    def __init__(self, client: Client, args: Any) -> None:
        self.client = client
        self.args = args
        self.checks: list[list[Any]] = []
        self.log: list[list[Any]] = []

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append([name, "PASS" if ok else "FAIL", detail])
        if self.args.verbose:
            print(f"  {'PASS' if ok else 'FAIL'} {name}: {detail}", file=sys.stderr, flush=True)
        return ok

    def send(self, label: str, messages: list[dict], *, session: str | None = None, header_session: str | None = None,
             extra: dict | None = None, stream: bool | None = None, max_tokens: int | None = None) -> ChatResult:
        headers = {"x-session-affinity": header_session} if header_session else None
        r = self.client.chat(messages, max_tokens=max_tokens or self.args.max_tokens, session_id=session,
                             headers=headers, extra=extra, stream=stream)
        self.log.append([label, r.prompt_tokens, r.cached_tokens, r.uncached_tokens, f"{r.reuse:.1%}",
                         f"{r.ttft_s:.2f}", r.finish_reason])
        self.well_formed(label, r)
        return r

    def well_formed(self, label: str, r: ChatResult) -> None:
        problems = []
        if r.status != 200:
            problems.append(f"status {r.status}")
        if not r.id:
            problems.append("no id")
        if r.finish_reason not in ("stop", "length", "tool_calls"):
            problems.append(f"finish_reason {r.finish_reason!r}")
        if not isinstance(r.text, str):
            problems.append("content not a string")
        if not (r.prompt_tokens > 0 and isinstance(r.usage.get("completion_tokens"), int)):
            problems.append(f"usage {r.usage}")
        if "<think>" in r.text:
            problems.append("raw <think> in content")
        if problems:
            self.check(f"well-formed: {label}", False, "; ".join(problems))

    def measure(self, messages: list[dict]) -> int:
        return self.client.chat(messages, max_tokens=1, session_id=f"measure-{nonce(6)}").prompt_tokens

    # ---------------------------------------------------------------- scenarios
    def conversation(self, kind: str, tag: str) -> None:
        """Three turns in one session (body id or header), new message ids each turn."""
        sid = f"oc-{kind}-{tag}"
        kw = {"session": sid} if kind == "body" else {"header_session": sid}
        msgs = [{"role": "system", "content": openclaw_system_prompt(self.args.system_tokens, tag=f"{tag}-{kind}")},
                {"role": "user", "content": openclaw_user("What is on my calendar today?", 300)}]
        r = self.send(f"{kind}: turn 1", msgs, **kw)
        for i, text in ((2, "Move the dentist to Friday."), (3, "And remind me an hour before.")):
            prev = r.prompt_tokens
            msgs = msgs + [assistant_echo(r), {"role": "user", "content": openclaw_user(text, 300 + i)}]
            r = self.send(f"{kind}: turn {i}", msgs, **kw)
            self.check(f"session via {kind}: turn {i} reuses the previous prompt", r.cached_tokens >= prev - 2,
                       f"cached {r.cached_tokens}, previous prompt {prev}, reuse {r.reuse:.1%}")
        # New day: the per-turn part after the boundary changes.
        sys_text = openclaw_system_prompt(self.args.system_tokens, tag=f"{tag}-{kind}", date="Tuesday, March 31, 2026")
        msgs2 = [{"role": "system", "content": sys_text}] + msgs[1:] + [
            assistant_echo(r), {"role": "user", "content": openclaw_user("Good morning!", 310)}]
        r2 = self.send(f"{kind}: next day", msgs2, **kw)
        if kind == "body":
            upto = self.measure([{"role": "system", "content": sys_text.split(OPENCLAW_BOUNDARY)[0]}]) - 8
            self.check("per-turn date after the boundary: reuse up to the boundary",
                       0.9 * upto <= r2.cached_tokens <= r2.prompt_tokens,
                       f"cached {r2.cached_tokens}, tokens before the boundary ~{upto}, prompt {r2.prompt_tokens}")

    def inbound_toggle(self, tag: str) -> None:
        sid = f"oc-inbound-{tag}"
        with_ctx = openclaw_system_prompt(self.args.system_tokens, tag=f"{tag}-in", inbound=True)
        without = openclaw_system_prompt(self.args.system_tokens, tag=f"{tag}-in", inbound=False)
        msgs = [{"role": "system", "content": with_ctx}, {"role": "user", "content": openclaw_user("Hi!", 400)}]
        r = self.send("inbound: present", msgs, session=sid)
        msgs = [{"role": "system", "content": without}] + msgs[1:] + [
            assistant_echo(r), {"role": "user", "content": openclaw_user("Still there?", 401)}]
        r = self.send("inbound: absent", msgs, session=sid)
        upto = self.measure([{"role": "system", "content": with_ctx[:with_ctx.index("## Inbound Context")]}]) - 8
        self.check("inbound context absent: reuse up to the block, not beyond",
                   0.9 * upto <= r.cached_tokens <= upto + 24, f"cached {r.cached_tokens}, tokens before block ~{upto}")

    def subagent_detour(self, tag: str) -> None:
        orch = f"oc-orch-{tag}"
        msgs = [{"role": "system", "content": openclaw_system_prompt(self.args.system_tokens, tag=f"{tag}-orch")},
                {"role": "user", "content": openclaw_user("Research flights to Lisbon, use a sub-agent.", 500)}]
        r = self.send("orchestrator turn 1", msgs, session=orch)
        # The sub-agent: its own session and prompt, two turns.
        sub = f"{orch}-sub"
        smsgs = [{"role": "system", "content": pi_system_prompt(self.args.system_tokens // 2, f"{tag}-sub")
                  + "\nYou are a sub-agent spawned by OpenClaw."},
                 {"role": "user", "content": "Task: find three flights to Lisbon next week."}]
        sr = self.send("sub-agent turn 1", smsgs, session=sub)
        prev = sr.prompt_tokens
        smsgs = smsgs + [assistant_echo(sr), {"role": "user", "content": "Give the cheapest one."}]
        sr = self.send("sub-agent turn 2", smsgs, session=sub)
        self.check("sub-agent session: warm turn reuses its history", sr.cached_tokens >= prev - 2,
                   f"cached {sr.cached_tokens}, previous prompt {prev}")
        prev = r.prompt_tokens
        report = openclaw_subagent_report("find flights to Lisbon", runtime_s=45)
        msgs = msgs + [assistant_echo(r), {"role": "user", "content": report}]
        r = self.send("orchestrator: sub-agent report", msgs, session=orch, extra={"thinking": "low"})
        self.check("orchestrator after the detour: history reused", r.cached_tokens >= prev - 2,
                   f"cached {r.cached_tokens}, previous prompt {prev}, reuse {r.reuse:.1%}")
        prev = r.prompt_tokens
        msgs = msgs + [assistant_echo(r), {"role": "user", "content": openclaw_user("Book the cheapest.", 502)}]
        r = self.send("orchestrator: next turn", msgs, session=orch)
        self.check("orchestrator next turn: history reused", r.cached_tokens >= prev - 2,
                   f"cached {r.cached_tokens}, previous prompt {prev}, reuse {r.reuse:.1%}")

    def reasoning_settings(self, tag: str) -> None:
        base = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": openclaw_user(f"Say hello ({tag}).", 600)}]
        for label, extra, stream in (
            ("thinking: low (stream)", {"thinking": "low"}, True),
            ("thinking: off", {"thinking": "off"}, False),
            ("reasoning_effort: high (stream)", {"reasoning_effort": "high"}, True),
            ("reasoning_effort: low", {"reasoning_effort": "low"}, False),
            ("reasoning: {effort: medium}", {"reasoning": {"effort": "medium"}}, True),
            ("enable_thinking: false", {"enable_thinking": False}, False),
        ):
            try:
                r = self.send(f"reasoning {label}", base, session=f"oc-reason-{tag}", extra=extra, stream=stream)
                self.check(f"reasoning setting {label}: well-formed", r.finish_reason in ("stop", "length"),
                           f"finish {r.finish_reason}, {len(r.text)} chars, reasoning {len(r.reasoning)} chars")
            except ProbeError as exc:
                self.check(f"reasoning setting {label}: accepted", False, str(exc)[:300])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_client_args(p, max_tokens=8)
    p.add_argument("--system-tokens", type=int, default=400, help="approximate system prompt size (default 400)")
    p.add_argument("--only", action="append", choices=("body", "header", "inbound", "subagent", "reasoning"),
                   help="run only these parts (repeatable)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    client = client_from_args(args)
    h = Harness(client, args)
    tag = nonce()
    parts = args.only or ["body", "header", "inbound", "subagent", "reasoning"]
    try:
        print(f"OpenClaw integration via {client.base_url} (model {client.model}, run {tag})")
        for part in parts:
            if part in ("body", "header"):
                h.conversation(part, tag)
            elif part == "inbound":
                h.inbound_toggle(tag)
            elif part == "subagent":
                h.subagent_detour(tag)
            elif part == "reasoning":
                h.reasoning_settings(tag)
    except ProbeError as exc:
        h.check("requests succeed", False, str(exc)[:500])
    print()
    print_table(["request", "prompt", "cached", "uncached", "reuse", "ttft_s", "finish"], h.log, markdown=args.markdown)
    print()
    print_table(["check", "result", "detail"], h.checks, markdown=args.markdown)
    stats = client.cache_stats()
    if stats:
        print(f"\ncorrectness counters: {stats.get('correctness')}")
    failed = [c for c in h.checks if c[1] != "PASS"]
    print(f"\n{len(h.checks) - len(failed)}/{len(h.checks)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
