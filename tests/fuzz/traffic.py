"""Agent traffic as plain data: what the differential fuzzer sends (no MLX, no engine).

    req = Req(rid="r3", session="s1", messages=[...], max_tokens=12)
    wave = [req, ...]               # arrives together: every request is admitted before any replies
    text = block(seed=7, lines=12)  # a deterministic "file" to paste into a message

A wave is the unit of concurrency: its requests are started (rendered, looked up, checked out)
before any of them finishes, so none of them can depend on another's reply -- which is what lets
a cold engine serve the same requests one at a time, in wave order, as the reference.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field

WORDS = ("cache", "token", "prefix", "agent", "branch", "reply", "model", "layer", "value", "file",
         "line", "edit", "tool", "call", "read", "write", "test", "batch", "row", "slab", "root",
         "tail", "disk", "spill", "grammar", "json", "seed", "retry", "fork", "turn")

SYSTEMS = (
    "You are a careful coding agent. Read files before editing them and repeat code exactly.",
    "You are a sub-agent. Search the repository and report what you find in one short paragraph.",
    "You are a reviewer. Point out one defect per reply, briefly.",
)

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@dataclass
class Req:
    """One request, as the engine's ChatJob takes it."""
    rid: str
    session: str
    messages: list[dict]
    max_tokens: int = 12
    temperature: float = 0.0
    seed: int | None = None
    grammar: bool = False             # a JSON schema the reply must match (llguidance, per row)
    hang_up: tuple[str, int] | None = None   # ("prefill" | "decode", after n scheduler steps)
    extends: bool = True              # its reply becomes a conversation the fuzzer may continue
    origin: str = ""                  # the rule that made it (coverage counts)
    scope: str = ""                   # its cache_salt ("": the default scope)
    fresh_scope: bool = False         # the first request of its scope: must reuse nothing
    marks: list = field(default_factory=list)   # cache breakpoints: [message index, chars or None, ttl]
    priority: int = 0                 # scheduler/priority.py: lower first (0 = as every request before)
    arrive: int = 0                   # the scheduler step it arrives at (0: with its wave)

    def key(self) -> str:
        """What the request is, without its id (identical retries share it)."""
        d = asdict(self)
        d.pop("rid")
        return json.dumps(d, sort_keys=True)


@dataclass
class Conversation:
    session: str
    messages: list[dict] = field(default_factory=list)
    scope: str = ""


def block(seed: int, lines: int) -> str:
    """A deterministic source file of ``lines`` lines (~9 tokens each)."""
    rnd = random.Random(seed)
    return "\n".join(f"{rnd.choice(WORDS)}_{i} = {rnd.choice(WORDS)}({rnd.randint(0, 99)})" for i in range(lines))


def sentence(seed: int, words: int) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(max(1, words))) + "?"


def with_user(messages: list[dict], text: str) -> list[dict]:
    return [*messages, {"role": "user", "content": text}]


def edited(messages: list[dict], at: int, text: str) -> list[dict]:
    """The conversation up to its ``at``-th user message, that message's text replaced (a client
    that edits an earlier message and resends: a branch)."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    i = users[at % len(users)]
    return [*messages[:i], {"role": "user", "content": text}]


FAN_OUT_QUESTIONS = ("What is line 3?", "Summarise it.", "Count the lines.", "Which line is last?")


def fan_out(history: list[dict], seed: int, lines: int) -> list[list[dict]]:
    """Four requests extending ``history`` by the same pasted file plus each its own question."""
    shared = block(seed, lines)
    return [with_user(history, shared + "\n" + q) for q in FAN_OUT_QUESTIONS]


def at_once(fn, items: list, timeout: float = 300) -> dict[int, object]:
    """``fn(item)`` for every item, each on its own thread, all started together: index -> result
    (an index is missing when its call raised or did not return in ``timeout``)."""
    import threading

    out: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fn(items[i]))) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out


def wave_json(waves: list[list[Req]]) -> str:
    return json.dumps([[asdict(r) for r in wave] for wave in waves], indent=1)


def waves_from_json(text: str) -> list[list[Req]]:
    out = []
    for wave in json.loads(text):
        out.append([Req(**{**r, "hang_up": tuple(r["hang_up"]) if r["hang_up"] else None}) for r in wave])
    return out
