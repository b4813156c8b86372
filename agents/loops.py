"""Degenerate repetition in a streaming reply: the same lines (or characters) over and over.

With the repetition penalty off for agent steps (code repeats itself on purpose) a small model
sometimes falls into a loop inside a file block (the 1.5B wrote ``words = words.replace(...)``
until its 2048-token budget ran out: six minutes on two cores). A reply whose end is one block
of lines repeated ``LINE_REPEATS`` times in a row (a longer block: ``LONG_REPEATS`` times), or
one short piece of text repeated ``CHAR_REPEATS`` times, is looping; real code rarely repeats a
whole block four times running. The 1.5B also cycles through variations: ``words.replace(c, "")``
for 23 punctuation characters, then the same 23 again. A run of ``SHAPE_RUN`` lines of one shape
(string and number literals masked) in which lines recur is that loop; a table of distinct
entries (a cipher's 26 mappings) has the shape but no recurring line.
"""

from __future__ import annotations

import re

LINE_REPEATS = 4  # a block of 1-8 lines, this many times in a row at the end
MAX_PERIOD_LINES = 8
MIN_BLOCK_CHARS = 24  # non-blank characters in the block (blank lines and "}" repeat legitimately)
CHAR_REPEATS = 8  # a piece of 4-64 characters, this many times in a row at the end (within a line)
MAX_LONG_PERIOD_LINES = 48
LONG_REPEATS = 3  # a block of 9-48 lines, this many times in a row at the end
SHAPE_RUN = 16  # this many lines of one shape at the end ...
SHAPE_RECURRING = 3  # ... of which this many repeat a line earlier in the run
MAX_SHAPE_RUN = 200
_LITERAL = re.compile(r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|\b\d+(?:\.\d+)?\b")


def looping(text: str) -> bool:
    """Whether ``text`` ends in a degenerate repetition (see the module docstring)."""
    lines = text.rstrip("\n").split("\n")
    return _lines_repeat(lines) or _shapes_recur(lines) or _chars_repeat(text)


def _lines_repeat(lines: list[str]) -> bool:
    for period in range(1, MAX_LONG_PERIOD_LINES + 1):
        repeats = LINE_REPEATS if period <= MAX_PERIOD_LINES else LONG_REPEATS
        if len(lines) < period * repeats:
            break
        block = lines[-period:]
        if sum(len(x.strip()) for x in block) < MIN_BLOCK_CHARS:
            continue
        if all(lines[-period * (k + 1): len(lines) - period * k] == block for k in range(1, repeats)):
            return True
    return False


def _shapes_recur(lines: list[str]) -> bool:
    if len(lines) < SHAPE_RUN or len(lines[-1].strip()) < 8:
        return False
    shape = _LITERAL.sub("L", lines[-1])
    run = []
    for x in reversed(lines[-MAX_SHAPE_RUN:]):
        if _LITERAL.sub("L", x) != shape:
            break
        run.append(x)
    return len(run) >= SHAPE_RUN and len(run) - len(set(run)) >= SHAPE_RECURRING


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
