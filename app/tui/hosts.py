"""What the main screen's action mixins need from the screen they are mixed into.

``MainScreen`` is composed of ``ChatActions``, ``AgentActions`` and ``DictationActions``; each
protocol below is the whole of what one of them uses of its host (besides Textual's own
``Screen`` API: ``notify``, ``app``, ``query_one``, ``post_message``, ``refresh_bindings``).
``tests/test_tui_hosts.py`` checks that ``MainScreen`` provides every member, so a rename in
the screen breaks a test instead of a mixin at run time.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol


class ChatHost(Protocol):
    """Needed by ``app.tui.screens.chat_actions.ChatActions``."""

    session_id: str | None

    @property
    def controller(self) -> Any: ...

    @property
    def visible_busy(self) -> bool: ...

    def open_session(self, session_id: str, switch_profile: bool = True) -> Awaitable[None]: ...

    def action_new_chat(self) -> Awaitable[None]: ...

    def stop_and_wait(self, everything: bool = False) -> Awaitable[None]: ...

    def refresh_sessions(self) -> None: ...

    def action_retry(self) -> Awaitable[None]: ...

    def action_switch_profile(self, spec: str = "") -> None: ...


class AgentHost(Protocol):
    """Needed by ``app.tui.agent_mode.AgentActions``."""

    session_id: str | None

    @property
    def controller(self) -> Any: ...

    @property
    def conversation(self) -> Any: ...

    @property
    def prompt(self) -> Any: ...

    @property
    def status(self) -> Any: ...

    def open_session(self, session_id: str, switch_profile: bool = True) -> Awaitable[None]: ...

    def action_new_chat(self) -> Awaitable[None]: ...

    def update_context(self) -> None: ...

    def refresh_sessions(self) -> None: ...

    def turn_status(self, pane: Any, text: str) -> None: ...

    def release_pane(self, pane: Any) -> Awaitable[None]: ...

    def pane_title(self, pane: Any) -> str: ...

    def load_profile(self, spec: str) -> None: ...


class DictationHost(Protocol):
    """Given to ``app.tui.dictation.DictationActions`` (which also queries the host for a
    ``RecordingIndicator`` with id ``recording``)."""

    @property
    def controller(self) -> Any: ...

    @property
    def prompt(self) -> Any: ...


HOSTS = {"ChatActions": ChatHost, "AgentActions": AgentHost, "DictationActions": DictationHost}


def members(protocol: type) -> list[str]:
    """The names a host must provide for ``protocol``."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return sorted(names)
