"""The live dashboard: static routes (no traversal) and a headless-Chromium check of the charts.

    pytest tests/test_dashboard.py -q          # needs Debian's chromium (apt-get install -y chromium)

The browser test drives /usr/bin/chromium through Playwright's Python package with
``executable_path`` (no Playwright browser download), waits until every chart has data points
(``window.dashboardState.points``), and saves ``dashboard.png`` under the test's tmp_path.
"""
from __future__ import annotations

import os
import shutil
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


def test_dashboard_renders_charts_in_headless_chromium(dash_server, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent: install Debian's chromium (apt-get install -y chromium) to run it")
    from playwright.sync_api import sync_playwright

    # One non-zero correctness counter, so the red highlight is checked too (reset afterwards).
    counters = dash_server.app.state.counters
    counters.bump("hybrid_trim_miss")
    shot = tmp_path / "dashboard.png"
    try:
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
                page.goto(f"{dash_server.base}/dashboard", wait_until="load")
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
                ctx.close()
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
