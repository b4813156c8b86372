"""Audio files in, 16 kHz mono float32 out.

WAV (PCM 8/16/24/32-bit) is read with the stdlib ``wave`` module; anything else (FLAC,
float WAV...) is decoded by the ``sox`` command when it is installed. Resampling is a
polyphase windowed-sinc (Kaiser) filter in numpy.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import wave
from functools import lru_cache
from pathlib import Path

from engine.speech.errors import AudioFileError
from engine.speech.mel import SAMPLE_RATE

import numpy as np


def load_audio(path: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Decode ``path`` to mono float32 in [-1, 1] at ``sample_rate``."""
    path = Path(path)
    if not path.is_file():
        raise AudioFileError(f"{path}: no such audio file")
    try:
        audio, rate = _read_wav(path)
    except (wave.Error, EOFError) as e:
        audio, rate = _read_with_sox(path, str(e))
    if audio.size == 0:
        raise AudioFileError(f"{path}: the file contains no audio samples")
    return resample(audio, rate, sample_rate)


def _read_wav(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as w:
        channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
        raw = w.readframes(w.getnframes())
    if width == 1:  # 8-bit WAV is unsigned
        data = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        data = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8  # sign-extend 24 bits
        data = ints.astype(np.float32) / 8388608.0
    elif width == 4:
        data = (np.frombuffer(raw, "<i4").astype(np.float64) / 2147483648.0).astype(np.float32)
    else:
        raise AudioFileError(f"{path}: unsupported WAV sample width of {width} bytes")
    return _to_mono(data, channels), rate


def _read_with_sox(path: Path, why: str) -> tuple[np.ndarray, int]:
    sox = shutil.which("sox")
    if sox is None:
        raise AudioFileError(
            f"{path}: not a PCM WAV file ({why}); install sox to read FLAC and other formats"
        )
    try:
        rate = int(float(_sox_info(sox, "-r", path)))
        channels = int(_sox_info(sox, "-c", path))
        raw = subprocess.run(
            [sox, str(path), "-t", "raw", "-e", "floating-point", "-b", "32", "-L", "-"],
            check=True, capture_output=True, timeout=600,
        ).stdout
    except (subprocess.CalledProcessError, ValueError, subprocess.TimeoutExpired) as e:
        raise AudioFileError(f"{path}: sox cannot decode this file ({_stderr(e)})") from None
    return _to_mono(np.frombuffer(raw, "<f4").astype(np.float32), channels), rate


def _sox_info(sox: str, flag: str, path: Path) -> str:
    return subprocess.run(
        [sox, "--i", flag, str(path)], check=True, capture_output=True, text=True, timeout=60
    ).stdout.strip()


def _stderr(e: Exception) -> str:
    err = getattr(e, "stderr", None)
    if isinstance(err, bytes):
        err = err.decode("utf-8", "replace")
    return (err or str(e)).strip().splitlines()[-1] if (err or str(e)).strip() else type(e).__name__


def _to_mono(interleaved: np.ndarray, channels: int) -> np.ndarray:
    if channels <= 1:
        return interleaved
    usable = interleaved.size - interleaved.size % channels
    return interleaved[:usable].reshape(-1, channels).mean(axis=1).astype(np.float32)


def resample(audio: np.ndarray, rate_in: int, rate_out: int, zero_crossings: int = 32) -> np.ndarray:
    """Band-limited resampling by a rational factor (polyphase windowed sinc).

    Each output sample is a dot product of ``2 * zero_crossings`` input samples (scaled
    by the rate ratio when downsampling) with one of ``up`` precomputed filter phases.
    The Kaiser window (beta 8.6, ~80 dB stop band) with a 95 % cutoff keeps the pass band
    flat to about 0.9 of the lower Nyquist frequency.
    """
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    if rate_in == rate_out or audio.size == 0:
        return audio.copy()
    if rate_in <= 0 or rate_out <= 0:
        raise AudioFileError(f"invalid sample rates {rate_in} -> {rate_out}")
    g = math.gcd(rate_in, rate_out)
    up, down = rate_out // g, rate_in // g
    phases, half = _polyphase_filter(up, down, zero_crossings)
    n_out = (audio.size * up + down - 1) // down
    padded = np.concatenate([np.zeros(half, np.float64), audio.astype(np.float64),
                             np.zeros(half + 1, np.float64)])
    # rows[i] = padded[i : i + 2*half]; outputs n, n + up, n + 2*up... share one filter
    # phase and step through the input by ``down`` samples, so each phase is one matmul.
    rows = np.lib.stride_tricks.sliding_window_view(padded, phases.shape[1])
    out = np.empty(n_out, dtype=np.float32)
    for first in range(min(up, n_out)):
        base, phase = divmod(first * down, up)
        count = len(range(first, n_out, up))
        out[first::up] = rows[base + 1::down][:count] @ phases[phase]
    return out


@lru_cache(maxsize=8)
def _polyphase_filter(up: int, down: int, zero_crossings: int) -> tuple[np.ndarray, int]:
    """Filter phases ``h[p, j]`` = kernel at time ``(j - half + 1) - p / up`` input samples."""
    cutoff = 0.95 * min(1.0, up / down)  # fraction of the input Nyquist to keep
    half = int(math.ceil(zero_crossings / cutoff))
    j = np.arange(2 * half)
    p = np.arange(up)[:, None]
    t = (half - 1 - j)[None, :] + p / up  # distance (input samples) from the tap to the output
    window = np.kaiser(4 * half + 1, 8.6)  # sampled finely, interpolated below
    w = np.interp(t, np.linspace(-half, half, window.size), window, left=0.0, right=0.0)
    h = cutoff * np.sinc(cutoff * t) * w
    h /= h.sum(axis=1, keepdims=True)  # unity DC gain for every phase
    return h, half
