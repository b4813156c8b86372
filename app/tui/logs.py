"""While the TUI owns the terminal, log records go to a file instead of stderr."""

from __future__ import annotations

import faulthandler
import logging
import logging.handlers
import signal
from collections.abc import Callable
from pathlib import Path

LOG_NAME = "tui.log"


def default_path() -> Path:
    from engine.paths import log_dir

    return log_dir() / LOG_NAME


def log_to_file(path: Path, level: int = logging.INFO) -> Callable[[], None]:
    """Route the root logger to ``path`` (rotating); returns a function that undoes it."""
    root = logging.getLogger()
    # Handlers writing to the terminal would tear the full-screen UI apart.
    removed = [h for h in root.handlers if isinstance(h, logging.StreamHandler)
               and not isinstance(h, logging.FileHandler)]
    for h in removed:
        root.removeHandler(h)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=2 << 20, backupCount=2,
                                                   encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(min(level, old_level) if old_level else level)
    logging.captureWarnings(True)
    # stderr is the screen: `kill -USR1 PID` writes every thread's stack to the log instead.
    dump_file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by restore)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)

    def restore() -> None:
        if hasattr(signal, "SIGUSR1"):
            faulthandler.unregister(signal.SIGUSR1)
        dump_file.close()
        logging.captureWarnings(False)
        root.removeHandler(handler)
        handler.close()
        root.setLevel(old_level)
        for h in removed:
            root.addHandler(h)

    return restore
