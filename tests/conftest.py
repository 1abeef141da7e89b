"""Shared pytest setup: the tests import their helpers (``tb_read``, ...) from this directory."""

import pytest

# live_helpers is both imported by the test_live_* modules and loaded as their fixture plugin
# (pytest_plugins); registering it first lets pytest rewrite its asserts without a warning.
pytest.register_assert_rewrite("live_helpers")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``scripts/test`` runs two pytest-xdist workers (``--dist loadgroup``). The tests that train
    with real MindSpore share one worker: the mindformers ones share the session's mindformers
    venv (built once, in one place), and two trainings at once would only fight over the cores.
    They go first, mindformers' before the rest: they are the longest stretch (about five minutes
    with the venv's build), and the other worker takes every other test meanwhile."""
    def order(item: pytest.Item) -> int:
        return 0 if item.get_closest_marker("mindformers") else 1 if item.get_closest_marker("mindspore") else 2

    items.sort(key=order)  # stable: within each kind, the order of collection
    for item in items:
        if order(item) < 2:
            item.add_marker(pytest.mark.xdist_group("training"))
