"""Word error rate: word-level edit distance over the reference length, after normalising."""

from __future__ import annotations

import re
import unicodedata


def normalize(text: str) -> list[str]:
    """Lower-case words without accents or punctuation ("Café, ok!" -> ["cafe", "ok"])."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = re.sub(r"[-‐‑–—/]", " ", text)  # hyphenated words count as separate words
    text = re.sub(r"[^\w\s']", "", text).replace("'", "")
    return text.split()


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(substitutions + insertions + deletions, number of reference words)."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1], len(ref)


def word_error_rate(reference: str, hypothesis: str) -> float:
    errors, n = word_errors(reference, hypothesis)
    return errors / n if n else float(errors > 0)
