"""The request assembly pass: messages in, one render, token ids with their boundaries out.

    prep = engine.prepare(job)   # heal -> canonicalise -> ONE render -> tokenise -> boundaries
    prep.model_tokens            # what the model computes on
    prep.key_tokens              # the cache key (canonical, scrubbed)
    prep.history_end             # tokens of the rendered history (generation prompt excluded)
    prep.generation_text         # what the generation prompt appended (decides <think>)
    prep.renders                 # chat-template renders this request cost (1 unless a fallback ran)

Everything else a request needs from its prompt comes from that one render:
- the cache key: the original rendering with each text the canonicaliser changed replaced where
  the template wrote it (prompt/key_text.py), then scrubbed; no text changed -> the key is the
  model text itself;
- the history boundary and the generation prompt: the template's generation suffix, probed once
  at start-up (ChatRenderer.generation_suffix), is the tail of the rendered prompt;
- the implicit session id: a digest of the canonical opening *messages* (no render at all);
- the stable prefix of a session's next turn: the turn store keeps this request's history
  boundary (``SessionTurnStore.recorded_history``).
Where a template defeats one of these (it escapes content, its generation prompt depends on the
conversation, a conversation branched inside its record), the old way runs -- a render of the
messages in question -- and is counted in ``prep.renders`` and the ``renders`` counter, so a
template that needs it is visible in /stats.
"""
from __future__ import annotations

import logging
from typing import Any

from ..cache.lcp import lcp
from ..cache.summary import opening_session_id
from ..prompt.canonicalize import canonicalize_messages
from ..prompt.key_text import canonical_text
from ..prompt.render import TemplateError, encode
from ..prompt.scrub import scrub_cache_key
from ..prompt.session_context import (SessionContext, extract_session_context, opening_end, prefix_hash_session_id, scoped,
                                      session_opening)
from ..prompt.write_content import omit_written_content
from .request import CacheBreakpoint, ChatJob, PreparedPrompt

log = logging.getLogger("mlxstack.request")


class PromptAssembly:
    """ChatEngine's first phase (engine/chat.py inherits it; engine/vlm_chat.py overrides the
    ``_tokenize`` / ``_plain_key`` / ``_rendered_tokens`` seams)."""

    loaded: Any
    renderer: Any
    state: Any
    settings: Any

    # ------------------------------------------------------------------ the pass
    def prepare(self, job: ChatJob) -> PreparedPrompt:
        """heal -> canonicalise -> render once -> tokenise (``_tokenize``: the VLM seam) -> the key
        safety check (``_plain_key``: what the key falls back to) -> history boundary."""
        if job.raw_prompt is not None:
            return self._prepare_raw(job)
        s = self.settings
        renders = [0]
        healed = self.state.heal(job.messages, job.scope)
        messages, omitted, omitted_bytes = (omit_written_content(healed, job.messages)
                                            if s.normalize_write_tool_content_for_prompt else (healed, 0, 0))
        original, canonical = canonicalize_messages(
            messages, enabled=s.cache_canonicalize_tool_context, strip_billing_header=s.strip_billing_header)
        model_text = self._render(renders, original, job)
        canon_text = canonical_text(model_text, original, canonical)
        if canon_text is None:   # a template that does not write message text verbatim
            canon_text = self._render(renders, canonical, job)
        key_text = scrub_cache_key(canon_text)
        model_tokens, key_tokens, extras, key_extra = self._tokenize(original, canonical, model_text, key_text)
        if s.cache_norm_safety_check and len(key_tokens) - key_extra < 0.9 * len(model_tokens):
            log.warning("%s cache key %d tokens vs prompt %d (>10%% shorter): using original tokens as key",
                        job.request_id, len(key_tokens), len(model_tokens))
            self.state.counters.bump("cache_key_safety_fallback")
            key_tokens = self._plain_key(model_tokens, extras)
        prep = PreparedPrompt(original, canonical, model_text, model_tokens, key_tokens,
                              len(model_text) - len(key_text), extras)
        prep.generation_text, prep.history_end = self._history_split(prep, job, renders)
        prep.breakpoints = self._breakpoints(prep, job, renders)
        prep.renders = renders[0]
        if omitted:   # the model sees placeholders; healing and the session records follow what was sent
            prep.sent, prep.sent_canonical = canonicalize_messages(
                healed, enabled=s.cache_canonicalize_tool_context, strip_billing_header=s.strip_billing_header)
            self.state.counters.bump("write_contents_omitted", omitted)
            self.state.counters.bump("write_content_bytes_omitted", omitted_bytes)
        return prep

    def _prepare_raw(self, job: ChatJob) -> PreparedPrompt:
        """A text completion's prompt (``job.raw_prompt``): its tokens are the model tokens and the
        key alike (the same list: nothing is canonicalised or scrubbed, so a hit is exactly the
        tokens two prompts share), no render, the whole prompt its own history."""
        tokens = self.raw_tokens(job.raw_prompt)
        prep = PreparedPrompt([], [], "", tokens, tokens, 0)
        prep.history_end = len(tokens)
        return prep

    def raw_tokens(self, parts: list) -> list[int]:
        """The token ids of a raw prompt's parts: ids as given, text encoded as it stands; a prompt
        that opens with text starts with the tokenizer's own leading tokens (a BOS where it adds one)."""
        tok = self.loaded.tokenizer
        out: list[int] = list(self._leading_ids()) if parts and isinstance(parts[0], str) else []
        for part in parts:
            if isinstance(part, str):
                out += encode(tok, part) if part else []
            else:
                out.append(int(part))
        return out

    def _leading_ids(self) -> list[int]:
        """What the tokenizer puts before a text of its own accord (its BOS, if any): the ids its
        plain encoding with special tokens has before those of the text alone (memoised)."""
        memo = self.__dict__.get("_leading_memo")
        if memo is None:
            tok = self.loaded.tokenizer
            try:
                full = list(tok.encode("a", add_special_tokens=True))
                bare = list(tok.encode("a", add_special_tokens=False))
            except TypeError:       # a tokenizer without the keyword adds nothing we can tell apart
                full = bare = []
            memo = full[: len(full) - len(bare)] if bare and full[len(full) - len(bare):] == bare else []
            self.__dict__["_leading_memo"] = memo
        return memo

    def _render(self, renders: list[int], messages: list[dict], job: ChatJob,
                add_generation_prompt: bool = True) -> str:
        renders[0] += 1
        return self.renderer.render(messages, job.tools, job.enable_thinking, add_generation_prompt=add_generation_prompt)

    def _tokenize(self, original: list[dict], canonical: list[dict], model_text: str,
                  key_text: str) -> tuple[list[int], list[int], dict, int]:
        """(model tokens, key tokens, backend extras, key tokens that are not text). A VLM expands
        image placeholders and adds image identity markers here."""
        tok = self.loaded.tokenizer
        model_tokens = encode(tok, model_text)
        key_tokens = model_tokens if key_text == model_text else encode(tok, key_text)
        return model_tokens, key_tokens, {}, 0

    def _plain_key(self, model_tokens: list[int], extras: dict) -> list[int]:
        """The key when the canonical one is refused: the model tokens themselves."""
        return model_tokens

    # ------------------------------------------------------------------ boundaries
    def _history_split(self, prep: PreparedPrompt, job: ChatJob, renders: list[int]) -> tuple[str, int]:
        """(the generation prompt's text, the token index where the rendered history ends). The
        probed generation suffix ends the prompt for every template we know; where it does not,
        the history is rendered on its own (the old way, counted)."""
        suffix = self.renderer.generation_suffix(job.enable_thinking)
        n = len(prep.model_tokens)
        if suffix and prep.model_text.endswith(suffix):
            suffix_ids = self._suffix_ids(suffix)
            if suffix_ids and prep.model_tokens[-len(suffix_ids):] == suffix_ids:
                return suffix, n - len(suffix_ids)
            history_text = prep.model_text[: len(prep.model_text) - len(suffix)]
            return suffix, lcp(self._tokens_of(history_text, prep), prep.model_np)
        history_text = self._render_prefix(renders, prep.original, job)
        if history_text is None:
            return suffix, n - 1
        start = _common_prefix_chars(history_text, prep.model_text)
        return prep.model_text[start:], lcp(self._tokens_of(history_text, prep), prep.model_np)

    def _breakpoints(self, prep: PreparedPrompt, job: ChatJob, renders: list[int]) -> list[tuple[int, float | None]]:
        """The client's cache breakpoints as (token position, asked ttl), sorted, one per position.
        A breakpoint's position is where the prompt's text stops agreeing with a render of the
        messages up to it (the marked message cut after its marked block, no generation prompt),
        re-tokenised and matched token by token: a position the next request that shares the
        text up to the mark also reaches, whatever the template writes around it. The end of the
        last message is the history boundary (no render). A mark whose message was dropped or
        merged on the way (the counts differ) or that the template refuses is skipped."""
        marks = job.breakpoints
        if not marks:
            return []
        sent = job.messages
        original = prep.original
        if len(sent) != len(original):
            return []
        found: dict[int, float | None] = {}
        for mark in map(lambda m: CacheBreakpoint(*m), marks):   # a rank's record holds plain tuples
            if not 0 <= mark.message < len(original):
                continue
            pos = self._mark_position(prep, job, renders, mark.message, _cut(sent[mark.message], original[mark.message],
                                                                              mark.chars))
            if pos is None or pos <= 0:
                continue
            if pos in found and found[pos] is not None and (mark.ttl is None or mark.ttl < found[pos]):
                continue
            found[pos] = mark.ttl
        return sorted(found.items())

    def _mark_position(self, prep: PreparedPrompt, job: ChatJob, renders: list[int], m: int,
                       cut: int | None) -> int | None:
        original = prep.original
        if cut is None and m == len(original) - 1:
            return prep.history_end
        msgs = original[:m + 1]
        if cut is not None:
            msgs = msgs[:-1] + [{**msgs[-1], "content": msgs[-1]["content"][:cut]}]
        text = self._render_prefix(renders, msgs, job)
        if text is None:
            return None
        chars = _common_prefix_chars(text, prep.model_text)
        return lcp(self._tokens_of(prep.model_text[:chars], prep), prep.model_np)

    def _suffix_ids(self, suffix: str) -> list[int]:
        memo = self.__dict__.setdefault("_suffix_memo", {})
        if suffix not in memo:
            memo[suffix] = encode(self.loaded.tokenizer, suffix)
        return memo[suffix]

    def _tokens_of(self, text: str, prep: PreparedPrompt) -> list[int]:
        """Model tokens of a prefix of the prompt's text (a VLM expands its image pads)."""
        return encode(self.loaded.tokenizer, text)

    def _render_prefix(self, renders: list[int], messages: list[dict], job: ChatJob) -> str | None:
        """The template's rendering of a message prefix without the generation prompt, or None
        when the template refuses that prefix (strict templates reject e.g. a [system]-only list)."""
        if not messages:
            return None
        try:
            return self._render(renders, messages, job, add_generation_prompt=False)
        except TemplateError:
            return None

    def stable_prefix(self, prep: PreparedPrompt, session_id: str, job: ChatJob) -> tuple[int, int]:
        """(stable message count, token boundary of those messages in the model tokens): from the
        turn store's record of the previous request when the stable messages are that whole
        record (a growing conversation), else by rendering them (a branch inside the record)."""
        if job.raw_prompt is not None:
            return 0, 0          # no messages: the turn store keeps nothing for a raw prompt
        turns = self.state.turns
        n = turns.stable_prefix(session_id, prep.record_canonical)
        if n <= 0:
            return 0, 0
        recorded = turns.recorded_history(session_id, n)
        if recorded is not None:
            return n, min(recorded, len(prep.model_tokens))
        renders = [0]
        text = self._render_prefix(renders, prep.original[:n], job)
        prep.renders += renders[0]
        return (n, lcp(self._tokens_of(text, prep), prep.model_np)) if text is not None else (0, 0)

    def session_of(self, prep: PreparedPrompt, job: ChatJob) -> SessionContext:
        """The client's session id, else the digest of the conversation's opening as the client
        sent it (the router's too), in the request's cache scope. A raw prompt without a client id:
        the digest of its first block of tokens (a prefix that does not grow as it is continued)."""
        if job.raw_prompt is not None:
            first = prep.model_tokens[: self.state.kv.config.block_size]
            implicit = SessionContext("completion:" + prefix_hash_session_id(first)[:32], "prompt-prefix")
            return scoped(extract_session_context(job.body, job.headers, implicit=implicit), job.scope)
        return scoped(extract_session_context(job.body, job.headers, implicit=self.implicit_session(job.messages)),
                      job.scope)

    def implicit_session(self, messages: list[dict]) -> SessionContext:
        """The implicit session of a conversation: the digest of its opening (prompt/session_context.py)."""
        s = self.settings
        opening = canonicalize_messages(messages[:opening_end(messages)], enabled=s.cache_canonicalize_tool_context,
                                        strip_billing_header=s.strip_billing_header)[1]
        return SessionContext(opening_session_id(session_opening(opening)), "message-prefix")


def _cut(sent: dict, original: dict, chars: int | None) -> int | None:
    """Where a mark ``chars`` into the text content the client sent falls in the message as the
    pipeline rendered it (canonicalisation may have dropped a leading line, e.g. a billing header:
    the text after the mark is matched from the end); None: after the whole message."""
    if chars is None:
        return None
    a, b = sent.get("content"), original.get("content")
    if not isinstance(a, str) or not isinstance(b, str) or chars >= len(a):
        return None
    tail = a[chars:]
    return len(b) - len(tail) if b.endswith(tail) and len(b) >= len(tail) else None


def _common_prefix_chars(a: str, b: str) -> int:
    """Length of the common prefix of two strings (binary search over C-level slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
