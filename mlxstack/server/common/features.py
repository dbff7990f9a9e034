"""Wire optional layers into a loaded App (each one a small module of its own).

Keep this a flat list of ``install_*(app)`` calls; each installer registers its own hooks
(``app.state.on_record``, ``app.after_response_hooks``) and routes (``app.extra_get_routes``).
"""
from __future__ import annotations

from typing import Any


def install_features(app: Any) -> None:
    """Called once the model is loaded, on the inference thread."""
    from ...observability.dashboard import install_dashboard
    from ...observability.metrics import install_metrics
    from ...observability.request_log import install_request_log

    install_metrics(app)
    install_request_log(app)
    install_dashboard(app)
