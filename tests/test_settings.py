"""engine.settings: every MLXTERM_* variable the engine reads, one on/off rule, one table."""

from __future__ import annotations

import re
from pathlib import Path

from engine import settings
from engine.settings import Blas, Kernels, Settings, SettingsError, parse, switch

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_defaults_when_nothing_is_set():
    assert parse({}) == Settings()
    s = parse({})
    assert s.home is None and s.kernels == Kernels(True, "") and s.blas == Blas(True, None)
    assert s.hugepages and s.gguf_cache


@pytest.mark.parametrize("value", ["1", "on", "TRUE", " yes "])
def test_on_values(value):
    assert switch({"MLXTERM_X": value}, "MLXTERM_X", default=False) is True


@pytest.mark.parametrize("value", ["0", "off", "False", "NO"])
def test_off_values(value):
    assert switch({"MLXTERM_X": value}, "MLXTERM_X") is False


def test_empty_is_the_default_and_anything_else_is_an_error():
    assert switch({"MLXTERM_X": ""}, "MLXTERM_X") is True
    assert switch({}, "MLXTERM_X", default=False) is False
    with pytest.raises(SettingsError, match="MLXTERM_GGUF_CACHE='maybe'"):
        parse({"MLXTERM_GGUF_CACHE": "maybe"})


def test_each_variable_reaches_its_field(tmp_path):
    s = parse({"MLXTERM_HOME": str(tmp_path), "MLXTERM_KERNELS": "avx2", "MLXTERM_OPENBLAS": "/x/libopenblas.so",
               "MLXTERM_HUGEPAGES": "off", "MLXTERM_GGUF_CACHE": "0"})
    assert s == Settings(home=tmp_path, kernels=Kernels(True, "avx2"), blas=Blas(True, "/x/libopenblas.so"),
                         hugepages=False, gguf_cache=False)
    assert parse({"MLXTERM_KERNELS": "off"}).kernels == Kernels(False, "")
    assert parse({"MLXTERM_OPENBLAS": "off"}).blas == Blas(False, None)
    assert parse({"MLXTERM_HUGEPAGES": "reexec"}).hugepages  # mid re-exec (engine.hugepages)
    with pytest.raises(SettingsError, match="avx2, avxvnni, avx512vnni"):
        parse({"MLXTERM_KERNELS": "sse"})


def test_current_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXTERM_HOME", str(tmp_path / "a"))
    assert settings.current().home == tmp_path / "a"
    monkeypatch.setenv("MLXTERM_HOME", str(tmp_path / "b"))
    assert settings.current().home == tmp_path / "b"
    assert settings.current() is settings.current()  # parsed once per environment


def test_docs_table_lists_every_engine_name():
    table = (REPO / "docs" / "settings.md").read_text()
    listed = set(re.findall(r"^\| `(MLXTERM_[A-Z0-9_]+)`", table, re.M))
    assert set(settings.NAMES) <= listed
    read = set(re.findall(r"MLXTERM_[A-Z0-9_]+", (REPO / "engine" / "settings.py").read_text()))
    read.discard("MLXTERM_")
    assert read == set(settings.NAMES)
