"""One chat request end to end, on the inference thread.

    heal -> canonicalise -> render x2 -> scrub (key only) -> tokenise x2 -> lookup
    -> checkout KV at physical offset P -> prefill model_tokens[P:] -> decode -> store

The canonical pipeline only *finds* cache entries; the original pipeline is what the model
sees, and reuse is accepted only up to where the entry's model tokens equal the request's.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from mlx_lm.models.cache import trim_prompt_cache

from ..cache.kv_ops import capture, checkout, is_trimmable, kv_offset
from ..cache.lcp import as_tokens, lcp
from ..cache.prompt_cache import MISS, POOL_KV, POOL_SNAPSHOT, MatchResult
from ..pipeline.canonicalize import canonicalize_messages
from ..pipeline.healing import history_digest
from ..pipeline.render import encode
from ..pipeline.scrub import scrub_cache_key
from ..parsing.reasoning import prompt_opens_thinking, split_output
from ..pipeline.session_context import extract_session_context
from ..runtime.generate import Aborted, SamplingParams, decode, feed, prefill
from ..runtime.stopping import StopMatcher, stop_token_ids

log = logging.getLogger("mlxstack.request")


class ClientGone(RuntimeError):
    """The client disconnected before or during generation."""


@dataclass
class ChatJob:
    """What the HTTP layer hands to the engine (already validated)."""
    request_id: str
    messages: list[dict]
    tools: list | None
    enable_thinking: bool
    params: SamplingParams
    stop: list[str]
    body: dict
    headers: dict[str, str]
    emit: Callable[[str], None]                  # text deltas, in order
    is_cancelled: Callable[[], bool] = lambda: False
    on_prompt: Callable[["PromptReady"], None] = lambda _p: None


@dataclass(frozen=True)
class PromptReady:
    """Sent once the prompt is rendered: does the output start inside a <think> block?"""
    thinking_started: bool


@dataclass
class ChatOutcome:
    text: str                 # visible generated text (stop strings removed)
    raw_text: str             # everything generated (for the healing store)
    finish_reason: str        # stop | length | cancelled
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    match_type: str
    thinking_started: bool
    session_id: str
    timings: dict = field(default_factory=dict)
    aborted: bool = False


@dataclass
class PreparedPrompt:
    original: list[dict]
    canonical: list[dict]
    model_text: str
    model_tokens: list[int]
    key_tokens: list[int]
    key_delta_chars: int
    extras: dict = field(default_factory=dict)   # backend-specific (e.g. VLM images, image spans)
    model_np: Any = None                         # the same tokens as int64 arrays (LCP, hashing)
    key_np: Any = None

    def __post_init__(self) -> None:
        self.model_np = as_tokens(self.model_tokens)
        self.key_np = self.model_np if self.key_tokens is self.model_tokens else as_tokens(self.key_tokens)


class ChatEngine:
    def __init__(self, loaded: Any, renderer: Any, state: Any, settings: Any) -> None:
        self.loaded = loaded
        self.renderer = renderer
        self.state = state          # engine/state.py: caches, counters, stores
        self.settings = settings
        self.stop_ids = stop_token_ids(loaded.tokenizer, renderer.template_source)

    # ---------------------------------------------------------------- pipeline
    def prepare(self, job: ChatJob) -> PreparedPrompt:
        s = self.settings
        messages = self.state.heal(job.messages)
        original, canonical = canonicalize_messages(
            messages, enabled=s.cache_canonicalize_tool_context, strip_billing_header=s.strip_billing_header)
        model_text = self.renderer.render(original, job.tools, job.enable_thinking)
        canon_text = scrub_cache_key(self.renderer.render(canonical, job.tools, job.enable_thinking))
        tok = self.loaded.tokenizer
        model_tokens = encode(tok, model_text)
        key_tokens = model_tokens if canon_text == model_text else encode(tok, canon_text)
        if s.cache_norm_safety_check and len(key_tokens) < 0.9 * len(model_tokens):
            log.warning("%s cache key %d tokens vs prompt %d (>10%% shorter): using original tokens as key",
                        job.request_id, len(key_tokens), len(model_tokens))
            self.state.counters.bump("cache_key_safety_fallback")
            key_tokens = model_tokens
        return PreparedPrompt(original, canonical, model_text, model_tokens, key_tokens,
                              len(model_text) - len(canon_text))

    def _rendered_tokens(self, messages: list[dict], prep: PreparedPrompt, job: ChatJob) -> list[int]:
        """Model tokens of ``messages`` rendered without the generation prompt (a VLM expands
        its image pads here)."""
        text = self.renderer.render(messages, job.tools, job.enable_thinking, add_generation_prompt=False)
        return encode(self.loaded.tokenizer, text)

    def _rendered_key_tokens(self, messages: list[dict], prep: PreparedPrompt, job: ChatJob) -> list[int]:
        """The same in cache-key form: scrubbed (a VLM adds image identity markers)."""
        text = self.renderer.render(messages, job.tools, job.enable_thinking, add_generation_prompt=False)
        return encode(self.loaded.tokenizer, scrub_cache_key(text))

    def _stable_prefix_tokens(self, prep: PreparedPrompt, session_id: str, job: ChatJob) -> tuple[int, int]:
        """(stable message count, exact token boundary of those messages in the model tokens)."""
        n = self.state.turns.stable_prefix(session_id, prep.canonical)
        if n <= 0:
            return 0, 0
        return n, lcp(self._rendered_tokens(prep.original[:n], prep, job), prep.model_np)

    def _session_key_tokens(self, prep: PreparedPrompt, job: ChatJob) -> list[int]:
        """Tokens a session without an explicit id is recognised by: the canonical key up to the
        end of the first user message (at most 128 tokens are hashed), so the id stays the same
        as the conversation grows even when that opening is shorter than 128 tokens."""
        first_user = next((i for i, m in enumerate(prep.canonical) if m.get("role") == "user"), 0)
        opening = self._rendered_key_tokens(prep.canonical[: first_user + 1], prep, job)
        return prep.key_tokens[: lcp(opening, prep.key_np)]

    def _history_boundary(self, prep: PreparedPrompt, job: ChatJob) -> int:
        """Token index where the rendered history ends (generation prompt excluded)."""
        return lcp(self._rendered_tokens(prep.original, prep, job), prep.model_np)

    def lookup(self, prep: PreparedPrompt, session_id: str, job: ChatJob) -> tuple[MatchResult, int]:
        cache = self.state.prompt_cache
        hashes = cache.hashes(prep.key_np)
        match = cache.lookup(prep.key_np, prep.model_np, key_hashes=hashes)
        stable_msgs, stable_tokens = self._stable_prefix_tokens(prep, session_id, job)
        if match.depth < min(stable_tokens, len(prep.model_tokens) - 1) or (not match.hit and len(cache)):
            second = cache.lookup(prep.key_np, prep.model_np, broad=True, key_hashes=hashes,
                                  extra_candidates=self.state.sessions.candidates(session_id))
            if second.depth > match.depth:
                match = second._replace(match_type="session" if second.entry.pool == POOL_KV else "snapshot")
        if match.hit and match.entry.pool == POOL_SNAPSHOT:
            match = match._replace(match_type="snapshot")
        return match, stable_msgs

    # ---------------------------------------------------------------- backend seams (VLM overrides)
    @property
    def decode_model(self) -> Any:
        """The module decode steps call (a VLM decodes through its language model)."""
        return self.loaded.model

    def new_cache(self) -> list[Any]:
        return self.state.new_cache(self.loaded.model)

    def key_prefix(self, prep: PreparedPrompt, depth: int) -> list[int]:
        """The cache key of ``model_tokens[:depth]`` (a VLM key carries image markers too)."""
        return prep.key_tokens[:depth]

    def validate_match(self, prep: PreparedPrompt, match: MatchResult) -> MatchResult:
        """Last check on a hit before checkout (VLM: never cut inside an image)."""
        return match

    def prefill(self, work: list[Any], prep: PreparedPrompt, start: int,
                checkpoint: Callable[[list[Any]], None], at: list[int],
                should_stop: Callable[[], bool] | None = None) -> Any:
        """Feed model_tokens[start:] into ``work``; return the last position's logits."""
        return prefill(self.loaded.model, work, prep.model_tokens[start:], self.settings.prefill_step_size,
                       checkpoint=checkpoint, at=at, should_stop=should_stop)

    # ---------------------------------------------------------------- request
    def run(self, job: ChatJob) -> ChatOutcome:
        if job.is_cancelled():
            raise ClientGone("client left before the request started")
        t0 = time.perf_counter()
        s = self.settings
        st = self.state
        deadline = t0 + s.generation_watchdog_seconds if s.generation_watchdog_seconds > 0 else None
        prep = self.prepare(job)
        session = extract_session_context(job.body, job.headers, self._session_key_tokens(prep, job))
        thinking_started = prompt_opens_thinking(prep.model_text)
        job.on_prompt(PromptReady(thinking_started))
        t_prep = time.perf_counter()

        match, stable_msgs = self.lookup(prep, session.session_id, job) if st.prompt_cache.enabled else (MISS, 0)
        match = self.validate_match(prep, match)
        if match.hit:
            work = checkout(match.entry.payload, match.depth)
        else:
            work = self.new_cache()
        start = kv_offset(work)
        assert start == match.depth, f"checkout offset {start} != match depth {match.depth}"
        st.counters.bump(f"hits_{match.match_type}" if match.hit else "misses")

        # Hybrid/recurrent caches cannot be trimmed: checkpoint them where a later turn will
        # extend exactly -- the end of the history (before the generation prompt) and prompt[:-1].
        pre_gen_snapshot: list[Any] = []
        checkpoints: list[int] = []
        if not is_trimmable(work) and st.prompt_cache.enabled and s.snapshot_max_entries > 0:
            history_end = self._history_boundary(prep, job)
            checkpoints = [k - start for k in (history_end, len(prep.model_tokens) - 1) if k > start]

        stopper = StopMatcher(job.stop)
        detok = self.loaded.tokenizer.detokenizer
        detok.reset()
        generated: list[int] = []
        visible: list[str] = []
        finish = "length"
        aborted = False
        watchdog = False

        def should_stop() -> bool:
            nonlocal watchdog
            if deadline is not None and time.perf_counter() > deadline:
                watchdog = True
                return True
            return job.is_cancelled()

        remaining = prep.model_tokens[start:]
        try:
            logits = self.prefill(work, prep, start, lambda cache: pre_gen_snapshot.append(capture(cache)),
                                  checkpoints, should_stop)
        except Aborted:
            logits = None
        t_first = time.perf_counter()

        stop_ids = job.params.stop_token_ids | self.stop_ids
        params = replace(job.params, stop_token_ids=stop_ids)
        stopped_by_string = False
        tokens = decode(self.decode_model, work, logits, prep.model_tokens, params, should_stop) if logits is not None else ()
        for tok in tokens:
            generated.append(tok)
            if tok in stop_ids:
                finish = "stop"
                break
            detok.add_token(tok)
            out, hit = stopper.push(detok.last_segment)
            if out:
                visible.append(out)
                job.emit(out)
            if hit:
                finish, stopped_by_string = "stop", True
                break
        if watchdog:
            aborted, finish = True, "length"
            st.counters.bump("watchdog_aborts")
        elif job.is_cancelled():
            aborted, finish = True, "cancelled"
            st.counters.bump("disconnects")
        if not stopped_by_string and not aborted:
            detok.finalize()
            out, hit = stopper.push(detok.last_segment)
            tail = out if hit else out + stopper.flush()
            if tail:
                visible.append(tail)
                job.emit(tail)
        t_end = time.perf_counter()

        raw_ids = [t for t in generated if t not in stop_ids]
        raw_text = self.loaded.tokenizer.decode(raw_ids)
        if not aborted and st.prompt_cache.enabled:
            continuation = self._close_turn(work, prep, generated, raw_ids, job)
            self._store(prep, session.session_id, match, work, continuation, pre_gen_snapshot)
        if not aborted:
            st.turns.update(session.session_id, prep.canonical)
            self._remember_reply(job, prep, raw_text, "".join(visible), thinking_started)

        prefill_s = t_first - t_prep
        decode_s = t_end - t_first
        outcome = ChatOutcome(
            text="".join(visible), raw_text=raw_text, finish_reason=finish,
            prompt_tokens=len(prep.model_tokens), cached_tokens=match.depth,
            completion_tokens=len(generated), match_type=match.match_type if match.hit else "miss",
            thinking_started=thinking_started,
            session_id=session.session_id, aborted=aborted,
            timings={
                "prepare_ms": round((t_prep - t0) * 1000, 2),
                "ttft_s": round(t_first - t0, 4),
                "prefill_s": round(prefill_s, 4),
                "prefill_tok_s": round(len(remaining) / prefill_s, 1) if prefill_s > 0 else 0.0,
                "decode_tok_s": round(len(generated) / decode_s, 1) if decode_s > 0 and generated else 0.0,
                "total_s": round(t_end - t0, 4),
                "prefilled_tokens": len(remaining),
                "stable_prefix_msgs": stable_msgs,
                "key_delta_chars": prep.key_delta_chars,
            },
        )
        st.record(job, outcome, prep)
        return outcome

    def _remember_reply(self, job: ChatJob, prep: PreparedPrompt, raw_text: str, visible: str,
                        thinking_started: bool) -> None:
        """Healing store: the reply as the client will see it -> the text as generated."""
        healing = self.state.healing
        if healing is None:
            return
        parsed = split_output(visible, thinking_started=thinking_started, tools=job.tools, family=self.loaded.family)
        extra = self.renderer.generation_extra(job.enable_thinking, bool(job.tools))
        healing.remember(history_digest(prep.canonical), parsed.content, parsed.tool_calls, extra + raw_text)

    def _close_turn(self, work: list[Any], prep: PreparedPrompt, generated: list[int], content_ids: list[int],
                    job: ChatJob) -> list[int]:
        """Feed what the next turn is certain to contain after this reply: the last sampled
        token (decode never feeds it) and the template's turn closer (``<|im_end|>\n``).

        Returns the tokens the KV now holds after the prompt. Correctness never depends on this
        guess -- reuse is still accepted only up to the token LCP -- but it is what lets a
        hybrid (exact-depth) cache continue straight into the next turn.
        """
        fed = kv_offset(work) - len(prep.model_tokens)
        closer = self.renderer.assistant_closer(job.enable_thinking)
        target = content_ids + (encode(self.loaded.tokenizer, closer) if closer else [])
        in_kv = generated[:fed]
        if fed < 0 or fed > len(generated):
            raise RuntimeError(f"bug: KV holds {fed} generated tokens but only {len(generated)} were sampled")
        if in_kv != target[:fed]:
            # A stop token the re-rendered history will not contain (e.g. <|endoftext|> where the
            # template closes turns with <|im_end|>): drop it if the cache can be trimmed.
            keep = lcp(in_kv, target[:fed])
            if not is_trimmable(work):
                return in_kv
            trim_prompt_cache(work, fed - keep)
            fed = keep
        feed(self.decode_model, work, target[fed:], self.settings.prefill_step_size)
        return target

    def _store(self, prep: PreparedPrompt, session_id: str, match: MatchResult, work: list[Any],
               continuation: list[int], pre_gen_snapshot: list[Any]) -> None:
        st = self.state
        parent = match.entry.session_id if match.hit else None
        all_model = prep.model_tokens + continuation
        state = capture(work)
        depth = state.offset
        extra = max(0, depth - len(prep.model_tokens))
        key = prep.key_tokens + continuation[:extra]
        pool = POOL_KV if state.trimmable else POOL_SNAPSHOT
        entry = st.prompt_cache.insert(key, all_model[:depth], state, nbytes=state.nbytes,
                                       trimmable=state.trimmable, pool=pool, session_id=session_id)
        if entry is not None:
            st.sessions.record(session_id, entry.entry_id, entry.depth, parent=parent)
        for snap in pre_gen_snapshot:
            snap_entry = st.prompt_cache.insert(self.key_prefix(prep, snap.offset), prep.model_tokens[:snap.offset], snap,
                                                nbytes=snap.nbytes, trimmable=False, pool=POOL_SNAPSHOT,
                                                session_id=session_id)
            if snap_entry is not None:
                st.sessions.record(session_id, snap_entry.entry_id, snap_entry.depth, parent=parent)
