"""``RecordingIndicator``: the one-line "recording" bar above the message box.

Shown while dictation starts, records and transcribes; hidden otherwise. The meter shows
the microphone level (RMS of the latest audio block) on a dB scale, so quiet speech still
moves it.
"""

from __future__ import annotations

import math

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

METER_WIDTH = 20
FLOOR_DB = -60.0  # the meter's empty end; 0 dBFS is full
BLOCKS = " ▏▎▍▌▋▊▉█"

STATES = {
    "starting": "starting…",
    "listening": "listening",
    "speaking": "hearing speech",
    "transcribing": "transcribing…",
}


def meter(level: float, width: int = METER_WIDTH) -> str:
    """A bar of ``width`` cells for RMS ``level`` (0..1), linear in dB from -60 to 0 dBFS."""
    db = 20 * math.log10(level) if level > 0 else FLOOR_DB
    fill = min(max((db - FLOOR_DB) / -FLOOR_DB, 0.0), 1.0) * width
    full = int(fill)
    part = BLOCKS[int((fill - full) * (len(BLOCKS) - 1))] if full < width else ""
    return ("█" * full + part).ljust(width)


class RecordingIndicator(Widget):
    """``● REC  ▕█████▌        ▏  hearing speech · F5 stops``; ``state`` None hides it."""

    COMPONENT_CLASSES = {"recording--dot", "recording--meter", "recording--hint"}

    state: reactive[str | None] = reactive(None)
    level: reactive[float] = reactive(0.0)

    def watch_state(self, state: str | None) -> None:
        self.display = state is not None

    def on_mount(self) -> None:
        self.display = self.state is not None

    def render(self) -> Text:
        label = STATES.get(self.state or "", self.state or "")
        text = Text()
        style = self.get_component_rich_style  # colours come from the theme (app.tcss)
        text.append("● REC ", style=style("recording--dot"))
        text.append("▕")
        text.append(meter(self.level), style=style("recording--meter"))
        text.append("▏ ")
        text.append(label)
        if self.state in ("listening", "speaking"):
            text.append(" · F5 stops", style=style("recording--hint"))
        return text
