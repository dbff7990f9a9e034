"""One chat request end to end, on the inference thread, in phases.

    start:    heal -> canonicalise -> render once -> key + boundaries from it -> tokenise
              (engine/assembly.py) -> lookup -> checkout KV at physical depth P   (ChatEngine.start)
    prefill:  model_tokens[P:] (+ checkpoints for caches that cannot be cut back later): runner/prefill.py,
              a chunk a step as the engine core's plan says
    decode:   sample until a stop; stream text
    finish:   close the turn in the KV -> store entries, session records, healing  (finish)

The canonical pipeline only *finds* cache entries; the original pipeline is what the model
sees, and reuse is accepted only up to where the entry's model tokens equal the request's and
only at a depth every cache layer can serve (cache/layer_kinds.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable

from ..cache.kv_ops import LiveCache
from ..cache.lifetimes import applied_lifetime, written_segments
from ..cache.manager import MISS, Lookup, MatchResult
from ..config import faults
from ..parsing.call_gate import CallGate
from ..parsing.harmony import HarmonyStopper
from ..parsing.reasoning import prompt_opens_thinking
from ..prompt.render import encode
from ..prompt.tokenize import encoder_for
from ..runner.generate import last_logits, prefill
from ..runner.rows import RunnerContext
from ..runner.sampling import Sampler
from ..runner.stopping import StopMatcher, stop_token_ids

from .assembly import PromptAssembly
from .diagnosis import start_report
from .finish import TurnFinish
from ..runner.spec.speculation import Speculation
from .request import (  # noqa: F401 - re-exported: the request types live in engine/request.py
    ChatJob,
    ChatOutcome,
    ClientGone,
    ContextLengthExceeded,
    PreparedPrompt,
    PromptReady,
    Request,
)

log = logging.getLogger("mlxstack.request")

GRAMMAR_DEAD_END = "grammar_dead_end"   # finish reason: the grammar could not continue the reply
REASONING_CLOSE = "</think>"            # closes the reasoning block a generation prompt opened


class ChatEngine(PromptAssembly, TurnFinish):
    def __init__(self, loaded: Any, renderer: Any, state: Any, settings: Any, draft: Any = None) -> None:
        self.loaded = loaded
        self.renderer = renderer
        self.state = state          # engine/state.py: caches, counters, stores, cache layout
        self.settings = settings
        self.harmony = loaded.family == "harmony"
        self.stop_ids = stop_token_ids(loaded.tokenizer, renderer.template_source, loaded.family)
        self.context_limit = int(loaded.context_length)
        encoder_for(loaded.tokenizer).max_bytes = settings.tokenizer_cache_max_bytes
        vocab = loaded.tokenizer.get_vocab() if hasattr(loaded.tokenizer, "get_vocab") else {}
        self.call_id = vocab.get("<|call|>") if self.harmony else None
        self._width: int | None = None
        # ids the tokenizer can decode: a padded logits width (Gemma 3: 262,208 vs 262,145 tokens)
        # is never sampled past it -- mlx-lm's detokenizers index their token map unchecked
        self.token_count = tokenizer_size(loaded.tokenizer)
        self.speculation = Speculation(settings, vlm=bool(getattr(loaded, "is_vlm", False)), draft=draft)
        state.kv.cache_model = loaded.model   # a miss checks out this model's empty caches
        self.alone: Any = None            # engine/core.py EngineCore of one slot: ``run`` (factory.py)
        self.runner = self.runner_context()

    @property
    def clock(self) -> Callable[[], float]:
        """What watchdog deadlines are read against (the runner's, runner/rows.py ``halted``):
        several ranks read rank 0's time as of the step (engine/lockstep.py sets it)."""
        return self.runner.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.runner.clock = clock

    def runner_context(self) -> RunnerContext:
        """What the runner knows of this model (plain data: runner/rows.py)."""
        st = self.state
        return RunnerContext(model=self.loaded.model, decode_model=self.loaded.model, layout=st.layout,
                             kv_quant=st.kv_quant, speculation=self.speculation, counters=st.counters,
                             shared_prefix_min_tokens=int(getattr(self.settings, "shared_prefix_min_tokens", 0) or 0),
                             prefill_step=max(1, int(self.settings.prefill_step_size)),
                             is_vlm=bool(getattr(self.loaded, "is_vlm", False)),
                             rank_group=self.loaded.extra.get("group"), replicated=st.replicated)

    def lookup_of(self, prep: PreparedPrompt, session_id: str, stable_tokens: int, scope: str = "") -> Lookup:
        """What this request looks up (cache/manager.py ``Lookup``: data; the match rules are the
        KV manager's). CACHE_SESSION_PARTITIONING: the session's own entry wins among equally deep ones."""
        images, markers = self.image_spans(prep)
        return Lookup(prep.key_np, prep.model_np, scope=scope, session_id=session_id,
                      prefer_session=bool(self.settings.cache_session_partitioning), stable_tokens=stable_tokens,
                      images=images, markers=markers)

    # ---------------------------------------------------------------- backend seams (VLM overrides)
    @property
    def decode_model(self) -> Any:
        """The module decode steps call (a VLM decodes through its language model)."""
        return self.loaded.model

    def new_cache(self) -> LiveCache:
        return self.state.kv.new()

    def key_prefix(self, prep: PreparedPrompt, depth: int) -> list[int]:
        """The cache key of ``model_tokens[:depth]`` (a VLM key carries image markers too)."""
        return prep.key_tokens[:depth]

    def image_spans(self, prep: PreparedPrompt) -> tuple[tuple, tuple | None]:
        """([start, end) of each image's pads, each image's marker or None) for the lookup (VLM)."""
        return (), None

    def prefill(self, live: LiveCache, prep: PreparedPrompt, start: int,
                checkpoint: Callable[[LiveCache], None], at: list[int],
                should_stop: Callable[[], bool] | None = None) -> Any:
        """Feed model_tokens[start:] into ``live``; return the last position's logits."""
        return prefill(self.loaded.model, live, prep.model_tokens[start:], self.settings.prefill_step_size,
                       checkpoint=checkpoint, at=at, should_stop=should_stop)

    # ---------------------------------------------------------------- phases
    def by_reference_depth(self) -> int:
        """From how many reused tokens a hit is checked out by reference (copy-free: the first
        append writes a short tail, not a copy of the whole reuse): SHARED_PREFIX_MIN_TOKENS where
        this model attends a prefix held elsewhere (runner/shared_prefix.py); 0 = a plain copy."""
        want = getattr(self.settings, "shared_prefix_min_tokens", 0)
        if want <= 0 or self.state.kv_quant is not None:
            return 0
        from ..runner.shared_prefix import shared_prefix_ok

        return want if shared_prefix_ok(self.runner) else 0

    def start(self, job: ChatJob) -> Request:
        """Render, tokenise, check the window, look the prompt up and check its KV out."""
        if job.is_cancelled():
            raise ClientGone("client left before the request started")
        faults.hit("admission", job.request_id)
        t0 = time.perf_counter()
        started = self.clock()        # the watchdog counts from here (render and lookup included)
        s = self.settings
        st = self.state
        prep = self.prepare(job)
        thinking_started = prompt_opens_thinking(prep.generation_text)
        forced = self._reply_prefix(job, thinking_started)
        if forced:
            prep = prep.extended(forced, encode(self.loaded.tokenizer, forced))
        n_prompt = len(prep.model_tokens)
        if n_prompt + 1 > self.context_limit:
            st.counters.bump("context_length_exceeded")
            raise ContextLengthExceeded(n_prompt, self.context_limit)
        # Never generate past the window: the rest of the budget ends with finish_reason=length.
        params = replace(job.params, stop_token_ids=job.params.stop_token_ids | self.stop_ids,
                         max_tokens=min(job.params.max_tokens, self.context_limit - n_prompt),
                         logit_bias=self._logit_bias(job))
        session = self.session_of(prep, job)
        t_prep = time.perf_counter()

        match, stable_msgs, from_disk, stored = self._find(prep, session.session_id, job)
        st.counters.bump("renders", prep.renders)
        live = st.kv.checkout(match, stored, self.by_reference_depth() if match.hit else 0)
        st.counters.bump(f"hits_{match.match_type}" if match.hit else "misses")
        if match.hit:   # whose entry served it (CACHE_SESSION_PARTITIONING prefers the session's own)
            st.counters.bump("own_session_hits" if match.entry.session_id == session.session_id else "other_session_hits")
            if match.preferred:
                st.counters.bump("own_session_preferred")
        if from_disk:
            st.counters.bump("hits_disk")
        fingerprint, report = start_report(st, job, prep, session.session_id, match, from_disk)
        # the opening events (and a stream's headers) go out once the lookup says what it reused
        job.on_prompt(PromptReady(thinking_started, report))

        # Caches that may not be able to cut back later (sliding windows, chunks, recurrent state)
        # are checkpointed where a later turn will extend exactly: the end of the history
        # (before the generation prompt) and prompt[:-1]. Checkpoints the final entry can serve
        # itself are dropped again in finish().
        # A client's cache breakpoints (cache_control, prompt_cache_breakpoint) are checkpoints too:
        # the next request that branches there is served at exactly that depth.
        history_end = prep.history_end
        marks = [k for k, _ttl in prep.breakpoints]
        checkpoints: list[int] = []
        if st.kv.enabled and s.snapshot_max_entries > 0 and not st.layout.always_trimmable:
            checkpoints = sorted({k for k in (history_end, n_prompt - 1, *marks) if match.depth < k < n_prompt})
        lifetimes = {k: self.lifetime(ttl) for k, ttl in prep.breakpoints}
        report.breakpoints = tuple(sorted(lifetimes.items()))
        if report.written:   # what this request will write, by the lifetime applied (cache/lifetimes.py)
            report.segments = tuple(written_segments(match.depth, n_prompt, lifetimes.items(), self.lifetime(job.cache_ttl)))
        deadline = started + s.generation_watchdog_seconds if s.generation_watchdog_seconds > 0 else None
        return Request(job=job, prep=prep, session=session, match=match, stable_msgs=stable_msgs, live=live,
                        start=match.depth, thinking_started=thinking_started, checkpoints=checkpoints,
                        history_end=history_end, params=params, t0=t0, t_prep=t_prep, deadline=deadline,
                        forced=forced, from_disk=from_disk, fingerprint=fingerprint, cache_report=report,
                        lifetimes=lifetimes)

    def lifetime(self, asked: float | None) -> float:
        """The idle lifetime a stored entry gets for a client's ``asked`` ttl (cache/lifetimes.py:
        never below PROMPT_CACHE_TTL_SECONDS, never above CACHE_TTL_MAX_SECONDS)."""
        s = self.settings
        return applied_lifetime(asked, s.prompt_cache_ttl_seconds, s.cache_ttl_max_seconds)

    def _find(self, prep: PreparedPrompt, session_id: str, job: ChatJob) -> tuple[MatchResult, int, bool, Any]:
        """Lookup over both tiers (cache/manager.py ``find``) -> (match, stable messages, from
        disk, the state to check out)."""
        if not self.state.kv.enabled:
            return MISS, 0, False, None
        stable_msgs, stable_tokens = self.stable_prefix(prep, session_id, job)
        found = self.state.kv.find(self.lookup_of(prep, session_id, stable_tokens, job.scope))
        return found.match, (0 if found.gave_up else stable_msgs), found.from_disk, found.stored

    # ---------------------------------------------------------------- tool_choice / JSON mode
    def _reply_prefix(self, job: ChatJob, thinking_started: bool) -> str:
        """Text the reply must start with, written for the model after the generation prompt --
        only for a request WITHOUT a grammar (no compiler for this tokenizer: best effort): the
        opening of a tool call (tool_choice "required" or a named function) or of a JSON object
        (response_format json_object / json_schema). With a grammar (``params.grammar``) nothing is
        written: the mask forces the opening token by token, so the prompt -- and everything the
        cache keys and reuses -- is exactly the prompt of the same request without constraints."""
        if job.params.grammar is not None:
            return ""
        choice, fmt = job.tool_choice, job.response_format or {}
        named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        close_think = "</think>\n\n" if thinking_started else ""
        if job.tools and (choice == "required" or named):
            if self.harmony:
                return "<|channel|>commentary to=functions." + (f"{named} <|constrain|>json<|message|>" if named else "")
            if "<function=" in self.renderer.template_source:   # Qwen3-Coder XML calls
                return close_think + "<tool_call>\n<function=" + (f"{named}>\n" if named else "")
            return close_think + '<tool_call>\n{"name": "' + (f'{named}", "arguments": ' if named else "")
        if fmt.get("type") in ("json_object", "json_schema") and not self.harmony:
            return close_think + "{"
        if fmt.get("type") in ("json_object", "json_schema") and self.harmony:
            return "<|channel|>final<|message|>{"
        return ""

    def _logit_bias(self, job: ChatJob) -> dict[int, float] | None:
        """The request's logit_bias; without a grammar (best effort), plus a ban on the tool-call
        token for tool_choice "none" (a grammar bans the opener in every spelling itself)."""
        bias = dict(job.params.logit_bias or {})
        if job.tool_choice == "none" and job.tools and job.params.grammar is None:
            tool_open = self.loaded.tokenizer.get_vocab().get("<tool_call>") if hasattr(
                self.loaded.tokenizer, "get_vocab") else None
            if tool_open is not None:
                bias[int(tool_open)] = -1e9
        outside = [t for t in bias if not 0 <= t < (self.token_count or t + 1)]
        if outside:   # the HTTP layer answers 400 first (server/common/validation.py); this guards every caller
            raise ValueError(f"logit_bias token id {outside[0]} is outside the tokenizer's vocabulary "
                             f"(0..{self.token_count - 1})")
        return bias or None

    def run(self, job: ChatJob) -> ChatOutcome:
        """The whole request on the calling (inference) thread, through this engine's own engine
        core of one slot (engine/factory.py sets ``alone``): the same phases, the same prefill and
        the same decode loop as every request the scheduler serves."""
        if self.alone is None:
            raise RuntimeError("this engine has no core to run on: build it with engine/factory.py make_engine")
        return self.alone.run(job)

    # ---------------------------------------------------------------- incremental phases
    def begin_decode(self, seq: Request, logits: Any) -> bool:
        """Per-sequence decode state (sampler, stop matchers, detokenizer); False when there is
        nothing to generate."""
        seq.stopper = StopMatcher(seq.job.stop)
        # harmony's rule ends a chat reply at its final message; a raw prompt's text has no messages
        seq.harmony_stop = HarmonyStopper() if self.harmony and seq.job.raw_prompt is None else None
        seq.detok = self.loaded.tokenizer.detokenizer
        seq.detok.reset()
        if seq.job.raw_prompt is not None:
            keep_leading_space(seq.detok)
        width = self.sampled_width(logits)
        seq.sampler = Sampler(seq.params, seq.prep.model_tokens, width, constraint=self.new_constraint(seq, width))
        seq.spec = self.speculation.row(seq)
        seq.calls = self.call_gate(seq)
        if seq.forced:
            self._show(seq, seq.forced)
        return seq.params.max_tokens > 0

    def call_gate(self, seq: Request) -> CallGate | None:
        """The gate a reply that may call tools passes (parsing/call_gate.py: a call is shown once
        it closes, a repeated call ends the reply, a cut call is never text: LESSONS 70); None when the reply
        cannot call (no tools, tool_choice none) or the format ends a turn at its call (harmony).
        ``single``: one call allowed and no grammar enforcing it (a grammar ends the reply itself)."""
        job = seq.job
        if not job.tools or job.tool_choice == "none" or self.harmony:
            return None
        named = isinstance(job.tool_choice, dict)
        single = (named or not job.parallel_tool_calls) and seq.params.grammar is None
        return CallGate(tools=job.tools, family=self.loaded.family, thinking_started=seq.thinking_started,
                        single=single)

    def _show(self, seq: Request, text: str, gated: bool = True) -> bool:
        """Stream reply text through the call gate (``gated=False``: what the gate let out at the
        end); True when the gate ends the reply there -- a finished reply whose visible text stops
        before the rest, as at a stop string."""
        end = False
        if seq.calls is not None and gated:
            text, end = seq.calls.push(text)
        if text:
            seq.visible.append(text)
            seq.job.emit(text)
        if end:
            seq.finish_reason, seq.stopped_by_string = "stop", True
            self.state.counters.bump("tool_call_gate_stops")
        return end

    def new_constraint(self, seq: Request, width: int) -> Any:
        """The request's grammar as a fresh per-row constraint (None without one). A prompt that
        left a reasoning block open keeps the reasoning free: the grammar starts once it closes."""
        grammar = seq.params.grammar
        if grammar is None:
            return None
        return grammar.new_row(seq.params.stop_token_ids, width, REASONING_CLOSE if seq.thinking_started else None)

    def _dead_end(self, seq: Request, row: Any) -> None:
        """The grammar could not continue the reply: only stop tokens were left, and one ended it.
        Never an exception (the rest of the batch goes on); the reply says so in its finish reason."""
        seq.finish_reason = GRAMMAR_DEAD_END
        self.state.counters.bump("grammar_dead_ends")
        log.error("%s the reply's grammar (%s) reached a dead end after %d tokens: %s", seq.job.request_id,
                  row.grammar.spec.kind, len(seq.generated), row.error)

    def consume(self, seq: Request, tok: int) -> bool:
        """One generated token read back: stream its text, apply every stop rule. True when the
        sequence is done (a stop token or string, harmony's stop rule, or max_tokens)."""
        seq.generated.append(tok)
        seq.produced += 1
        if tok in seq.params.stop_token_ids:
            seq.finish_reason = "stop"
            row = seq.sampler.constraint if seq.sampler is not None else None
            if row is not None and row.dead_end:
                self._dead_end(seq, row)
            return True
        faults.hit("detokenizer", seq.job.request_id)
        seq.detok.add_token(tok)
        segment = seq.detok.last_segment
        out, hit = seq.stopper.push(segment)
        if out and self._show(seq, out):
            return True
        if hit:
            if seq.calls is not None:     # a client's stop string: what the gate held is shown
                self._show(seq, seq.calls.flush(cut=False), gated=False)
            seq.finish_reason, seq.stopped_by_string = "stop", True
            return True
        if seq.harmony_stop is not None and seq.harmony_stop.push(segment):
            seq.finish_reason = "stop"  # a final message ended, or a non-assistant turn began
            return True
        return seq.produced >= seq.params.max_tokens

    def end_decode(self, seq: Request) -> None:
        """Flush the text a stop matcher held back (unless a stop string or an abort ended it)."""
        if not seq.stopped_by_string and not (seq.watchdog or seq.job.is_cancelled()):
            seq.detok.finalize()
            out, hit = seq.stopper.push(seq.detok.last_segment)
            tail = out if hit else out + seq.stopper.flush()
            if tail and self._show(seq, tail):
                return
            if seq.calls is not None:     # a reply cut inside a call never shows it (call_gate.py)
                self._show(seq, seq.calls.flush(cut=seq.finish_reason == "length"), gated=False)

    def _logit_width(self, logits: Any) -> int:
        if logits is None:
            return self.logit_width()
        return int(logits.shape[-1])

    def sampled_width(self, logits: Any = None) -> int:
        """Logits a sampler considers: the model's width, cut at the tokenizer's size (ids past it
        are padding no tokenizer can decode; the sampler never picks them)."""
        width = self._logit_width(logits)
        return min(width, self.token_count) if self.token_count else width

    def logit_width(self) -> int:
        """Width of the model's logits (once, from a one-token forward on a fresh cache)."""
        if self._width is None:
            live = self.new_cache()
            self._width = int(last_logits(self.loaded.model, live, 0).shape[-1])
        return self._width


SHOWN_FROM = "\x00"     # a detokenizer's text before a raw prompt's reply: never shown


def keep_leading_space(detok: Any) -> None:
    """A raw prompt's reply continues its text, so its first token keeps its leading space
    ("is" + " Berlin"). mlx-lm's streaming detokenizers drop that space while their text is empty
    (right for a reply after a chat template's generation prompt): the text starts with a marker
    the reply's segments never include (``last_segment`` reads from ``offset`` on)."""
    if isinstance(getattr(type(detok), "text", None), property):   # the naive one: text is computed
        detok._text = SHOWN_FROM
    else:
        detok.text = SHOWN_FROM
    detok.offset = len(SHOWN_FROM)


def tokenizer_size(tokenizer: Any) -> int | None:
    """How many ids ``tokenizer`` can decode (``len`` of the tokenizer, added tokens included; what
    mlx-lm's streaming detokenizers build their token maps from); None when it cannot say."""
    for obj in (tokenizer, getattr(tokenizer, "tokenizer", None), getattr(tokenizer, "_tokenizer", None)):
        try:
            n = len(obj) if obj is not None else 0
        except TypeError:
            continue
        if n > 0:
            return n
    return None

