"""Token-level constraints (structured output, guaranteed tool calls) with llguidance.

Layers inside the package, bottom up: ``grammars`` (pure: request fields -> GrammarSpec),
``compiler`` (GrammarSpec -> CompiledGrammar for one tokenizer: limits, timeout, LRU cache, errors
naming the schema path), ``row`` (one request's RowConstraint: tokens in, bitmask out), ``masking``
(bitmasks onto MLX logits, one row or a batch). Imports only ``config`` and ``parsing`` (the tool-call parser's schema typing) from mlxstack.

    compiler = GrammarCompiler.for_tokenizer(tokenizer, stop_ids=engine_stop_ids,
                                             **compiler_options(settings))                # at load
    spec = spec_for_request(response_format=..., tools=..., tool_choice=..., parallel_tool_calls=...,
                            tool_format=tool_format_for(family, template), reasoning_close=...,
                            specials=compiler.specials)                                   # handler thread
    grammar = compiler.compile(spec) if spec else None          # raises SchemaError -> 400
    params = replace(params, grammar=grammar)                   # runner/sampling.py does the rest
"""
from .compiler import (CompiledGrammar, CompilerBusy, GrammarCompiler, GrammarTooComplex, SchemaError, compiler_options,
                       locate_schema_error)
from .grammars import (GLM, HARMONY, HERMES, QWEN_XML, TOOL_FORMATS, GrammarSpec, SpecError, Stage, json_spec,
                       opener_of, spec_for_request, tool_format_for, tools_spec)
from .masking import BatchMasks, allowed_mask, apply_mask
from .row import RowConstraint

__all__ = [
    "BatchMasks", "CompiledGrammar", "CompilerBusy", "GLM", "GrammarCompiler", "GrammarSpec", "GrammarTooComplex", "HARMONY",
    "HERMES", "QWEN_XML", "RowConstraint", "SchemaError", "SpecError", "Stage", "TOOL_FORMATS", "allowed_mask",
    "apply_mask", "compiler_options", "json_spec", "locate_schema_error", "opener_of", "spec_for_request",
    "tool_format_for", "tools_spec",
]
