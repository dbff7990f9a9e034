"""The backend a loaded model gets (backends/__init__.py ``select``, engine/factory.py ``install_backend``):
CPU_BACKEND=off / auto and the device choose it, its report says what it turned on and why -- one
log line at load and /health's ``backend`` through the real HTTP server -- an engine built again
reuses the installed backend, and MLX's own backend takes the CPU backend's hooks out again."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import mlx.core as mx

from mlxstack.backends import BackendReport, select
from mlxstack.backends import cascade
from mlxstack.runner.forward import backend_of
from tests.conftest import LiveServer, build_engine, engine_settings, http_json
from tests.test_host_forward import tiny_llama

FEATURES = {"cascade_attention", "cpu_kernels", "native_attention", "host_forward", "native_products",
            "turboquant_coder"}


def test_the_report_is_one_line_and_a_dict():
    report = BackendReport("cpu", {"host_forward": "on (float32 Llama, 3 layers)", "native_attention": "off: no C compiler"})
    assert report.line() == "backend cpu: host_forward=on (float32 Llama, 3 layers); native_attention=off: no C compiler"
    assert report.as_dict() == {"name": "cpu", "features": dict(report.features)}
    assert BackendReport("mlx").line() == "backend mlx"


def _loaded(model=None, **extra):
    return SimpleNamespace(model=model if model is not None else tiny_llama(11), extra=dict(extra), is_vlm=False)


def test_select_follows_the_switch_and_the_device():
    auto, off = engine_settings(None), engine_settings(None, cpu_backend="off")
    assert select(auto, _loaded(), mx.cpu).name == "cpu"
    chosen = select(off, _loaded(), mx.cpu)
    assert chosen.name == "mlx" and chosen.cpu == "off: CPU_BACKEND=off"
    chosen = select(auto, _loaded(), mx.gpu)                                # Metal / CUDA: MLX's own
    assert chosen.name == "mlx" and chosen.cpu.startswith("off: MLX computes on")
    assert select(engine_settings(None, cpu_kernels="on"), _loaded(), mx.gpu).name == "cpu"   # asked for: as before
    assert select(auto, _loaded(group=object()), mx.gpu).name == "cpu"     # every rank joins the kernels' collective
    ok, why = select(auto, _loaded(), mx.cpu).applies(None, mx.gpu)
    assert not ok and why


def test_off_takes_the_cpu_hooks_out_and_auto_reuses_the_installed_backend(tiny_dense_path):
    """CPU_BACKEND=off on an engine whose model had the CPU backend: MLX's own backend, mlx-lm's exp
    and swiglu again (the cascade stays); auto again: the CPU backend, the same object when the
    settings are the same (no second install); its report says why the host path is off here."""
    from mlx_lm.models import activations

    from mlxstack.backends.cpu.fast_math import fast_swiglu
    from mlxstack.models.loader import load_model

    auto = engine_settings(tiny_dense_path)
    loaded = load_model(auto)
    from mlxstack.engine.factory import install_backend, make_engine

    first = install_backend(loaded, auto)
    assert first.name == "cpu" and backend_of(loaded.model) is first and loaded.extra["backend"] is first
    assert set(first.report.features) == FEATURES
    assert first.report.features["host_forward"] == "off: not an mlx-lm Llama (mlx_lm.models.qwen3.Model)"
    assert first.report.features["turboquant_coder"] == "off: needs host_forward on"
    mod = __import__(type(loaded.model).__module__, fromlist=["x"])
    kernels_on = first.report.features["cpu_kernels"].startswith("on")
    try:
        off = install_backend(loaded, engine_settings(tiny_dense_path, cpu_backend="off"))
        assert off.name == "mlx" and backend_of(loaded.model) is off
        assert off.report.features == {"cascade_attention": off.report.features["cascade_attention"],
                                       "cpu_backend": "off: CPU_BACKEND=off"}
        assert off.report.features["cascade_attention"].startswith("on (")
        assert cascade._exp is mx.exp and not cascade.native_in_use() and not cascade._plain
        assert getattr(mod, "swiglu", activations.swiglu) is activations.swiglu
        assert getattr(mod.scaled_dot_product_attention, "__mlxstack_shared_prefix__", False)   # the cascade stays
    finally:
        again = install_backend(loaded, auto)
    assert again.name == "cpu" and again.report.features == first.report.features
    assert (cascade._exp is not mx.exp) == kernels_on and (getattr(mod, "swiglu", None) is fast_swiglu) == kernels_on
    engine = make_engine(loaded, auto)                  # the engine the server builds: the same backend, reused
    assert loaded.extra["backend"] is engine.loaded.extra["backend"] and backend_of(loaded.model).name == "cpu"


def test_the_report_is_logged_at_load_and_in_health(embedded_model_path, tmp_path, caplog):
    """A real server on the embedded model (a float32 Llama): one log line ``backend cpu: ...`` at
    load, the same report as /health's ``backend``, and -- where the host path is on -- a chat
    request's decode steps computed by it (the backend's counter)."""
    caplog.set_level(logging.INFO, logger="mlxstack.engine")
    server = LiveServer(engine_settings(None, log_root=str(tmp_path)))
    try:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("backend ")]
        assert len(lines) == 1 and lines[0].startswith("backend cpu: cascade_attention=on"), lines
        status, body, _ = http_json(server.base + "/health")
        assert status == 200 and body["ready"] is True
        report = body["backend"]
        assert report["name"] == "cpu" and set(report["features"]) == FEATURES
        assert all(v.startswith(("on", "off: ")) for v in report["features"].values()), report
        assert lines[0] == BackendReport(report["name"], report["features"]).line()
        backend = server.app.loaded.extra["backend"]
        if report["features"]["host_forward"].startswith("on"):
            before = backend.host_calls
            status, reply, _ = http_json(server.base + "/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6,
                                          "temperature": 0})
            assert status == 200, reply
            assert backend.host_calls > before
    finally:
        server.close()


def test_health_says_why_when_the_cpu_backend_is_off(tiny_dense_path, tmp_path):
    server = LiveServer(engine_settings(tiny_dense_path, log_root=str(tmp_path), cpu_backend="off"))
    try:
        status, body, _ = http_json(server.base + "/health")
        assert status == 200 and body["backend"]["name"] == "mlx"
        assert body["backend"]["features"]["cpu_backend"] == "off: CPU_BACKEND=off"
    finally:
        server.close()
        build_engine(engine_settings(tiny_dense_path))      # the CPU backend's hooks back for the tests after
