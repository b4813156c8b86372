"""Persistent sessions: the one store shared by the TUI chat, agents and the CLI.

``SessionStore()`` opens ``engine.paths.data_dir()/sessions.sqlite3`` (SQLite, WAL, foreign
keys on, busy timeout; safe for several processes at once). A session is a list of messages;
each message keeps, besides its text, the exact token ids the model was fed (user, system,
tool) or produced (assistant) for it, so a session's context is the concatenation of its
messages' ``token_ids`` (``SessionStore.context_tokens``) and ``Message.context_start`` is the
offset of a message in that context. A session that ran on a remote profile's server keeps
messages without token ids and says so in its meta (engine.sessions.remote_chat).

JSON export (``SessionStore.export(id, "json")``), ``format_version`` 1::

Design notes, measurements and history: docs/engine-notes.md (__init__.py).
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
