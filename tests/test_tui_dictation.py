"""Push-to-talk dictation in the TUI (F5): text splicing, the meter, the no-microphone path,
and (e2e) a spoken sentence fed through a fake microphone into real Whisper tiny.en."""

from __future__ import annotations

import shutil
import threading
import time

from engine.speech.errors import NoAudioInputDevice

import numpy as np
import pytest
from textual.app import App, ComposeResult

from app.tui.app import MlxtermApp
from app.tui.dictation import (
    IDLE,
    RECORDING,
    PromptSplice,
    Transcript,
    is_dictate_command,
    join_texts,
    with_spacing,
)
from app.tui.widgets.prompt import PromptInput
from app.tui.widgets.recording import METER_WIDTH, meter
from tests.tiny_models import write_profile

SIZE = (120, 36)
BLOCK_S = 0.25  # audio block the fake microphone delivers, at real-time pace
NO_MIC = "no audio input: PortAudio library not found (install libportaudio2)"


async def wait_for(pilot, condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


# -- plain logic -----------------------------------------------------------------------------


def test_transcript_replaces_partials_and_appends_finals():
    t = Transcript()
    assert t.apply("partial", " Please send") and t.text == "Please send"
    assert t.apply("partial", " Please send the report") and t.text == "Please send the report"
    assert t.apply("final", " Please send the report.") and t.text == "Please send the report."
    assert t.apply("partial", " Thanks") and t.text == "Please send the report. Thanks"
    assert not t.apply("level", "") and not t.apply("speech_end", "")
    assert t.apply("done", " Please send the report. Thanks.") and t.text == "Please send the report. Thanks."
    assert not Transcript().apply("done", "") and join_texts([" a ", "", " b"]) == "a b"


@pytest.mark.parametrize("before, after, expected", [
    ("", "", "hello"),            # empty box
    ("x", "", " hello"),          # after a word
    (" ", "", "hello"),           # after a space
    ("(", "", "hello"),           # after an opening bracket
    ("", "w", "hello "),          # before a word
    ("", ".", "hello"),           # before punctuation
    ("a", "b", " hello "),        # inside a word run
])
def test_with_spacing(before, after, expected):
    assert with_spacing("hello", before, after) == expected
    assert with_spacing("", before, after) == ""


def test_meter_is_logarithmic_and_bounded():
    assert meter(0.0) == " " * METER_WIDTH
    assert meter(1.0) == "█" * METER_WIDTH and meter(4.0) == "█" * METER_WIDTH
    half = meter(10 ** (-30 / 20))  # -30 dBFS: half way from -60 to 0
    assert half.count("█") == METER_WIDTH // 2 and len(half) == METER_WIDTH
    assert meter(0.01).count("█") < meter(0.1).count("█") < meter(0.5).count("█")


def test_dictate_command_is_recognised():
    assert is_dictate_command("/dictate") and is_dictate_command("  /DICTATE ")
    assert not is_dictate_command("/dictate now") and not is_dictate_command("//dictate")


class BoxApp(App):
    def compose(self) -> ComposeResult:
        yield PromptInput(id="box")


async def test_splice_inserts_at_cursor_and_replaces_the_selection():
    app = BoxApp()
    async with app.run_test() as pilot:
        box = app.query_one(PromptInput)
        box.load_text("Dear Ann, thanks.\nBye")
        box.move_cursor((0, 9))  # after "Dear Ann,"
        splice = PromptSplice(box)
        for text in ("I", "I will", "I will come"):  # partials replace each other
            splice.show(text)
            assert box.text == f"Dear Ann, {text} thanks.\nBye"
        splice.show("I will come.")  # the final
        assert box.text == "Dear Ann, I will come. thanks.\nBye"
        assert box.cursor_location == (0, 22)
        splice.show("")
        assert box.text == "Dear Ann, thanks.\nBye"

        box.load_text("call Bob now")
        box.selection = ((0, 5), (0, 8))  # "Bob"
        splice = PromptSplice(box)
        splice.show("")
        assert box.text == "call Bob now"  # the selection stays until text arrives
        splice.show("Alice")
        assert box.text == "call Alice now"
        await pilot.pause()


# -- the app ---------------------------------------------------------------------------------


def make_app(profile) -> MlxtermApp:
    return MlxtermApp(str(profile), memory_probe=lambda: 300 << 20)


def main_screen(app):
    return app.screen_stack[0]


def footer_key(app, key: str):
    return next(b for b in app.active_bindings.values() if b.binding.key == key)


class DeadMicrophone:
    """A capture whose ``start`` fails the way ``MicrophoneCapture`` does without PortAudio."""

    starts = 0

    def __init__(self, callback) -> None:
        self.callback = callback

    def start(self) -> None:
        DeadMicrophone.starts += 1
        raise NoAudioInputDevice(NO_MIC)

    def stop(self) -> None:
        pass


async def test_no_input_device_disables_dictation_with_one_notice(tiny_profile, monkeypatch):
    loads = []

    def no_device():
        raise NoAudioInputDevice(NO_MIC)

    app = make_app(tiny_profile)
    async with app.run_test(size=SIZE) as pilot:
        screen = main_screen(app)
        d = screen.dictation_actions.dictation
        d.probe = no_device
        d.loader = lambda name: loads.append(name)
        await wait_for(pilot, lambda: app.controller.loaded, what="the model")
        box = screen.prompt
        box.focus()
        await pilot.press(*"hi")
        assert footer_key(app, "f5").enabled
        await pilot.press("f5")
        await wait_for(pilot, lambda: d.state == IDLE and d.unavailable, what="the probe")
        await pilot.pause()
        notes = [n.message for n in app._notifications]
        assert notes == [f"Dictation is unavailable: {NO_MIC}"]
        assert loads == []  # no microphone: Whisper is never loaded
        assert not box.read_only and box.text == "hi" and screen.dictation_actions.indicator.state is None
        assert not screen.dictation_actions.indicator.display
        assert not footer_key(app, "f5").enabled  # shown as unavailable
        await pilot.press("f5")  # disabled: nothing happens, no second notice
        await pilot.pause()
        assert len(app._notifications) == 1 and d.state == IDLE

        # /dictate says why instead of doing nothing; the app keeps working
        box.load_text("/dictate")
        await pilot.press("enter")
        await pilot.pause()
        assert [n.message for n in app._notifications][-1] == f"Dictation is unavailable: {NO_MIC}"
        assert box.text == ""

        # the capture failing at start (probe passed) ends the same way
        d.unavailable, d.probe, d.capture_factory = None, None, DeadMicrophone
        d.bundle, d._model = object(), "whisper-tiny.en"  # skip the model load
        monkeypatch.setattr("app.tui.dictation._session_class", lambda: FakeSession)
        await pilot.press("f5")
        await wait_for(pilot, lambda: d.unavailable is not None, what="the failed start")
        await wait_for(pilot, lambda: d.state == IDLE, what="idle")
        assert DeadMicrophone.starts == 1 and FakeSession.cancelled
        assert not footer_key(app, "f5").enabled and not box.read_only


async def test_bad_speech_model_is_a_notification(tmp_path, tiny_llama_dir):
    profile = write_profile(tmp_path / "p.yaml", tiny_llama_dir, speech={"whisper": "whisper-nope"})
    app = make_app(profile)
    async with app.run_test(size=SIZE) as pilot:
        screen = main_screen(app)
        d = screen.dictation_actions.dictation
        d.probe = None  # pretend there is a microphone; the real loader refuses the name
        await pilot.press("f5")
        await wait_for(pilot, lambda: d.state == IDLE, what="the failed start")
        await pilot.pause()
        notes = [n.message for n in app._notifications]
        assert "loading speech model…" in notes
        assert any("whisper-nope: no such speech model" in n for n in notes)
        assert d.unavailable is None and footer_key(app, "f5").enabled  # may be fixed and retried
        assert not screen.prompt.read_only and not screen.dictation_actions.indicator.display


class FakeSession:
    """Records that a failed start cancels the session it made."""

    cancelled = False

    def __init__(self, on_event, config, bundle) -> None:
        self.feed = lambda chunk: None

    def cancel(self) -> None:
        FakeSession.cancelled = True


# -- e2e: real Whisper on a synthesized sentence ---------------------------------------------


class ClipMicrophone:
    """Stands in for ``MicrophoneCapture``: plays ``audio`` into ``callback`` in 0.25-s blocks
    at real-time pace on a thread, then silence until stopped (as a microphone would)."""

    def __init__(self, audio: np.ndarray, callback) -> None:
        self.audio, self.callback = audio, callback
        self.block = int(16000 * BLOCK_S)
        self.fed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._play, name="fake-mic", daemon=True)
        self._thread.start()

    def _play(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            chunk = self.audio[self.fed:self.fed + self.block]
            if chunk.size < self.block:
                chunk = np.concatenate([chunk, np.zeros(self.block - chunk.size, np.float32)])
            self.callback(chunk)
            self.fed += self.block
            self._stop.wait(max(0.0, t0 + self.fed / 16000 - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def clip_played(self) -> bool:
        return self.fed >= self.audio.size


def spoken(name: str) -> np.ndarray:
    """A clip of ``app.benches.speech.CLIPS`` spoken by espeak-ng, 16 kHz mono via sox."""
    if not (shutil.which("espeak-ng") and shutil.which("sox")):
        pytest.skip("espeak-ng and sox synthesize the spoken sentences")
    from app.benches.speech import clip

    return clip(name)


@pytest.fixture(scope="module")
def whisper_loader(tmp_path_factory):
    from engine.speech.loader import load_whisper

    root = tmp_path_factory.mktemp("whisper-cache")  # converted once for the module
    return lambda name: load_whisper(name, cache_root=root)


def dictation_app(tmp_path, tiny_llama_dir, audio, loader, auto_stop: bool):
    profile = write_profile(tmp_path / "dictate.yaml", tiny_llama_dir, speech={"auto_stop": auto_stop})
    app = make_app(profile)
    mics: list[ClipMicrophone] = []

    def setup() -> None:
        d = main_screen(app).dictation_actions.dictation
        d.probe, d.loader = None, loader

        def factory(callback):
            mics.append(ClipMicrophone(audio, callback))
            return mics[-1]

        d.capture_factory = factory

    return app, mics, setup


@pytest.mark.e2e
async def test_push_to_talk_shows_partials_then_final(tmp_path, tiny_llama_dir, whisper_loader):
    # ~12 s: "Dictation works best when the speaker talks clearly and at a steady pace. The
    # system listens to the microphone, ..." (long enough for partials on a cold model)
    audio = spoken("paragraph")
    app, mics, setup = dictation_app(tmp_path, tiny_llama_dir, audio, whisper_loader, auto_stop=False)
    async with app.run_test(size=SIZE) as pilot:
        setup()
        screen = main_screen(app)
        d, box, indicator = screen.dictation_actions.dictation, screen.prompt, screen.dictation_actions.indicator
        await wait_for(pilot, lambda: app.controller.loaded, what="the chat model")
        box.focus()
        await pilot.press(*"Note:")
        assert not indicator.display

        t0 = time.monotonic()
        await pilot.press("f5")
        assert indicator.display and box.read_only
        await wait_for(pilot, lambda: d.state == RECORDING, timeout=60, what="recording to start")
        started_s = time.monotonic() - t0
        assert "loading speech model…" in [n.message for n in app._notifications]

        partials_in_box: list[str] = []
        levels: list[float] = []

        def watch() -> bool:
            levels.append(indicator.level)
            partial = d.transcript.partial.strip()
            if partial and not d.transcript.finals and partial in box.text:
                partials_in_box.append(box.text)
            return bool(d.transcript.finals) and mics[0].clip_played

        await wait_for(pilot, watch, timeout=45, what="the final text")
        final_s = time.monotonic() - t0
        assert partials_in_box, "no partial text appeared in the box before the final"
        assert all(p.startswith("Note: ") for p in partials_in_box)
        assert max(levels) > 0.01  # the meter moved
        assert d.state == RECORDING  # auto_stop is off: still recording through the silence

        await pilot.press("f5")  # stop
        await wait_for(pilot, lambda: d.state == IDLE, timeout=30, what="the take to finish")
        await pilot.pause()
        text = box.text
        words = text.lower()
        assert text.startswith("Note: ") and all(w in words for w in ("speaker", "steady pace", "microphone",
                                                                      "text box"))
        assert not indicator.display and not box.read_only and box.has_focus
        assert box.cursor_location == (0, len(text))
        assert mics[0]._stop.is_set()
        print(f"\nstart {started_s:.1f} s (model load incl.), final {final_s:.1f} s for a "
              f"{audio.size / 16000:.1f} s clip; {len(set(partials_in_box))} partial states; {text!r}")

        # the dictated text is an ordinary message now: edit and send
        await pilot.press("end", *" Thanks", "enter")
        await wait_for(pilot, lambda: not screen.generating and screen.session_id, what="the reply")
        assert screen.conversation.views()[0].content == text + " Thanks"


@pytest.mark.e2e
async def test_auto_stop_ends_the_take_after_silence(tmp_path, tiny_llama_dir, whisper_loader):
    audio = spoken("short")  # "Please send the report to my manager before lunch."
    app, mics, setup = dictation_app(tmp_path, tiny_llama_dir, audio, whisper_loader, auto_stop=True)
    async with app.run_test(size=SIZE) as pilot:
        setup()
        screen = main_screen(app)
        d, box = screen.dictation_actions.dictation, screen.prompt
        await pilot.press("f5")
        await wait_for(pilot, lambda: d.state == RECORDING, timeout=60, what="recording to start")
        await wait_for(pilot, lambda: d.state == IDLE, timeout=45, what="the automatic stop")
        await pilot.pause()
        assert "report" in box.text.lower() and not screen.dictation_actions.indicator.display
        assert mics[0]._stop.is_set()
        silence_fed = (mics[0].fed - audio.size) / 16000
        assert mics[0].clip_played and silence_fed < 6  # stopped by the pause, not a timeout
