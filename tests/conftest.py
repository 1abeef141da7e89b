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


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - Iterator[MLflowServer]
    """One real ``mlflow server`` (:mod:`mlflow_server`) for the session, i.e. for the pytest-xdist
    worker that runs its tests: ``test_mlflow_sink`` and ``test_model_sinks`` share the xdist group
    ``model-sinks``, so one worker starts it once (each start took 6-16 s). Each test uses its own
    experiment; a test that stops the server starts it again."""
    pytest.importorskip("mlflow")
    from mlflow_server import MLflowServer

    server = MLflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    yield server
    server.stop()
