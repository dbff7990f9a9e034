"""The live cache dashboard: ``GET /dashboard`` and the static files beside this module.

    install_dashboard(app)      # server/common/features.py does this once the model is loaded
    open http://127.0.0.1:8080/dashboard

The page (index.html + dashboard.js/.css, no build step) polls ``/v1/cache/stats`` every 2 s and
draws with uPlot, vendored under ``vendor/`` (MIT, see vendor/uPlot.LICENSE; from npm
``uplot@1.6.32``, files ``dist/uPlot.iife.min.js`` and ``dist/uPlot.min.css``) so nothing is
fetched from a CDN at run time.

Only the files present in this folder at install time, with a known suffix, get a route: a
request path is looked up in that table, never joined onto the file system, so ``..`` cannot
escape the folder.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

DASHBOARD_DIR = Path(__file__).resolve().parent
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "application/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".LICENSE": "text/plain; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}


def dashboard_assets(folder: Path = DASHBOARD_DIR) -> dict[str, Path]:
    """URL path → file for every servable file under ``folder`` (``/dashboard`` is index.html)."""
    assets: dict[str, Path] = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.suffix in CONTENT_TYPES and not any(part.startswith(".") for part in p.parts):
            assets["/dashboard/" + p.relative_to(folder).as_posix()] = p
    if "/dashboard/index.html" in assets:
        assets["/dashboard"] = assets["/dashboard/index.html"]
    return assets


def install_dashboard(app: Any, folder: Path = DASHBOARD_DIR) -> dict[str, Path]:
    """Register one GET route per dashboard file on ``app.extra_get_routes``."""
    assets = dashboard_assets(folder)
    for url, path in assets.items():
        app.extra_get_routes[url] = (lambda h, p=path: _serve(h, p))
    return assets


def _serve(h: Any, path: Path) -> None:
    # Read per request so an edited page shows on reload; the files are small.
    h._send(200, path.read_bytes(), CONTENT_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})
