import os
import tempfile

import pytest

pytest_plugins = ["tests.ci_strict"]  # CI=true: skips fail (see tests/ci_strict.py)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Every test gets its own $MLXTERM_HOME so nothing touches the user's data, and its own
    folder for this process's temporary files (``tempfile``: e.g. the benches' run folders),
    which pytest removes with the rest of its old runs instead of leaving them in /tmp."""
    home = tmp_path_factory.mktemp("mlxterm-home")
    monkeypatch.setenv("MLXTERM_HOME", str(home))
    scratch = tmp_path_factory.mktemp("tempfile")
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    link_shared_models(home)
    # No converted-GGUF cache per test home (hundreds of MB per real model); its tests turn it on.
    monkeypatch.setenv("MLXTERM_GGUF_CACHE", "0")
    yield home


def link_shared_models(home):
    """``home``'s installed-models folder as a link to the shared one (engine.paths.models_dir)."""
    models = home / "data" / "models"
    models.parent.mkdir(parents=True, exist_ok=True)
    models.symlink_to(_shared_models_dir(), target_is_directory=True)


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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from tests.tiny_models import LLAMA_CONFIG, make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny-llama"), LLAMA_CONFIG)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from tests.tiny_models import QWEN2_CONFIG, make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), QWEN2_CONFIG)


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory):
    from tests.tiny_models import GEMMA3_CONFIG, make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny-gemma3"), GEMMA3_CONFIG)


@pytest.fixture
def tiny_profile(tmp_path, tiny_llama_dir):
    from tests.tiny_models import write_profile

    return write_profile(tmp_path / "tiny.yaml", tiny_llama_dir)


@pytest.fixture(scope="session")
def smollm2_path():
    """The default model's GGUF, used in place from its pip package (via the catalogue)."""
    from engine.model.catalog import model_path

    return model_path("smollm2-135m")


@pytest.fixture(scope="session")
def gemma_path():
    """The Gemma-3-270M GGUF, assembled once (SHA-256 checked) by the catalogue."""
    from engine.model.catalog import model_path

    return model_path("gemma3-270m")


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_llama_dir):
    """The batching tests' (solo, batch) engine pair on the tiny llama, one per test module: each
    its own checkpoint store, so neither reuses the other's KV."""
    from tests.batch_helpers import make_engine

    tmp = tmp_path_factory.mktemp("batch")
    solo = make_engine(tmp, tiny_llama_dir, "solo")
    batch = make_engine(tmp, tiny_llama_dir, "batch")
    yield solo, batch
    solo.close()
    batch.close()
