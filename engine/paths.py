"""Where runtime data lives: ``$MLXTERM_HOME`` if set, else the XDG directories."""

from __future__ import annotations

import os
from pathlib import Path

from engine.settings import current


def _xdg(var: str, default: str, sub: str) -> Path:
    home = current().home
    if home is not None:
        return home / sub
    base = os.environ.get(var) or str(Path.home() / default)
    return Path(base).expanduser() / "mlxterm"


def data_dir() -> Path:
    """Sessions, checkpoints, installed models (``$MLXTERM_HOME/data`` or XDG data)."""
    return _ensure(_xdg("XDG_DATA_HOME", ".local/share", "data"))


def config_dir() -> Path:
    """User profiles and settings (``$MLXTERM_HOME/config`` or XDG config)."""
    return _ensure(_xdg("XDG_CONFIG_HOME", ".config", "config"))


def cache_dir() -> Path:
    """Converted weights and other rebuildable files (``$MLXTERM_HOME/cache`` or XDG cache)."""
    return _ensure(_xdg("XDG_CACHE_HOME", ".cache", "cache"))


def log_dir() -> Path:
    return _ensure(data_dir() / "logs")


def _ensure(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def models_dir() -> Path:
    """Installed catalogue models (tests link it to one folder shared across runs)."""
    return _ensure(data_dir() / "models")
