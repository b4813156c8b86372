"""Session ids and default titles."""

from __future__ import annotations

import re
import secrets
import time

# Crockford base32, lower case: digits sort before letters in ASCII, so ids sort by time.
ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"
ID_LENGTH = 12
_TIME_CHARS = 9  # 45 bits of milliseconds since 1970: good until the year 3084
_RANDOM_CHARS = ID_LENGTH - _TIME_CHARS  # 15 random bits; inserts retry on the rare clash

DEFAULT_TITLE = "New chat"
TITLE_MAX = 60


def _encode(value: int, width: int) -> str:
    chars = []
    for _ in range(width):
        value, digit = divmod(value, 32)
        chars.append(ALPHABET[digit])
    return "".join(reversed(chars))


def new_id(now: float | None = None) -> str:
    """A 12-character id: creation time in milliseconds, then random bits (sortable by time)."""
    ms = int((time.time() if now is None else now) * 1000)
    return _encode(ms, _TIME_CHARS) + _encode(secrets.randbits(5 * _RANDOM_CHARS), _RANDOM_CHARS)


_NAMED_ID = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


def is_id_prefix(text: str) -> bool:
    """Whether ``text`` can be (the start of) a session id (generated or user-named)."""
    return _NAMED_ID.fullmatch(text) is not None


def check_named_id(text: str) -> str:
    """A user-chosen session id (``generate --session my-notes``): lowercase letters, digits,
    '.', '_' and '-', up to 64 characters, starting with a letter or digit."""
    key = text.strip().lower()
    if _NAMED_ID.fullmatch(key) is None:
        from engine.sessions.errors import SessionError

        raise SessionError(
            f"session id {text!r} is not valid: use up to 64 lowercase letters, digits, '.', '_' "
            "or '-', starting with a letter or digit."
        )
    return key


_MARKUP = re.compile(r"^[#>*\-+`\s]+|[*`]+")


def suggest_title(text: str, max_len: int = TITLE_MAX) -> str:
    """A one-line title from the first user message: first non-empty line, markup stripped,
    cut at a word boundary with an ellipsis. Empty text gives ``"New chat"``."""
    for line in text.splitlines():
        line = " ".join(_MARKUP.sub("", line).split())
        if line:
            break
    else:
        return DEFAULT_TITLE
    if len(line) <= max_len:
        return line
    cut = line[: max_len - 1]
    space = cut.rfind(" ")
    if space >= max_len // 2:  # keep whole words unless that throws away most of the line
        cut = cut[:space]
    return cut.rstrip(" ,.;:-") + "…"
