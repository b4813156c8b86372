"""Errors raised by the session store; each carries one readable sentence."""

from __future__ import annotations

from engine.errors import MlxtermError


class SessionError(MlxtermError):
    """Bad input to the session store, or its database cannot be used."""


class SessionNotFound(SessionError):
    """No session has this id, or an id prefix matches more than one session."""
