import os

import pytest


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Every test gets its own $MLXTERM_HOME so nothing touches the user's data."""
    home = tmp_path_factory.mktemp("mlxterm-home")
    monkeypatch.setenv("MLXTERM_HOME", str(home))
    monkeypatch.setenv("MLXTERM_MODELS_DIR", str(_shared_models_dir()))
    yield home


def _shared_models_dir():
    """Assembled catalogue models (e.g. the 260 MB Gemma GGUF) are kept across test runs."""
    from pathlib import Path

    d = Path(os.environ.get("MLXTERM_TEST_MODELS_DIR", Path.home() / ".cache" / "mlxterm-tests" / "models"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MLXTERM_OPTIN"):
        return
    skip = pytest.mark.skip(reason="opt-in (set MLXTERM_OPTIN=1): needs an optional large model")
    for item in items:
        if "optin" in item.keywords:
            item.add_marker(skip)
