"""The syntax check after write_file/edit_file (tools/lint.py): Python and JSON in-process,
JavaScript and an HTML page's inline scripts with Node.js's parser."""

from __future__ import annotations

import shutil

import pytest

from tools import default_registry
from tools.lint import inline_scripts, syntax_problem

PAGE = """<!doctype html>
<html>
<head><script src="app.js"></script></head>
<body>
<script type="application/json">{not json, not checked}</script>
<script>
  const board = [];
  const board = {};
</script>
</body>
</html>
"""


@pytest.fixture
def node():
    if shutil.which("node") is None and shutil.which("nodejs") is None:
        pytest.skip("Node.js missing: ./setup.sh --test installs nodejs")


def test_python_and_json_problems_name_the_line():
    assert syntax_problem("ok.py", "def f():\n    return 1\n") is None
    problem = syntax_problem("bad.py", "def f():\n    return 1\n  x = 2\n")
    assert problem.startswith("bad.py:3: IndentationError: unindent does not match") and problem.endswith("\n    x = 2")
    assert syntax_problem("a.json", '{"a": [1, 2]}') is None
    assert syntax_problem("a.json", '{"a": 1,\n}').startswith("a.json:2: invalid JSON: ")
    assert syntax_problem("notes.txt", "def (") is None and syntax_problem("s.css", "body {") is None


def test_javascript_redeclaration_and_modules(node):
    assert syntax_problem("app.js", "function f() {}\nconst a = 1;\n") is None
    assert syntax_problem("app.js", "function f() {}\nconst a = 1;\nconst a = 2;\n") == (
        "app.js:3: SyntaxError: Identifier 'a' has already been declared\n    const a = 2;")
    # import/export: parsed as a module (a classic script would reject the import)
    assert syntax_problem("main.js", 'import { f } from "./f.js";\nexport const g = f;\n') is None
    assert syntax_problem("main.js", 'import { f } from "./f.js";\nlet x = (;\n').startswith("main.js:2: SyntaxError: ")


def test_html_inline_scripts_are_checked_at_their_page_line(node):
    assert [(line, module) for _, line, module in inline_scripts(PAGE)] == [(6, False)]
    assert syntax_problem("index.html", PAGE) == (
        "index.html:8: SyntaxError: Identifier 'board' has already been declared\n    const board = {};")
    assert syntax_problem("index.html", PAGE.replace("const board = {};", "board.push(1);")) is None


def test_write_and_edit_report_a_file_that_does_not_parse(tmp_path, node):
    ws = tmp_path / "ws"
    ws.mkdir()
    reg = default_registry(ws)
    result = reg.run("write_file", {"path": "app.js", "content": "let n = 1;\nlet n = 2;\n"})
    assert result.ok and (ws / "app.js").read_text() == "let n = 1;\nlet n = 2;\n"  # written all the same
    assert "The file does not parse: app.js:2: SyntaxError" in result.content and result.content.endswith("Fix it.")
    assert result.data["syntax_error"].startswith("app.js:2:")
    fixed = reg.run("edit_file", {"path": "app.js", "old_text": "let n = 2;", "new_text": "n = 2;"})
    assert fixed.ok and "does not parse" not in fixed.content and "syntax_error" not in fixed.data
    broken = reg.run("edit_file", {"path": "app.js", "old_text": "n = 2;", "new_text": "n = (2;"})
    assert broken.ok and "The file does not parse now: app.js:2: SyntaxError" in broken.content
    ok = reg.run("write_file", {"path": "m.py", "content": "print('hi')\n"})
    assert ok.ok and "syntax_error" not in ok.data and "parse" not in ok.content
