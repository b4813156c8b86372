"""The reply widget streams Markdown incrementally (scripts/stream_smoothness.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "stream_smoothness.py"


def _script():
    spec = importlib.util.spec_from_file_location("stream_smoothness", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_stream_batches_tokens_and_never_rebuilds_earlier_blocks():
    report = await _script().measure(n_tokens=400, rate=0)
    assert report["source_matches"]
    assert report["full_rerenders"] == 0
    assert report["earlier_blocks_kept"]
    assert report["markdown_blocks"] >= 5  # paragraphs, lists and code fences
    # Fed as fast as possible, tokens are batched: far fewer appends than tokens.
    assert report["appends"]["count"] < report["tokens"] / 3
    assert report["write_per_token"]["count"] == 400


def test_scripted_tokens_reassemble_the_text():
    mod = _script()
    tokens = mod.scripted_tokens(2000)
    assert len(tokens) == 2000
    assert "".join(tokens[:50]) == mod.PARAGRAPH[: len("".join(tokens[:50]))]
