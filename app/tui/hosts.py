"""What each of the main screen's controllers may use of its host, the screen that owns it.

``MainScreen`` constructs ``ChatActions``, ``AgentActions`` and ``DictationActions`` with itself
as ``host``; each protocol below is the whole of what one of them uses of ``self.host``
(besides Textual's own ``Screen`` API: ``notify``, ``app``, ``query_one``, ``refresh_bindings``).
Where the screen must react to a controller, the controller posts a message declared on its own
class (``AgentActions.RunEnded``) instead of calling into the screen. ``tests/test_tui_hosts.py``
checks that ``MainScreen`` provides every member and that no controller uses an undeclared one.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol


class ChatHost(Protocol):
    """The host of ``app.tui.screens.chat_actions.ChatActions``."""

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
    """The host of ``app.tui.agent_mode.AgentActions``."""

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

    def pane_title(self, pane: Any) -> str: ...

    def load_profile(self, spec: str) -> None: ...


class DictationHost(Protocol):
    """The host of ``app.tui.dictation.DictationActions`` (which also queries it for a
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
