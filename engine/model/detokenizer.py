"""Incremental detokenization for streaming output.

A token's text is not always a whole piece of a string: a byte-level BPE token can hold half of
a UTF-8 character, a SentencePiece byte-fallback token a single byte. The detokenizers here look
each token up once (O(1) per step, no re-decoding of the sequence) and hold back only what is
not yet a whole character, so the concatenated output equals the batch ``decode`` of all ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

Piece = str | bytes


class _Start:
    """Skipping special ids and removing the one leading space SentencePiece decoders strip."""

    def __init__(self, skip: frozenset[int], strip_leading_space: bool) -> None:
        self.skip = skip
        self.strip = strip_leading_space
        self.at_start = True

    def text(self, text: str) -> str:
        if self.at_start and text:
            self.at_start = False
            if self.strip and text[0] == " ":
                return text[1:]
        return text


class ByteStreamDetokenizer:
    """For byte-level BPE: every token is bytes; the stream is decoded as one UTF-8 string.

    ``piece_bytes(id)`` gives a token's bytes. Invalid bytes become U+FFFD by the maximal-subpart
    rule, as the batch decoder's ``String::from_utf8_lossy`` does.
    """

    def __init__(
        self,
        piece_bytes: Callable[[int], bytes],
        *,
        skip: frozenset[int] = frozenset(),
        strip_leading_space: bool = False,
    ) -> None:
        self._piece_bytes = piece_bytes
        self._start = _Start(skip, strip_leading_space)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Add one token; return the text it completes (may be empty)."""
        if token_id in self._start.skip:
            return ""
        return self._start.text(self._utf8.decode(self._piece_bytes(token_id)))

    def flush(self) -> str:
        """Return what is left (an unfinished character becomes U+FFFD) and reset."""
        text = self._start.text(self._utf8.decode(b"", final=True))
        self._utf8.reset()
        self._start.at_start = True
        return text


class PieceStreamDetokenizer:
    """For SentencePiece vocabularies: a token is text, or one raw byte (``<0xNN>`` fallback).

    ``piece(id)`` returns ``str`` for text tokens and ``bytes`` for byte-fallback tokens. As in
    the batch decoder, a run of consecutive byte tokens is decoded as a whole: valid UTF-8 gives
    its text, anything else one U+FFFD per byte. The run is therefore held until a text token
    (or ``flush``) ends it.
    """

    def __init__(
        self,
        piece: Callable[[int], Piece],
        *,
        skip: frozenset[int] = frozenset(),
        strip_leading_space: bool = False,
    ) -> None:
        self._piece = piece
        self._start = _Start(skip, strip_leading_space)
        self._run = bytearray()

    def add(self, token_id: int) -> str:
        if token_id in self._start.skip:
            return ""
        piece = self._piece(token_id)
        if isinstance(piece, bytes):
            self._run += piece
            return ""
        return self._start.text(self._end_run() + piece)

    def flush(self) -> str:
        text = self._start.text(self._end_run())
        self._start.at_start = True
        return text

    def _end_run(self) -> str:
        if not self._run:
            return ""
        try:
            text = self._run.decode("utf-8")
        except UnicodeDecodeError:
            text = "\ufffd" * len(self._run)
        self._run.clear()
        return text


class WindowDetokenizer:
    """Fallback for decoders whose per-token output is unknown: re-decode the current line.

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


Detokenizer = ByteStreamDetokenizer | PieceStreamDetokenizer | WindowDetokenizer
