"""Per-request session logs: fields written by a live server, size cap, line cap, failures swallowed.

    pytest tests/test_request_log.py -q
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from types import SimpleNamespace

import pytest

from mlxstack.observability.request_log import (RequestLogger, build_record, log_files, read_records,
                                                session_file_name)
from tests.conftest import LiveServer, engine_settings, http_json


def fake_row(session: str = "abcdef0123456789", n_tokens: int = 5, key_tokens: list[int] | None = None,
             text: str = "hello world", ts: float | None = None) -> dict:
    tokens = list(range(n_tokens))
    prep = SimpleNamespace(model_text="<|im_start|>user\nhi<|im_end|>", model_tokens=tokens,
                           key_tokens=tokens if key_tokens is None else key_tokens)
    return {
        "time": ts or time.time(), "request_id": "req123", "session": session, "prompt_tokens": n_tokens,
        "cached_tokens": 2, "prefilled_tokens": n_tokens - 2, "completion_tokens": 3, "match_type": "prefix",
        "finish_reason": "stop", "ttft_s": 0.1, "prefill_tok_s": 100.0, "decode_tok_s": 50.0, "total_s": 0.2,
        "stable_prefix_msgs": 1, "key_delta_chars": 0, "prepare_ms": 1.5,
        "prep": prep, "outcome": SimpleNamespace(text=text, aborted=False),
        "job": SimpleNamespace(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]),
    }


# ---------------------------------------------------------------- live server

@pytest.fixture(scope="module")
def logged_server(embedded_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("request-logs")
    server = LiveServer(engine_settings(None, enable_request_logging="true", log_root=str(root)))
    try:
        yield server, root
    finally:
        server.close()


@pytest.mark.slow
def test_live_server_writes_session_log(logged_server):
    server, root = logged_server
    messages = [{"role": "user", "content": "Say hello."}]
    replies = []
    for _ in range(2):
        status, body, _ = http_json(f"{server.base}/v1/chat/completions",
                                    {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 5,
                                     "user": "log-test-session"})
        assert status == 200, body
        replies.append(body["choices"][0]["message"]["content"])
    assert server.app.state.request_logger.flush(10)
    files = log_files(root)
    assert len(files) == 1, files
    path = files[0]
    assert path.parent.name == time.strftime("%Y-%m-%d")
    assert path.name.startswith("cache-session-") and path.suffix == ".log"
    recs = list(read_records(path))
    assert len(recs) == 2
    first, second = recs
    for rec in recs:
        assert rec["v"] == 1 and rec["model"] == "SmolLM2-135M-Instruct"
        assert rec["prompt_sha256"] == hashlib.sha256(rec["model_text"].encode()).hexdigest()
        assert rec["model_tokens"] and rec["key_tokens"]
        assert set(rec["cache"]) == {"match_type", "prompt_tokens", "cached_tokens", "prefilled_tokens",
                                     "stable_prefix_msgs", "key_delta_chars", "cache_tier", "cache_written",
                                     "cache_explain", "cache_diagnosis"}
        assert rec["cache"]["prompt_tokens"] == len(rec["model_tokens"])
        assert set(rec["timings"]) == {"ttft_s", "prefill_tok_s", "decode_tok_s", "total_s", "prepare_ms"}
        assert set(rec["speculation"]) == {"proposed", "accepted"}
        assert 0 <= rec["speculation"]["accepted"] <= rec["speculation"]["proposed"]
        assert rec["scheduling"] == {"priority": 0, "from": "default", "preemptions": 0}
        assert rec["output"]["finish_reason"] in ("stop", "length")
        assert rec["message_roles"] == ["user"]
        assert path.name == session_file_name(rec["session"])   # msg:<digest> is written as msg_<digest>
        assert rec["truncated"] == []
    assert first["cache"]["match_type"] == "miss"
    assert second["cache"]["match_type"] != "miss" and second["cache"]["cached_tokens"] > 0
    # the explanation (cache/diagnosis.py): the first request has nothing to compare with; the
    # repeat reuses all but the last prompt token of the session's previous request
    n = first["cache"]["prompt_tokens"]
    assert (first["cache"]["cache_tier"], first["cache"]["cache_written"], first["cache"]["cache_explain"]) == \
        ("none", n, "first")
    assert (second["cache"]["cache_tier"], second["cache"]["cached_tokens"], second["cache"]["cache_written"],
            second["cache"]["cache_explain"]) == ("ram", n - 1, 1, "hit")
    assert second["cache"]["cache_diagnosis"] == {"status": "hit", "where": None, "message": None, "field": None,
                                                  "missed": 0, "common": n // 16 * 16, "previous": n - 1}
    assert first["prompt_sha256"] == second["prompt_sha256"]
    rows = server.app.state.stats()["recent"]
    assert [r["request_id"] for r in rows[-2:]] == [first["request_id"], second["request_id"]]
    assert [r["output"]["text_head"] for r in recs] == [t[:200] for t in replies]


# ---------------------------------------------------------------- records

def test_record_fields_and_key_compression():
    rec = build_record(fake_row(), model="m")
    assert rec["key_same_as_model"] is True and rec["key_tokens"] is None
    assert rec["model_tokens"] == [0, 1, 2, 3, 4]
    assert rec["output"] == {"completion_tokens": 3, "finish_reason": "stop", "aborted": False,
                             "text_head": "hello world"}
    assert rec["message_roles"] == ["system", "user"]
    json.dumps(rec)  # serialisable as is

    diff = build_record(fake_row(key_tokens=[0, 1, 9]), decode=lambda toks: "/".join(map(str, toks)))
    assert diff["key_same_as_model"] is False and diff["key_tokens"] == [0, 1, 9]
    assert diff["key_text"] == "0/1/9"


def test_long_token_lists_and_text_are_capped():
    rec = build_record(fake_row(n_tokens=100, key_tokens=list(range(50)), text="x" * 1000), max_tokens=64,
                       max_text=10)
    assert rec["model_tokens"] is None and rec["key_tokens"] == list(range(50))
    assert rec["model_text"] == "<|im_start|>"[:10]
    assert rec["output"]["text_head"] == "x" * 200
    assert "model_tokens" in rec["truncated"] and "model_text" in rec["truncated"]


def test_read_records_restores_key_tokens(tmp_path):
    logger = RequestLogger(tmp_path, 10**9)
    path = logger.write(fake_row())
    (rec,) = read_records(path)
    assert rec["key_tokens"] == rec["model_tokens"] == [0, 1, 2, 3, 4]


def test_session_file_name_is_safe():
    assert session_file_name("../../etc/passwd") == "cache-session-______etc_passwd.log"
    assert session_file_name("") == "cache-session-nosession.log"
    assert session_file_name("0123456789abcdefEXTRA") == "cache-session-0123456789abcdef.log"


# ---------------------------------------------------------------- size cap

def test_size_cap_deletes_oldest_files_first(tmp_path):
    day = tmp_path / "2024-01-01"
    day.mkdir()
    old = []
    for i in range(3):  # three old sessions of 1000 bytes, mtimes 100 s apart, oldest first
        p = day / f"cache-session-old{i}.log"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (1_000_000 + 100 * i, 1_000_000 + 100 * i))
        old.append(p)
    logger = RequestLogger(tmp_path, max_bytes=3000)
    assert logger._total == 3000
    new = logger.write(fake_row(session="new-session"))
    size_new = new.stat().st_size
    assert 0 < size_new < 1000
    # 3000 + new > cap: only the oldest goes, and the total is back under the cap.
    assert [p.exists() for p in old] == [False, True, True]
    assert new.exists()
    assert sum(p.stat().st_size for p in log_files(tmp_path)) == 2000 + size_new <= 3000
    assert logger._total == 2000 + size_new

    logger.max_bytes = 1500
    removed = logger.prune()
    assert removed == old[1:]
    assert not day.exists()  # emptied day folders go too
    assert log_files(tmp_path) == [new]


def test_background_writer_and_failures_never_raise(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the log root should be")
    logger = RequestLogger(blocker, max_bytes=10**6)
    logger.submit(fake_row())
    logger.submit({"prep": object()})  # malformed row: skipped, not raised
    assert logger.flush(5)
    assert logger.failures == 2 and logger.written == 0

    good = RequestLogger(tmp_path / "logs", max_bytes=10**6)
    for i in range(5):
        good.submit(fake_row(session=f"s{i % 2}"))
    assert good.flush(5)
    assert good.written == 5
    assert sorted(p.name for p in log_files(tmp_path / "logs")) == ["cache-session-s0.log", "cache-session-s1.log"]


# ---------------------------------------------------------------- privacy (issue 10, item 11)

def test_logs_are_private_from_creation(tmp_path):
    old = os.umask(0o022)  # a typical umask would make files 0644 and folders 0755
    try:
        root = tmp_path / "logs"
        logger = RequestLogger(root, 10**9)
        path = logger.write(fake_row())
        assert oct(root.stat().st_mode & 0o777) == "0o700"
        assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        logger.write(fake_row())  # appending keeps the mode
        assert oct(path.stat().st_mode & 0o777) == "0o600" and len(list(read_records(path))) == 2
        logger.close()
    finally:
        os.umask(old)


def test_readable_logs_from_older_versions_are_tightened(tmp_path):
    day = tmp_path / "2025-01-01"
    day.mkdir(mode=0o755)
    old_log = day / "cache-session-abc.log"
    old_log.write_text("{}\n")
    os.chmod(old_log, 0o644)
    other = tmp_path / "litellm_config.yaml"  # not a session log: left alone
    other.write_text("x")
    os.chmod(other, 0o644)
    logger = RequestLogger(tmp_path, 10**9)
    assert oct(old_log.stat().st_mode & 0o777) == "0o600" and oct(day.stat().st_mode & 0o777) == "0o700"
    assert oct(other.stat().st_mode & 0o777) == "0o644"
    logger.close()
