"""Pure helpers of the chat front ends: formatting, slash commands, code blocks, controller."""

from __future__ import annotations

import json

from engine.sessions import SessionStore

import pytest

from app.tui import format as fmt
from app.tui.controller import ChatController, ChatError, readable
from app.tui.history import PromptHistory
from app.tui.slash import UnknownCommand, literal, parse_slash
from app.tui.widgets.message import code_blocks


def test_turn_summary_reports_restore_source_and_speed():
    meta = {"usage": {"prompt_tokens": 9000, "cached_tokens": 8123, "completion_tokens": 40},
            "timings": {"ttft_ms": 95.4, "decode_tps": 42.06, "restore_ms": 180.2},
            "cache": {"source": "ssd", "restore_ms": 180.2}}
    assert fmt.turn_summary(meta) == ("restored 8,123 tokens from SSD in 180 ms · TTFT 95 ms"
                                      " · 42.1 tok/s")
    meta["cache"] = {"source": "none", "restore_ms": 0.0}
    meta["usage"]["cached_tokens"] = 0
    assert fmt.turn_summary(meta).startswith("prefilled 9,000 tokens · ")


def test_ago_and_size_and_clean():
    assert fmt.ago(100.0, 130.0) == "just now"
    assert fmt.ago(0.0, 5 * 60) == "5m ago"
    assert fmt.ago(0.0, 3 * 3600 + 5) == "3h ago"
    assert fmt.ago(0.0, 2 * 86400) == "2d ago"
    assert fmt.ago(0.0, 21 * 86400) == "3w ago"
    assert fmt.size(512 << 20) == "512 MiB"
    assert fmt.size(3 << 30) == "3.00 GiB"
    assert fmt.clean("a\x1b[31mb\x08c\td\ne\x9b") == "a[31mbc\td\ne"


def test_process_rss_is_plausible():
    assert 10 << 20 < fmt.process_rss() < 64 << 30


def test_slash_parsing():
    cmd, arg = parse_slash("/export json out.json")
    assert (cmd.name, arg) == ("export", "json out.json")
    assert parse_slash("hello /new") is None
    assert parse_slash("//new") is None and literal("//new") == "/new"
    with pytest.raises(UnknownCommand, match=r"unknown command /nope; type /help"):
        parse_slash("/nope")


def test_code_blocks_found_including_an_unclosed_one():
    text = "a\n```py\nx = 1\n```\nb\n~~~\nls\n~~~\n```sh\necho stopped mid-way"
    assert code_blocks(text) == ["x = 1", "ls", "echo stopped mid-way"]
    assert code_blocks("no code") == []


def test_readable_drops_file_and_key_prefix():
    line = "/p/x.yaml:8: model.source: model not found at /m"
    assert readable(line) == "model not found at /m"
    assert readable("/p/x.yaml:3:5: YAML syntax error: bad") == "YAML syntax error: bad"


def test_controller_without_model_explains(tmp_path):
    store = SessionStore(tmp_path / "s.db")
    c = ChatController(store, "smollm2-135m")
    s = c.new_session()
    with pytest.raises(ChatError, match="no model is loaded yet"):
        c.send(s.id, "hi")
    with pytest.raises(ChatError, match="unknown export format"):
        c.export(s.id, "pdf")


def test_controller_export_default_path_and_directory(tmp_path):
    from engine.paths import data_dir

    store = SessionStore(tmp_path / "s.db")
    c = ChatController(store)
    s = store.create("Plans: May / June!")
    store.add_message(s.id, "user", "hello")
    md = c.export(s.id)
    assert md == data_dir() / "exports" / f"plans-may-june-{s.id}.md"
    assert "hello" in md.read_text()
    out = c.export(s.id, "json", tmp_path)
    assert out.parent == tmp_path and json.loads(out.read_text())["messages"][0]["content"] == "hello"
    with pytest.raises(ChatError, match="cannot write"):
        c.export(s.id, "md", tmp_path / "s.db" / "x.md")  # a file where a directory should be


def test_controller_check_names_the_profile(tmp_path):
    from engine.errors import ProfileError

    from tests.tiny_models import write_profile

    broken = write_profile(tmp_path / "broken.yaml", tmp_path / "missing")
    c = ChatController(SessionStore(tmp_path / "s.db"), str(broken))
    with pytest.raises(ProfileError, match=r"^profile broken cannot be used: model not found at "):
        c.check()


def test_prompt_history_is_shared_file(tmp_path):
    path = tmp_path / "hist"
    h = PromptHistory(path)
    h.add("one")
    h.add("two\nlines")
    h.add("two\nlines")
    assert PromptHistory(path).entries == ["two\nlines", "one"]
