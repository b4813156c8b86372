"""read_file, write_file, edit_file, list_dir and grep on real files in a tmp workspace."""

from __future__ import annotations

import os
import stat
import time
import tracemalloc

import pytest

from tools import default_registry
from tools.read_file import MAX_CHARS


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def reg(ws):
    return default_registry(ws)


# --- read_file --------------------------------------------------------------------------


def test_read_whole_small_file(ws, reg):
    (ws / "a.txt").write_text("one\ntwo\nthree\n")
    result = reg.run("read_file", {"path": "a.txt"})
    assert result.ok
    assert result.content == "a.txt lines 1-3 of 3:\none\ntwo\nthree\n"
    assert result.data["total_lines"] == 3 and not result.data["truncated"]


def test_read_line_window_is_one_based_inclusive(ws, reg):
    (ws / "a.txt").write_text("".join(f"line {i}\n" for i in range(1, 11)))
    result = reg.run("read_file", {"path": "a.txt", "start_line": 3, "end_line": 5})
    assert result.content.splitlines()[1:] == ["line 3", "line 4", "line 5"]
    assert result.data["end_line"] == 5
    last = reg.run("read_file", {"path": "a.txt", "start_line": 10})
    assert last.content.endswith("line 10\n") and last.data["total_lines"] == 10


def test_read_errors(ws, reg):
    (ws / "a.txt").write_text("x\ny")  # no trailing newline: 2 lines
    (ws / "d").mkdir()
    past = reg.run("read_file", {"path": "a.txt", "start_line": 5})
    assert not past.ok and "past the end" in past.error and "has 2 lines" in past.error
    assert "before start_line" in reg.run("read_file", {"path": "a.txt", "start_line": 2, "end_line": 1}).error
    assert "does not exist" in reg.run("read_file", {"path": "missing.txt"}).error
    assert "is a directory" in reg.run("read_file", {"path": "d"}).error
    os.mkfifo(ws / "fifo")
    assert "not a regular file" in reg.run("read_file", {"path": "fifo"}).error
    (ws / "empty").write_bytes(b"")
    assert "is empty" in reg.run("read_file", {"path": "empty"}).content


def _write_big(path, n_lines=500_000):
    pad = "x" * 89
    with open(path, "w") as f:  # 100 bytes per line, numbered so windows can be checked
        for block in range(0, n_lines, 10_000):
            f.write("".join(f"{i:09d} {pad}\n" for i in range(block + 1, block + 10_001)))


def test_read_50mb_file_is_capped_fast_and_memory_bounded(ws, reg):
    _write_big(ws / "big.log")
    assert (ws / "big.log").stat().st_size == 50_000_000
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        head = reg.run("read_file", {"path": "big.log"})
        deep = reg.run("read_file", {"path": "big.log", "start_line": 400_000})
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert head.ok and head.data["truncated"]
    assert len(head.content) < MAX_CHARS + 500
    nxt = head.data["next_start_line"]
    assert f"start_line={nxt}" in head.content
    shown = head.content.split("\n\n[output capped")[0].splitlines()
    assert shown[0] == f"big.log lines 1-{nxt - 1}:"
    assert shown[-1].startswith(f"{nxt - 1:09d} ")  # ends on the last full line shown
    assert deep.content.splitlines()[1].startswith("000400000 ")
    assert elapsed < 3.0, elapsed
    assert peak < 4 * 1024 * 1024, peak  # never near the 50 MB file size


def test_read_single_huge_line_is_cut(ws, reg):
    (ws / "one.min.js").write_bytes(b"a" * 3_000_000 + b"\nsecond\n")
    result = reg.run("read_file", {"path": "one.min.js"})
    assert result.ok and result.data["truncated"]
    assert "too long and was cut" in result.content
    assert len(result.content) < MAX_CHARS + 500
    nxt = reg.run("read_file", {"path": "one.min.js", "start_line": 2})
    assert nxt.content.splitlines()[1] == "second"


def test_read_binary_file_is_summarised(ws, reg):
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
    (ws / "pic.png").write_bytes(png)
    (ws / "blob.dat").write_bytes(b"\xff\xfe\x00\x01" * 100)
    (ws / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    result = reg.run("read_file", {"path": "pic.png"})
    assert result.ok and result.data["binary"]
    assert result.content == f"pic.png: binary file, {len(png)} bytes, PNG image; not shown as text."
    assert "binary file, 400 bytes" in reg.run("read_file", {"path": "blob.dat"}).content
    assert reg.run("read_file", {"path": "latin1.txt"}).data["binary"]


def test_read_utf8_split_at_sniff_boundary_is_text(ws, reg):
    (ws / "u.txt").write_text("a" + "é" * 10_000)  # the 8192-byte sample ends mid-"é"
    result = reg.run("read_file", {"path": "u.txt"})
    assert result.ok and not result.data["binary"]


# --- write_file -------------------------------------------------------------------------


def test_write_creates_parents_and_reports_bytes(ws, reg):
    result = reg.run("write_file", {"path": "a/b/c.txt", "content": "héllo\n"})
    assert result.ok and result.data["created"]
    assert (ws / "a/b/c.txt").read_text() == "héllo\n"
    assert result.data["bytes_written"] == len("héllo\n".encode())
    assert "+1 -0" in result.content
    assert [p.name for p in (ws / "a/b").iterdir()] == ["c.txt"]  # no temp file left behind


def test_write_diff_against_previous_content_and_keeps_mode(ws, reg):
    script = ws / "run.sh"
    script.write_text("#!/bin/sh\necho old\nexit 0\n")
    script.chmod(0o755)
    result = reg.run("write_file", {"path": "run.sh", "content": "#!/bin/sh\necho new\nexit 0\n"})
    assert result.ok and not result.data["created"]
    diff = result.data["diff"]
    assert "--- a/run.sh" in diff and "+++ b/run.sh" in diff
    assert "-echo old\n" in diff and "+echo new\n" in diff
    assert (result.data["lines_added"], result.data["lines_removed"]) == (1, 1)
    assert stat.S_IMODE(script.stat().st_mode) == 0o755
    assert script.read_text().endswith("echo new\nexit 0\n")


def test_write_over_binary_skips_diff_and_directory_is_refused(ws, reg):
    (ws / "b.bin").write_bytes(b"\x00\x01")
    result = reg.run("write_file", {"path": "b.bin", "content": "text"})
    assert result.ok and result.data["diff_skipped"]
    (ws / "d").mkdir()
    assert "is a directory" in reg.run("write_file", {"path": "d", "content": "x"}).error


# --- edit_file --------------------------------------------------------------------------

SOURCE = """def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return a * b
"""


def test_edit_single_match_returns_diff(ws, reg):
    (ws / "m.py").write_text(SOURCE)
    result = reg.run("edit_file", {"path": "m.py", "old_text": "return a - b", "new_text": "return b - a"})
    assert result.ok
    assert "-    return a - b" in result.content and "+    return b - a" in result.content
    assert result.data["diff"].startswith("--- a/m.py")
    assert (ws / "m.py").read_text() == SOURCE.replace("a - b", "b - a")


def test_edit_two_matches_is_an_error_with_count_and_lines(ws, reg):
    (ws / "m.py").write_text(SOURCE)
    result = reg.run("edit_file", {"path": "m.py", "old_text": "(a, b):", "new_text": "(x, y):"})
    assert not result.ok and result.data["matches"] == 3
    assert "matches 3 times" in result.error and "lines 1, 5, 9" in result.error
    assert (ws / "m.py").read_text() == SOURCE
    ok = reg.run("edit_file", {"path": "m.py", "old_text": "(a, b):", "new_text": "(x, y):", "replace_all": True})
    assert ok.ok and ok.data["replacements"] == 3
    assert (ws / "m.py").read_text().count("(x, y):") == 3


def test_edit_zero_matches_shows_near_match_with_line_numbers(ws, reg):
    (ws / "m.py").write_text(SOURCE)
    # Wrong indentation and a typo: not found, but lines 5-6 are the obvious target.
    result = reg.run("edit_file", {"path": "m.py", "old_text": "def sub(a, b):\n  return a - c\n", "new_text": "x"})
    assert not result.ok and result.data["matches"] == 0
    assert "not found" in result.error
    first = result.error.split("--- lines ", 1)[1]
    assert first.startswith("5-6 (similarity")
    assert "def sub(a, b):\n    return a - b" in result.error
    assert (ws / "m.py").read_text() == SOURCE


def test_edit_whitespace_only_difference_is_called_out(ws, reg):
    (ws / "m.py").write_text(SOURCE)
    result = reg.run("edit_file", {"path": "m.py", "old_text": "def mul(a, b):\n  return a * b", "new_text": "x"})
    assert "lines 9-10" in result.error and "only in whitespace" in result.error


def test_edit_nothing_similar(ws, reg):
    (ws / "m.py").write_text(SOURCE)
    result = reg.run("edit_file", {"path": "m.py", "old_text": "class Zebra(Protocol): pass", "new_text": "x"})
    assert not result.ok and "nothing similar" in result.error


def test_edit_crlf_file_with_lf_old_text(ws, reg):
    (ws / "w.txt").write_bytes(b"alpha\r\nbeta\r\ngamma\r\n")
    result = reg.run("edit_file", {"path": "w.txt", "old_text": "alpha\nbeta", "new_text": "alpha\nBETA"})
    assert result.ok
    assert (ws / "w.txt").read_bytes() == b"alpha\r\nBETA\r\ngamma\r\n"


def test_edit_errors(ws, reg):
    (ws / "b.bin").write_bytes(b"\x00abc")
    (ws / "t.txt").write_text("abc")
    assert "binary" in reg.run("edit_file", {"path": "b.bin", "old_text": "abc", "new_text": "x"}).error
    assert "use write_file" in reg.run("edit_file", {"path": "no.txt", "old_text": "a", "new_text": "b"}).error
    assert "old_text is empty" in reg.run("edit_file", {"path": "t.txt", "old_text": "", "new_text": "b"}).error
    assert "identical" in reg.run("edit_file", {"path": "t.txt", "old_text": "a", "new_text": "a"}).error


def test_near_match_search_is_fast_on_a_large_file(ws, reg):
    lines = [f"    value_{i} = compute({i}, factor={i % 7})" for i in range(20_000)]
    (ws / "big.py").write_text("\n".join(lines) + "\n")
    t0 = time.perf_counter()
    result = reg.run("edit_file", {"path": "big.py", "old_text": "    value_12345 = compute(12345, factor=9)", "new_text": "x"})
    assert time.perf_counter() - t0 < 5.0
    assert "--- lines 12346-12346" in result.error


# --- list_dir ---------------------------------------------------------------------------


def test_list_dir_types_sizes_depth_and_git_skipped(ws, reg):
    (ws / "src/pkg").mkdir(parents=True)
    (ws / "src/pkg/mod.py").write_text("x" * 2048)
    (ws / "README.md").write_text("hi")
    (ws / ".git").mkdir()
    (ws / ".git/config").write_text("[core]")
    os.symlink("README.md", ws / "link.md")
    top = reg.run("list_dir", {})
    assert top.ok
    assert top.content.splitlines()[1:] == ["README.md  (2 B)", "link.md -> README.md", "src/"]
    types = {e["path"]: (e["type"], e["size"]) for e in top.data["entries"]}
    assert types == {"README.md": ("file", 2), "link.md": ("symlink", None), "src": ("dir", None)}
    deep = reg.run("list_dir", {"path": ".", "depth": 3})
    assert "src/pkg/mod.py  (2.0 KB)" in deep.content
    assert ".git" not in deep.content
    assert "src/pkg/mod.py" not in reg.run("list_dir", {"depth": 2}).content
    assert "not a directory" in reg.run("list_dir", {"path": "README.md"}).error
    assert "must be <= 5" in reg.run("list_dir", {"depth": 9}).error


def test_list_dir_caps_entries(ws, reg):
    for i in range(600):
        (ws / f"f{i:03d}.txt").write_text("")
    result = reg.run("list_dir", {"path": "."})
    assert result.data["truncated"] and len(result.data["entries"]) == 500
    assert "capped at 500" in result.content
    assert len(result.content.splitlines()) == 501


# --- grep -------------------------------------------------------------------------------


def test_grep_line_numbers_globs_and_case(ws, reg):
    (ws / "src").mkdir()
    (ws / "src/a.py").write_text("import os\n# TODO: fix\nx = 1\n")
    (ws / "src/b.md").write_text("todo list\n")
    (ws / "src/c.js").write_text("// TODO js\n")
    (ws / ".git").mkdir()
    (ws / ".git/HEAD").write_text("TODO in git\n")
    (ws / "img.bin").write_bytes(b"TODO\x00\x00binary")
    result = reg.run("grep", {"pattern": "TODO"})
    assert result.ok
    assert result.content.splitlines()[1:] == ["src/a.py:2:# TODO: fix", "src/c.js:1:// TODO js"]
    assert result.data["skipped_binary"] == 1
    py = reg.run("grep", {"pattern": "todo", "include": "*.py", "case_insensitive": True})
    assert py.content.splitlines()[1:] == ["src/a.py:2:# TODO: fix"]
    both = reg.run("grep", {"pattern": "todo", "include": "*.{md,js}", "case_insensitive": True})
    assert both.content.splitlines()[1:] == ["src/b.md:1:todo list", "src/c.js:1:// TODO js"]
    one = reg.run("grep", {"pattern": "^x = \\d$", "path": "src/a.py"})
    assert one.content.splitlines()[1:] == ["src/a.py:3:x = 1"]
    none = reg.run("grep", {"pattern": "nothing-here"})
    assert none.ok and none.content.startswith("No matches")


def test_grep_caps_results_and_long_lines(ws, reg):
    (ws / "many.txt").write_text("hit\n" * 1000)
    (ws / "long.txt").write_text("y" * 5000 + "NEEDLE" + "z" * 5000 + "\n")
    result = reg.run("grep", {"pattern": "hit"})
    assert result.data["matches"] == 200 and result.data["truncated"]
    assert "stopped at the cap (200 matches" in result.content
    (ws / "wide").mkdir()
    (ws / "wide" / ("n" * 120 + ".txt")).write_text(("w" * 250 + "\n") * 300)
    wide = reg.run("grep", {"pattern": "^w", "path": "wide"})
    assert wide.data["truncated"] and 20 < wide.data["matches"] < 200
    assert len(wide.content) < 20_500
    long = reg.run("grep", {"pattern": "NEEDLE"})
    line = long.content.splitlines()[1]
    assert "NEEDLE" in line and len(line) < 400


def test_grep_invalid_regex_is_a_clear_error(ws, reg):
    result = reg.run("grep", {"pattern": "foo("})
    assert not result.ok and "invalid regular expression" in result.error
