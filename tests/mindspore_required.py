"""Gate for tests that need real MindSpore: skip without it, unless CI demands it.

CI sets ``MSTB_REQUIRE_MINDSPORE=1`` (``scripts/test`` does), so a broken install of the
``mindspore`` extra fails the run instead of silently skipping these tests.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_mindspore() -> None:
    if importlib.util.find_spec("mindspore") is not None:
        return
    if os.environ.get("MSTB_REQUIRE_MINDSPORE") == "1":
        pytest.fail("MSTB_REQUIRE_MINDSPORE=1 but mindspore is not importable (install the 'mindspore' extra)",
                    pytrace=False)
    pytest.skip("mindspore not installed", allow_module_level=True)
