"""Tools the tests build from the Go module proxy (csi-sanity, promtool, versitygw):
where one cannot be had, its tests skip, unless CI asks for it.

Why one rule: a skip that hides a gap is a defect, so CI sets ``<TOOL>_REQUIRED=1``
(the Makefile's ``check``) and the same missing tool is a failure there, while a
developer's machine without Go still runs everything else.
"""

from __future__ import annotations

import os

import pytest


def unavailable(required_var: str, message: str) -> None:
    """Skip with ``message``, or fail with it where ``required_var`` is set (not 0)."""
    if os.environ.get(required_var, "") not in ("", "0"):
        pytest.fail(f"{message}\n({required_var} is set, so this is a failure)",
                    pytrace=False)
    pytest.skip(message)
