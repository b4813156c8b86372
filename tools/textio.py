"""Text helpers shared by the tools: binary sniffing, output caps, diffs."""

from __future__ import annotations

import codecs
import difflib
import mimetypes
import re
from pathlib import Path

SNIFF_BYTES = 8192

# (offset, magic, description): enough to tell the model what a binary file probably is.
_MAGIC: list[tuple[int, bytes, str]] = [
    (0, b"\x89PNG\r\n\x1a\n", "PNG image"),
    (0, b"\xff\xd8\xff", "JPEG image"),
    (0, b"GIF8", "GIF image"),
    (0, b"%PDF-", "PDF document"),
    (0, b"PK\x03\x04", "ZIP archive (or docx/xlsx/jar/wheel)"),
    (0, b"\x1f\x8b", "gzip compressed data"),
    (0, b"BZh", "bzip2 compressed data"),
    (0, b"\xfd7zXZ\x00", "xz compressed data"),
    (0, b"7z\xbc\xaf\x27\x1c", "7-zip archive"),
    (0, b"\x28\xb5\x2f\xfd", "zstd compressed data"),
    (0, b"\x7fELF", "ELF executable or shared library"),
    (0, b"MZ", "Windows executable"),
    (0, b"GGUF", "GGUF model weights"),
    (0, b"\x93NUMPY", "NumPy array (.npy)"),
    (0, b"SQLite format 3\x00", "SQLite database"),
    (0, b"\x00asm", "WebAssembly module"),
    (0, b"ID3", "MP3 audio"),
    (0, b"fLaC", "FLAC audio"),
    (0, b"OggS", "Ogg media"),
    (0, b"\x1aE\xdf\xa3", "Matroska/WebM video"),
    (257, b"ustar", "tar archive"),
]

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def looks_binary(sample: bytes, complete: bool) -> bool:
    """True when ``sample`` has NUL bytes or is not UTF-8.

    ``complete`` says the sample is the whole file; otherwise a multi-byte character cut at
    the end of the sample is not held against it.
    """
    if b"\x00" in sample:
        return True
    try:
        codecs.getincrementaldecoder("utf-8")().decode(sample, final=complete)
    except UnicodeDecodeError:
        return True
    return False


def guess_type(sample: bytes, path: Path) -> str:
    for offset, magic, what in _MAGIC:
        if sample[offset : offset + len(magic)] == magic:
            if what == "Windows executable" and b"PE\x00\x00" not in sample[:1024]:
                continue
            return what
    if sample[:4] == b"RIFF" and sample[8:12] in (b"WAVE", b"AVI ", b"WEBP"):
        return {b"WAVE": "WAV audio", b"AVI ": "AVI video", b"WEBP": "WebP image"}[sample[8:12]]
    if path.suffix == ".safetensors":
        return "safetensors model weights"
    mime, _ = mimetypes.guess_type(path.name)
    return mime or "unknown binary data"


def cap_text(text: str, max_chars: int) -> tuple[str, bool]:
    """Keep the head and tail of ``text`` within ``max_chars``, marking what was dropped."""
    if len(text) <= max_chars:
        return text, False
    keep = max_chars // 2
    omitted = len(text) - 2 * keep
    return f"{text[:keep]}\n[… {omitted} characters omitted …]\n{text[-keep:]}", True


def strip_ansi(text: str) -> str:
    """Drop terminal colour/cursor escapes: noise for the model and the TUI."""
    return _ANSI.sub("", text)


def unified_diff(old: str, new: str, name: str) -> str:
    lines = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        fromfile=f"a/{name}",
        tofile=f"b/{name}",
    )
    # A last line without newline would glue onto the next diff line; mark it like git does.
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def diff_stats(diff: str) -> tuple[int, int]:
    """(lines added, lines removed) in a unified diff."""
    added = removed = 0
    for line in diff.splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed


class HeadTail:
    """Byte sink that keeps only the first and last ``half`` bytes of a stream.

    Lets a command print 10 MB while memory stays at ~2 * ``half``.
    """

    def __init__(self, cap: int) -> None:
        self.half = cap // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def write(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            if len(self.tail) > 2 * self.half:  # trim in batches, not on every chunk
                del self.tail[: len(self.tail) - self.half]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + min(len(self.tail), self.half)

    def text(self) -> str:
        tail = bytes(self.tail[-self.half :]) if self.half else b""
        head = bytes(self.head)
        if not self.truncated:
            return (head + bytes(self.tail)).decode("utf-8", errors="replace")
        omitted = self.total - len(head) - len(tail)
        return (
            head.decode("utf-8", errors="replace")
            + f"\n[… {omitted} bytes omitted …]\n"
            + tail.decode("utf-8", errors="replace")
        )
