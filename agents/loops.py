"""Degenerate repetition in a streaming reply: the same lines (or characters) over and over.

With the repetition penalty off for agent steps (code repeats itself on purpose) a small model
sometimes falls into a loop inside a file block (the 1.5B wrote ``words = words.replace(...)``
until its 2048-token budget ran out: six minutes on two cores). A reply whose end is one block
of lines repeated ``LINE_REPEATS`` times in a row, or one short piece of text repeated
``CHAR_REPEATS`` times, is looping; real code rarely repeats a whole block four times running.
"""

from __future__ import annotations

LINE_REPEATS = 4  # a block of 1-8 lines, this many times in a row at the end
MAX_PERIOD_LINES = 8
MIN_BLOCK_CHARS = 24  # non-blank characters in the block (blank lines and "}" repeat legitimately)
CHAR_REPEATS = 8  # a piece of 4-64 characters, this many times in a row at the end (within a line)


def looping(text: str) -> bool:
    """Whether ``text`` ends in a degenerate repetition (see the module docstring)."""
    return _lines_repeat(text) or _chars_repeat(text)


def _lines_repeat(text: str) -> bool:
    lines = text.rstrip("\n").split("\n")
    for period in range(1, MAX_PERIOD_LINES + 1):
        if len(lines) < period * LINE_REPEATS:
            break
        block = lines[-period:]
        if sum(len(x.strip()) for x in block) < MIN_BLOCK_CHARS:
            continue
        if all(lines[-period * (k + 1): len(lines) - period * k] == block for k in range(1, LINE_REPEATS)):
            return True
    return False


def _chars_repeat(text: str) -> bool:
    tail = text[-64 * CHAR_REPEATS:]
    for size in range(4, 65):
        if len(tail) < size * CHAR_REPEATS:
            break
        piece = tail[-size:]
        if not piece.strip():
            continue
        if tail.endswith(piece * CHAR_REPEATS):
            return True
    return False


class LoopGuard:
    """Checks a growing reply at line ends (and every ``every`` characters within a line)."""

    def __init__(self, every: int = 256):
        self.every = every
        self._checked = 0
        self.tripped = False

    def update(self, text: str) -> bool:
        if self.tripped:
            return True
        if text.endswith("\n") or len(text) - self._checked >= self.every:
            self._checked = len(text)
            self.tripped = looping(text)
        return self.tripped
