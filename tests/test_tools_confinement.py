"""Workspace confinement and the registry's contract (schemas, validation, never raising)."""

from __future__ import annotations

import os
import threading

import pytest

from tools import TOOL_NAMES, Tool, ToolError, ToolRegistry, ToolResult, Workspace, default_registry
from tools.schema import check_schema

SECRET = "outside secret 42\n"


@pytest.fixture
def layout(tmp_path):
    """ws/ is the workspace; outside/ holds a file the tools must never touch."""
    root = tmp_path / "ws"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    (root / "inside.txt").write_text("inside 42\n")
    (root / "sub").mkdir()
    os.symlink(outside / "secret.txt", root / "link_file")  # file symlink pointing out
    os.symlink(outside, root / "link_dir")  # directory symlink pointing out
    os.symlink(outside / "new.txt", root / "dangling")  # dangling link to a would-be file out
    os.symlink(root / "inside.txt", root / "good_link")  # link that stays inside
    return root, outside


ESCAPES = [
    "../outside/secret.txt",
    "sub/../../outside/secret.txt",
    "link_file",
    "link_dir/secret.txt",
]


def _abs_outside(outside):
    return str(outside / "secret.txt")


@pytest.mark.parametrize("path", [*ESCAPES, "ABS"])
@pytest.mark.parametrize(
    "tool,extra",
    [
        ("read_file", {}),
        ("write_file", {"content": "pwned"}),
        ("edit_file", {"old_text": "outside", "new_text": "pwned"}),
        ("grep", {"pattern": "secret"}),
    ],
)
def test_file_tools_refuse_paths_outside(layout, tool, extra, path):
    root, outside = layout
    if path == "ABS":
        path = _abs_outside(outside)
    result = default_registry(root).run(tool, {"path": path, **extra})
    assert not result.ok
    assert "outside the workspace" in result.error
    assert result.content.startswith("Error: ")
    assert (outside / "secret.txt").read_text() == SECRET


@pytest.mark.parametrize("path", ["..", "link_dir", "sub/../.."])
def test_list_dir_refuses_outside(layout, path):
    root, _ = layout
    result = default_registry(root).run("list_dir", {"path": path})
    assert not result.ok and "outside the workspace" in result.error
    assert "secret" not in result.content


def test_symlink_message_names_the_symlink(layout):
    root, _ = layout
    result = default_registry(root).run("read_file", {"path": "link_dir/secret.txt"})
    assert "symlink" in result.error


@pytest.mark.parametrize("path", ["link_dir/new.txt", "dangling", "link_dir/deeper/new.txt"])
def test_write_through_symlinked_parent_or_dangling_link_creates_nothing_outside(layout, path):
    root, outside = layout
    result = default_registry(root).run("write_file", {"path": path, "content": "x"})
    assert not result.ok
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]


def test_paths_that_stay_inside_are_allowed(layout):
    root, _ = layout
    reg = default_registry(root)
    for path in ["inside.txt", "sub/../inside.txt", str(root / "inside.txt"), "good_link", "~/inside.txt"]:
        result = reg.run("read_file", {"path": path})
        assert result.ok, (path, result.content)
        assert "inside 42" in result.content


def test_workspace_resolve_raises_tool_error_and_registry_converts(layout):
    root, _ = layout
    ws = Workspace(root)
    with pytest.raises(ToolError):
        ws.resolve("../outside")
    with pytest.raises(ToolError):
        ws.resolve("")
    with pytest.raises(ToolError):
        ws.resolve("a\x00b")
    assert ws.resolve(".") == ws.root
    assert ws.display(ws.resolve("sub")) == "sub"


def test_grep_and_list_dir_do_not_follow_links_out(layout):
    root, _ = layout
    reg = default_registry(root)
    found = reg.run("grep", {"pattern": "42"})
    assert found.ok
    assert "inside.txt:1:inside 42" in found.content
    assert "outside secret" not in found.content
    listing = reg.run("list_dir", {"depth": 3})
    assert listing.ok
    assert "link_dir -> " in listing.content
    assert "link_dir/secret.txt" not in listing.content


def test_bash_runs_in_workspace_root(layout):
    root, _ = layout
    result = default_registry(root).run("bash", {"command": "pwd; echo $HOME"})
    assert result.ok
    assert result.data["stdout"].split() == [str(root), str(root)]


# --- registry and schemas -------------------------------------------------------------


def test_default_registry_schemas_have_openai_shape(tmp_path):
    reg = default_registry(tmp_path)
    schemas = reg.schemas()
    assert [s["function"]["name"] for s in schemas] == list(TOOL_NAMES)
    assert set(TOOL_NAMES) == {"read_file", "write_file", "edit_file", "list_dir", "grep", "bash"}
    for s in schemas:
        assert s["type"] == "function"
        params = s["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert s["function"]["description"]
        for prop in params["properties"].values():
            assert prop["type"] in {"string", "integer", "boolean", "array"} and prop["description"]
    assert reg.get("bash") is not None and reg.get("nope") is None


def _echo_tool():
    def fn(ws, args, cancel):
        return ToolResult.success(repr(sorted(args.items())), args=args)

    return Tool(
        name="echo",
        description="Echo the arguments.",
        parameters={
            "type": "object",
            "properties": {
                "mode": {"type": "string", "enum": ["fast", "slow"], "description": "Speed."},
                "n": {"type": "integer", "minimum": 1, "maximum": 10, "default": 3, "description": "Count."},
                "flag": {"type": "boolean", "description": "A flag."},
                "tags": {"type": "array", "items": {"type": "string"}, "description": "Tags."},
            },
            "required": ["mode"],
            "additionalProperties": False,
        },
        fn=fn,
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        ({}, "missing required argument 'mode'"),
        ({"mode": "fast", "colour": "red"}, "unknown argument 'colour'"),
        ({"mode": "medium"}, 'must be one of "fast", "slow"'),
        ({"mode": 3}, "'mode' must be string, got integer"),
        ({"mode": "fast", "n": "3"}, "'n' must be integer, got string"),
        ({"mode": "fast", "n": True}, "'n' must be integer, got boolean"),
        ({"mode": "fast", "n": 2.5}, "'n' must be integer, got number"),
        ({"mode": "fast", "n": 11}, "'n' must be <= 10"),
        ({"mode": "fast", "flag": "yes"}, "'flag' must be boolean"),
        ({"mode": "fast", "tags": ["a", 1]}, "'tags' must be array of string"),
        (["fast"], "arguments must be a JSON object, got array"),
    ],
)
def test_validation_errors_name_problem_and_shape(tmp_path, args, needle):
    reg = ToolRegistry(Workspace(tmp_path), [_echo_tool()])
    result = reg.run("echo", args)
    assert not result.ok
    assert needle in result.error
    if "must be one of" not in needle and "<=" not in needle:
        assert 'echo(mode: "fast" | "slow", n?: integer 1..10 = 3' in result.error


def test_validation_fills_defaults_and_accepts_integral_float(tmp_path):
    reg = ToolRegistry(Workspace(tmp_path), [_echo_tool()])
    result = reg.run("echo", {"mode": "slow", "n": 4.0, "flag": None})
    assert result.ok
    assert result.data["args"] == {"mode": "slow", "n": 4}
    assert reg.run("echo", {"mode": "slow"}).data["args"]["n"] == 3


def test_unknown_tool_and_tool_exceptions_become_error_results(tmp_path):
    def boom(ws, args, cancel):
        raise RuntimeError("kaput")

    def denied(ws, args, cancel):
        raise PermissionError(13, "Permission denied", "/x")

    schema = {"type": "object", "properties": {}, "additionalProperties": False}
    reg = ToolRegistry(
        Workspace(tmp_path),
        [Tool("boom", "d", schema, boom), Tool("denied", "d", schema, denied)],
    )
    result = reg.run("nope", {})
    assert not result.ok and "unknown tool 'nope'" in result.error and "boom" in result.error
    result = reg.run("boom", None)
    assert not result.ok and "RuntimeError: kaput" in result.error
    result = reg.run("denied", {})
    assert not result.ok and "Permission denied (/x)" in result.error


def test_registry_passes_cancel_event(tmp_path):
    seen = []
    schema = {"type": "object", "properties": {}, "additionalProperties": False}
    reg = ToolRegistry(Workspace(tmp_path), [Tool("t", "d", schema, lambda ws, a, c: seen.append(c) or ToolResult.success(""))])
    event = threading.Event()
    reg.run("t", {}, cancel=event)
    assert seen == [event]


def test_registry_caps_content_and_honours_a_cancel_set_before_start(tmp_path):
    from tools.registry import MAX_CONTENT_CHARS

    calls = []
    schema = {"type": "object", "properties": {}, "additionalProperties": False}

    def flood(ws, args, cancel):
        calls.append(1)
        return ToolResult.success("y" * 100_000)

    reg = ToolRegistry(Workspace(tmp_path), [Tool("flood", "d", schema, flood)])
    result = reg.run("flood", {})
    assert result.ok and result.data["content_truncated"]
    assert len(result.content) < MAX_CONTENT_CHARS + 100 and "characters omitted" in result.content
    event = threading.Event()
    event.set()
    stopped = reg.run("flood", {}, cancel=event)
    assert not stopped.ok and "cancelled before it started" in stopped.error
    assert calls == [1]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {}},  # additionalProperties missing
        {"type": "object", "properties": {"x": {"type": "number", "description": "d"}}, "additionalProperties": False},
        {"type": "object", "properties": {"x": {"type": "string"}}, "additionalProperties": False},
        {"type": "object", "properties": {"x": {"type": "string", "description": "d", "pattern": "a"}}, "additionalProperties": False},
        {"type": "object", "properties": {}, "required": ["x"], "additionalProperties": False},
    ],
)
def test_schemas_outside_the_subset_are_rejected(schema):
    with pytest.raises(ValueError):
        check_schema("bad", schema)


def test_workspace_root_must_be_a_directory(tmp_path):
    with pytest.raises(ValueError):
        Workspace(tmp_path / "missing")


# -- races: a symlink swapped in between the path check and the open ----------------------------

def _swap_after_resolve(monkeypatch, swap):
    """Run ``swap()`` right after each path check, i.e. inside the check-then-open window."""
    original = Workspace.resolve

    def resolve(self, path):
        real = original(self, path)
        swap()
        return real

    monkeypatch.setattr(Workspace, "resolve", resolve)


@pytest.mark.parametrize("tool,args", [
    ("read_file", {"path": "d/f.txt"}),
    ("write_file", {"path": "d/f.txt", "content": "pwned"}),
    ("edit_file", {"path": "d/f.txt", "old_text": "outside", "new_text": "pwned"}),
    ("grep", {"pattern": "secret", "path": "d/f.txt"}),
])
def test_directory_swapped_for_a_symlink_after_the_check_is_not_followed(layout, monkeypatch, tool, args):
    root, outside = layout
    (root / "d").mkdir()
    (root / "d/f.txt").write_text("inside text\n")
    (outside / "f.txt").write_text(SECRET)

    def swap():
        os.rename(root / "d", root / "d.old")
        os.symlink(outside, root / "d")

    _swap_after_resolve(monkeypatch, swap)
    result = default_registry(root).run(tool, args)
    assert not result.ok or tool == "grep", result.content  # grep skips the file instead
    assert "42" not in result.content and "matching lines" not in result.content
    assert (outside / "f.txt").read_text() == SECRET  # nothing written through the link
    assert sorted(p.name for p in outside.iterdir()) == ["f.txt", "secret.txt"]


@pytest.mark.parametrize("tool,args", [
    ("read_file", {"path": "f.txt"}),
    ("edit_file", {"path": "f.txt", "old_text": "outside", "new_text": "pwned"}),
])
def test_file_swapped_for_a_symlink_after_the_check_is_not_followed(layout, monkeypatch, tool, args):
    root, outside = layout
    (root / "f.txt").write_text("inside text\n")

    def swap():
        os.unlink(root / "f.txt")
        os.symlink(outside / "secret.txt", root / "f.txt")

    _swap_after_resolve(monkeypatch, swap)
    result = default_registry(root).run(tool, args)
    assert not result.ok and "secret" not in result.content
    assert "changed into a symlink" in result.content
    assert (outside / "secret.txt").read_text() == SECRET


def test_write_over_a_swapped_file_link_never_writes_its_target(layout, monkeypatch):
    root, outside = layout
    (root / "f.txt").write_text("inside text\n")

    def swap():
        os.unlink(root / "f.txt")
        os.symlink(outside / "secret.txt", root / "f.txt")

    _swap_after_resolve(monkeypatch, swap)
    result = default_registry(root).run("write_file", {"path": "f.txt", "content": "new\n"})
    assert not result.ok and "changed into a symlink" in result.content
    assert (outside / "secret.txt").read_text() == SECRET


@pytest.mark.parametrize("tool,extra", [("read_file", {}), ("write_file", {"content": "x"}), ("list_dir", {})])
def test_sibling_directory_with_the_workspace_name_as_prefix_is_refused(tmp_path, tool, extra):
    root = tmp_path / "ws"
    sibling = tmp_path / "ws2"
    root.mkdir()
    sibling.mkdir()
    (sibling / "f.txt").write_text(SECRET)
    target = str(sibling / "f.txt") if tool != "list_dir" else str(sibling)
    for path in (target, "../ws2/f.txt" if tool != "list_dir" else "../ws2"):
        result = default_registry(root).run(tool, {"path": path, **extra})
        assert not result.ok and "outside the workspace" in result.content
    assert (sibling / "f.txt").read_text() == SECRET
