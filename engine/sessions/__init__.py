"""Persistent sessions: the one store shared by the TUI chat, agents and the CLI.

``SessionStore()`` opens ``engine.paths.data_dir()/sessions.sqlite3`` (SQLite, WAL, foreign
keys on, busy timeout; safe for several processes at once). A session is a list of messages;
each message keeps, besides its text, the exact token ids the model was fed (user, system,
tool) or produced (assistant) for it, so a session's context is the concatenation of its
messages' ``token_ids`` (``SessionStore.context_tokens``) and ``Message.context_start`` is the
offset of a message in that context.

JSON export (``SessionStore.export(id, "json")``), ``format_version`` 1::

    {
      "format": "mlxterm.session",
      "format_version": 1,
      "session": {
        "id": "0jb2c8f1m4xq",          # 12 chars, sorts by creation time
        "title": str, "profile": str, "kind": "chat" | "agent",
        "workspace": str | null,       # agent sessions: the directory they work in
        "parent_id": str | null,       # set for forks (null once the parent is deleted)
        "fork_at": int | null,         # forks: how many parent messages were copied
        "created": "2025-05-01T09:30:00.125Z", "updated": ...,   # ISO 8601 UTC
        "message_count": int, "token_count": int,
        "meta": {...}                  # free-form JSON object
      },
      "messages": [
        {
          "index": int,                # 0-based position
          "role": "system" | "user" | "assistant" | "tool",
          "content": str,
          "reasoning": str | null,     # thinking text kept apart from the answer
          "tool_calls": [...] | null,  # assistant: the calls as the model emitted them
          "tool_call_id": str | null,  # tool: which call this result answers
          "name": str | null,          # tool: the tool's name
          "profile": str,              # profile that produced / received the message
          "created": iso, "updated": iso,
          "token_count": int,          # len(token_ids)
          "context_start": int,        # offset of the first token in the session context
          "meta": {...},               # e.g. usage, timings, cache source, finish_reason
          "token_ids": [int, ...]      # only with include_tokens=True
        }
      ]
    }

Readers must ignore keys they do not know; a change that breaks readers bumps
``format_version``.
"""

from engine.sessions.errors import SessionError, SessionNotFound
from engine.sessions.export import FORMAT_NAME, FORMAT_VERSION
from engine.sessions.model import Message, Session, SessionSummary
from engine.sessions.naming import suggest_title
from engine.sessions.store import UNSET, SessionStore, default_path

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "UNSET", "Message", "Session", "SessionError",
    "SessionNotFound", "SessionStore", "SessionSummary", "default_path", "suggest_title",
]
