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


def test_the_tools_follow_the_same_on_off_rule():
    from tools import settings as tool_settings

    assert (tool_settings.ON, tool_settings.OFF) == (settings.ON, settings.OFF)
    for value in ("", "1", "On", "true", "YES", "0", "off", "False", "no"):
        env = {"MLXTERM_X": value}
        assert tool_settings.switch(env, "MLXTERM_X") == switch(env, "MLXTERM_X")
    with pytest.raises(tool_settings.SettingsError, match="MLXTERM_X='maybe'"):
        tool_settings.switch({"MLXTERM_X": "maybe"}, "MLXTERM_X")


def test_sandbox_switch_and_user():
    from tools.settings import NOBODY, Sandbox, sandbox, sandbox_user
    from tools.settings import SettingsError as ToolSettingsError

    assert sandbox({}) == Sandbox(True, True)
    assert sandbox({"MLXTERM_SANDBOX": "off"}) == Sandbox(False, True)
    assert sandbox({"MLXTERM_SANDBOX": "No-Landlock"}) == Sandbox(True, False)
    with pytest.raises(ToolSettingsError, match="MLXTERM_SANDBOX='landlock': use on, off or no-landlock"):
        sandbox({"MLXTERM_SANDBOX": "landlock"})
    assert sandbox_user({}) == (NOBODY, NOBODY)
    assert sandbox_user({"MLXTERM_SANDBOX_USER": "1000"}) == (1000, 1000)
    assert sandbox_user({"MLXTERM_SANDBOX_USER": " 1000:100 "}) == (1000, 100)
    for bad in ("0", "1000:0", "nobody", "1000:", ":5", "-3"):
        with pytest.raises(ToolSettingsError, match="MLXTERM_SANDBOX_USER="):
            sandbox_user({"MLXTERM_SANDBOX_USER": bad})


def test_docs_table_lists_every_tools_name():
    from tools import settings as tool_settings

    table = (REPO / "docs" / "settings.md").read_text()
    listed = set(re.findall(r"^\| `(MLXTERM_[A-Z0-9_]+)`", table, re.M))
    assert set(tool_settings.NAMES) <= listed
    read = set(re.findall(r"MLXTERM_[A-Z0-9_]+", (REPO / "tools" / "settings.py").read_text()))
    read.discard("MLXTERM_")
    assert read == set(tool_settings.NAMES)
