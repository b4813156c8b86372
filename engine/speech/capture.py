"""Microphone capture with ``sounddevice``: 16 kHz mono float32 blocks to a callback.

Where there is no usable input (PortAudio missing, no input device, device refuses to
open) :class:`NoAudioInputDevice` / :class:`AudioInputError` is raised with one sentence
saying why, so the app can disable dictation instead of crashing.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.speech.errors import AudioInputError, NoAudioInputDevice
from engine.speech.mel import SAMPLE_RATE


def _sounddevice():
    try:
        import sounddevice
    except OSError as e:  # raised at import when the PortAudio library is missing
        raise NoAudioInputDevice(f"no audio input: {e} (install libportaudio2)") from None
    except ImportError:
        raise NoAudioInputDevice("no audio input: the sounddevice package is not installed") from None
    return sounddevice


def default_input_device() -> str:
    """Name of the input device that capture would use; raises if there is none."""
    sd = _sounddevice()
    try:
        info = sd.query_devices(kind="input")
    except (sd.PortAudioError, ValueError) as e:
        raise NoAudioInputDevice(f"no audio input device found ({e})") from None
    if not info or int(info.get("max_input_channels", 0)) < 1:
        raise NoAudioInputDevice("no audio input device found")
    return str(info.get("name", "default"))


def input_available() -> bool:
    """True when a microphone can be opened (cheap check for enabling dictation)."""
    try:
        default_input_device()
    except AudioInputError:
        return False
    return True


class MicrophoneCapture:
    """Streams the default (or given) input device into ``callback(block)``.

    ``callback`` runs on PortAudio's audio thread with a fresh ``(n,)`` float32 array; it
    must return quickly (``DictationSession.feed`` does).
    """

    def __init__(self, callback: Callable, device: int | str | None = None, block_ms: int = 100):
        self.callback = callback
        self.device = device
        self.blocksize = SAMPLE_RATE * block_ms // 1000
        self._stream = None

    def start(self) -> None:
        sd = _sounddevice()
        if self.device is None:
            default_input_device()
        try:
            self._stream = sd.InputStream(
                samplerate=SAMPLE_RATE, channels=1, dtype="float32", blocksize=self.blocksize,
                device=self.device, callback=self._on_block,
            )
            self._stream.start()
        except (sd.PortAudioError, ValueError) as e:
            self._stream = None
            raise AudioInputError(f"cannot open the microphone at 16 kHz mono ({e})") from None

    def _on_block(self, indata, frames, time_info, status) -> None:
        self.callback(indata[:, 0].copy())

    def stop(self) -> None:
        if self._stream is not None:
            try:
                self._stream.stop()
                self._stream.close()
            finally:
                self._stream = None

    def __enter__(self) -> MicrophoneCapture:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
