import os

import pytest


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Every test gets its own $MLXTERM_HOME so nothing touches the user's data."""
    home = tmp_path_factory.mktemp("mlxterm-home")
    monkeypatch.setenv("MLXTERM_HOME", str(home))
    yield home


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MLXTERM_OPTIN"):
        return
    skip = pytest.mark.skip(reason="opt-in (set MLXTERM_OPTIN=1): needs an optional large model")
    for item in items:
        if "optin" in item.keywords:
            item.add_marker(skip)
