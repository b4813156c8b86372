"""``StatusBar``: profile and KV format, context used, the last turn's cache and speed, requests
sharing the engine, memory."""

from __future__ import annotations

from collections.abc import Callable

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, LoadingIndicator

from app.tui.format import size, tokens

MEMORY_REFRESH_S = 2.0


class StatusBar(Horizontal):
    """One line: ``profile · KV fmt  ctx used/limit  last turn  RSS``."""

    def __init__(self, memory_probe: Callable[[], int], **kwargs) -> None:
        super().__init__(**kwargs)
        self._memory_probe = memory_probe
        self.turn_text = ""  # what the last-turn segment shows (tests read it)
        self.requests_probe: Callable[[], int] | None = None  # in-flight requests of the engine

    def compose(self) -> ComposeResult:
        yield LoadingIndicator(id="status-spinner")
        yield Label("no model", id="status-model")
        yield Label("", id="status-context")
        yield Label("", id="status-turn")
        yield Label("", id="status-shared")
        yield Label("", id="status-memory")

    def on_mount(self) -> None:
        self.query_one("#status-spinner").display = False
        self.refresh_memory()
        self.set_interval(MEMORY_REFRESH_S, self.refresh_memory)

    def refresh_memory(self) -> None:
        self.query_one("#status-memory", Label).update(f"RSS {size(self._memory_probe())}")
        self.refresh_shared()

    def refresh_shared(self) -> None:
        """``N requests share the engine`` while more than one is in flight (batched decode)."""
        n = self.requests_probe() if self.requests_probe else 0
        self.query_one("#status-shared", Label).update(f"{n} requests share the engine " if n > 1 else "")

    def set_loading(self, text: str | None) -> None:
        """Show a spinner with ``text`` (e.g. "loading smollm2-135m…"); None hides it."""
        self.query_one("#status-spinner").display = text is not None
        if text is not None:
            self.query_one("#status-model", Label).update(text)

    def set_model(self, info) -> None:
        """``info``: a controller ModelInfo, or None when no model is loaded."""
        self.set_loading(None)
        label = self.query_one("#status-model", Label)
        if info is None:
            label.update("no model")
        elif info.remote:
            label.update(f"{info.profile} · remote")
            label.tooltip = f"{info.model} on {info.remote}"
        else:
            label.update(f"{info.profile} · KV {info.kv_format}")
            label.tooltip = f"{info.model} ({info.weight_format} weights, loaded in {info.load_ms:.0f} ms)"

    def set_context(self, used: int | None, limit: int | None) -> None:
        text = "" if used is None or not limit else f"ctx {tokens(used)}/{tokens(limit)}"
        self.query_one("#status-context", Label).update(text)

    def set_turn(self, text: str) -> None:
        self.turn_text = text
        self.query_one("#status-turn", Label).update(text)
