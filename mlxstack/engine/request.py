"""What one chat request is on its way through the engine: the job the HTTP layer hands over,
the prepared prompt, the in-flight sequence (cache, prefill and decode state), the outcome.

    job = ChatJob(...)                    # server/common/job_adapter.py builds it from a validated request
    seq = engine.start(job)               # -> Request (engine/chat.py)
    outcome = engine.finish(seq)          # -> ChatOutcome
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from ..cache.kv_ops import KVState, LiveCache
from ..cache.lcp import as_tokens
from ..cache.manager import MatchResult
from ..prompt.session_context import SessionContext
from ..runner.sampling import Sampler, SamplingParams
from ..scheduler.status import RequestStatus


class CacheBreakpoint(NamedTuple):
    """Where a client marked a reusable prefix to end (Anthropic ``cache_control``, Responses
    ``prompt_cache_breakpoint``): after ``chars`` characters of chat message ``message``'s text
    content (None: after the whole message, its turn closer included), kept ``ttl`` seconds (None:
    the server's default). Resolved to a token position by the assembly pass (engine/assembly.py)."""
    message: int
    chars: int | None = None
    ttl: float | None = None


class ClientGone(RuntimeError):
    """The client disconnected before or during generation."""


class ContextLengthExceeded(ValueError):
    """The prompt does not fit the model's context window (a client error: 400)."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
            f"{prompt_tokens} tokens (at least 1 more is needed for the reply). Please reduce the length of "
            "the messages, or raise MAX_KV_SIZE if the model supports a longer context.")
        self.prompt_tokens = prompt_tokens
        self.limit = limit


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
    # the submitter's hang-up probe (server/common/job_adapter.py polls the client's socket), asked
    # by the runner between forwards; a job nobody can cancel gets an event nobody sets (a probe
    # that is data, not a function of the engine's: tests/test_boundaries.py)
    is_cancelled: Callable[[], bool] = threading.Event().is_set
    on_prompt: Callable[["PromptReady"], None] = lambda _p: None
    tool_choice: str | dict | None = None        # none | auto | required | {"type": "function", ...}
    parallel_tool_calls: bool = True             # false: at most one call (anthropic disable_parallel_tool_use)
    prefill_only: bool = False                   # WARM_PROMPTS: prefill and store, no reply
    response_format: dict | None = None         # {"type": "text" | "json_object" | "json_schema", ...}
    sampling_origin: dict[str, str] = field(default_factory=dict)   # field -> request | generation_config | ...
    # cache diagnoses (cache/diagnosis.py): the id clients know this reply by (its fingerprint is
    # kept under it), whether the client asked for a diagnosis, and the reply it compares with
    response_id: str = ""
    diagnose: bool = False
    compare_to: str | None = None
    # client cache controls: stored-entry boundaries and the lifetime asked for the rest (seconds)
    breakpoints: tuple[CacheBreakpoint, ...] = ()
    cache_ttl: float | None = None
    api: str = ""                                # the front it came in by: chat | responses | messages
    # the cache scope (cache/summary.py scope_of: the tenant the front door vouched for and the
    # request's cache_salt; "" = the default scope): entries, sessions, healing and diagnoses of
    # one scope are never seen, reused or timed by another
    scope: str = ""
    # who goes first (scheduler/priority.py: lower first) and where that came from: request |
    # header | a client shape's marker | default
    priority: int = 0
    priority_source: str = "default"
    # a text completion's prompt (POST /v1/completions) instead of a chat: token ids and text
    # pieces in order (a text piece encoded as it stands, added tokens parsed, nothing added; a
    # prompt that opens with text gets the tokenizer's own leading tokens). No chat template, no
    # canonical key, no turn or healing records: the model sees exactly these tokens and the
    # cache is looked up, reused and stored on them alone. None: a chat job (``messages``).
    raw_prompt: list | None = None


@dataclass
class CacheReport:
    """What the cache did for one request (hashes and counts, never text): the tier that served
    the prefix, tokens reused, the comparison with the session's previous request and with the
    request the client named, and the prompt tokens this request handed to the cache."""
    tier: str                     # ram | disk | none
    match: str                    # exact | prefix | ... | miss
    cached: int
    prompt: int
    session: Any = None           # cache/diagnosis.Diagnosis vs the session's previous request (None: first)
    asked: Any = None             # Diagnosis vs the named reply (None: not asked)
    written: int = 0              # prompt tokens stored by this request (cache_creation / cache_write)
    segments: tuple = ()          # cache/lifetimes.Segment: the written tokens by breakpoint and lifetime
    breakpoints: tuple = ()       # (token position, applied lifetime) of the client's breakpoints


@dataclass(frozen=True)
class PromptReady:
    """Sent once the prompt is rendered and looked up: does the output start inside a <think>
    block, and what did the cache do (None: no report, e.g. a replayed job)?"""
    thinking_started: bool
    cache: CacheReport | None = None


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
    logprobs: list[dict] | None = None
    cache: CacheReport | None = None


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
    generation_text: str = ""                    # what the generation prompt appended to the history
    history_end: int = 0                         # tokens of the rendered history (no generation prompt)
    renders: int = 0                             # chat-template renders this prompt cost
    breakpoints: list[tuple[int, float | None]] = field(default_factory=list)   # (token position, asked ttl)
    # NORMALIZE_WRITE_TOOL_CONTENT_FOR_PROMPT replaced old write contents in original / canonical:
    # the conversation as the client sent it (healed; original and canonical), which the healing
    # digest and the session records keep following. None = original / canonical themselves.
    sent: list[dict] | None = None
    sent_canonical: list[dict] | None = None

    def __post_init__(self) -> None:
        self.model_np = as_tokens(self.model_tokens)
        self.key_np = self.model_np if self.key_tokens is self.model_tokens else as_tokens(self.key_tokens)

    @property
    def history_messages(self) -> list[dict]:
        """The messages a healing-store digest covers (as sent, never normalised)."""
        return self.original if self.sent is None else self.sent

    @property
    def record_canonical(self) -> list[dict]:
        """The canonical messages the turn store and the session id follow (as sent)."""
        return self.canonical if self.sent_canonical is None else self.sent_canonical

    def extended(self, text: str, ids: list[int]) -> "PreparedPrompt":
        """The prompt with the start of the reply forced (``text`` encoded as ``ids``)."""
        key = self.model_tokens + ids if self.key_tokens is self.model_tokens else self.key_tokens + ids
        model = self.model_tokens + ids
        return PreparedPrompt(self.original, self.canonical, self.model_text + text, model,
                              model if self.key_tokens is self.model_tokens else key, self.key_delta_chars, self.extras,
                              generation_text=self.generation_text, history_end=self.history_end,
                              renders=self.renders, sent=self.sent, sent_canonical=self.sent_canonical,
                              breakpoints=self.breakpoints)


@dataclass(eq=False)       # identity: a request is itself, never "equal" to another
class Request:
    """One request between start() and finish(): its prompt, cache, and decode state."""
    job: ChatJob
    prep: PreparedPrompt
    session: SessionContext
    match: MatchResult
    stable_msgs: int
    live: LiveCache
    start: int                        # KV depth reused from the cache
    thinking_started: bool
    checkpoints: list[int]            # absolute depths to snapshot during prefill
    history_end: int                  # where the rendered history ends (generation prompt excluded)
    params: SamplingParams
    t0: float
    t_prep: float
    deadline: float | None
    snapshots: list[KVState] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    visible: list[str] = field(default_factory=list)
    finish_reason: str = "length"
    stopped_by_string: bool = False
    watchdog: bool = False
    t_first: float = 0.0
    t_end: float = 0.0
    sampler: Sampler | None = None
    forced: str = ""                  # reply text the engine wrote for the model (tool_choice, JSON mode)
    from_disk: bool = False           # the reused KV was loaded from the disk tier
    # incremental prefill / decode state (engine/core.py drives these step by step)
    pos: int = -1                     # next prompt token to feed (-1: not started)
    logits: Any = None                # after the last prompt token
    prefill_aborted: bool = False
    stopper: Any = None
    harmony_stop: Any = None
    detok: Any = None
    pending: Any = None               # sampled, not yet read, next token (lazy mx array)
    tail: bool = False                # ``pending`` is the last PROMPT token, fed by the next decode step
    produced: int = 0
    queued_at: float = 0.0            # when the HTTP layer submitted it (queue wait)
    batch_sizes: list[int] = field(default_factory=list)
    closed: list[int] | None = None   # the turn was closed in the KV already: what it holds after the prompt
    stored: bool = False              # finish() / store_turn() stored (or salvaged) the turn: never twice
    spec: Any = None                  # runner/spec/speculation.RowSpec: drafter + draft control (None: no drafts)
    calls: Any = None                 # parsing/call_gate.CallGate (None: the reply cannot call tools)
    stops: list[int] = field(default_factory=list)   # depths a prefill chunk ends at (others fork there)
    follows: Any = None               # (leader Request, depth): waits to take the leader's first tokens
    shared_prefill: int = 0           # prompt tokens taken from another request's prefill (not computed)
    fingerprint: Any = None           # cache/diagnosis.Fingerprint of the prompt (None: not taken)
    cache_report: CacheReport | None = None
    lifetimes: dict[int, float] = field(default_factory=dict)   # snapshot depth -> applied lifetime (breakpoints)
    record_session: str | None = None # the session its records are kept under (finish.py ``record_session``)
    status: RequestStatus = RequestStatus.WAITING   # set at every transition (engine/core.py)
    preempted_at: float = 0.0         # when it last left the batch for a more urgent request
    preemptions: int = 0              # times it did
    shielded: bool = False            # came back by waiting: not preempted again (no starvation)
    decode_model: Any = None          # what this row's decode steps call, when not the model's own
                                      # (a VLM: its language model at this prompt's rope offset)
