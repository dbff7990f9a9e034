"""Compile grammar specs for one tokenizer: bounded in time and size, cached by spec hash, errors that
name the schema path.

    compiler = GrammarCompiler.for_tokenizer(hf_tokenizer, stop_ids={2})   # once per model (~0.5 s)
    grammar = compiler.compile(spec)          # request time, on the HTTP handler thread
    row = grammar.new_row(stop_ids, width)    # per request, on the inference thread (microseconds)

``compile`` runs llguidance on a small worker pool and waits at most ``timeout_s``: a schema too
large or too slow to compile raises ``GrammarTooComplex`` (a 400) within that time and never reaches
the inference thread; llguidance's own limits (``LLParserLimits``: grammar size, lexer fuel, Earley
items per step) bound both the compile and every later mask step. The first mask is computed here
too (llguidance builds its lexer lazily on it), so a row's first step costs what later ones do.

A schema llguidance cannot compile raises ``SchemaError`` naming the field and the JSON pointer of
the smallest sub-schema that fails with the same message (llguidance's own messages carry no path):
``response_format.json_schema.schema#/properties/when: Unknown format: weird``.

Nobody starves the pool: a failure is cached by spec hash like a success (a bad schema sent again is
refused at once, without compiling or locating its error again); at most ``max_pending`` compiles
are queued or running, and one client (``compile(spec, client=...)``) at most half of them --
past either bound ``CompilerBusy`` (429 for the client over its share, 503 when the pool is full,
with Retry-After); a compile whose every waiter timed out is dropped if it has not started.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import llguidance as llg
import numpy as np

from .grammars import GrammarSpec, Stage
from .row import RowConstraint

__all__ = ["CompiledGrammar", "CompilerBusy", "GrammarCompiler", "GrammarTooComplex", "SchemaError", "compiler_options",
           "locate_schema_error"]

DEFAULT_LIMITS = dict(max_grammar_size=200_000)   # symbols; llguidance's default is 500k
LOCATE_MAX_CHECKS = 256                           # sub-schemas tried when naming the failing path
LOCATE_BUDGET_S = 1.0


def compiler_options(settings: Any) -> dict[str, Any]:
    """GrammarCompiler keyword arguments from Settings (GRAMMAR_CACHE_ENTRIES, GRAMMAR_COMPILE_TIMEOUT_SECONDS,
    GRAMMAR_MAX_SIZE, GRAMMAR_MAX_PENDING)."""
    return {"cache_entries": settings.grammar_cache_entries, "timeout_s": settings.grammar_compile_timeout_seconds,
            "limits": {"max_grammar_size": settings.grammar_max_size}, "max_pending": settings.grammar_max_pending}


class SchemaError(ValueError):
    """A schema (or grammar) the request sent that cannot be enforced: answer 400. ``param`` is the
    request field plus the JSON pointer inside it."""

    def __init__(self, where: str, pointer: str, reason: str) -> None:
        self.where, self.pointer, self.reason = where, pointer, reason
        super().__init__(f"{self.param}: {reason}")

    @property
    def param(self) -> str:
        return f"{self.where}{self.pointer}" if self.pointer != "#" else self.where


class GrammarTooComplex(SchemaError):
    """Over a size limit or the compile time bound."""


class CompilerBusy(RuntimeError):
    """No room to compile now: the pool is full (``mine`` False: 503) or this client already has its
    share of the queue (``mine`` True: 429). Retry after ``retry_after`` seconds."""

    def __init__(self, message: str, mine: bool, retry_after: int) -> None:
        super().__init__(message)
        self.mine, self.retry_after = mine, retry_after


@dataclass(slots=True)
class CompileStats:
    compiles: int = 0
    hits: int = 0
    errors: int = 0
    failure_hits: int = 0          # a failure answered from the cache
    timeouts: int = 0
    evictions: int = 0
    refused: int = 0               # CompilerBusy
    dropped: int = 0               # queued compiles cancelled: every waiter had timed out
    compile_ms: list[float] = field(default_factory=list)


@dataclass(eq=False)
class CompiledGrammar:
    """A spec compiled for one tokenizer: a warmed template matcher that rows copy."""
    spec: GrammarSpec
    template: llg.LLMatcher
    tokenizer: llg.LLTokenizer
    compile_ms: float
    ws_words: np.ndarray | None = None     # bitmask of whitespace-only tokens (rows trim a leading one)

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.spec.stages

    def new_matcher(self) -> llg.LLMatcher:
        return self.template.deep_copy()

    def new_row(self, stop_ids: Iterable[int], width: int, reasoning_close: str | None = None):
        """A fresh per-request constraint (constraints/row.py). ``reasoning_close``: the prompt left a
        reasoning block open (the engine knows after rendering); the grammar starts once it closes."""
        return RowConstraint(self, stop_ids, width, self.spec.stages_for(reasoning_close))


class GrammarCompiler:
    """One per tokenizer. Thread-safe: handler threads compile concurrently; one compile per key."""

    def __init__(self, tokenizer: llg.LLTokenizer, specials: Mapping[str, int] | None = None, *,
                 cache_entries: int = 64, timeout_s: float = 5.0, limits: Mapping[str, Any] | None = None,
                 workers: int = 2, max_pending: int = 8) -> None:
        self.tokenizer = tokenizer
        self.specials = dict(specials or {})
        self.cache_entries = max(0, int(cache_entries))
        self.timeout_s = float(timeout_s)
        self._limit_args = {**DEFAULT_LIMITS, **(limits or {})}
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._inflight: dict[str, Future] = {}
        self._failed: OrderedDict[tuple, SchemaError] = OrderedDict()   # _failure_key -> its error
        self._waiters: dict[str, int] = {}                               # spec key -> threads waiting
        self._owner: dict[str, str] = {}                                 # spec key -> client that queued it
        self.max_pending = max(1, int(max_pending))
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="grammar-compile")
        self._ws_words: np.ndarray | None = None
        self.stats = CompileStats()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, stop_ids: Iterable[int] = (), **kwargs: Any) -> "GrammarCompiler":
        """From a Hugging Face fast tokenizer (or mlx-lm's TokenizerWrapper around one). ``stop_ids``
        become llguidance's end-of-sequence tokens: a finished grammar allows exactly those."""
        from copy import copy

        hf = tokenizer if hasattr(tokenizer, "backend_tokenizer") else getattr(tokenizer, "_tokenizer", tokenizer)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"constrained decoding needs a fast (tokenizers) tokenizer, not {type(hf).__name__}")
        # as llguidance.hf.from_tokenizer, without its isinstance check (mlx-lm's classes differ)
        backend = copy(backend)
        backend.no_padding()
        backend.no_truncation()
        eos = sorted(set(int(i) for i in stop_ids)) or getattr(hf, "eos_token_id", None)
        llt = llg.LLTokenizer(backend.to_str(), eos_token=eos)
        return cls(llt, special_tokens(hf, llt), **kwargs)

    # ------------------------------------------------------------------ compile
    def limits(self) -> llg.LLParserLimits:
        return llg.LLParserLimits(**self._limit_args)

    def compile(self, spec: GrammarSpec, client: str | None = None) -> CompiledGrammar:
        """The compiled grammar for ``spec`` (cached, failures too). Raises SchemaError /
        GrammarTooComplex, or CompilerBusy when it would have to queue past the bounds (``client``:
        who asks, for the per-client share; None -- a rank replaying rank 0's request -- only the
        pool's bound)."""
        key, failure_key = spec.key, _failure_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return hit
            failed = self._failed.get(failure_key)
            if failed is not None:
                self._failed.move_to_end(failure_key)
                self.stats.failure_hits += 1
                raise type(failed)(failed.where, failed.pointer, failed.reason)
            fut = self._inflight.get(key)
            fresh = fut is None
            if fresh:
                self._admit(client)
                fut = self._pool.submit(self._build, spec)
                self._inflight[key] = fut
                if client is not None:
                    self._owner[key] = client
            self._waiters[key] = self._waiters.get(key, 0) + 1
        if fresh:      # outside the lock: a future already done runs the callback right here
            fut.add_done_callback(lambda f, k=key, fk=failure_key: self._done(k, f, fk))
        try:
            return fut.result(timeout=self.timeout_s)
        except CancelledError:          # dropped by a waiter that gave up just as this one came
            return self.compile(spec, client)
        except FutureTimeout:
            self.stats.timeouts += 1
            raise GrammarTooComplex(_where(spec), "#", f"the grammar did not compile within {self.timeout_s:g} s "
                                    "(simplify the schema: fewer alternatives, shorter enums, bounded patterns)") from None
        finally:
            with self._lock:
                left = self._waiters.get(key, 1) - 1
                if left > 0:
                    self._waiters[key] = left
                else:
                    self._waiters.pop(key, None)
            # nobody waits and it has not started: drop it (outside the lock: a cancel runs _done here)
            if left <= 0 and not fut.done() and fut.cancel():
                self.stats.dropped += 1

    def _admit(self, client: str | None) -> None:
        """Room for one more queued compile (under the lock), else CompilerBusy."""
        if client is not None:
            share = max(1, self.max_pending // 2)
            if sum(1 for k in self._inflight if self._owner.get(k) == client) >= share:
                self.stats.refused += 1
                raise CompilerBusy(f"{share} grammar compile(s) of this client are already queued; retry when they "
                                   "finish", mine=True, retry_after=max(1, round(self.timeout_s)))
        if len(self._inflight) >= self.max_pending:
            self.stats.refused += 1
            raise CompilerBusy(f"{len(self._inflight)} grammar compiles are queued (the most: {self.max_pending}); "
                               "retry shortly", mine=False, retry_after=max(1, round(self.timeout_s)))

    def _done(self, key: str, fut: Future, failure_key: tuple) -> None:
        with self._lock:
            self._inflight.pop(key, None)
            self._owner.pop(key, None)
            if fut.cancelled():
                return
            exc = fut.exception()
            if isinstance(exc, SchemaError):
                self._failed[failure_key] = exc
                self._failed.move_to_end(failure_key)
                while len(self._failed) > max(64, self.cache_entries):
                    self._failed.popitem(last=False)
            if exc is not None or self.cache_entries == 0:
                return
            self._cache[key] = fut.result()
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
                self.stats.evictions += 1

    def _build(self, spec: GrammarSpec) -> CompiledGrammar:
        t0 = time.perf_counter()
        grammar = llg.LLMatcher.grammar_from_lark(spec.lark)
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits())
        if not matcher.is_error():
            # llguidance builds the lexer on the first mask: pay it here, not on the inference thread
            words = np.zeros(((self.tokenizer.vocab_size + 31) // 32,), dtype=np.int32)
            matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if matcher.is_error():
            self.stats.errors += 1
            raise self._explain(spec, matcher.get_error())
        ms = (time.perf_counter() - t0) * 1000
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_ms.append(ms)
        return CompiledGrammar(spec, matcher, self.tokenizer, ms, self.whitespace_words() if spec.lead_ws else None)

    def whitespace_words(self) -> np.ndarray:
        """Bitmask (llguidance's words) of the tokens that are whitespace only (once per tokenizer)."""
        with self._lock:
            if self._ws_words is None:
                llt = self.tokenizer
                words = np.zeros(((llt.vocab_size + 31) // 32,), dtype=np.uint32)
                for i in range(llt.vocab_size):
                    b = llt.decode_bytes([i])
                    if b and not b.strip(b" \t\r\n"):
                        words[i >> 5] |= np.uint32(1 << (i & 31))
                self._ws_words = words.view(np.int32)
            return self._ws_words

    def _explain(self, spec: GrammarSpec, message: str) -> SchemaError:
        """Which embedded schema failed, and where inside it."""
        reason = _first_line(message)
        too_big = any(w in message for w in ("too big", "too large", "too complex", "limit", "fuel"))
        for where, text in spec.schemas:
            schema = json.loads(text)
            err = _schema_error(schema, self.limits())
            if err is None:
                continue
            pointer, why = locate_schema_error(schema, err, self.limits())
            cls = GrammarTooComplex if too_big else SchemaError
            return cls(where, pointer, why)
        cls = GrammarTooComplex if too_big else SchemaError
        return cls(_where(spec), "#", reason)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _failure_key(spec: GrammarSpec) -> tuple:
    """A failure's cache key: the grammar and the request fields its schemas came from (the error
    names the field: the same schema through /v1/responses is ``text.format.schema``)."""
    return (spec.key, tuple(where for where, _ in spec.schemas))


def _where(spec: GrammarSpec) -> str:
    return spec.schemas[0][0] if len(spec.schemas) == 1 else ("tools" if spec.kind.startswith("tool") else "grammar")


def _first_line(message: str) -> str:
    """llguidance's message without its parser-state dump."""
    return message.split("\n<state>")[0].strip()


def _schema_error(schema: Any, limits: llg.LLParserLimits) -> str | None:
    """llguidance's error for ``schema`` alone (strict: no lenient mode), or None."""
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema)
    except (ValueError, TypeError) as exc:
        return str(exc)
    bad, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=limits)
    return _first_line(msgs[0]) if bad and msgs else None


# ------------------------------------------------------------------ where a schema fails
_MAP_KEYS = ("$defs", "definitions", "properties", "patternProperties", "dependentSchemas")  # definitions first: a $ref fails where it points
_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONE_KEYS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
             "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def _children(node: Any, path: str) -> Iterator[tuple[Any, str]]:
    if not isinstance(node, dict):
        return
    for key in _MAP_KEYS:
        if isinstance(node.get(key), dict):
            for name, child in node[key].items():
                yield child, f"{path}/{key}/{_escape(name)}"
    for key in _LIST_KEYS:
        if isinstance(node.get(key), list):
            for i, child in enumerate(node[key]):
                yield child, f"{path}/{key}/{i}"
    for key in _ONE_KEYS:
        child = node.get(key)
        if isinstance(child, dict):
            yield child, f"{path}/{key}"
        elif key == "items" and isinstance(child, list):
            for i, sub in enumerate(child):
                yield sub, f"{path}/items/{i}"


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def locate_schema_error(schema: Any, message: str, limits: llg.LLParserLimits | None = None) -> tuple[str, str]:
    """(JSON pointer, reason) of the deepest sub-schema that fails alone with ``message`` (the root's
    error): "#/properties/a" for an unknown type at property a. Sub-schemas are checked with the
    root's ``$defs`` / ``definitions`` so references resolve. At most LOCATE_MAX_CHECKS checks and
    LOCATE_BUDGET_S seconds; "#" when nothing deeper reproduces it."""
    limits = limits or llg.LLParserLimits()
    # sub-schemas are checked with the root's definitions and compile options
    defs = {k: schema[k] for k in ("$defs", "definitions", "x-guidance") if isinstance(schema, dict) and k in schema}
    deadline = time.perf_counter() + LOCATE_BUDGET_S
    checks = 0

    def fails(node: Any) -> bool:
        nonlocal checks
        checks += 1
        if not isinstance(node, dict):
            return False
        err = _schema_error({**defs, **node}, limits)
        return err is not None and err == message

    def visit(node: Any, path: str) -> str | None:
        for child, cpath in _children(node, path):
            if checks >= LOCATE_MAX_CHECKS or time.perf_counter() > deadline:
                return None
            found = visit(child, cpath)
            if found is not None:
                return found
        if path and checks < LOCATE_MAX_CHECKS and fails(node):
            return path
        return None

    return "#" + (visit(schema, "") or ""), message


# ------------------------------------------------------------------ tokenizer facts
def special_tokens(hf: Any, llt: llg.LLTokenizer) -> dict[str, int]:
    """Added tokens llguidance treats as special (text -> id): Lark must write them ``<text>``."""
    out: dict[str, int] = {}
    decoder = getattr(hf, "added_tokens_decoder", None) or {}
    for tid, tok in decoder.items():
        text = getattr(tok, "content", str(tok))
        if 0 <= int(tid) < llt.vocab_size and llt.is_special_token(int(tid)):
            out[text] = int(tid)
    return out
