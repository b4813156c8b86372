"""Push-to-talk dictation in the TUI: F5 (or ``/dictate``, or the palette) starts and stops it.

Three layers, so most of it is testable without a terminal:

- plain logic: :class:`Transcript` (final texts + the current partial), :func:`with_spacing`
  and :class:`PromptSplice` (keeps the dictated span in the message box as partials change);
- :class:`Dictation`: one object per screen that owns the lifecycle (probe the microphone,
  load Whisper once, start a ``DictationSession`` fed by an audio source, stop, cancel); the
  audio source is injectable (``capture_factory``), so tests push audio through the same
  ``session.feed`` callback the microphone uses;
- :class:`DictationActions`: the Textual surface, a hidden child widget ``MainScreen`` owns.

Session events arrive on worker threads and are posted as ``DictationActions.Update`` messages
(``post_message`` never blocks, so workers never wait on the UI; the UI may wait on them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from engine.errors import MlxtermError
from engine.speech.errors import AudioInputError, NoAudioInputDevice

from textual import work
from textual.message import Message
from textual.widget import Widget

from app.tui.commands import SingleCommand
from app.tui.slash import Command

if TYPE_CHECKING:
    from engine.profile_schema import SpeechConfig
    from engine.speech.stream import DictationEvent

    from app.tui.hosts import DictationHost

log = logging.getLogger(__name__)

DICTATE_SLASH = Command("dictate", "/dictate", "start or stop dictation into the message box (F5)")
PALETTE_TITLE = "Dictate (start/stop)"
PALETTE_HELP = "Speak into the message box (F5); partial text appears as you talk"

# Lifecycle states of :class:`Dictation`.
IDLE, STARTING, RECORDING, FINISHING = "idle", "starting", "recording", "finishing"


def is_dictate_command(text: str) -> bool:
    """Whether a submitted prompt is the ``/dictate`` command."""
    return text.strip().lower() == "/" + DICTATE_SLASH.name


# -- text ------------------------------------------------------------------------------------


def join_texts(parts: list[str]) -> str:
    """Whisper segment texts (with their leading spaces) as one line of words."""
    return " ".join(p.strip() for p in parts if p.strip())


def with_spacing(text: str, before: str, after: str) -> str:
    """``text`` with a space added where it would otherwise touch a neighbouring word.

    ``before`` / ``after`` are the characters just outside the insertion ("" at a line edge).
    """
    if not text:
        return ""
    if before and not before.isspace() and before not in "([{\"'":
        text = " " + text
    if after and not after.isspace() and after not in ".,;:!?)]}\"'":
        text = text + " "
    return text


@dataclass
class Transcript:
    """The take's text as the events describe it: committed finals plus the live partial."""

    finals: list[str] = field(default_factory=list)
    partial: str = ""

    def apply(self, kind: str, text: str) -> bool:
        """Update from one event; True when the displayed text may have changed."""
        if kind == "partial":
            self.partial = text
        elif kind == "final":
            self.finals.append(text)
            self.partial = ""
        elif kind == "done" and text.strip():
            # the session's whole-take text is authoritative (same words, final spacing)
            self.finals, self.partial = [text], ""
        else:
            return False
        return True

    @property
    def text(self) -> str:
        return join_texts([*self.finals, self.partial])


class PromptSplice:
    """The dictated span of a ``TextArea``: starts at the cursor (or replaces the selection)
    and is replaced as a whole each time the transcript changes.

    The box is read-only while dictating, so the text around the span cannot move.
    """

    def __init__(self, area) -> None:
        self.area = area
        self.start, self.end = sorted(area.selection)
        self.before = _char_before(area, self.start)
        self.after = _char_at(area, self.end)
        self.shown = ""

    def show(self, text: str) -> None:
        new = with_spacing(text, self.before, self.after)
        if new == self.shown:
            return  # unchanged (and an untouched selection stays until text arrives)
        result = self.area.replace(new, self.start, self.end, maintain_selection_offset=False)
        self.end, self.shown = result.end_location, new
        self.area.move_cursor(self.end)


def _char_before(area, loc: tuple[int, int]) -> str:
    row, col = loc
    return area.document.get_line(row)[col - 1] if col > 0 else ""


def _char_at(area, loc: tuple[int, int]) -> str:
    row, col = loc
    line = area.document.get_line(row)
    return line[col] if col < len(line) else ""


# -- lifecycle -------------------------------------------------------------------------------


def dictation_config(speech: SpeechConfig):
    """The ``DictationConfig`` for a profile's ``speech:`` section.

    ``vad`` has one choice (Silero) and ``language`` is implied by the model (``.en``).
    """
    from engine.speech.stream import DictationConfig

    return DictationConfig(model=speech.whisper, min_silence_ms=speech.min_silence_ms,
                           vad_threshold=speech.vad_threshold)


def _default_probe() -> None:
    from engine.speech.capture import default_input_device

    default_input_device()  # raises NoAudioInputDevice with the reason


def _default_capture(callback: Callable):
    from engine.speech.capture import MicrophoneCapture

    return MicrophoneCapture(callback)


def _default_loader(name: str):
    from engine.speech.loader import load_whisper

    return load_whisper(name)


class Dictation:
    """Microphone -> ``DictationSession`` lifecycle, one take at a time.

    ``post(take, event)`` receives every session event on a worker thread; ``take`` tells
    events of an abandoned take from the current one. ``open`` blocks (microphone probe,
    model load): call it from a thread worker. Everything else is UI-thread cheap, except
    ``close``, which waits for the session's workers to stop.
    """

    def __init__(self, post: Callable[[int, DictationEvent], None], *,
                 probe: Callable[[], None] | None = _default_probe,
                 capture_factory: Callable[[Callable], Any] = _default_capture,
                 loader: Callable[[str], Any] = _default_loader,
                 session_factory: Callable[..., Any] | None = None) -> None:
        self.post = post
        self.probe = probe
        self.capture_factory = capture_factory
        self.loader = loader
        self.session_factory = session_factory
        self.state = IDLE
        self.unavailable: str | None = None  # why there is no microphone (then disabled)
        self.auto_stop = True
        self.take = 0
        self.bundle = None
        self._model: str | None = None  # the model ``bundle`` was loaded for
        self.session = None
        self.capture = None
        self.transcript = Transcript()
        self.stop_requested = False  # stop pressed while still starting
        self.closed = False  # the screen went away: a take still starting must not go on

    @property
    def active(self) -> bool:
        return self.state != IDLE

    def begin(self) -> int:
        """The key was pressed while idle: a new take starts (UI thread)."""
        self.take += 1
        self.state, self.stop_requested = STARTING, False
        self.transcript = Transcript()
        return self.take

    def needs_model(self, name: str) -> bool:
        return self.bundle is None or self._model != name

    def check_input(self) -> None:
        """Raise ``NoAudioInputDevice`` (and mark dictation unavailable) without a microphone.

        Cheap; done before the model load so a machine without one never loads Whisper.
        """
        try:
            if self.probe is not None:
                self.probe()
        except NoAudioInputDevice as e:
            self.unavailable = str(e)
            raise

    def open(self, speech: SpeechConfig) -> None:
        """Load Whisper (first time only), then start a session and the audio capture.

        Raises ``AudioInputError`` (``NoAudioInputDevice`` also marks dictation unavailable)
        or another ``MlxtermError`` (e.g. the model cannot load); nothing is left running.
        """
        if self.needs_model(speech.whisper):
            self.bundle, self._model = self.loader(speech.whisper), speech.whisper
        factory = self.session_factory or _session_class()
        self.auto_stop = speech.auto_stop
        session = factory(partial(self.post, self.take), dictation_config(speech), self.bundle)
        capture = self.capture_factory(session.feed)
        try:
            capture.start()
        except NoAudioInputDevice as e:
            self.unavailable = str(e)
            session.cancel()
            raise
        except BaseException:
            session.cancel()
            raise
        self.session, self.capture = session, capture
        if self.closed:  # closed while we were loading: nothing may keep running
            self.close()

    def stop(self) -> None:
        """End the take: stop the audio; the session finishes on its own (``done`` follows)."""
        self._stop_capture()
        if self.session is not None:
            self.session.finish(timeout=0)  # returns at once; the text arrives as events
        if self.state == RECORDING:
            self.state = FINISHING

    def finished(self) -> None:
        """The session reported ``done`` (or never started): back to idle."""
        self._stop_capture()
        self.session, self.state = None, IDLE

    def close(self) -> None:
        """Abandon the take (screen closing): waits until the session's workers stop."""
        self.closed = True
        self._stop_capture()
        session, self.session = self.session, None
        if session is not None:
            session.cancel()
        self.state = IDLE

    def _stop_capture(self) -> None:
        capture, self.capture = self.capture, None
        if capture is not None:
            try:
                capture.stop()
            except Exception:  # a failing device must not keep the take open
                log.exception("stopping the audio capture failed")


def _session_class():
    from engine.speech.stream import DictationSession

    return DictationSession


# -- Textual surface -------------------------------------------------------------------------


class DictationCommands(SingleCommand):
    """The palette entry (calls the controller directly, so it can say why it is unavailable)."""

    title = PALETTE_TITLE
    help = PALETTE_HELP

    def _run(self) -> None:
        self.screen.query_one(DictationActions).command()


class DictationActions(Widget):
    """The screen's dictation controller: a hidden child widget (its workers and messages are
    its own) that uses of its host only what ``app.tui.hosts.DictationHost`` lists."""

    DEFAULT_CSS = "DictationActions { display: none; }"

    class Update(Message, bubble=False):
        """A session event, posted from a worker thread to this controller."""

        def __init__(self, take: int, event: DictationEvent) -> None:
            super().__init__()
            self.take = take
            self.event = event

    def __init__(self, host: DictationHost, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.host = host
        self.dictation = Dictation(lambda take, ev: self.post_message(self.Update(take, ev)))
        self._splice: PromptSplice | None = None

    @property
    def indicator(self):
        return self.host.query_one("#recording")

    def enabled(self) -> bool | None:
        """For the screen's ``check_action``: None (shown disabled) without a microphone."""
        return None if self.dictation.unavailable else True

    def command(self) -> None:
        """``/dictate`` and the palette: like F5, but says why when it is unavailable."""
        if self.dictation.unavailable:
            self.notify(f"Dictation is unavailable: {self.dictation.unavailable}", severity="warning")
            return
        self.toggle()

    def toggle(self) -> None:
        """F5: start a take when idle, stop it while recording."""
        d = self.dictation
        if d.state == IDLE:
            self._start_dictation()
        elif d.state == STARTING:
            d.stop_requested = True
        elif d.state == RECORDING:
            self._stop_dictation()

    def _start_dictation(self) -> None:
        prompt = self.host.prompt
        take = self.dictation.begin()
        self._splice = PromptSplice(prompt)
        prompt.read_only = True  # the box is the transcript's until the take ends
        prompt.add_class("-dictating")
        self.indicator.level, self.indicator.state = 0.0, "starting"
        self.host.refresh_bindings()
        self._open_dictation(take)

    @work(thread=True, exclusive=True, group="dictation", exit_on_error=False)
    def _open_dictation(self, take: int) -> None:
        d = self.dictation
        try:
            speech = self._speech_config()
            d.check_input()  # before the (slow) model load: no microphone, no load
            if d.needs_model(speech.whisper):
                self.app.call_from_thread(self.notify, "loading speech model…", timeout=4)
            d.open(speech)
        except MlxtermError as e:
            self.app.call_from_thread(self._dictation_failed, take, e)
        except Exception as e:  # noqa: BLE001 (never crash the app over dictation)
            log.exception("starting dictation failed")
            self.app.call_from_thread(self._dictation_failed, take,
                                      MlxtermError(f"dictation failed: {type(e).__name__}: {e}"))
        else:
            self.app.call_from_thread(self._dictation_started, take)

    def _speech_config(self) -> SpeechConfig:
        eng = self.host.controller.engine
        if eng is not None:
            return eng.profile.speech
        from engine.profiles import load_profile

        return load_profile(self.host.controller.profile_spec).speech

    def _dictation_started(self, take: int) -> None:
        d = self.dictation
        if take != d.take:
            return
        d.state = RECORDING
        self.indicator.state = "listening"
        if d.stop_requested:
            self._stop_dictation()

    def _dictation_failed(self, take: int, error: MlxtermError) -> None:
        if take != self.dictation.take:
            return
        if isinstance(error, NoAudioInputDevice):
            message = f"Dictation is unavailable: {error}"
        elif isinstance(error, AudioInputError):
            message = f"Cannot record: {error}"
        else:
            message = str(error)
        log.warning("%s", message)
        self.notify(message, severity="error" if not isinstance(error, NoAudioInputDevice)
                    else "warning", timeout=8)
        self._end_dictation()

    def _stop_dictation(self) -> None:
        self.dictation.stop()
        self.indicator.state = "transcribing"
        self.host.refresh_bindings()

    def _end_dictation(self) -> None:
        self.dictation.finished()
        self._splice = None
        prompt = self.host.prompt
        prompt.read_only = False
        prompt.remove_class("-dictating")
        self.indicator.state = None
        self.host.refresh_bindings()
        prompt.focus()

    def on_dictation_actions_update(self, message: Update) -> None:
        d, ev = self.dictation, message.event
        if message.take != d.take or d.state == IDLE:
            return  # an abandoned take
        if ev.kind == "level":
            self.indicator.level = ev.level
        elif ev.kind == "speech_start" and d.state == RECORDING:
            self.indicator.state = "speaking"
        elif ev.kind == "speech_end" and d.state == RECORDING:
            self.indicator.state = "listening"
            if d.auto_stop:  # the VAD heard min_silence_ms of silence after speech
                self._stop_dictation()
        elif ev.kind == "error":
            self.notify(f"Dictation failed: {ev.text}", severity="error", timeout=8)
            self._stop_dictation()  # the session stops itself; ``done`` follows
        if d.transcript.apply(ev.kind, ev.text) and self._splice is not None:
            self._splice.show(d.transcript.text)
        if ev.kind == "done":
            self._end_dictation()

    def close(self) -> None:
        """Stop any take (the screen is going away); waits for its workers."""
        self.dictation.close()
