"""Incremental detokenization for streaming output.

A token's text is not always a whole piece of a string: a byte-level BPE token can hold half of
a UTF-8 character, a SentencePiece byte-fallback token a single byte. ``StreamDetokenizer`` keeps
the bytes of each token (looked up once per id) and feeds them to an incremental UTF-8 decoder,
so each step costs O(1) and the concatenated output equals the batch decode of all ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class StreamDetokenizer:
    """Turn token ids into text one at a time, never splitting a UTF-8 character.

    ``piece_bytes(id)`` gives the bytes the batch decoder produces for one token. ``skip`` holds
    ids to drop (special tokens when decoding with ``skip_special``). ``strip_leading_space``
    removes one space at the very start, as SentencePiece decoders do for the prefix space the
    encoder added.
    """

    def __init__(
        self,
        piece_bytes: Callable[[int], bytes],
        *,
        skip: frozenset[int] = frozenset(),
        strip_leading_space: bool = False,
    ) -> None:
        self._piece_bytes = piece_bytes
        self._skip = skip
        self._strip = strip_leading_space
        self._at_start = True
        # "replace" follows the maximal-subpart rule, as Rust's from_utf8_lossy does.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Add one token; return the text it completes (may be empty)."""
        if token_id in self._skip:
            return ""
        data = self._piece_bytes(token_id)
        if self._at_start and data:
            self._at_start = False
            if self._strip and data[:1] == b" ":
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Return what is left (an unfinished character becomes U+FFFD) and reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        self._at_start = True
        return text


class WindowDetokenizer:
    """Fallback for decoders whose per-token bytes are unknown: re-decode the current line.

    The ids since the last emitted newline are decoded each step together with a few ids before
    them (so decoders that treat the first token specially see the same context as a batch
    decode); the cost grows with line length, not with the whole sequence. Text ending in U+FFFD
    is held back in case the next token completes the character.
    """

    _CONTEXT = 4

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._start = 0  # first id of the current window
        self._context_len = 0  # characters that decode(context) yields
        self._sent = 0  # characters of the window already returned

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._window_text()
        if text.endswith("\ufffd"):
            return ""
        new = text[self._sent :]
        self._sent = len(text)
        if text.endswith("\n"):
            self._restart()
        return new

    def flush(self) -> str:
        text = self._window_text()[self._sent :]
        self._ids, self._start, self._context_len, self._sent = [], 0, 0, 0
        return text

    def _window_text(self) -> str:
        context = self._ids[max(0, self._start - self._CONTEXT) : self._start]
        return self._decode(context + self._ids[self._start :])[self._context_len :]

    def _restart(self) -> None:
        self._start = len(self._ids)
        context = self._ids[max(0, self._start - self._CONTEXT) :]
        self._context_len = len(self._decode(context))
        self._sent = 0
