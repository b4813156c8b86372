"""Session transcripts as Markdown (for people) and JSON (for programs).

The JSON layout (``format_version`` 1) is documented in ``engine/sessions/__init__.py``.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from engine.sessions.model import Message, Session

FORMAT_NAME = "mlxterm.session"
FORMAT_VERSION = 1


def iso_time(ts: float) -> str:
    """Unix seconds as ISO 8601 UTC with milliseconds, e.g. ``2025-05-01T09:30:00.125Z``."""
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def session_dict(s: Session) -> dict[str, Any]:
    return {
        "id": s.id, "title": s.title, "profile": s.profile, "kind": s.kind,
        "workspace": s.workspace, "parent_id": s.parent_id, "fork_at": s.fork_at,
        "created": iso_time(s.created), "updated": iso_time(s.updated),
        "message_count": s.message_count, "token_count": s.token_count, "meta": s.meta,
    }


def message_dict(m: Message, include_tokens: bool = False) -> dict[str, Any]:
    d = {
        "index": m.index, "role": m.role, "content": m.content, "reasoning": m.reasoning,
        "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id, "name": m.name,
        "profile": m.profile, "created": iso_time(m.created), "updated": iso_time(m.updated),
        "token_count": m.token_count, "context_start": m.context_start, "meta": m.meta,
    }
    if include_tokens:
        d["token_ids"] = list(m.token_ids)
    return d


def to_json(session: Session, messages: list[Message], include_tokens: bool = False) -> str:
    doc = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "session": session_dict(session),
        "messages": [message_dict(m, include_tokens) for m in messages],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def _fence(text: str, lang: str = "") -> str:
    # A fence longer than any backtick run inside, so code in the text cannot close it.
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}"


def _as_json_block(text: str) -> str:
    try:
        return _fence(json.dumps(json.loads(text), indent=2, ensure_ascii=False), "json")
    except (ValueError, TypeError):
        return _fence(text)


def _human_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _heading(m: Message, session: Session) -> str:
    if m.role == "tool":
        label = "Tool result" + (f": {m.name}" if m.name else "")
        if m.tool_call_id:
            label += f" (`{m.tool_call_id}`)"
    else:
        label = m.role.capitalize()
    if m.profile and m.profile != session.profile:
        label += f" · {m.profile}"
    return f"## {label}"


def to_markdown(session: Session, messages: list[Message]) -> str:
    lines = [f"# {session.title}", ""]
    lines.append(f"- Session: `{session.id}` ({session.kind})")
    lines.append(f"- Profile: {session.profile or '(none)'}")
    if session.workspace:
        lines.append(f"- Workspace: `{session.workspace}`")
    lines.append(f"- Created: {_human_time(session.created)}")
    lines.append(f"- Updated: {_human_time(session.updated)}")
    if session.parent_id or session.fork_at is not None:
        parent = f"`{session.parent_id}`" if session.parent_id else "a deleted session"
        lines.append(f"- Forked from {parent} at message {session.fork_at}")
    lines.append(f"- Messages: {session.message_count} ({session.token_count} tokens)")
    for m in messages:
        lines += ["", _heading(m, session), ""]
        if m.reasoning:
            lines += ["<details>", "<summary>Reasoning</summary>", "", m.reasoning.strip(), "",
                      "</details>", ""]
        if m.role == "tool":
            lines.append(_as_json_block(m.content))
        elif m.content.strip():
            lines.append(m.content.strip())
        if m.tool_calls:
            if m.content.strip():
                lines.append("")
            lines += ["Tool calls:", "",
                      _fence(json.dumps(m.tool_calls, indent=2, ensure_ascii=False), "json")]
    return "\n".join(lines) + "\n"
