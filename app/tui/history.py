"""Prompt history shared by the TUI and the plain REPL (prompt-toolkit's FileHistory file)."""

from __future__ import annotations

from pathlib import Path

HISTORY_FILE = "prompt_history"
MAX_ENTRIES = 1000


def default_path() -> Path:
    from engine.paths import data_dir

    return data_dir() / HISTORY_FILE


class PromptHistory:
    """Previous prompts, newest first; ``add`` appends to the file at once."""

    def __init__(self, path: Path | None = None) -> None:
        from prompt_toolkit.history import FileHistory

        self.path = path or default_path()
        self._file = FileHistory(str(self.path))
        try:
            self.entries: list[str] = list(self._file.load_history_strings())[:MAX_ENTRIES]
        except (OSError, UnicodeDecodeError):
            self.entries = []  # an unreadable history file must not stop the chat

    def add(self, text: str) -> None:
        if self.entries and self.entries[0] == text:
            return
        self.entries.insert(0, text)
        try:
            self._file.store_string(text)
        except OSError:
            pass  # e.g. disk full: history is a convenience
