#!/usr/bin/env python
"""Stream N scripted tokens into the chat TUI's reply widget and report UI cost per token.

The tokens go through the same path as a real reply (``MessageView.write`` ->
``MarkdownStream`` -> ``Markdown.append``) in a headless Textual app, at a fixed rate. The
JSON report says how long the UI loop spends per token, how many Markdown appends the
stream batched the tokens into, how long each append took, how late the event loop ran
(input latency while streaming), and whether earlier blocks were ever rebuilt (they must
not be: only the last block is updated or replaced, new blocks are mounted after it).

    .venv/bin/python scripts/stream_smoothness.py --tokens 2000 --rate 200 [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PARAGRAPH = (
    "Streaming Markdown has to stay cheap: each token appends a few characters, and only "
    "the block being written should change. Here is a list of things to check:\n\n"
    "- the **paragraph** being written grows in place\n- finished blocks stay as they are\n"
    "- code fences are highlighted as they arrive\n\n"
    "```python\ndef fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n```\n\n"
)


def scripted_tokens(n: int) -> list[str]:
    """``n`` token-sized pieces (words, spaces, punctuation, newlines) of Markdown."""
    pieces = re.findall(r"\s+|\w+|[^\w\s]", PARAGRAPH)
    out: list[str] = []
    while len(out) < n:
        out.extend(pieces)
    return out[:n]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    return {"count": len(values), "mean_ms": round(statistics.fmean(values) * 1000, 3),
            "p50_ms": round(pct(0.50) * 1000, 3), "p95_ms": round(pct(0.95) * 1000, 3),
            "max_ms": round(ordered[-1] * 1000, 3)}


async def measure(n_tokens: int = 2000, rate: float = 200.0, size=(100, 40)) -> dict:
    """Stream ``n_tokens`` at ``rate`` tokens/s (0: as fast as possible) and time the UI."""
    from textual.app import App
    from textual.await_complete import AwaitComplete
    from textual.widgets import Markdown
    from textual.widgets._markdown import MarkdownBlock

    from app.tui.widgets.conversation import Conversation
    from app.tui.widgets.message import MessageView

    appends: list[tuple[int, float]] = []
    rebuilt = {"update_calls": 0, "blocks_replaced": 0}
    original_append, original_update = Markdown.append, Markdown.update
    original_remove = MarkdownBlock.remove

    def timed_append(self, markdown: str) -> AwaitComplete:
        pending = original_append(self, markdown)

        async def run() -> None:
            t0 = time.perf_counter()
            await pending
            appends.append((len(markdown), time.perf_counter() - t0))

        return AwaitComplete(run())

    def counted_update(self, markdown: str):
        rebuilt["update_calls"] += 1
        return original_update(self, markdown)

    def counted_remove(self):
        rebuilt["blocks_replaced"] += 1
        return original_remove(self)

    class StreamApp(App):
        CSS_PATH = [Path(__file__).resolve().parent.parent / "app/tui/styles/app.tcss"]

        def compose(self):
            yield Conversation()

    tokens = scripted_tokens(n_tokens)
    write_times: list[float] = []
    lags: list[float] = []
    app = StreamApp()
    async with app.run_test(size=size) as pilot:
        conversation = app.query_one(Conversation)
        reply = await conversation.add(MessageView("assistant", state="streaming"))
        await pilot.pause()
        Markdown.append, Markdown.update, MarkdownBlock.remove = (
            timed_append, counted_update, counted_remove)
        stop = asyncio.Event()

        async def watch_lag() -> None:  # how late a 10 ms timer fires = input latency
            while not stop.is_set():
                t0 = time.perf_counter()
                await asyncio.sleep(0.01)
                lags.append(max(0.0, time.perf_counter() - t0 - 0.01))

        watcher = asyncio.create_task(watch_lag())
        try:
            t_start = time.perf_counter()
            interval = 1.0 / rate if rate > 0 else 0.0
            halfway: list = []
            for i, tok in enumerate(tokens):
                if i == len(tokens) // 2:
                    halfway = list(reply.query_one(".message-body", Markdown).children)
                if interval:
                    delay = t_start + i * interval - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                t0 = time.perf_counter()
                await reply.write(tok)
                write_times.append(time.perf_counter() - t0)
            t_fed = time.perf_counter()
            await reply.finish("done")
            await pilot.pause()
            t_done = time.perf_counter()
        finally:
            stop.set()
            await watcher
            Markdown.append, Markdown.update, MarkdownBlock.remove = (
                original_append, original_update, original_remove)
        body = reply.query_one(".message-body", Markdown)
        source_ok = body.source == "".join(tokens)
        blocks = len(body.children)
        final = set(map(id, body.children))
        # Every block finished by half time (all but the last one then) is the same object now.
        kept = all(id(b) in final for b in halfway[:-1])

    append_s = [t for _, t in appends]
    ui_total = sum(write_times) + sum(append_s)
    return {
        "tokens": n_tokens,
        "rate_tok_s": rate,
        "feed_s": round(t_fed - t_start, 3),
        "drain_after_last_token_ms": round((t_done - t_fed) * 1000, 1),
        "ui_ms_per_token": round(ui_total / n_tokens * 1000, 4),
        "write_per_token": percentiles(write_times),
        "appends": percentiles(append_s),
        "tokens_per_append": round(n_tokens / max(1, len(appends)), 1),
        "loop_lag": percentiles(lags),
        "markdown_blocks": blocks,
        "full_rerenders": rebuilt["update_calls"],
        "last_block_replacements": rebuilt["blocks_replaced"],
        "earlier_blocks_kept": kept,
        "source_matches": source_ok,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=200.0,
                        help="tokens per second fed to the widget (0: as fast as possible)")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    report = asyncio.run(measure(args.tokens, args.rate))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    ok = report["source_matches"] and report["earlier_blocks_kept"] and not report["full_rerenders"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
