"""pytest wiring for the guest suite: pick the tests of this boot's configuration.

Why: one suite serves two QEMU configurations (e2e/vm/run.sh). A test marked
``@pytest.mark.vmconfig("misaligned")`` only makes sense on that machine; rather than
reporting it as skipped on the other one (noise in every JUnit report), it is
deselected there. Unmarked tests run in the ``main`` configuration.
"""

from __future__ import annotations

import os

import pytest

CONFIG = os.environ.get("E2E_VM_CONFIG", "main")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vmconfig(name): the QEMU configuration a test needs")
    config.addinivalue_line("markers", "no_leak_check: the test leaves its volume on purpose "
                                       "(for the next boot)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("vmconfig")
        wanted = marker.args[0] if marker else "main"
        (keep if wanted == CONFIG else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
