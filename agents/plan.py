"""The plan of a long task: which files to write, and the features of each.

For a task bigger than one file the agent first answers with a short plan; ``parse_plan`` reads
it from the model's text (numbered or bulleted lines, or headings, that name a file path; the
lines under an item add to its features). The plan is then worked through item by item and each
item is ticked when its file is written. ``Plan`` round-trips through plain dicts so it lives in
the session's meta (``plan``) and in the transcript (``plan`` / ``plan_tick`` records).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from agents.edits import LANG_EXTS, PATH_TOKEN

# what a plan item may be: source and text files (``document.title`` or ``console.log`` in a
# sentence are not files to write; the 0.5B's plan named document.title)
FILE_EXTS = frozenset(e for exts in LANG_EXTS.values() for e in exts) | {
    "htm", "svg", "csv", "xml", "ini", "cfg", "jsx", "vue", "scss", "less", "php", "kt", "swift", "lua"}
MAX_ITEMS = 12  # more than this is not a short plan: the rest is dropped
FEATURES_CHARS = 400  # per item, what the step prompt repeats
_ITEM = re.compile(r"^(\s*)(?:\d{1,2}[.)]|[-*+\u2022]|#{1,4}|\[[ xX]\])\s+(.*)$")
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
_NUMBER = re.compile(r"^(?:\d{1,2}[.)]\s+)+")
_MARKUP = re.compile(r"[`*_]+")
_LEAD = re.compile(r"^[\s:\-\u2013\u2014()\[\],.]+|[\s:\-\u2013\u2014(\[,]+$")


@dataclass
class PlanItem:
    path: str
    features: str = ""
    done: bool = False
    attempts: int = 0  # runs started for this item (a resumed run counts the killed one)
    given_up: bool = False  # its runs wrote nothing: the checks and repair rounds take over


@dataclass
class Plan:
    items: list[PlanItem] = field(default_factory=list)
    source: str = "model"  # model: parsed from the reply; task: the files the task names

    def next_item(self) -> PlanItem | None:
        return next((i for i in self.items if not i.done and not i.given_up), None)

    @property
    def finished(self) -> bool:
        return all(i.done for i in self.items)

    def tick(self, paths: list[str]) -> list[PlanItem]:
        """Mark the items whose file is among ``paths`` done; returns the newly ticked ones."""
        wanted = {_norm(p) for p in paths}
        ticked = []
        for item in self.items:
            if not item.done and _norm(item.path) in wanted:
                item.done = True
                ticked.append(item)
        return ticked

    def render(self) -> str:
        """A checklist, one line per item (progress output, transcript, report)."""
        lines = []
        for n, item in enumerate(self.items, 1):
            mark = "x" if item.done else ("-" if item.given_up else " ")
            lines.append(f"[{mark}] {n}. {item.path}" + (f": {item.features}" if item.features else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "items": [asdict(i) for i in self.items]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls([PlanItem(**i) for i in data.get("items", [])], data.get("source", "model"))


def parse_plan(text: str, allowed: list[str] | None = None) -> Plan:
    """The plan in a model's reply. ``allowed``: when given, only these paths count (the files
    the task names), so a path mentioned in passing does not become an item. Code blocks are
    skipped; an empty plan means the reply held none."""
    items: list[PlanItem] = []
    by_path: dict[str, PlanItem] = {}
    allow = {_norm(p) for p in allowed} if allowed else None
    current: PlanItem | None = None
    item_indent, under_heading = 0, False
    in_code = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_code = not in_code
            continue
        if in_code or not line.strip():
            continue
        m = _ITEM.match(line)
        body = _NUMBER.sub("", _MARKUP.sub("", m.group(2) if m else line))  # "1. 1. Create ..." (the 0.5B)
        token = _first_path(body, allow)
        indent = len(m.group(1)) if m else 0
        heading = bool(m) and line.lstrip().startswith("#")
        under = current is not None and (indent > item_indent or (under_heading and not heading))
        if m and token and not under:
            path = _norm(token)
            item = by_path.get(path)
            if item is None:
                if len(items) >= MAX_ITEMS:
                    break
                item = by_path[path] = PlanItem(path)
                items.append(item)
            current, item_indent, under_heading = item, indent, heading
            _add_feature(item, _LEAD.sub("", body.replace(token, "", 1)))
        elif under or (current is not None and not m and line[:1].isspace()):
            _add_feature(current, _LEAD.sub("", body))
        elif m:
            current = None  # a sibling item with no file: not part of the one before
    return Plan(items)


def plan_from_task(prompt: str, exists) -> Plan:
    """The fallback plan: the files the task prompt names that ``exists(path)`` says are not
    there yet, in the order named (used when the reply holds no plan)."""
    text = _URL.sub(" ", prompt)  # http://127.0.0.1:PORT/index.html names no file to write
    paths = [p for p in dict.fromkeys(PATH_TOKEN.findall(text)) if _safe(p) and not exists(p)]
    return Plan([PlanItem(p) for p in paths[:MAX_ITEMS]], source="task")


def _first_path(text: str, allow: set[str] | None) -> str | None:
    """The first usable path token in ``text`` (as written there), or None."""
    for token in PATH_TOKEN.findall(text):
        if _safe(token) and (allow is None or _norm(token) in allow):
            return token
    return None


def _add_feature(item: PlanItem, text: str) -> None:
    text = text.strip()
    if text.endswith(")") and text.count(")") > text.count("("):
        text = text[:-1].rstrip()  # "index.html (the markup)": the path took the opening one
    if not text:
        return
    joined = f"{item.features}; {text}" if item.features else text
    item.features = joined[:FEATURES_CHARS]


def _safe(path: str) -> bool:
    return (not path.startswith("/") and ".." not in path.split("/")
            and path.rsplit(".", 1)[-1].lower() in FILE_EXTS)


def _norm(path: str) -> str:
    return path[2:] if path.startswith("./") else path
