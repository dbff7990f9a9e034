"""Structured output and tool_choice: a validated request -> the grammar its reply must match.

Runs on the HTTP handler thread, never the inference thread: the compiler (constraints/compiler.py,
built once at model load) compiles on its own small pool and waits at most
GRAMMAR_COMPILE_TIMEOUT_SECONDS, so a schema too large or too slow to compile is a 400 before the
request is queued. Compiled grammars are cached by a hash of the grammar (GRAMMAR_CACHE_ENTRIES).

    structured = Structured.for_model(loaded, engine, settings)      # at load (None: no compiler)
    req.grammar = structured.grammar_for(req, CHAT_FIELDS)            # per request; APIError(400)

What is constrained (every front translates to these chat fields first):

| request | grammar |
|---|---|
| ``response_format`` json_object / json_schema | the reply is that JSON (after any reasoning block) |
| ``tool_choice`` "required" | a call from the first token (after reasoning), parallel calls unless ``parallel_tool_calls`` is false |
| ``tool_choice`` a named function | one call of that function from the first token (after reasoning), then the reply ends |
| ``tool_choice`` "auto" (or absent) with tools | lazy: free text until the model opens a call in its format, then a valid name and arguments |
| ``tool_choice`` "none" with tools | any text that never opens a call |

A full compile queue answers 503 (429 for a client over its share), with Retry-After; a schema
that failed once is refused again from the failure cache without compiling (constraints/compiler.py).
A schema the grammar cannot take is a 400 naming its field and JSON pointer -- except for the lazy
``auto`` case with no strict tool: agent clients send tool schemas of every kind, and such a request
is served as before, unconstrained (logged once per tool set, counted as ``grammar_fallbacks``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ...constraints import CompilerBusy, GrammarCompiler, GrammarTooComplex, SchemaError, SpecError, \
    compiler_options, spec_for_request, tool_format_for
from ..http.errors import APIError, rate_limited, unavailable

log = logging.getLogger("mlxstack.structured")


@dataclass(frozen=True)
class Fields:
    """Where a front's request holds the schemas (error messages name them)."""
    schema: str = "response_format.json_schema.schema"
    tools: str = "tools[{i}].function.parameters"


CHAT_FIELDS = Fields()
RESPONSES_FIELDS = Fields("text.format.schema", "tools[{i}].parameters")
MESSAGES_FIELDS = Fields("output_config.format.schema", "tools[{i}].input_schema")


def _strict_tool(tool: Any) -> bool:
    fn = tool.get("function", tool) if isinstance(tool, dict) else {}
    return isinstance(fn, dict) and fn.get("strict") is True


class Structured:
    """One per loaded model: the grammar compiler for its tokenizer and its tool-call format."""

    def __init__(self, compiler: GrammarCompiler, tool_format: str, counters: Any = None) -> None:
        self.compiler = compiler
        self.tool_format = tool_format
        self.counters = counters
        self._warned: set[str] = set()

    @classmethod
    def for_model(cls, loaded: Any, engine: Any, settings: Any) -> "Structured | None":
        """The compiler for ``loaded``'s tokenizer (about half a second), or None when its tokenizer
        cannot drive one (not a fast tokenizer): constrained requests are then served best effort
        (the engine writes the reply's opening; see engine/chat.py ``_reply_prefix``)."""
        try:
            compiler = GrammarCompiler.for_tokenizer(loaded.tokenizer, stop_ids=engine.stop_ids,
                                                     **compiler_options(settings))
        except Exception as exc:  # noqa: BLE001 - structured output degrades, serving goes on
            log.warning("structured output is best effort for %s (no grammar compiler: %s)", loaded.model_id, exc)
            return None
        fmt = tool_format_for(loaded.family, engine.renderer.template_source, loaded.family == "harmony")
        log.info("structured output: grammars for %s, tool calls in %s format", loaded.model_id, fmt)
        return cls(compiler, fmt, engine.state.counters)

    def grammar_for(self, req: Any, fields: Fields = CHAT_FIELDS) -> Any:
        """The compiled grammar for a validated ChatRequest, or None when nothing constrains it.
        Raises APIError(400) naming the field for a schema or tool set that cannot be enforced."""
        try:
            spec = spec_for_request(response_format=req.response_format, tools=req.tools, tool_choice=req.tool_choice,
                                    parallel_tool_calls=req.parallel_tool_calls, tool_format=self.tool_format,
                                    specials=self.compiler.specials, schema_where=fields.schema,
                                    tools_where=fields.tools)
        except SpecError as exc:
            raise APIError(400, str(exc), param=exc.where, code="invalid_tool_choice") from None
        if spec is None:
            return None
        lazy = spec.kind == "tool_auto" and bool(spec.stages) and not any(_strict_tool(t) for t in req.tools or ())
        try:
            return self.compiler.compile(spec, client=client_of(req))
        except CompilerBusy as exc:
            if lazy:                    # the grammar is a nicety here: serve as without one
                self._fall_back(spec.key, exc)
                return None
            if exc.mine:
                raise rate_limited(str(exc), exc.retry_after, code="grammar_queue_share") from None
            raise unavailable(str(exc), exc.retry_after, code="grammar_queue_full") from None
        except SchemaError as exc:
            if lazy:
                self._fall_back(spec.key, exc)
                return None
            code = "grammar_too_complex" if isinstance(exc, GrammarTooComplex) else "invalid_json_schema"
            raise APIError(400, str(exc), param=exc.param, code=code) from None

    def _fall_back(self, key: str, exc: Exception) -> None:
        if self.counters is not None:
            self.counters.bump("grammar_fallbacks")
        if key not in self._warned and len(self._warned) < 1024:
            self._warned.add(key)
            log.warning("tool_choice auto: the tools' grammar cannot be built (%s); serving without it", exc)

    def close(self) -> None:
        self.compiler.close()


def client_of(req: Any) -> str:
    """Who asks, for the compile queue's per-client share: the request's ``user`` / ``session_id`` /
    Anthropic ``metadata.user_id``; requests that name nobody share one share."""
    body = getattr(req, "body", None) or {}
    meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    for value in (body.get("user"), body.get("session_id"), meta.get("user_id")):
        if isinstance(value, str) and value:
            return value[:200]
    return "-"


__all__ = ["CHAT_FIELDS", "Fields", "MESSAGES_FIELDS", "RESPONSES_FIELDS", "Structured", "client_of"]
