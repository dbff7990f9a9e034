"""What one MLX server holds, for a router placing new sessions (``GET /v1/cache/summary``).

    body = summary_for(app)                           # the route: reads App / EngineState, no MLX
    chain = message_digests(canonical_messages)       # [(digest, chars), ...]: the router's side

The router (a LiteLLM hook) has neither the tokenizer nor the chat template, so it cannot compute
the prompt cache's token block hashes. Both sides *can* compute **message-boundary digests**: a
SHA-256 chain over a normalised fingerprint of each canonical message (role, text, tool calls;
reasoning left out because clients strip it and healing restores it). The server lists the
digests of every session whose KV it still holds (the session's turn-store record: the messages
of its last prompt); the router hashes a request's messages the same way and sends a new session
to the backend holding its deepest digest. A digest is only a hint: reuse is still decided on
model tokens by the server, so a stale or wrong hint costs one cold turn, never a wrong answer.

Also listed, for operators and for comparing replicas: the block-hash chain heads (the last
full-block hash of the deepest entries: the same chained SHA-256 the prompt cache indexes by)
with the namespace seed they hang from; entries, bytes, budget; queue depth and busy.

Thread-safety: the route runs on a handler thread while the inference thread mutates the stores;
it only takes C-level copies (``list(...)``) and the prompt cache's own lock.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import time
import weakref
from typing import Any, Mapping, Sequence

DIGEST_HEX = 32                      # 128 bits: collisions only cost a misplaced session
MAX_PREFIXES = 8192                  # digests listed (most recently used sessions first)
MAX_HEADS = 32                       # deepest entries listed
_ROOT = hashlib.sha256(b"mlxstack.message-digest.v1").digest()


# --- digests (pure; the router imports these) ------------------------------------------------------
def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return json.dumps(content, sort_keys=True, ensure_ascii=False, default=str)
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, Mapping):
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text"):
                out.append(str(part.get("text", "")))
            elif kind in ("image_url", "input_image", "image"):
                ref = part.get("image_url", part.get("source", ""))
                ref = ref.get("url", "") if isinstance(ref, Mapping) and "url" in ref else ref
                blob = json.dumps(ref, sort_keys=True, default=str) if not isinstance(ref, str) else ref
                out.append(f"[image {hashlib.sha256(blob.encode('utf-8', 'replace')).hexdigest()[:16]}]")
            else:
                out.append(f"[{kind}]")
    return "".join(out)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _reply_text(text: str) -> Any:
    """A reply's text, its JSON parsed when it is one object or array (a structured-output client
    echoes the object it parsed, re-serialised: ``JSON.stringify`` drops the spaces)."""
    stripped = text.strip()
    if stripped[:1] in ("{", "[") and stripped[-1:] in ("}", "]"):
        try:
            return json.loads(stripped)
        except ValueError:
            pass
    return text


def message_fingerprint(message: Mapping[str, Any]) -> str:
    """A message as both sides see it: role (developer = system), text (an assistant's JSON reply
    parsed), tool calls (arguments parsed, so re-serialised JSON matches), tool_call_id and name.
    Reasoning is left out."""
    role = message.get("role")
    role = "system" if role == "developer" else role
    calls = []
    for call in message.get("tool_calls") or []:
        if isinstance(call, Mapping):
            fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
            calls.append([fn.get("name"), _arguments(fn.get("arguments"))])
    text: Any = _text_of(message.get("content"))
    if role == "assistant":
        text = _reply_text(text)
    return json.dumps([role, text, calls, message.get("tool_call_id"),
                       message.get("name")], sort_keys=True, ensure_ascii=False, default=str)


def message_digests(messages: Sequence[Mapping[str, Any]], scope: str = "") -> list[tuple[str, int]]:
    """``[(digest_i, chars_i)]``: digest of messages[0..i] (chained SHA-256 over fingerprints) and
    the characters of text up to and including message i (a size the router can rank by). The
    chain of a cache scope starts from its own root: a router placing a request by another
    scope's digests finds none of them."""
    out, chars = [], 0
    parent = _ROOT if not scope else hashlib.sha256(_ROOT + b"\x00scope\x00" + scope.encode()).digest()
    for message in messages:
        if not isinstance(message, Mapping):
            break
        fp = message_fingerprint(message)
        parent = hashlib.sha256(parent + fp.encode("utf-8", "replace")).digest()
        chars += len(fp)
        out.append((parent.hex()[:DIGEST_HEX], chars))
    return out


IMPLICIT_PREFIX = "msg:"
TENANT_HEADER = "x-mlxstack-tenant"  # set by the front door only (the backend key proves it)
_SCOPE_ROOT = b"mlxstack.cache-scope.v1\x00"


def sign_tenant(name: str, key: str) -> str:
    """The tenant header's value: the tenant's name and an HMAC of it under the backend key
    (MLX_API_KEY), so only who holds that key -- the front door -- can name a tenant; a client
    that slips the header into a request (a body's ``extra_headers``) cannot."""
    mac = hmac.new(key.encode(), b"mlxstack-tenant\x00" + name.encode(), hashlib.sha256).hexdigest()[:32]
    return f"{name}.{mac}"


def verify_tenant(value: str, key: str) -> str | None:
    """The tenant a header value names, when ``key`` signed it; None otherwise."""
    name, _, mac = str(value or "").strip().rpartition(".")
    if not name or not key:
        return None
    return name if hmac.compare_digest(sign_tenant(name, key), f"{name}.{mac}") else None


def scope_of(tenant: str, salt: str) -> str:
    """A request's cache scope: its tenant (the front door's word, from the client's key) and its
    ``cache_salt``; "" -- the default scope -- for the master key without a salt. A digest, so
    neither the tenant's name nor the salt is kept, logged or listed anywhere."""
    tenant, salt = str(tenant or "").strip(), str(salt or "")
    if not tenant and not salt:
        return ""
    blob = json.dumps([tenant, salt], ensure_ascii=False).encode("utf-8", "surrogatepass")
    return "s" + hashlib.sha256(_SCOPE_ROOT + blob).hexdigest()[:23]


def opening_session_id(opening: Sequence[Mapping[str, Any]]) -> str:
    """``msg:`` + the digest of a conversation's opening (prompt/session_context.py
    ``session_opening``): the implicit session id, spelled the same by the router and the engine."""
    chain = message_digests(opening)
    return IMPLICIT_PREFIX + (chain[-1][0][:24] if chain else "empty")


# --- the summary (server side) ---------------------------------------------------------------------
_memo: "weakref.WeakKeyDictionary[Any, dict[str, tuple[list, list]]]" = weakref.WeakKeyDictionary()


def _session_digests(turns: Any, session_id: str, messages: list, scope: str = "") -> list[tuple[str, int]]:
    """Digests of one turn-store record in its scope, computed once per record (records are
    replaced, never edited, so the list object identifies the version)."""
    memo = _memo.setdefault(turns, {})
    hit = memo.get(session_id)
    if hit is not None and hit[0] is messages:
        return hit[1]
    digests = message_digests(messages, scope)
    memo[session_id] = (messages, digests)
    return digests


def build_summary(state: Any, *, model_id: str, ready: bool, queue_depth: int, busy: bool,
                  running: int | None = None, now: float | None = None) -> dict:
    """The summary body for one EngineState (``None`` while the model loads). ``running``: sequences
    in flight (a batching scheduler runs several; default 1 when busy)."""
    body: dict[str, Any] = {"object": "cache.summary", "model": model_id, "ready": bool(ready),
                            "queue_depth": int(queue_depth), "busy": bool(busy),
                            "running": int(busy) if running is None else int(running),
                            "digest": "sha256-chain/message-fingerprint/v1", "time": time.time() if now is None else now}
    if state is None:
        body.update(entries=0, bytes=0, sessions=0, prefixes={}, heads=[])
        return body
    pc = state.kv.index
    entries = pc.entries(include_disk=True)
    in_ram = [e for e in entries if e.payload is not None]
    # Most recently used sessions first, so the cap drops the coldest ones.
    held: dict[str, float] = {}
    scopes: dict[str, str] = {}
    for e in entries:
        held[e.session_id] = max(held.get(e.session_id, 0.0), e.last_used)
        scopes[e.session_id] = getattr(e, "scope", "")
    prefixes: dict[str, int] = {}
    for sid in sorted(held, key=held.get, reverse=True):
        messages = state.turns.get(sid)
        if not messages:
            continue
        for digest, chars in _session_digests(state.turns, sid, messages, scopes.get(sid, "")):
            prefixes[digest] = chars
        if len(prefixes) >= MAX_PREFIXES:
            break
    memo = _memo.get(state.turns)
    if memo is not None:
        for sid in [s for s in list(memo) if s not in held]:
            memo.pop(sid, None)
    deepest = sorted(entries, key=lambda e: e.depth, reverse=True)[:MAX_HEADS]
    body.update(
        namespace=bytes(pc.seed).hex()[:DIGEST_HEX] if getattr(pc, "seed", None) is not None else None,
        block_size=pc.config.block_size,
        entries=len(in_ram), disk_only_entries=len(entries) - len(in_ram),
        bytes=sum(e.nbytes for e in in_ram), budget_bytes=int(getattr(state, "cache_budget", 0) or 0),
        tokens=sum(e.depth for e in in_ram), sessions=len(held),
        heads=[{"tokens": e.depth, "head": e.block_hashes[-1].hex()[:DIGEST_HEX] if e.block_hashes else None,
                "session": e.session_id[:16], "in_ram": e.payload is not None} for e in deepest],
        prefixes=dict(list(prefixes.items())[:MAX_PREFIXES]),
    )
    return body


def summary_for(app: Any) -> dict:
    """``GET /v1/cache/summary`` for an App (server/app.py)."""
    scheduler = getattr(app.worker, "core", None)
    running = getattr(scheduler, "active", None)
    return build_summary(app.state, model_id=app.model_id, ready=app.ready, queue_depth=app.worker.queue_depth,
                         busy=app.worker.busy, running=running if isinstance(running, int) else None)
