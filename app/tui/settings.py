"""TUI preferences kept between runs (``config_dir()/tui.json``): just the theme for now."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

DARK, LIGHT = "textual-dark", "textual-light"
DEFAULTS = {"theme": DARK}


def default_path() -> Path:
    from engine.paths import config_dir

    return config_dir() / "tui.json"


def load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return dict(DEFAULTS)
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable TUI settings %s: %s", path, e)
        return dict(DEFAULTS)
    return {**DEFAULTS, **data} if isinstance(data, dict) else dict(DEFAULTS)


def save(path: Path, settings: dict) -> None:
    from engine.atomic import atomic_write_text

    try:
        atomic_write_text(path, json.dumps(settings, indent=1) + "\n")
    except OSError as e:  # preferences are not worth interrupting the user for
        log.warning("cannot save TUI settings %s: %s", path, e)
