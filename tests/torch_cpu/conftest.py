"""The torch tests that need no GPU: run by `make torch-test` in .venv-torch.

Why collected only there: the main .venv (and `make check`) has no torch by design. The
Makefile target sets CSI_PMEM_TORCH_TESTS=1; then nothing here is skipped, and a missing
torch, transformers or vLLM is a collection error (a failure), never a skip. Anywhere
else this directory is left out of collection, not reported as skipped tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENABLED = os.environ.get("CSI_PMEM_TORCH_TESTS") == "1"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not ENABLED and collection_path.suffix == ".py":
        return True
    return None


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Never reach the Hugging Face hub: everything is a local directory."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
