"""Shared pytest fixtures. Each owner keeps their fixtures in their own marked section."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


# ===========================================================================
# Tiny random-weight models and the embedded model (tests/fixtures/tiny_models.py)
# ===========================================================================


def _model_cache_dir() -> Path:
    """Where the converted embedded model lives across test runs."""
    return Path(os.environ.get("MLXSTACK_TEST_MODEL_CACHE", Path.home() / ".cache" / "mlxstack"))


@pytest.fixture(scope="session")
def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct MLX folder converted from the bundled GGUF (cached)."""
    from mlxstack.engine.embedded_model import ensure_embedded_model

    return Path(ensure_embedded_model(_model_cache_dir()))


@pytest.fixture(scope="session")
def tiny_dense_path(tmp_path_factory, embedded_model_path) -> Path:
    """qwen3, 2 layers, hidden 64; every cache layer a trimmable KVCache."""
    from tests.fixtures.tiny_models import build_tiny_dense

    return build_tiny_dense(tmp_path_factory.mktemp("tiny_dense"), embedded_model_path)


@pytest.fixture(scope="session")
def tiny_hybrid_path(tmp_path_factory, embedded_model_path) -> Path:
    """qwen3_next, 4 layers: cache [ArraysCache, KVCache, ArraysCache, KVCache]."""
    from tests.fixtures.tiny_models import build_tiny_hybrid

    return build_tiny_hybrid(tmp_path_factory.mktemp("tiny_hybrid"), embedded_model_path)


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory, embedded_model_path) -> Path:
    """qwen2_5_vl with a 2-block vision tower, processor configs included."""
    from tests.fixtures.tiny_models import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"), embedded_model_path)


# ===========================================================================
# (end of tiny model fixtures)
# ===========================================================================
