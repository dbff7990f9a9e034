"""The live dashboard: static routes (no traversal) and a headless-Chromium check of the charts.

    pytest tests/test_dashboard.py -q          # needs Debian's chromium (apt-get install -y chromium)

The browser test drives /usr/bin/chromium through Playwright's Python package with
``executable_path`` (no Playwright browser download), waits until every chart has data points
(``window.dashboardState.points``), and saves ``dashboard.png`` under the test's tmp_path.
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mlxstack.observability.dashboard import DASHBOARD_DIR, dashboard_assets
from tests.conftest import LiveServer, engine_settings, http_json

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def get(url: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("Content-Type", "")


@pytest.fixture(scope="module")
def dash_server(embedded_model_path, tmp_path_factory):
    server = LiveServer(engine_settings(None, log_root=str(tmp_path_factory.mktemp("dash-logs"))))
    try:
        conversation = [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": "What is the capital of France?"}]
        for turn in range(3):  # a cold turn, then growing warm turns of the same conversation
            status, body, _ = http_json(f"{server.base}/v1/chat/completions",
                                        {"model": "SmolLM2-135M-Instruct", "messages": conversation,
                                         "max_tokens": 8})
            assert status == 200, body
            conversation += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                             {"role": "user", "content": f"And one more fact, number {turn + 1}?"}]
        yield server
    finally:
        server.close()


def test_assets_are_the_folder_files_only():
    assets = dashboard_assets()
    assert assets["/dashboard"] == DASHBOARD_DIR / "index.html"
    assert {"/dashboard/dashboard.js", "/dashboard/dashboard.css", "/dashboard/vendor/uPlot.iife.min.js",
            "/dashboard/vendor/uPlot.min.css", "/dashboard/vendor/uPlot.LICENSE"} <= set(assets)
    assert not any(url.endswith(".py") for url in assets)
    assert all(p.resolve().is_relative_to(DASHBOARD_DIR) for p in assets.values())


@pytest.mark.slow
def test_routes_serve_pages_and_refuse_traversal(dash_server):
    base = dash_server.base
    status, body, ctype = get(f"{base}/dashboard")
    assert status == 200 and ctype.startswith("text/html") and b"/v1/cache/stats" in body
    status, body, ctype = get(f"{base}/dashboard/vendor/uPlot.iife.min.js")
    assert status == 200 and ctype.startswith("application/javascript") and b"uPlot" in body
    for bad in ("/dashboard/__init__.py", "/dashboard/../api/app.py", "/dashboard/%2e%2e/api/app.py",
                "/dashboard/vendor/../../metrics.py", "/dashboard/nope.js"):
        status, _, _ = get(base + bad)
        assert status == 404, bad


@contextmanager
def dashboard_page(base: str, tmp_path: Path):
    """(a headless Chromium page with ``base``'s dashboard loaded, the page errors it raises)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=[a for a in CHROMIUM_ARGS if a != "--headless"], viewport={"width": 1440, "height": 1100},
            # the test process may run with OpenBLAS in LD_PRELOAD (test_runner); Chromium crashes with it
            env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
        try:
            page = ctx.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{base}/dashboard", wait_until="load")
            yield page, errors
        finally:
            ctx.close()


@pytest.mark.e2e
def test_dashboard_renders_charts_in_headless_chromium(dash_server, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent: install Debian's chromium (apt-get install -y chromium) to run it")

    # One non-zero correctness counter, so the red highlight is checked too (reset afterwards).
    counters = dash_server.app.state.counters
    counters.bump("hybrid_trim_miss")
    shot = tmp_path / "dashboard.png"
    try:
        with dashboard_page(dash_server.base, tmp_path) as (page, errors):
            page.wait_for_function(
                "() => { const s = window.dashboardState; return s && s.refreshes >= 2 && "
                "s.points.ttft > 0 && s.points.speed > 0 && s.points.match > 0 && s.points.memory > 1; }",
                timeout=20_000)
            state = page.evaluate("window.dashboardState")
            page.screenshot(path=str(shot), full_page=True)
            nonzero = page.eval_on_selector_all("#correctness .ctile.nonzero", "els => els.map(e => e.dataset.counter)")
            zero = page.eval_on_selector_all("#correctness .ctile:not(.nonzero)", "els => els.map(e => e.dataset.counter)")
            table_rows = page.eval_on_selector_all("#recent tbody tr", "els => els.length")
            canvases = page.eval_on_selector_all("canvas", "els => els.length")
    finally:
        counters.bump("hybrid_trim_miss", -1)

    assert errors == []
    assert state["errors"] == 0
    assert state["points"]["ttft"] == state["points"]["match"] == 3
    assert state["recentRows"] == 3 and table_rows == 3
    assert canvases == 4
    assert nonzero == ["hybrid_trim_miss"]
    assert sorted(zero) == ["exact_key_rejected_by_model_lcp", "vlm_retreat"]
    assert state["correctness"]["hybrid_trim_miss"] == 1
    assert sum(state["hits"].values()) >= 2 and state["misses"] == 1
    assert shot.exists() and shot.stat().st_size > 20_000
    if os.environ.get("DASHBOARD_SCREENSHOT_DIR"):  # CI artefact: keep the picture past tmp_path
        keep = Path(os.environ["DASHBOARD_SCREENSHOT_DIR"])
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, keep / "dashboard.png")


# ------------------------------------------------------------------ why the cache reused what it did
EXPLAIN_SYSTEM = "You are a helpful assistant."
EXPLAIN_MAX_TOKENS = 8   # every reply is cut by max_tokens: all of its tokens are in the next turn's reach


@pytest.fixture(scope="module")
def explain_server(embedded_model_path, tmp_path_factory):
    """A chat session of 3 turns whose third edits its first user message, then an Anthropic
    request in a session of its own; yields (server, [(api, usage), ...])."""
    server = LiveServer(engine_settings(None, log_root=str(tmp_path_factory.mktemp("dash-explain-logs"))))
    try:
        answered = []
        first = {"role": "user", "content": "Name a fruit."}
        conversation = [{"role": "system", "content": EXPLAIN_SYSTEM}, first]
        for turn in range(3):
            if turn == 2:
                conversation[1] = {"role": "user", "content": "Name a vegetable."}
            status, body, _ = http_json(f"{server.base}/v1/chat/completions",
                                        {"model": "SmolLM2-135M-Instruct", "messages": conversation,
                                         "max_tokens": EXPLAIN_MAX_TOKENS, "prompt_cache_key": "dash-explain"})
            assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
            answered.append(("chat", body["usage"]))
            conversation += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                             {"role": "user", "content": f"And one more, number {turn + 2}?"}]
        status, body, _ = http_json(f"{server.base}/v1/messages",
                                    {"model": "SmolLM2-135M-Instruct", "system": "Be terse.", "max_tokens": 4,
                                     "messages": [{"role": "user", "content": "Say hi."}]},
                                    headers={"x-claude-code-session-id": "dash-messages"})
        assert status == 200, body
        answered.append(("messages", body["usage"]))
        yield server, answered
    finally:
        server.close()


@pytest.mark.e2e
def test_explain_panel_names_tier_reuse_and_the_first_divergence(explain_server, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent: install Debian's chromium (apt-get install -y chromium) to run it")

    server, answered = explain_server
    with dashboard_page(server.base, tmp_path) as (page, errors):
        page.wait_for_function("() => document.querySelectorAll('#explain tbody tr[data-request]').length === 4",
                               timeout=20_000)
        cells = page.eval_on_selector_all(
            "#explain tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
        miss_rows = page.eval_on_selector_all("#explain tbody tr.missrow", "els => els.length")
        page.screenshot(path=str(tmp_path / "explain.png"), full_page=True)
    assert errors == []

    rows = http_json(f"{server.base}/v1/cache/stats")[1]["recent"]
    chat = [u for api, u in answered if api == "chat"]
    prompt = [u["prompt_tokens"] for u in chat]
    read = [u["prompt_tokens_details"]["cached_tokens"] for u in chat]
    written = [u["prompt_tokens_details"]["cache_write_tokens"] for u in chat]
    left = [p + EXPLAIN_MAX_TOKENS for p in prompt]       # prompt and reply: what the next turn can reuse
    # turn 3 parts from turn 2 inside message 1: the server reuses up to the first differing token, the
    # digests vouch for the whole 16-token blocks before it
    common = read[2] // 16 * 16
    assert 16 <= read[2] < left[1] and rows[2]["cache_diagnosis"]["common"] == common
    msgs = answered[3][1]
    n_msgs = msgs["input_tokens"] + msgs["cache_read_input_tokens"] + msgs["cache_creation_input_tokens"]
    assert msgs["cache_read_input_tokens"] == 0 and msgs["cache_creation_input_tokens"] == n_msgs
    # newest first; the time column is the browser's clock format and is left out
    assert [c[:1] + c[2:] for c in cells] == [
        ["4", "messages", "dash-messages", "none", str(n_msgs), "0", str(n_msgs), "",
         "first request of its session"],
        ["3", "chat", "dash-explain", "ram", str(prompt[2]), str(read[2]), str(written[2]), "message 1 content",
         f"miss: message 1 content changed; {left[1] - read[2]} of {left[1]} reusable tokens not reused, "
         f"the prompts part at token {common}"],
        ["2", "chat", "dash-explain", "ram", str(prompt[1]), str(read[1]), str(written[1]), "",
         f"hit: continues the previous request ({left[0]} tokens in common)"],
        ["1", "chat", "dash-explain", "none", str(prompt[0]), "0", str(prompt[0]), "",
         "first request of its session"]]
    assert miss_rows == 1
    assert [w + r for w, r in zip(written, read)] == prompt
