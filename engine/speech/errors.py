"""Errors raised by the speech stack; each carries one readable sentence."""

from __future__ import annotations

from engine.errors import MlxtermError


class AudioFileError(MlxtermError):
    """An audio file is missing, unreadable or in a format we cannot decode."""


class AudioInputError(MlxtermError):
    """The microphone cannot be used (no device, no PortAudio, device busy)."""


class NoAudioInputDevice(AudioInputError):
    """There is no audio input device on this machine; dictation must be disabled."""
