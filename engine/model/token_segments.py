"""Encode long prompts by their segments between added tokens, reusing ids already computed.

A served conversation, or an agent's context, is rendered and tokenized whole at every request:
~7 ms for 7,000 tokens on one core, most of it text the previous request already tokenized.
The ``tokenizers`` library cuts the input at its added tokens (``<|im_start|>``, ``<|im_end|>``,
...) before anything else and tokenizes the pieces between them independently, so the ids of a
text are the ids of its pieces in order, with each added token's id between them. This module
cuts the same way and keeps recent pieces' ids (LRU, bounded by characters), so a follow-up
turn tokenizes only its new messages.

That equality holds only for pipelines where nothing crosses the cuts: no normalizer, a
byte-level pre-tokenizer without ``add_prefix_space`` (alone or after regex splits: the gpt2 /
Qwen / SmolLM2 family), and added tokens that strip no whitespace, match whole words only or
are normalized. ``for_backend`` returns None for anything else (the caller encodes whole).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import tokenizers

# Texts shorter than this are encoded whole (the cut and the lookups would cost more).
MIN_CHARS = 2048
# Characters of cached pieces kept (~4 MB of text: a few long conversations).
MAX_CACHED_CHARS = 4 << 20


def _segment_safe(backend: tokenizers.Tokenizer) -> bool:
    # The pre-tokenizer's own state, not the whole tokenizer's JSON (~200 ms for Qwen's vocabulary).
    if backend.normalizer is not None or backend.pre_tokenizer is None:
        return False
    pre = json.loads(backend.pre_tokenizer.__getstate__())
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("add_prefix_space"):
        return False
    if any(s.get("type") not in ("Split", "ByteLevel") for s in steps):
        return False
    return all(
        not (t.lstrip or t.rstrip or t.single_word or t.normalized)
        for t in backend.get_added_tokens_decoder().values()
    )


class SegmentCache:
    """``encode(text)`` = ``backend.encode(text, add_special_tokens=False).ids``, piece by piece."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self.backend = backend
        added = backend.get_added_tokens_decoder()
        self.ids = {t.content: i for i, t in added.items()}
        # Longest first: at one position the longest added token wins, as the library's
        # leftmost-longest match does.
        alternatives = sorted(self.ids, key=len, reverse=True)
        self.pattern = re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    @classmethod
    def for_backend(cls, backend: tokenizers.Tokenizer) -> SegmentCache | None:
        """A cache for ``backend``, or None where its pipeline does not split at added tokens."""
        if not backend.get_added_tokens_decoder() or not _segment_safe(backend):
            return None
        return cls(backend)

    def encode(self, text: str) -> list[int]:
        parts = self.pattern.split(text)  # pieces at even indices, added tokens at odd ones
        with self._lock:
            found = {p: self._pieces.get(p) for p in parts[0::2] if p}
            for p, ids in found.items():
                if ids is not None:
                    self._pieces.move_to_end(p)
        missing = [p for p, ids in found.items() if ids is None]
        if missing:
            encoded = self.backend.encode_batch(missing, add_special_tokens=False)
            fresh = {p: tuple(e.ids) for p, e in zip(missing, encoded, strict=True)}
            found.update(fresh)
            self._remember(fresh)
        out: list[int] = []
        for i, p in enumerate(parts):
            if i % 2:
                out.append(self.ids[p])
            elif p:
                out.extend(found[p])
        return out

    def _remember(self, fresh: dict[str, tuple[int, ...]]) -> None:
        with self._lock:
            for p, ids in fresh.items():
                if len(p) > MAX_CACHED_CHARS // 4 or p in self._pieces:
                    continue
                self._pieces[p] = ids
                self._chars += len(p)
            while self._chars > MAX_CACHED_CHARS:
                old, _ = self._pieces.popitem(last=False)
                self._chars -= len(old)
