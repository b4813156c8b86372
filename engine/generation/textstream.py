"""Turn a stream of decoded text into content/reasoning deltas, honouring stop strings.

Both filters hold back only the few characters that could still become a marker or a stop
string, so text reaches the screen as soon as it cannot change.
"""

from __future__ import annotations


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class StopMatcher:
    """Cuts the stream at the first stop string; the stop string itself is not emitted."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(s for s in stops if s)
        self._buf = ""
        self.stopped: str | None = None

    def feed(self, text: str) -> str:
        if self.stopped is not None:
            return ""
        if not self.stops:
            return text
        self._buf += text
        hits = [(self._buf.find(s), s) for s in self.stops if s in self._buf]
        if hits:
            idx, stop = min(hits)
            self.stopped = stop
            out, self._buf = self._buf[:idx], ""
            return out
        keep = _held_suffix(self._buf, self.stops)
        out = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(out) :]
        return out

    def flush(self) -> str:
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out


class ReasoningSplitter:
    """Splits ``<think>…</think>`` (or the template's markers) out of the content stream.

    ``feed`` returns a list of ``("reasoning" | "content", text)`` pieces. When the prompt
    already opened a reasoning block (templates that end the generation prompt with
    ``<think>``), start with ``in_reasoning=True``.
    """

    def __init__(self, start: str = "<think>", end: str = "</think>", in_reasoning: bool = False):
        self.start, self.end = start, end
        self.in_reasoning = in_reasoning
        self._buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        pieces: list[tuple[str, str]] = []
        while True:
            marker = self.end if self.in_reasoning else self.start
            idx = self._buf.find(marker)
            kind = "reasoning" if self.in_reasoning else "content"
            if idx < 0:
                keep = _held_suffix(self._buf, (marker,))
                out = self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(out) :]
                if out:
                    pieces.append((kind, out))
                return pieces
            if idx:
                pieces.append((kind, self._buf[:idx]))
            self._buf = self._buf[idx + len(marker) :]
            self.in_reasoning = not self.in_reasoning

    def flush(self) -> list[tuple[str, str]]:
        out, self._buf = self._buf, ""
        return [("reasoning" if self.in_reasoning else "content", out)] if out else []
