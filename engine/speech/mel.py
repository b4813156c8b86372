"""Whisper's log-mel front end in numpy.

Recipe (Whisper's): 16 kHz audio, 400-point STFT with a periodic Hann window, hop 160,
centred frames with reflect padding at the start of the signal, power spectrum, 80 Slaney
mel filters, ``log10(max(x, 1e-10))``, floor at ``max - 8``, then ``(x + 4) / 4``.

The STFT runs in float64 so that bins near the ``max - 8`` floor keep full precision; the
result is float32 shaped ``(frames, n_mels)`` (time first, as MLX's conv1d wants it).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # samples in one 30-s window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # mel frames in one window (3000)
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    mel = f / f_sp
    above = f >= min_log_hz
    mel[above] = min_log_mel + np.log(f[above] / min_log_hz) / logstep
    return mel


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    f = f_sp * m
    above = m >= min_log_mel
    f[above] = min_log_hz * np.exp(logstep * (m[above] - min_log_mel))
    return f


@lru_cache(maxsize=4)
def mel_filters(n_mels: int = 80, n_fft: int = N_FFT, sr: int = SAMPLE_RATE) -> np.ndarray:
    """Triangular Slaney-normalised mel filterbank, shape ``(n_mels, n_fft // 2 + 1)``.

    Same construction as librosa's ``filters.mel(sr, n_fft, n_mels)`` (htk=False,
    norm="slaney"), which is what Whisper ships in ``mel_filters.npz``.
    """
    fft_freqs = np.linspace(0.0, sr / 2, n_fft // 2 + 1)
    mel_pts = _mel_to_hz(np.linspace(_hz_to_mel(np.array([0.0]))[0],
                                     _hz_to_mel(np.array([sr / 2]))[0], n_mels + 2))
    widths = np.diff(mel_pts)
    ramps = mel_pts[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_pts[2:] - mel_pts[:-2]))[:, None]
    out = weights.astype(np.float32)
    out.setflags(write=False)
    return out


@lru_cache(maxsize=1)
def _hann(n_fft: int = N_FFT) -> np.ndarray:
    """Periodic Hann window (torch.hann_window default)."""
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n_fft) / n_fft)


def mel_power(audio: np.ndarray, start_frame: int, n_frames: int, n_mels: int = 80) -> np.ndarray:
    """Mel power of frames ``[start_frame, start_frame + n_frames)`` of ``audio``, float64.

    Frame ``f`` is centred on sample ``f * HOP_LENGTH``. The signal is reflected at its
    start (as ``torch.stft(center=True)``) and continues with zeros past its end, which is
    what Whisper sees after padding the audio with 30 s of silence. Any window of frames
    can therefore be computed from the audio alone, identically in batch and streaming use.
    """
    audio = np.asarray(audio, dtype=np.float64).reshape(-1)
    half = N_FFT // 2
    lo = start_frame * HOP_LENGTH - half
    hi = (start_frame + n_frames - 1) * HOP_LENGTH + half
    seg = np.zeros(hi - lo, dtype=np.float64)
    src_lo, src_hi = max(lo, 0), min(hi, audio.size)
    if src_hi > src_lo:
        seg[src_lo - lo:src_hi - lo] = audio[src_lo:src_hi]
    if lo < 0:  # reflect padding at the signal start: x[-k] = x[k]
        k = np.arange(1, -lo + 1)
        seg[-lo - k] = audio[k] if audio.size > -lo else _reflect(audio, k)
    frames = np.lib.stride_tricks.sliding_window_view(seg, N_FFT)[::HOP_LENGTH][:n_frames]
    spec = np.fft.rfft(frames * _hann(), axis=-1)
    power = spec.real**2 + spec.imag**2
    return power @ mel_filters(n_mels).T.astype(np.float64)


def _reflect(audio: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Reflected samples for a signal shorter than the STFT half-window (zeros beyond)."""
    out = np.zeros(k.size)
    ok = k < audio.size
    out[ok] = audio[k[ok]]
    return out


def _normalise(power: np.ndarray) -> np.ndarray:
    log_spec = np.log10(np.maximum(power, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


def log_mel_spectrogram(audio: np.ndarray, n_mels: int = 80, padding: int = 0) -> np.ndarray:
    """Whisper's ``log_mel_spectrogram`` of the whole signal, shape ``(frames, n_mels)``.

    ``padding`` zero samples are appended first; there are ``(len + padding) // 160`` frames
    (the STFT's last frame is dropped, as Whisper does). The ``max - 8`` floor is global.
    """
    n = (np.asarray(audio).size + padding) // HOP_LENGTH
    return _normalise(mel_power(audio, 0, n, n_mels))


def log_mel_window(audio: np.ndarray, start_frame: int, n_valid: int = N_FRAMES, n_mels: int = 80,
                   n_frames: int = N_FRAMES) -> np.ndarray:
    """One model input at ``start_frame``: ``(n_frames, n_mels)`` (a 30-s window by default).

    As in Whisper's ``transcribe``, only ``n_valid`` frames carry audio (fewer in the last
    window) and the rest are 0.0. The ``max - 8`` floor is taken over the valid frames of
    this window only (Whisper was trained on mels of single 30-s segments), so a window's
    input depends on nothing but its own audio; that is what lets streaming reproduce
    batch transcription exactly. ``n_frames < 3000`` gives a trimmed window (the encoder
    then runs on a shorter context).
    """
    n_valid = max(0, min(n_valid, n_frames))
    out = np.zeros((n_frames, n_mels), dtype=np.float32)
    if n_valid:
        out[:n_valid] = _normalise(mel_power(audio, start_frame, n_valid, n_mels))
    return out
