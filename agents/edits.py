"""File edits written as plain text: whole files in fenced blocks, and search/replace blocks.

Why: models write code better in a fenced block than inside a JSON string (small models also
lose indentation there), so besides JSON tool calls the agent reads two text formats out of its
reply, line by line as the stream arrives: a path line then the complete file in one fence
(whole file), or a path line then ``<<<<<<< SEARCH`` / ``=======`` / ``>>>>>>> REPLACE`` blocks.
Each edit becomes an ordinary ``write_file`` / ``edit_file`` call (same approvals, workspace
confinement, tool cards and diffs). Text is held back one line so a path line can still turn
into part of an edit. What counts as a path line, and ``infer_path`` for a fence without one:
docs/agents.md, "Writing files as text".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from agents.parse_events import Forming, Malformed, Parsed, ParseEvent, Text
from agents.protocol import ToolCall

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+#.-]*)\s*(\S*)\s*$")
SEARCH = re.compile(r"^\s*<{5,9} ?SEARCH\s*$")
DIVIDER = re.compile(r"^\s*={5,9}\s*$")
REPLACE = re.compile(r"^\s*>{5,9} ?REPLACE\s*$")
_PATH = r"(?:\.{0,2}/)?(?:[\w.-]+/)*[\w-][\w.-]*\.[A-Za-z][A-Za-z0-9]{0,7}"
PATH_TOKEN = re.compile(rf"(?<![\w/.-])({_PATH})(?![\w/-])")
BARE_PATH = re.compile(rf"^(?:file(?:name)?\s*:\s*)?({_PATH})\s*:?$", re.IGNORECASE)
COMMENT_PATH = re.compile(rf"^\s*(?:#|//|--|<!--|/\*)\s*(?:file(?:name)?\s*:\s*)?({_PATH})\s*(?:-->|\*/)?\s*$",
                          re.IGNORECASE)

# fence language -> file extensions it may write (a sentence naming x.py before ```python is a path line)
LANG_EXTS = {
    "python": ("py", "pyi"), "py": ("py", "pyi"), "javascript": ("js", "mjs", "cjs"), "js": ("js", "mjs", "cjs"),
    "typescript": ("ts", "tsx"), "ts": ("ts", "tsx"), "html": ("html", "htm"), "css": ("css",),
    "json": ("json",), "yaml": ("yaml", "yml"), "yml": ("yaml", "yml"), "toml": ("toml",),
    "markdown": ("md",), "md": ("md",), "c": ("c", "h"), "cpp": ("cpp", "cc", "hpp", "h"), "c++": ("cpp", "hpp"),
    "rust": ("rs",), "go": ("go",), "java": ("java",), "ruby": ("rb",), "sh": ("sh",), "bash": ("sh",),
    "text": ("txt",), "txt": ("txt",), "sql": ("sql",),
}
SHELL_LANGS = ("sh", "bash", "shell", "console", "zsh", "shell-session")




@dataclass
class _Block:
    kind: str  # "file" (whole file), "other" (plain fenced text), "sr" (search/replace)
    path: str | None
    fence: str | None  # the fence marker that closes it (None: a bare search/replace block)
    index: int = -1
    raw: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    search: list[str] | None = None  # set once the ======= divider is seen
    undecided: bool = False  # fence without a path: the first line may be a path comment
    id: str = ""
    lang: str = ""
    inferred: bool = False  # the path came from infer_path, not from the reply


def path_in_line(line: str, lang: str = "") -> str | None:
    """The file a line announces for the block after it, or None (see the module docstring)."""
    text = line.strip().strip("*_").strip()
    text = re.sub(r"^#{1,6}\s+", "", text).strip("`*_ ").rstrip(":").strip("`*_ ")
    m = BARE_PATH.match(text)
    if m:
        path = m.group(1)
    else:
        exts = LANG_EXTS.get(lang.lower())
        found = [p for p in PATH_TOKEN.findall(line) if exts and p.rsplit(".", 1)[1].lower() in exts]
        if len(set(found)) != 1:
            return None
        path = found[0]
    if lang.lower() in SHELL_LANGS and not path.endswith(".sh"):
        return None
    return path


class TextEditParser:
    """Reads edits out of the visible reply text as it streams; ``next_id`` numbers calls in
    reply order together with the JSON calls (shared counter)."""

    def __init__(self, next_id: Callable[[], tuple[int, str]], infer_path: Callable[[str], str | None] | None = None):
        self._next_id = next_id
        self._infer = infer_path
        self._partial = ""  # the current line, not yet ended
        self._held: list[str] = []  # last non-blank text line and blank lines after it
        self._block: _Block | None = None
        self.edits = 0

    def feed(self, text: str) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        self._partial += text
        while "\n" in self._partial:
            line, self._partial = self._partial.split("\n", 1)
            self._line(line, out)
        if self._block is not None and self._block.kind in ("file", "sr"):
            out.append(Forming(self._block.index, "\n".join(self._block.raw + [self._partial]),
                                   "write_file" if self._block.kind == "file" else "edit_file"))
        return out

    @property
    def open_path(self) -> str | None:
        """The file an edit block still streaming writes to (None: no edit block is open)."""
        b = self._block
        return b.path if b is not None and b.kind in ("file", "sr") else None

    def finish(self) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        if self._partial:
            line, self._partial = self._partial, ""
            self._line(line, out, last=True)
        b = self._block
        if b is not None:
            self._block = None
            if b.kind == "other" and b.undecided:
                out.append(Text(b.raw[0] + "\n"))
            if b.kind in ("file", "sr"):
                what = "file block" if b.kind == "file" else "search/replace block"
                out.append(self._malformed(b, f"the {what} for {b.path} was cut off before its end "
                                              f"({'a closing fence' if b.kind == 'file' else '>>>>>>> REPLACE'})"))
        self._flush_held(out)
        return out

    # -- lines ----------------------------------------------------------------------------------
    def _line(self, line: str, out: list[ParseEvent], last: bool = False) -> None:
        b = self._block
        if b is None:
            self._text_line(line, out, last)
        elif b.kind == "sr-next":  # after a fenced block's REPLACE: another block, the fence's end, or text
            if SEARCH.match(line):
                self._open(_Block("sr", b.path, b.fence), line)
            else:
                self._block = None
                if not _closes(b, line):
                    self._text_line(line, out, last)
        elif b.kind == "other":
            self._other_line(b, line, out)
        elif b.kind == "file":
            self._file_line(b, line, out)
        else:
            self._sr_line(b, line, out)

    def _text_line(self, line: str, out: list[ParseEvent], last: bool) -> None:
        fence = FENCE.match(line)
        if fence and not last:
            marker, lang, info = fence.group(1), fence.group(2), fence.group(3)
            path = path_in_line(info, lang) if info else None
            if path is None and lang and "." in lang and not info:
                path = path_in_line(lang)  # ```binary_search.py
                lang = ""
            held_path = path_in_line(self._held[0], lang) if self._held and path is None else None
            if held_path is not None:
                # a bare path line is part of the edit; a sentence naming the file stays text
                if BARE_PATH.match(_undecorate(self._held[0])):
                    self._held = []
                path = held_path
            self._flush_held(out)
            if path is not None:
                self._open(_Block("file", path, marker[0] * len(marker)), line)
            else:
                # held until its first line says whether it is a file after all
                self._block = _Block("other", None, marker[0] * len(marker), raw=[line], undecided=True, lang=lang)
            return
        if SEARCH.match(line) and not last:
            path = path_in_line(self._held[0]) if self._held else None
            if path is not None and BARE_PATH.match(_undecorate(self._held[0])):
                self._held = []
            self._flush_held(out)
            self._open(_Block("sr", path, None), line)
            return
        if line.strip():
            self._flush_held(out)
        self._held.append(line)
        if last:
            self._flush_held(out, newline=False)

    def _other_line(self, b: _Block, line: str, out: list[ParseEvent]) -> None:
        if b.undecided:
            b.undecided = False
            m = COMMENT_PATH.match(line)
            if m:  # ```python / # x.py / ...: a whole file after all (the comment stays in it)
                self._block = None
                nb = _Block("file", m.group(1), b.fence)
                self._open(nb, b.raw[0])
                nb.raw.append(line)
                nb.lines.append(line)
                return
            if SEARCH.match(line):
                self._open(_Block("sr", None, b.fence), line)
                return
            target = self._infer(b.lang) if self._infer and b.lang and b.lang.lower() not in SHELL_LANGS else None
            if target is not None and not _closes(b, line):
                self._block = None
                nb = _Block("file", target, b.fence, inferred=True)
                self._open(nb, b.raw[0])
                self._file_line(nb, line, out)
                return
            out.append(Text(b.raw[0] + "\n"))
        if _closes(b, line):
            self._block = None
        out.append(Text(line + "\n"))

    def _file_line(self, b: _Block, line: str, out: list[ParseEvent]) -> None:
        if not b.lines and SEARCH.match(line):  # a fenced search/replace block (aider's layout)
            b.kind, b.search = "sr", None
            b.raw.append(line)
            return
        if _closes(b, line):
            self._block = None
            content = "\n".join(b.lines) + ("\n" if b.lines else "")
            out.append(self._parsed(b, "write_file", {"path": b.path, "content": content}))
            return
        b.raw.append(line)
        b.lines.append(line)

    def _sr_line(self, b: _Block, line: str, out: list[ParseEvent]) -> None:
        b.raw.append(line)
        if b.search is None and DIVIDER.match(line):
            b.search, b.lines = b.lines, []
            return
        if b.search is not None and REPLACE.match(line):
            out.append(self._finish_sr(b))
            # inside a fence more blocks for the same file may follow
            self._block = None if b.fence is None else _Block("sr-next", b.path, b.fence)
            return
        b.lines.append(line)

    def _finish_sr(self, b: _Block):
        if b.path is None:
            return self._malformed(b, "a SEARCH/REPLACE block needs the file's path on the line before it")
        search, replace = "\n".join(b.search or []), "\n".join(b.lines)
        if not search.strip():
            return self._malformed(b, f"the SEARCH section for {b.path} is empty: to create or rewrite a file, "
                                      "write its path line and then the whole file in one fenced block")
        return self._parsed(b, "edit_file", {"path": b.path, "old_text": search + "\n", "new_text":
                                             replace + "\n" if replace else ""})

    # -- helpers --------------------------------------------------------------------------------
    def _open(self, b: _Block, first_line: str) -> None:
        b.index, b.id = self._reserve()
        b.raw.append(first_line)
        self._block = b

    def _reserve(self) -> tuple[int, str]:
        self.edits += 1
        return self._next_id()

    def _parsed(self, b: _Block, name: str, args: dict) -> Parsed:
        return Parsed(b.index, ToolCall(b.id, name, args, raw="\n".join(b.raw), inferred_path=b.inferred))

    def _malformed(self, b: _Block, error: str) -> Malformed:
        return Malformed(b.index, b.id, "\n".join(b.raw), error,
                             "write_file" if b.kind == "file" else "edit_file")

    def _flush_held(self, out: list[ParseEvent], newline: bool = True) -> None:
        if self._held:
            text = "\n".join(self._held) + ("\n" if newline else "")
            out.append(Text(text))
            self._held = []


def _undecorate(line: str) -> str:
    text = line.strip().strip("*_").strip()
    return re.sub(r"^#{1,6}\s+", "", text).strip("`*_ ").rstrip(":").strip("`*_ ")


def _closes(b: _Block, line: str) -> bool:
    s = line.strip()
    return bool(b.fence) and s.startswith(b.fence[0] * 3) and set(s) == {b.fence[0]} and len(s) >= len(b.fence)
