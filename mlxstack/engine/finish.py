"""The finish phase of a chat request: close the turn in the KV, store what it holds, record it.

    outcome = engine.finish(seq)     # ChatEngine inherits TurnFinish (engine/chat.py)

- ``finish``: the outcome (text, usage, timings) and the request row; a JSON-mode check.
- ``plan_close`` / ``_close_turn``: feed what the next turn is certain to contain after this reply
  (the last sampled token and the template's turn closer), so an exact-depth cache continues
  straight into the next turn; the scheduler closes several sequences in one forward.
- ``_store``: the turn's KV entry and its snapshots with their session records, all or nothing;
  ``_salvage``: an aborted request keeps the KV it computed.
- ``_remember_reply``: the healing store (the reply as the client sees it -> as generated).
Never raises because of a cache kind: a failed store is logged and counted, the reply goes out.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from ..cache.lcp import lcp
from ..cache.manager import POOL_KV, POOL_SNAPSHOT
from ..parsing.harmony import healing_patch
from ..prompt.canonicalize import canonicalize_messages
from ..prompt.healing import apply_patch
from ..prompt.render import TemplateError, encode
from ..prompt.session_context import has_reply, scoped
from ..runner.generate import feed
from .diagnosis import keep_fingerprint
from .request import ChatOutcome, Request

log = logging.getLogger("mlxstack.request")


class TurnFinish:
    """ChatEngine's last phase (needs ``state``, ``settings``, ``loaded``, ``renderer``, ``harmony``,
    ``call_id``, ``context_limit``, ``decode_model``, ``key_prefix``)."""

    state: Any
    settings: Any
    loaded: Any
    renderer: Any
    harmony: bool
    call_id: int | None
    context_limit: int

    def finish(self, seq: Request, store: bool = True) -> ChatOutcome:
        """Close the turn, store what the KV holds, record the request. Never raises because
        of a cache kind: a failed store is logged and counted, the reply still goes out.
        ``store=False`` (a completed reply only): the reply without closing and storing the
        turn, which ``store_turn`` does later (the scheduler sends a reply before its rows'
        closing forward; engine/core.py)."""
        st = self.state
        prep, job = seq.prep, seq.job
        aborted = False
        if seq.spec is not None:
            seq.spec.drafter.close()          # a draft model's cache goes back to its store
        if seq.watchdog:
            aborted, seq.finish_reason = True, "length"
            st.counters.bump("watchdog_aborts")
        elif job.is_cancelled():
            aborted, seq.finish_reason = True, "cancelled"
            st.counters.bump("disconnects")
        raw_ids = self.content_ids(seq)
        raw_text = seq.forced + self.loaded.tokenizer.decode(raw_ids)
        visible = "".join(seq.visible)
        if not aborted and seq.finish_reason == "stop" \
                and (job.response_format or {}).get("type") in ("json_object", "json_schema"):
            self._check_json(seq, visible)
        if store or aborted or job.prefill_only:     # an abort (a hang-up just now) salvages at once
            self._store_turn(seq, aborted, raw_ids)
        if not aborted and not job.prefill_only and job.raw_prompt is None:   # a raw prompt has no messages to record
            st.turns.update(self.record_session(seq), prep.record_canonical, history=prep.history_end)
            self._remember_reply(seq, raw_text, visible)

        if not seq.t_first:
            seq.t_first = seq.t_end = time.perf_counter()
        prefill_s = seq.t_first - seq.t_prep
        decode_s = seq.t_end - seq.t_first
        remaining = len(prep.model_tokens) - seq.start
        outcome = ChatOutcome(
            text=visible, raw_text=raw_text, finish_reason=seq.finish_reason,
            prompt_tokens=len(prep.model_tokens), cached_tokens=seq.start,
            completion_tokens=len(seq.generated), match_type=seq.match.match_type if seq.match.hit else "miss",
            thinking_started=seq.thinking_started, session_id=self.record_session(seq), aborted=aborted,
            logprobs=self._logprobs(seq),
            timings={
                "prepare_ms": round((seq.t_prep - seq.t0) * 1000, 2),
                "ttft_s": round(seq.t_first - seq.t0, 4),
                "prefill_s": round(prefill_s, 4),
                "prefill_tok_s": round(remaining / prefill_s, 1) if prefill_s > 0 else 0.0,
                "decode_tok_s": round(len(seq.generated) / decode_s, 1) if decode_s > 0 and seq.generated else 0.0,
                "total_s": round(seq.t_end - seq.t0, 4),
                "prefilled_tokens": remaining,
                "stable_prefix_msgs": seq.stable_msgs,
                "renders": prep.renders,
                "key_delta_chars": prep.key_delta_chars,
                "cache_tier": "disk" if seq.from_disk else ("ram" if seq.match.hit else "none"),
                "queue_wait_s": round(max(0.0, seq.t0 - seq.queued_at), 4) if seq.queued_at else 0.0,
                "batch_size_max": max(seq.batch_sizes, default=1),
                "batch_size_mean": round(sum(seq.batch_sizes) / len(seq.batch_sizes), 2) if seq.batch_sizes else 1.0,
                "spec_proposed": seq.spec.control.proposed if seq.spec is not None else 0,
                "spec_accepted": seq.spec.control.accepted if seq.spec is not None else 0,
                "preemptions": seq.preemptions,
            },
        )
        outcome.cache = self._cache_report(seq, aborted, raw_ids)
        st.record(job, outcome, prep)
        return outcome

    def _cache_report(self, seq: Request, aborted: bool, raw_ids: list[int]) -> Any:
        """The request's cache report with the prompt tokens it hands to the cache (its turn's
        entry holds the prompt: what was not reused is written), and its fingerprint kept over
        what the next turn continues from (the prompt, then the reply the client saw)."""
        report = seq.cache_report
        if report is None:
            return None
        n_prompt = len(seq.prep.model_tokens)
        stores = self.state.kv.enabled and not aborted and n_prompt > seq.start
        report.written = n_prompt - seq.start if stores else 0
        if not stores:
            report.segments = ()
        reply = [] if aborted or seq.job.prefill_only or seq.stopped_by_string else raw_ids
        self.record_session(seq)
        keep_fingerprint(self.state, seq, seq.prep.model_tokens + reply)
        return report

    def store_turn(self, seq: Request) -> None:
        """The rest of ``finish(seq, store=False)``: close the turn and store it (once)."""
        self._store_turn(seq, False, self.content_ids(seq))

    def _store_turn(self, seq: Request, aborted: bool, raw_ids: list[int]) -> None:
        st, job = self.state, seq.job
        if not st.kv.enabled or seq.stored:
            return
        seq.stored = True
        try:
            if aborted:
                self._salvage(seq)
            elif job.prefill_only:
                self._store(seq, [])
            else:
                continuation = seq.closed if seq.closed is not None else self._close_turn(seq, raw_ids)
                self._store(seq, continuation)
        except Exception:  # noqa: BLE001 - the reply is complete; only caching it failed
            log.exception("%s storing the KV failed (cache layout %s); the reply is unaffected",
                          job.request_id, st.layout.describe())
            st.counters.bump("store_failures")

    def _check_json(self, seq: Request, visible: str) -> None:
        """A JSON-mode reply that ended on its own must hold one JSON object (a tool call instead
        is fine when tools were offered). Without a grammar (best effort) a miss is counted
        (``json_mode_invalid``) and logged; with one it cannot happen -- a miss is a bug
        (``grammar_invalid_output``, logged as an error). The reply goes out as generated."""
        import json

        from ..parsing.output import split_reply

        parsed = split_reply(visible, thinking_started=seq.thinking_started, tools=seq.job.tools,
                             family=self.loaded.family, parse_tools=bool(seq.job.tools))
        try:
            ok = isinstance(json.loads(parsed.content), dict)
        except ValueError:
            ok = bool(parsed.tool_calls) and not parsed.content.strip()
        if ok:
            return
        if seq.params.grammar is not None:
            self.state.counters.bump("grammar_invalid_output")
            log.error("%s response_format %s under a grammar: the reply is not a JSON object (a bug): %r",
                      seq.job.request_id, seq.job.response_format.get("type"), visible[:200])
            return
        self.state.counters.bump("json_mode_invalid")
        log.warning("%s response_format %s: the reply is not a JSON object (finish=%s)", seq.job.request_id,
                    seq.job.response_format.get("type"), seq.finish_reason)

    def _logprobs(self, seq: Request) -> list[dict] | None:
        """OpenAI ``logprobs.content`` entries for the tokens the client sees (stop tokens excluded)."""
        if not seq.params.logprobs or seq.sampler is None:
            return None
        tok = self.loaded.tokenizer
        out = []
        for token, lp in zip(seq.generated, seq.sampler.logprobs):
            if token in seq.params.stop_token_ids:
                break
            text = tok.decode([token])
            entry = {"token": text, "logprob": float(lp.logprob.item()), "bytes": list(text.encode("utf-8")),
                     "top_logprobs": []}
            if lp.top_ids is not None:
                for tid, val in zip(lp.top_ids.tolist(), lp.top_logprobs.tolist()):
                    t = tok.decode([tid])
                    entry["top_logprobs"].append({"token": t, "logprob": float(val), "bytes": list(t.encode("utf-8"))})
            out.append(entry)
        return out

    def _remember_reply(self, seq: Request, raw_text: str, visible: str) -> None:
        """Healing store: the reply as the client will see it -> the text as generated. A reply a
        client stop string cut is remembered only up to the cut (the client never saw the rest)."""
        healing = self.state.healing
        if healing is None:
            return
        from ..prompt.healing import history_digest

        parsed, healed = self._healed(seq, raw_text, visible)
        if healed is None:
            return
        healing.remember(history_digest([healing.view(m) for m in seq.prep.history_messages], seq.job.scope),
                         parsed.content,
                         parsed.tool_calls, healed)

    def _healed(self, seq: Request, raw_text: str, visible: str) -> tuple[Any, Any]:
        """(the reply as the client sees it, what healing puts back for it: the generated text, or
        a harmony field patch; None when a harmony generation fits no one message)."""
        from ..parsing.output import split_reply

        job = seq.job
        parsed = split_reply(visible, thinking_started=seq.thinking_started, tools=job.tools, family=self.loaded.family)
        generated = visible if seq.stopped_by_string else raw_text
        if self.harmony:
            # A harmony template wraps content in channel markup: heal the message's fields so
            # it re-renders what the model generated (seed 002: track what is in the KV).
            return parsed, healing_patch(generated)
        return parsed, self.renderer.generation_extra(job.enable_thinking, bool(job.tools)) + generated

    def record_session(self, seq: Request) -> str:
        """The session a turn's records (entries, turn store, fingerprint) are kept under: its own,
        but a conversation's first turn in an implicit session keeps them under the id its reply
        gives the conversation (prompt/session_context.py ``opening_end``): the id its next turn has."""
        if seq.record_session is None:
            seq.record_session = seq.session.session_id
            job = seq.job
            if seq.session.source == "message-prefix" and not has_reply(job.messages) and not job.prefill_only:
                sent = self.client_reply(seq)
                seq.record_session = scoped(self.implicit_session(job.messages + [sent]), job.scope).session_id
        return seq.record_session

    def client_reply(self, seq: Request) -> dict:
        """The reply as the client sends it back: its visible content and tool calls."""
        from ..parsing.output import split_reply

        parsed = split_reply("".join(seq.visible), thinking_started=seq.thinking_started, tools=seq.job.tools,
                             family=self.loaded.family)
        sent: dict = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            sent["tool_calls"] = [{"id": c.id or f"call_{i}", "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}}
                                  for i, c in enumerate(parsed.tool_calls)]
        return sent

    def echoed_message(self, seq: Request, content_ids: list[int]) -> dict:
        """The assistant message the next turn's prompt renders for this reply: as the client
        sends it back (visible content, its tool calls), healed as the healing store will heal it."""
        raw_text = seq.forced + self.loaded.tokenizer.decode(content_ids)
        _parsed, healed = self._healed(seq, raw_text, "".join(seq.visible))
        sent = self.client_reply(seq)
        if self.state.healing is None or healed is None:
            return sent          # healing leaves it as the client sent it
        if self.harmony:
            return apply_patch(sent, healed)
        return {"role": "assistant", "content": healed}

    def echo_ids(self, seq: Request, content_ids: list[int]) -> list[int] | None:
        """The tokens the next turn's prompt holds after this prompt, through the reply's turn
        closer: the reply as the client echoes it (``echoed_message``) rendered by the template
        after this history and encoded as the next prompt will be -- as far as every plausible
        next message (a user turn, a tool result) agrees. What a grammar or a sampler wrote need
        not be the tokenizer's own encoding of its text (LESSONS 80): the turn closes with these,
        so the next turn reuses the whole reply. None where the next turn does not re-render this
        prompt as its prefix (a template that drops earlier turns' reasoning; an image prompt)."""
        prep, job = seq.prep, seq.job
        if prep.extras or seq.forced or job.raw_prompt is not None:
            # images expand on the VLM's own path; a forced opening is its own piece; a raw prompt
            # is continued by its reply's own tokens, never rendered
            return None
        message = self.echoed_message(seq, content_ids)
        history = prep.original + canonicalize_messages(
            [message], enabled=False, strip_billing_header=self.settings.strip_billing_header)[0]
        calls = message.get("tool_calls") or [{"id": "call_0"}]
        # markers that part at their first byte: the two encodings agree up to them, never into them
        follow = ({"role": "user", "content": "A1"},
                  {"role": "tool", "tool_call_id": calls[0].get("id", "call_0"), "content": "B2"},
                  {"role": "user", "content": "C3"})
        encoded: list[list[int]] = []
        for nxt in follow:
            self.state.counters.bump("echo_renders")
            try:
                text = self.renderer.render(history + [nxt], job.tools, job.enable_thinking, add_generation_prompt=False)
            except TemplateError:
                continue         # e.g. a template that refuses a tool result without a call before it
            encoded.append(encode(self.loaded.tokenizer, text))
            if len(encoded) == 2:
                break
        if len(encoded) < 2:
            return None
        n = len(prep.model_tokens)
        certain = lcp(encoded[0], encoded[1])
        if certain <= n or encoded[0][:n] != prep.model_tokens:
            return None
        return encoded[0][n:certain]

    def _close_turn(self, seq: Request, content_ids: list[int]) -> list[int]:
        """Feed what the next turn is certain to contain after this prompt: the reply as the
        client echoes it and the template's turn closer (``<|im_end|>\n``), ``plan_close``.

        Returns the tokens the KV now holds after the prompt. Correctness never depends on this
        guess -- reuse is still accepted only up to the token LCP -- but it is what lets the next
        turn reuse the whole reply, and an exact-depth cache (recurrent state, a rotated window)
        continue straight into the next turn.
        """
        target, to_feed = self.plan_close(seq, content_ids)
        feed(seq.decode_model or self.decode_model, seq.live, to_feed, self.settings.prefill_step_size)
        return target

    def plan_close(self, seq: Request, content_ids: list[int]) -> tuple[list[int], list[int]]:
        """What closing the turn leaves after the prompt, and the tokens still to feed for it. The
        target is the echo's tokens (``echo_ids``), else the reply's own tokens and the closer. The
        KV is cut back to where it agrees with the target (a stop token the next turn will not
        contain, a grammar's spelling of the text); a cache that cannot be cut there is put back
        at its deepest snapshot of the prompt, and the rest fed from there -- or, without one,
        left as it is. The scheduler feeds the closers of sequences finishing together in one
        forward."""
        live, prep, generated = seq.live, seq.prep, seq.generated
        n = len(prep.model_tokens)
        fed = live.depth - n
        if fed < 0 or fed > len(generated):
            raise RuntimeError(f"bug: KV holds {fed} generated tokens but only {len(generated)} were sampled")
        in_kv = generated[:fed]
        target = self.echo_ids(seq, content_ids)
        guess = None if seq.stopped_by_string else content_ids + self._closer_ids(seq, content_ids)
        if target is None:
            if guess is None:
                return in_kv, []  # the client never sees the rest: the next turn will not contain it
            target = guess
        elif guess is None or target[:len(guess)] != guess:
            self.state.counters.bump("echo_closes")   # the echo is not the reply's own tokens
        if n + len(target) > self.context_limit:
            return in_kv, []  # no room left in the window to close the turn
        if in_kv != target[:fed]:
            keep = lcp(in_kv, target[:fed])
            if live.floor > n + keep:
                snap = max((s for s in seq.snapshots if s.depth <= n), key=lambda s: s.depth, default=None)
                if snap is None:
                    return in_kv, []
                seq.live = self.state.kv.restore(snap)
                self.state.counters.bump("echo_refeeds")
                return target, (prep.model_tokens + target)[snap.depth:]
            live.cut(n + keep)
            fed = keep
        return target, target[fed:]

    def _closer_ids(self, seq: Request, content_ids: list[int]) -> list[int]:
        """The template's turn closer after the reply's own tokens (the guess without an echo); a
        raw prompt's reply has none (the next completion continues the text itself)."""
        if seq.job.raw_prompt is not None:
            return []
        closer = self.renderer.assistant_closer(seq.job.enable_thinking)
        closer_ids = encode(self.loaded.tokenizer, closer) if closer else []
        generated = seq.generated
        if self.harmony and generated and generated[-1] == self.call_id:
            return [self.call_id]   # a harmony tool call stays closed by <|call|> in history
        if closer_ids and content_ids[-len(closer_ids):] == closer_ids:
            return []               # the reply already ended with the closer (harmony <|end|>)
        return closer_ids

    def content_ids(self, seq: Request) -> list[int]:
        """The reply's tokens without stop tokens (what the client's next turn renders back)."""
        stop_ids = seq.params.stop_token_ids
        return [t for t in seq.generated if t not in stop_ids]

    def completed(self, seq: Request) -> bool:
        """The reply ran to its end (no watchdog, no hang-up): its turn is closed and stored."""
        return not seq.watchdog and not seq.job.is_cancelled() and not seq.job.prefill_only

    def _salvage(self, seq: Request) -> None:
        """Nothing prefilled is thrown away: a request aborted by a hang-up or the watchdog keeps
        the KV it computed -- cut at the last completed prefill chunk, or the prompt plus what was
        decoded -- as an ordinary entry, so the client's retry pays only the rest."""
        prep, live = seq.prep, seq.live
        n_prompt = len(prep.model_tokens)
        in_kv = (seq.generated if seq.closed is None else seq.closed)[: max(0, live.depth - n_prompt)]
        depth = live.depth
        if depth <= seq.start or depth < self.state.kv.config.block_size:
            return
        self._store(seq, in_kv, prompt_depth=min(depth, n_prompt))
        self.state.counters.bump("salvaged_prefill_tokens", min(depth, n_prompt) - seq.start)

    def _store(self, seq: Request, continuation: list[int], prompt_depth: int | None = None) -> None:
        """Store the turn's KV (and its snapshots) with their session records -- all or nothing:
        a failure part-way removes the entries this call inserted before it re-raises."""
        inserted: list[int] = []
        try:
            self._store_entries(seq, continuation, prompt_depth, inserted)
        except BaseException:
            for entry_id in inserted:
                try:   # its session record and disk copy go with it (KVManager._on_evict)
                    self.state.kv.remove(entry_id, "store_failed")
                except Exception:  # noqa: BLE001 - best effort: the original error is what matters
                    log.exception("removing entry %s after a failed store failed", entry_id)
            raise

    def _store_entries(self, seq: Request, continuation: list[int], prompt_depth: int | None,
                       inserted: list[int]) -> None:
        st = self.state
        prep, match, session_id = seq.prep, seq.match, self.record_session(seq)
        parent = match.entry.session_id if match.hit else None
        n_prompt = len(prep.model_tokens) if prompt_depth is None else prompt_depth
        all_model = prep.model_tokens[:n_prompt] + continuation
        state = st.kv.snapshot(seq.live)
        depth = state.depth
        extra = max(0, depth - n_prompt)
        key = (prep.key_tokens if n_prompt == len(prep.model_tokens) else self.key_prefix(prep, n_prompt)) \
            + continuation[:extra]
        # the turn's entry is kept as long as the longest lifetime asked of a depth it can serve
        # (the request's own; a breakpoint's where it can be cut back there)
        asked = [seq.job.cache_ttl] + [t for k, t in seq.prep.breakpoints if state.can_serve(k)]
        ttl = max(self.lifetime(a) for a in asked) if any(a is not None for a in asked) else None
        scope = seq.job.scope
        turn = st.kv.new_turn()   # the turn's entry and its snapshots: one turn (the eviction order)
        # with priorities, a less urgent request's entries leave RAM first (LESSONS 95); several
        # ranks evict alike without them (each rank's job carries what rank 0 sent)
        urgency = int(getattr(seq.job, "priority", 0)) if self.settings.priority_scheduling and not st.replicated else 0
        st.kv.store(key, all_model[:depth], state, pool=POOL_KV, session_id=session_id, parent=parent, ttl=ttl,
                    inserted=inserted, fault=seq.job.request_id, scope=scope, turn=turn, priority=urgency)
        for snap in seq.snapshots:
            if state.can_serve(snap.depth):
                continue  # the turn's own entry serves this depth: no copy needed
            st.kv.store(self.key_prefix(prep, snap.depth), prep.model_tokens[:snap.depth], snap, pool=POOL_SNAPSHOT,
                        session_id=session_id, parent=parent, ttl=seq.lifetimes.get(snap.depth), inserted=inserted,
                        scope=scope, turn=turn, priority=urgency)
