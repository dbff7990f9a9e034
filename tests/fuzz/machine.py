"""A Hypothesis state machine of concurrent agent traffic against the differential harness.

Rules queue requests (new sessions, next turns, fan-outs over a warm conversation on both sides
of SHARED_PREFIX_MIN_TOKENS, identical retries, branches that edit an earlier message, sub-agents
under one system prompt, grammar rows, seeded sampled rows, hang-ups mid-prefill / mid-decode);
``wave`` serves what is queued together and checks every reply against the cold reference;
``restart`` brings the warm engine back from its disk tier. Hypothesis chooses the sequence and
shrinks a failing one; ``Fuzz.on_finding`` writes the shrunk case as a ready pytest file
(``write_reproducer``), overwritten by each smaller failing run -- the last one written is the
minimal case.

    run_machine(config, model_path, tmp, seed=1, examples=3, steps=12)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from .harness import Config, Harness
from .traffic import SYSTEMS, Conversation, Req, block, edited, sentence, wave_json, with_user

MAX_WAVE = 10          # requests queued before a wave is forced
MAX_CONVERSATIONS = 12


class Fuzz(RuleBasedStateMachine):
    config: Config
    model_path: Path
    tmp: Path
    reproducer: Path | None = None
    totals: Any = None                   # a Stats-like accumulator shared across examples (scripts)

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(self.config, self.model_path, self.tmp)
        self.convos: list[Conversation] = []
        self.queue: list[Req] = []
        self.n = 0
        self.waves_since_restart = 0

    # ------------------------------------------------------------------ helpers
    def _rid(self) -> str:
        self.n += 1
        return f"r{self.n}"

    def _queue(self, req: Req) -> None:
        self.queue.append(req)
        if len(self.queue) >= MAX_WAVE:
            self.wave()

    def _min(self) -> int:
        return self.config.min_shared

    # ------------------------------------------------------------------ rules
    @initialize(system=st.integers(0, len(SYSTEMS) - 1), words=st.integers(3, 12))
    def first_session(self, system: int, words: int) -> None:
        msgs = [{"role": "system", "content": SYSTEMS[system]}]
        self._queue(Req(self._rid(), "s0", with_user(msgs, sentence(self.n, words)), max_tokens=8, origin="session"))
        self.wave()

    @rule(system=st.integers(0, len(SYSTEMS) - 1), words=st.integers(3, 30), tokens=st.integers(4, 16))
    def new_session(self, system: int, words: int, tokens: int) -> None:
        msgs = [{"role": "system", "content": SYSTEMS[system]}]
        self._queue(Req(self._rid(), f"s{self.n}", with_user(msgs, sentence(self.n, words)), max_tokens=tokens,
                        origin="session"))

    @precondition(lambda self: self.convos)
    @rule(pick=st.integers(0, 99), words=st.integers(2, 20), lines=st.integers(0, 6), tokens=st.integers(4, 16))
    def next_turn(self, pick: int, words: int, lines: int, tokens: int) -> None:
        c = self.convos[pick % len(self.convos)]
        text = sentence(self.n, words) + ("\n" + block(self.n, lines) if lines else "")
        self._queue(Req(self._rid(), c.session, with_user(c.messages, text), max_tokens=tokens, origin="turn",
                        scope=c.scope))

    @precondition(lambda self: self.convos)
    @rule(pick=st.integers(0, 99), words=st.integers(2, 12), tokens=st.integers(6, 16))
    def structured_turn(self, pick: int, words: int, tokens: int) -> None:
        """A conversation's next turn under a JSON schema: its reply (a grammar's spelling, not the
        text's own encoding) is echoed by the turn after it -- the turn closes with the echo's tokens."""
        c = self.convos[pick % len(self.convos)]
        self._queue(Req(self._rid(), c.session, with_user(c.messages, sentence(self.n, words)), max_tokens=tokens,
                        grammar=True, origin="structured-turn", scope=c.scope))

    @precondition(lambda self: self.convos)
    @rule(pick=st.integers(0, 99), n=st.integers(2, 5), ttl=st.sampled_from([None, 300.0, 3600.0]),
          cut=st.booleans())
    def breakpoint_branches(self, pick: int, n: int, ttl: float | None, cut: bool) -> None:
        """A client's cache breakpoint (cache_control / prompt_cache_breakpoint) on a warm
        conversation's last message -- its end, or inside its text -- and ``n`` branches from
        it, each with its own question: every branch reads the mark (an exact-depth snapshot for
        a recurrent or windowed model) and answers as the cold reference."""
        c = self.convos[pick % len(self.convos)]
        last = len(c.messages) - 1
        text = c.messages[last].get("content")
        chars = len(text) // 2 if cut and isinstance(text, str) and len(text) > 8 else None
        for i in range(n):
            self._queue(Req(self._rid(), c.session if i == 0 else f"{c.session}.b{self.n}",
                            with_user(c.messages, sentence(self.n + i, 5)), max_tokens=8,
                            origin="breakpoint" + ("-cut" if chars is not None else ""), scope=c.scope,
                            marks=[[last, chars, ttl]]))

    @precondition(lambda self: self.convos)
    @rule(pick=st.integers(0, 99), words=st.integers(2, 12))
    def other_scope(self, pick: int, words: int) -> None:
        """A warm conversation's next turn sent in a scope nobody used yet (another tenant, another
        cache_salt): it must reuse nothing -- not the entries, not a shared prefill -- and answer as
        the cold reference; the conversation goes on in that scope."""
        c = self.convos[pick % len(self.convos)]
        self._queue(Req(self._rid(), c.session, with_user(c.messages, sentence(self.n, words)), max_tokens=8,
                        origin="scope", scope=f"salt-{self.n}", fresh_scope=True))

    @precondition(lambda self: self.convos)
    @rule(pick=st.integers(0, 99), n=st.integers(2, 8), side=st.sampled_from(["below", "above", "far"]),
          same_session=st.booleans(), grammar=st.integers(0, 3), sampled=st.integers(0, 3))
    def fan_out(self, pick: int, n: int, side: str, same_session: bool, grammar: int, sampled: int) -> None:
        """``n`` requests extend one warm conversation by the same pasted block plus each its own
        question: sub-agents over one context. The block is sized to put the shared part below,
        just above, or well past SHARED_PREFIX_MIN_TOKENS (~9 tokens a line)."""
        c = self.convos[pick % len(self.convos)]
        lines = {"below": max(0, self._min() // 9 - 2), "above": self._min() // 9 + 2, "far": self._min() // 9 * 3 + 4}[side]
        shared = block(self.n, lines)
        for i in range(n):
            req = Req(self._rid(), c.session if same_session or i == 0 else f"{c.session}.f{self.n}",
                      with_user(c.messages, shared + "\n" + sentence(self.n + i, 4)), max_tokens=10,
                      grammar=i < grammar, temperature=0.8 if grammar <= i < grammar + sampled else 0.0,
                      seed=self.n + i if grammar <= i < grammar + sampled else None,
                      origin=f"fanout-{side}" + ("-grammar" if i < grammar else "")
                      + ("-sampled" if grammar <= i < grammar + sampled else ""), scope=c.scope)
            self._queue(req)

    @precondition(lambda self: self.queue)
    @rule(k=st.integers(1, 3))
    def retry(self, k: int) -> None:
        """The last queued request again, identical, ``k`` times (a client retrying)."""
        last = self.queue[-1]
        for _ in range(k):
            self._queue(Req(self._rid(), last.session, [dict(m) for m in last.messages], last.max_tokens,
                            last.temperature, last.seed, last.grammar, None, False, "retry", scope=last.scope))

    @precondition(lambda self: any(sum(m["role"] == "user" for m in c.messages) >= 2 for c in self.convos))
    @rule(pick=st.integers(0, 99), at=st.integers(0, 5), words=st.integers(2, 12))
    def branch(self, pick: int, at: int, words: int) -> None:
        """A conversation resent with an earlier user message edited."""
        deep = [c for c in self.convos if sum(m["role"] == "user" for m in c.messages) >= 2]
        c = deep[pick % len(deep)]
        self._queue(Req(self._rid(), c.session, edited(c.messages, at, sentence(self.n, words)), max_tokens=8,
                        origin="branch", scope=c.scope))

    @rule(n=st.integers(2, 6), lines=st.integers(1, 8))
    def subagents(self, n: int, lines: int) -> None:
        """``n`` new sessions under one long system prompt, each with its own task."""
        system = SYSTEMS[1] + "\nRepository map:\n" + block(7, lines * self._min() // 36 + 1)
        for i in range(n):
            self._queue(Req(self._rid(), f"sub{self.n}", [{"role": "system", "content": system},
                                                           {"role": "user", "content": sentence(self.n + i, 6)}],
                            max_tokens=8, origin="subagent"))

    @precondition(lambda self: self.queue)
    @rule(which=st.integers(0, 99), when=st.sampled_from(["prefill", "decode"]), after=st.integers(0, 4))
    def hang_up(self, which: int, when: str, after: int) -> None:
        req = self.queue[which % len(self.queue)]
        req.hang_up, req.extends = (when, after), False
        req.origin = req.origin.split("+hangup")[0] + f"+hangup-{when}"

    @precondition(lambda self: len(self.queue) >= 2)
    @rule(which=st.integers(0, 99), arrive=st.integers(0, 24))
    def urgent(self, which: int, arrive: int) -> None:
        """The wave's requests become background work (priority 1; those queued after this rule
        too, in ``wave``) but one: the user's own turn, arriving ``arrive`` scheduler steps into the
        wave (mid-prefill, or once the others decode) -- it preempts less urgent rows when the batch
        is full and decodes beside as many as the wave allows (harness: 0, 1, 2; with none beside,
        a decoding batch is set aside whole)."""
        req = self.queue[which % len(self.queue)]
        for other in self.queue:
            other.priority = 1
        req.priority, req.arrive = 0, arrive
        req.origin = req.origin.split("+urgent")[0] + "+urgent"

    @precondition(lambda self: self.queue)
    @rule()
    def wave(self) -> None:
        queued, self.queue = self.queue, []
        user = next((r for r in queued if "+urgent" in r.origin and r.priority == 0), None)
        if user is not None:
            for r in queued:      # queued after the urgent rule too: background work of the same wave
                if r is not user:
                    r.priority = 1
        self.waves_since_restart += 1
        served = self.h.run(queued)
        for s in served:
            if s.req.extends and s.verified and s.text:
                self.convos.append(Conversation(s.req.session, [*s.req.messages,
                                                                {"role": "assistant", "content": s.text}],
                                                scope=s.req.scope))
        del self.convos[:-MAX_CONVERSATIONS]
        self._report()

    @precondition(lambda self: self.config.disk and self.waves_since_restart >= 2)
    @rule()
    def restart(self) -> None:
        if self.queue:
            self.wave()
        self.h.restart()
        self.waves_since_restart = 0

    # ------------------------------------------------------------------ checks
    def _report(self) -> None:
        if self.h.findings:
            if self.totals is not None:
                self.totals.last_findings = [str(f) for f in self.h.findings]
            if self.reproducer is not None:
                write_reproducer(self.reproducer, self.config, self.h.log, [str(f) for f in self.h.findings])
            raise AssertionError("differential fuzzer: " + "; ".join(str(f) for f in self.h.findings[:3]))

    @invariant()
    def no_findings(self) -> None:
        assert not self.h.findings

    def teardown(self) -> None:
        try:
            if self.queue:
                self.wave()
        finally:
            if self.totals is not None:
                self.totals.add(self.h.stats)
            self.h.close()


def write_reproducer(path: Path, config: Config, log: list[Any], findings: list[str]) -> None:
    """A pytest file that replays ``log`` (waves and restarts) on the harness and fails while the
    defect is there."""
    body = wave_json([w for w in log if w != "restart"])
    order = ["restart" if w == "restart" else "wave" for w in log]
    path.write_text(f'''"""Shrunk by the differential fuzzer (tests/fuzz). Findings when written:
{chr(10).join("  " + f for f in findings)}
"""
from tests.fuzz.replay import replay
from tests.fuzz.harness import Config

CONFIG = {config!r}
ORDER = {order!r}
WAVES = {body!r}


def test_replay(tiny_kind_paths, embedded_model_path, tmp_path):
    assert replay(CONFIG, ORDER, WAVES, tiny_kind_paths, embedded_model_path, tmp_path) == []
''')


def model_path(kind: str, tiny_kind_paths: Any, embedded: Path) -> Path:
    return Path(embedded) if kind == "embedded" else tiny_kind_paths(kind)


def run_machine(config: Config, path: Path, tmp: Path, seed: int, examples: int, steps: int,
                reproducer: Path | None = None, totals: Any = None, shrink: bool = True) -> None:
    """Run the machine for ``examples`` examples of up to ``steps`` rules from ``seed`` (the
    example database off: a run is its seed); raises on a finding, after shrinking it."""
    machine = type(f"Fuzz_{config.name().replace('-', '_').replace('@', '_')}", (Fuzz,),
                   {"config": config, "model_path": Path(path), "tmp": Path(tmp), "reproducer": reproducer,
                    "totals": totals})
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    run_state_machine_as_test(hseed(seed)(machine), settings=settings(
        max_examples=examples, stateful_step_count=steps, database=None, deadline=None, phases=phases,
        suppress_health_check=list(HealthCheck), print_blob=False, report_multiple_bugs=False))
