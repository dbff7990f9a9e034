"""GET /metrics on a live server (embedded SmolLM2): Prometheus text parsed back into values.

    pytest tests/test_metrics.py -q
"""
from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import LiveServer, engine_settings, http_json

pytestmark = pytest.mark.slow  # a live server on the embedded model, ~20 s to start here (docs/testing.md#tiers)

PROMPT = [{"role": "system", "content": "You are a terse assistant."},
          {"role": "user", "content": "Name three colours of the rainbow."}]


def chat(base: str, messages: list[dict]) -> dict:
    status, body, _ = http_json(f"{base}/v1/chat/completions",
                                {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 6,
                                 "temperature": 0})
    assert status == 200, body
    return body


def scrape(base: str) -> tuple[dict[tuple[str, tuple], float], str, str]:
    """({(sample name, sorted labels): value}, content type, raw text)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        ctype, text = resp.headers["Content-Type"], resp.read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, ctype, text


def wait_for(base: str, name: str, labels: tuple, value: float, timeout: float = 5.0) -> dict:
    """The HTTP status is counted just after the body is written: poll briefly for it."""
    deadline = time.monotonic() + timeout
    while True:
        samples, _, _ = scrape(base)
        if samples.get((name, labels)) == value or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


@pytest.fixture(scope="module")
def served(embedded_model_path, tmp_path_factory):
    server = LiveServer(engine_settings(None, log_root=str(tmp_path_factory.mktemp("metrics-logs"))))
    try:
        chat(server.base, PROMPT)
        chat(server.base, PROMPT)  # the same prompt again: a cache hit
        yield server
    finally:
        server.close()


def test_content_type_is_prometheus_text_004(served):
    _, ctype, text = scrape(served.base)
    assert ctype.startswith("text/plain; version=0.0.4")
    assert "# TYPE mlxstack_ttft_seconds histogram" in text
    assert "# HELP mlxstack_cache_correctness_total" in text


def test_request_and_token_counters(served):
    samples = wait_for(served.base, "mlxstack_http_responses_total", (("status", "200"),), 2.0)
    assert samples[("mlxstack_http_responses_total", (("status", "200"),))] == 2.0
    assert samples[("mlxstack_requests_total", ())] == 2.0
    row = served.app.state.stats()["recent"]
    assert samples[("mlxstack_cached_tokens_total", ())] == sum(r["cached_tokens"] for r in row)
    assert samples[("mlxstack_prefilled_tokens_total", ())] == sum(r["prefilled_tokens"] for r in row)
    assert samples[("mlxstack_cached_tokens_total", ())] > 0  # the repeat reused the first turn


def test_hits_misses_and_correctness(served):
    samples, _, _ = scrape(served.base)
    hits = {dict(labels)["match_type"]: v for (name, labels), v in samples.items()
            if name == "mlxstack_cache_hits_total"}
    assert set(hits) >= {"exact", "prefix", "supersequence", "lcp", "session", "snapshot"}
    assert sum(hits.values()) >= 1
    assert samples[("mlxstack_cache_misses_total", ())] == 1.0
    for kind in ("vlm_retreat", "hybrid_trim_miss", "exact_key_rejected_by_model_lcp"):
        assert samples[("mlxstack_cache_correctness_total", (("kind", kind),))] == 0.0
    assert samples[("mlxstack_client_disconnects_total", ())] == 0.0
    assert samples[("mlxstack_watchdog_aborts_total", ())] == 0.0
    assert samples[("mlxstack_cache_evictions_total", ())] == 0.0


def test_gauges(served):
    samples, _, _ = scrape(served.base)
    stats = served.app.state.stats()
    assert samples[("mlxstack_cache_bytes", ())] == stats["bytes"] > 0
    assert samples[("mlxstack_cache_budget_bytes", ())] == stats["budget_bytes"] > 0
    assert samples[("mlxstack_cache_entries", ())] == stats["entries"] >= 1
    assert samples[("mlxstack_queue_depth", ())] == 0.0
    assert samples[("mlxstack_model_ready", ())] == 1.0
    assert samples[("mlxstack_model_info", (("family", "generic"), ("model", "SmolLM2-135M-Instruct")))] == 1.0


def test_histograms_fed_per_request(served):
    samples, _, _ = scrape(served.base)
    assert samples[("mlxstack_ttft_seconds_count", ())] == 2.0
    assert samples[("mlxstack_ttft_seconds_bucket", (("le", "+Inf"),))] == 2.0
    assert samples[("mlxstack_ttft_seconds_sum", ())] > 0
    assert samples[("mlxstack_request_duration_seconds_count", ())] == 2.0
    assert samples[("mlxstack_cache_reuse_ratio_count", ())] == 2.0
    # Both requests prefilled something (a full hit still prefills the last prompt token) and decoded.
    assert 1.0 <= samples[("mlxstack_prefill_tokens_per_second_count", ())] <= 2.0
    assert samples[("mlxstack_decode_tokens_per_second_count", ())] == 2.0


def test_registry_is_not_the_global_one(served):
    from prometheus_client import REGISTRY

    assert served.app.metrics.registry is not REGISTRY
    assert REGISTRY.get_sample_value("mlxstack_requests_total") is None
