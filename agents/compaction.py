"""Making room in the context: drop old file versions, then shorten old tool output.

First the per-file policy: a file the agent wrote more than once keeps only its latest version;
each older one (the block in the assistant turn that wrote it, or a ``read_file`` result of it)
is replaced by a one-line reference (``superseded``). Then, while more room is needed, tool
results are shortened, oldest first (head and tail kept, the middle replaced by a note). System
and user messages stay as they are, and so do the example turns. Everything before the first
changed message keeps its tokens, so the KV checkpoint still covers that prefix; compacting
well below the limit (``TARGET_FRACTION``) keeps compactions, and the re-prefill each one
costs, rare.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.sessions import Message

TARGET_FRACTION = 0.75  # compact down to this share of the room available to the prompt
KEEP_CHARS = 400  # of each shortened result: ~2/3 head, ~1/3 tail
MIN_SAVING_CHARS = 200  # results shorter than KEEP_CHARS + this are left alone
MIN_VERSION_CHARS = 120  # older file versions shorter than this are left alone


@dataclass(frozen=True)
class CompactionPlan:
    indices: tuple[int, ...]  # message indices to change, oldest first
    new_content: dict[int, str]  # tool messages: their new content; assistant turns: their new raw text
    tokens_saved: int  # estimated
    superseded: dict[int, str] = field(default_factory=dict)  # index -> the file whose older version went


@dataclass(frozen=True)
class OldVersion:
    index: int  # the message holding it
    path: str
    text: str  # the file's text as it appears in that message (the whole content for a tool result)


def reference(path: str) -> str:
    """The one line that stands for an older version of ``path``."""
    return f"[an older version of {path} was here: removed, the latest one is further on]"


def old_versions(messages: Sequence[Message]) -> list[OldVersion]:
    """Every version of a file, written (the content of a successful write_file call) or read
    (a read_file result), that a later write or read of the same file supersedes; oldest first."""
    calls = {c["id"]: (m, c) for m in messages if m.role == "assistant" and m.tool_calls
             for c in m.tool_calls if isinstance(c, dict) and "id" in c}
    seen: dict[str, list[tuple[int, str]]] = {}
    for m in messages:
        if m.role != "tool" or m.meta.get("example") or not m.meta.get("ok") or not m.meta.get("path"):
            continue
        path = m.meta["path"]
        if m.name == "read_file":
            seen.setdefault(path, []).append((m.index, m.content))
        elif m.name == "write_file" and m.tool_call_id in calls:
            owner, call = calls[m.tool_call_id]
            content = (call.get("function") or {}).get("arguments", {}).get("content")
            if isinstance(content, str):
                seen.setdefault(path, []).append((owner.index, content))
    out = []
    for path, versions in seen.items():
        latest_index = versions[-1][0]
        out += [OldVersion(i, path, text) for i, text in versions[:-1]
                if i != latest_index and len(text) >= MIN_VERSION_CHARS]
    return sorted(out, key=lambda v: v.index)


def drop_version(message: Message, version: OldVersion, current: str | None = None) -> str | None:
    """``message``'s renderable text (or ``current``, an earlier rewrite of it) with ``version``
    replaced by its reference; None when the text cannot be found (left as it is)."""
    ref = reference(version.path)
    if message.role == "tool":
        return ref
    text = current if current is not None else message.meta.get("raw_text", message.content)
    for form in (version.text, json.dumps(version.text, ensure_ascii=False)[1:-1]):
        if form and form in text:
            return text.replace(form, ref, 1)
    return None


def shorten(text: str, keep: int = KEEP_CHARS) -> str:
    """``text`` with its middle replaced by a note saying how much was removed."""
    if len(text) <= keep + MIN_SAVING_CHARS:
        return text
    head, tail = text[: keep * 2 // 3], text[-(keep // 3):]
    removed = len(text) - len(head) - len(tail)
    return f"{head}\n[... {removed} characters of tool output removed to fit the context ...]\n{tail}"


def plan(
    messages: Sequence[Message],
    tokens_over: int,
    count_tokens: Callable[[str], int],
    keep_last: int = 1,
) -> CompactionPlan:
    """Messages to change (oldest first) until about ``tokens_over`` tokens are saved: older
    file versions first, then tool results to shorten. The newest ``keep_last`` tool results
    are kept whole unless nothing else is left.
    """
    by_index = {m.index: m for m in messages}
    new_content: dict[int, str] = {}
    superseded: dict[int, str] = {}
    saved = 0
    for version in old_versions(messages):
        if saved >= tokens_over:
            break
        m = by_index[version.index]
        text = drop_version(m, version, new_content.get(m.index))
        if text is None:
            continue
        before = new_content.get(m.index, m.meta.get("raw_text", m.content) if m.role == "assistant" else m.content)
        gain = count_tokens(before) - count_tokens(text)
        if gain <= 0:
            continue
        new_content[m.index] = text
        superseded[m.index] = version.path
        saved += gain
    candidates = [m for m in messages if m.role == "tool" and not m.meta.get("example")
                  and not m.meta.get("compacted") and m.index not in new_content]
    ordered = candidates[:-keep_last] + candidates[-keep_last:] if keep_last else candidates
    for m in ordered:
        if saved >= tokens_over:
            break
        short = shorten(m.content)
        if short == m.content:
            continue
        gain = (m.token_count or count_tokens(m.content)) - count_tokens(short)  # no tokens: a remote session
        if gain <= 0:
            continue
        new_content[m.index] = short
        saved += gain
    return CompactionPlan(tuple(sorted(new_content)), new_content, saved, superseded)
