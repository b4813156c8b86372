"""Making room in the context: shorten old tool output, oldest first.

Only tool results are shortened (head and tail kept, the middle replaced by a note); system,
user and assistant messages stay as they are, and so do the example turns. Everything before
the first shortened message keeps its tokens, so the KV checkpoint still covers that prefix;
compacting well below the limit (``TARGET_FRACTION``) keeps compactions, and the re-prefill
each one costs, rare.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.sessions import Message

TARGET_FRACTION = 0.75  # compact down to this share of the room available to the prompt
KEEP_CHARS = 400  # of each shortened result: ~2/3 head, ~1/3 tail
MIN_SAVING_CHARS = 200  # results shorter than KEEP_CHARS + this are left alone


@dataclass(frozen=True)
class CompactionPlan:
    indices: tuple[int, ...]  # message indices to shorten, oldest first
    new_content: dict[int, str]
    tokens_saved: int  # estimated


def shorten(text: str, keep: int = KEEP_CHARS) -> str:
    """``text`` with its middle replaced by a note saying how much was removed."""
    if len(text) <= keep + MIN_SAVING_CHARS:
        return text
    head, tail = text[: keep * 2 // 3], text[-(keep // 3):]
    removed = len(text) - len(head) - len(tail)
    return f"{head}\n[... {removed} characters of tool output removed to fit the context ...]\n{tail}"


def plan(
    messages: Sequence[Message],
    tokens_over: int,
    count_tokens: Callable[[str], int],
    keep_last: int = 1,
) -> CompactionPlan:
    """Tool messages to shorten (oldest first) until about ``tokens_over`` tokens are saved.

    The newest ``keep_last`` tool results are kept whole unless nothing else is left.
    """
    candidates = [m for m in messages if m.role == "tool" and not m.meta.get("example")
                  and not m.meta.get("compacted")]
    ordered = candidates[:-keep_last] + candidates[-keep_last:] if keep_last else candidates
    chosen: list[int] = []
    new_content: dict[int, str] = {}
    saved = 0
    for m in ordered:
        if saved >= tokens_over:
            break
        short = shorten(m.content)
        if short == m.content:
            continue
        gain = m.token_count - count_tokens(short)
        if gain <= 0:
            continue
        chosen.append(m.index)
        new_content[m.index] = short
        saved += gain
    return CompactionPlan(tuple(sorted(chosen)), new_content, saved)
