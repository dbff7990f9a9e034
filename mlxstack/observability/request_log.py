"""Per-request session logs: one JSON line per chat request, one file per session and day.

    LOG_ROOT/<YYYY-MM-DD>/cache-session-<session16>.log      (ENABLE_REQUEST_LOGGING, LOG_MAX_BYTES)

    logger = install_request_log(app)           # server/common/features.py does this once the model is loaded
    for rec in read_records(path): ...          # scripts/diff_turns.py reads them this way

One line (``v`` = 1) holds:
- ``request_id``, ``api`` (the front: chat, responses, messages), ``time`` (ISO local), ``ts`` (epoch),
  ``session`` (16 chars), ``model``
- ``prompt_sha256``: sha256 of the rendered model text; ``key_sha256``: sha256 of the cache-key tokens
- ``message_roles``: roles of the request's messages, in order
- ``cache``: match_type, prompt/cached/prefilled tokens, stable_prefix_msgs, key_delta_chars, and why
  (cache/diagnosis.py): cache_tier (ram / disk / none), cache_written (prompt tokens stored),
  cache_explain (one line) and cache_diagnosis (the comparison with the session's previous request)
- ``timings``: ttft_s, prefill_tok_s, decode_tok_s, total_s, prepare_ms
- ``speculation``: draft tokens proposed and accepted for this reply (SPECULATIVE)
- ``output``: completion_tokens, finish_reason, aborted, ``text_head`` (first 200 characters)
- ``model_text``, ``model_tokens``; ``key_tokens`` (null with ``key_same_as_model: true`` when equal to
  model_tokens; ``read_records`` fills it back in) and ``key_text`` (the decoded key when it differs)
- ``truncated``: fields dropped or cut to keep one line bounded (token lists over MAX_LOG_TOKENS,
  text over MAX_LOG_TEXT_CHARS)

Lines are written by a background thread: a slow disk or a full queue drops a log line, never
delays or fails a request. When the files under LOG_ROOT exceed LOG_MAX_BYTES, the oldest files
(by modification time) are deleted first.

The logs hold full prompts: files are created 0600 inside 0700 folders (mode given at creation,
never chmodded after a write); logs an older version left readable are tightened at start-up.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ..system.secrets import PRIVATE_DIR, PRIVATE_FILE, make_private_dir, open_private_append

log = logging.getLogger("mlxstack.request_log")

LOG_VERSION = 1
MAX_LOG_TOKENS = 65536          # per token list; longer lists are dropped (and noted in "truncated")
MAX_LOG_TEXT_CHARS = 1_000_000  # model_text / key_text beyond this are cut (and noted)
OUTPUT_HEAD_CHARS = 200
FILE_GLOB = "*/cache-session-*.log"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def session_file_name(session: str) -> str:
    safe = _UNSAFE.sub("_", session[:16]) or "nosession"
    return f"cache-session-{safe}.log"


def token_digest(tokens: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()


def _sampling(job: Any) -> dict:
    """The request's sampling values and where each came from (request, generation_config,
    settings; "greedy": a default penalty a temperature-0 request did not get)."""
    params, origin = getattr(job, "params", None), getattr(job, "sampling_origin", None) or {}
    if params is None:
        return {}
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    out = {}
    for name in names:
        value = getattr(params, name, None)
        out[name] = {"value": value, "from": origin.get(name, "request" if value else "off")}
    return out


def build_record(row: dict, *, model: str = "", decode: Callable[[list[int]], str] | None = None,
                 max_tokens: int = MAX_LOG_TOKENS, max_text: int = MAX_LOG_TEXT_CHARS) -> dict:
    """The JSON-ready log record for one ``EngineState.on_record`` row (pure apart from ``decode``)."""
    prep, outcome, job = row.get("prep"), row.get("outcome"), row.get("job")
    ts = float(row.get("time") or time.time())
    truncated: list[str] = []
    model_text = getattr(prep, "model_text", "") or ""
    model_tokens = list(getattr(prep, "model_tokens", []) or [])
    key_tokens = list(getattr(prep, "key_tokens", []) or [])
    key_same = key_tokens == model_tokens
    rec: dict[str, Any] = {
        "v": LOG_VERSION,
        "request_id": row.get("request_id"),
        "api": row.get("api", ""),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 1000):03d}",
        "ts": round(ts, 3),
        "session": row.get("session", ""),
        "model": model,
        "prompt_sha256": hashlib.sha256(model_text.encode("utf-8", "surrogatepass")).hexdigest(),
        "key_sha256": token_digest(key_tokens),
        "message_roles": [m.get("role") for m in (getattr(job, "messages", None) or []) if isinstance(m, dict)],
        "cache": {k: row.get(k) for k in ("match_type", "prompt_tokens", "cached_tokens", "prefilled_tokens",
                                          "stable_prefix_msgs", "key_delta_chars", "cache_tier", "cache_written",
                                          "cache_explain", "cache_diagnosis")},
        "timings": {k: row.get(k) for k in ("ttft_s", "prefill_tok_s", "decode_tok_s", "total_s", "prepare_ms")},
        "speculation": {"proposed": row.get("spec_proposed", 0), "accepted": row.get("spec_accepted", 0)},
        "scheduling": {"priority": row.get("priority", 0), "from": row.get("priority_from", "default"),
                       "preemptions": row.get("preemptions", 0)},
        "sampling": _sampling(job),
        "output": {
            "completion_tokens": row.get("completion_tokens"),
            "finish_reason": row.get("finish_reason"),
            "aborted": bool(getattr(outcome, "aborted", False)),
            "text_head": (getattr(outcome, "text", "") or "")[:OUTPUT_HEAD_CHARS],
        },
        "key_same_as_model": key_same,
    }
    if len(model_text) > max_text:
        model_text = model_text[:max_text]
        truncated.append("model_text")
    rec["model_text"] = model_text
    if len(model_tokens) > max_tokens:
        model_tokens = None
        truncated.append("model_tokens")
    rec["model_tokens"] = model_tokens
    if key_same:
        rec["key_tokens"] = None
    elif len(key_tokens) > max_tokens:
        rec["key_tokens"] = None
        truncated.append("key_tokens")
    else:
        rec["key_tokens"] = key_tokens
    if not key_same and decode is not None:
        try:
            key_text = decode(key_tokens)
            if len(key_text) > max_text:
                key_text = key_text[:max_text]
                truncated.append("key_text")
            rec["key_text"] = key_text
        except Exception as exc:  # noqa: BLE001 - a log detail, not worth failing the line
            rec["key_text"] = None
            truncated.append(f"key_text ({type(exc).__name__})")
    rec["truncated"] = truncated
    return rec


def read_records(path: Path | str) -> Iterator[dict]:
    """Records of one log file, oldest first, with ``key_tokens`` restored where it equals model_tokens."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash mid-write
            if rec.get("key_same_as_model") and rec.get("key_tokens") is None:
                rec["key_tokens"] = rec.get("model_tokens")
            yield rec


def log_files(root: Path | str) -> list[Path]:
    """Session log files under ``root``, oldest (modification time) first."""
    files = []
    for p in Path(root).glob(FILE_GLOB):
        try:
            files.append((p.stat().st_mtime_ns, str(p), p))
        except OSError:
            continue
    return [p for _, _, p in sorted(files)]


def tighten_permissions(root: Path) -> list[Path]:
    """Make session logs 0600 and their day folders 0700 (what older versions left readable);
    returns what changed."""
    changed = []
    for p in log_files(root):
        for target, mode in ((p.parent, PRIVATE_DIR), (p, PRIVATE_FILE)):
            try:
                if target.stat().st_mode & 0o777 != mode:
                    os.chmod(target, mode)
                    changed.append(target)
            except OSError:
                continue
    if changed:
        log.info("request logs: made %d file(s)/folder(s) under %s private", len(changed), root)
    return changed


class RequestLogger:
    """Appends records on a background thread and keeps LOG_ROOT under ``max_bytes``."""

    def __init__(self, root: Path | str, max_bytes: int, *, model: str = "",
                 decode: Callable[[list[int]], str] | None = None, queue_size: int = 256,
                 max_tokens: int = MAX_LOG_TOKENS, max_text: int = MAX_LOG_TEXT_CHARS) -> None:
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.model = model
        self.decode = decode
        self.max_tokens = max_tokens
        self.max_text = max_text
        self.dropped = 0
        self.failures = 0
        self.written = 0
        self._q: "queue.Queue[dict | None]" = queue.Queue(maxsize=queue_size)
        self._total = sum(self._size(p) for p in log_files(self.root)) if self.root.exists() else 0
        if self.root.exists():
            tighten_permissions(self.root)
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # ------------------------------------------------------------------ API
    def submit(self, row: dict) -> None:
        """``EngineState.on_record`` hook; returns at once."""
        try:
            self._q.put_nowait(row)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning("request log queue full: %d line(s) dropped so far", self.dropped)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted row is written (tests, shutdown). True if drained in time."""
        done = threading.Event()
        try:
            self._q.put({"_flush": done}, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self) -> None:
        if self._thread.is_alive():
            self.flush(2.0)
            try:
                self._q.put_nowait(None)
            except queue.Full:
                pass

    def write(self, row: dict) -> Path | None:
        """Write one row now (the background thread's step; errors are logged, never raised)."""
        try:
            rec = build_record(row, model=self.model, decode=self.decode, max_tokens=self.max_tokens,
                               max_text=self.max_text)
            line = (json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8", "replace")
            day = time.strftime("%Y-%m-%d", time.localtime(rec["ts"]))
            path = self.root / day / session_file_name(rec["session"] or "")
            make_private_dir(self.root)
            make_private_dir(path.parent)
            with open_private_append(path) as fh:
                fh.write(line)
            self.written += 1
            self._total += len(line)
            if self._total > self.max_bytes:
                self.prune()
            return path
        except Exception as exc:  # noqa: BLE001 - logging must never take the server down
            self.failures += 1
            log.warning("request log write failed (%s: %s)", type(exc).__name__, exc)
            return None

    def prune(self) -> list[Path]:
        """Delete the oldest session logs until the total is within ``max_bytes``; returns what went."""
        files = log_files(self.root)
        sizes = {p: self._size(p) for p in files}
        total = sum(sizes.values())
        removed: list[Path] = []
        for p in files:
            if total <= self.max_bytes:
                break
            try:
                p.unlink()
            except OSError as exc:
                log.warning("could not remove old request log %s: %s", p, exc)
                continue
            total -= sizes[p]
            removed.append(p)
            try:
                p.parent.rmdir()  # only succeeds once the day folder is empty
            except OSError:
                pass
        self._total = total
        if removed:
            log.info("request logs over LOG_MAX_BYTES=%d: removed %d oldest file(s)", self.max_bytes, len(removed))
        return removed

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _size(p: Path) -> int:
        try:
            return p.stat().st_size
        except OSError:
            return 0

    def _run(self) -> None:
        while True:
            row = self._q.get()
            if row is None:
                return
            if "_flush" in row:
                row["_flush"].set()
                continue
            self.write(row)


def install_request_log(app: Any) -> RequestLogger | None:
    """Attach a RequestLogger to a loaded App when ENABLE_REQUEST_LOGGING is on."""
    s = app.settings
    if not s.enable_request_logging:
        return None
    tokenizer = getattr(app.loaded, "tokenizer", None)
    decode = (lambda toks: tokenizer.decode(toks)) if tokenizer is not None else None
    logger = RequestLogger(s.log_root_path, s.log_max_bytes, model=app.model_id, decode=decode)
    app.state.request_logger = logger
    app.state.on_record.append(logger.submit)
    log.info("request logs: %s (cap %d MiB)", s.log_root_path, s.log_max_bytes // 2**20)
    return logger
