"""Shared pytest setup: the tests import their helpers (``tb_read``, ...) from this directory."""

import pytest

# live_helpers is both imported by the test_live_* modules and loaded as their fixture plugin
# (pytest_plugins); registering it first lets pytest rewrite its asserts without a warning.
pytest.register_assert_rewrite("live_helpers")
