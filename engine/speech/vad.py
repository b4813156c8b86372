"""Silero VAD (16 kHz) in MLX, and a streaming speech/silence segmenter on top of it.

Per 32-ms frame (512 samples, prefixed by the previous frame's last 64 samples) the
model computes an STFT as a stride-128 convolution (magnitudes of 129 bins, 4 steps),
four ReLU conv blocks down to one 128-d vector, one LSTM cell step (state carried across
frames) and a sigmoid head: the probability that the frame is speech. Weights:
``assets/silero_vad_16k.safetensors`` (MIT, see ``assets/SILERO_VAD_LICENSE.txt``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError

import mlx.core as mx
import numpy as np

FRAME = 512  # samples per VAD step at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous frame prepended to each step
ASSET = Path(__file__).resolve().parents[2] / "assets" / "silero_vad_16k.safetensors"
_SHAPES = {
    "stft.weight": (258, 256, 1),
    "encoder.0.weight": (128, 3, 129), "encoder.0.bias": (128,),
    "encoder.1.weight": (64, 3, 128), "encoder.1.bias": (64,),
    "encoder.2.weight": (64, 3, 64), "encoder.2.bias": (64,),
    "encoder.3.weight": (128, 3, 64), "encoder.3.bias": (128,),
    "lstm.weight_ih": (512, 128), "lstm.weight_hh": (512, 128),
    "lstm.bias_ih": (512,), "lstm.bias_hh": (512,),
    "head.weight": (1, 1, 128), "head.bias": (1,),
}
_STRIDES = (1, 2, 2, 1)


class SileroVAD:
    """The network. ``probabilities`` runs frames in order, carrying the LSTM state."""

    def __init__(self, path: Path = ASSET):
        try:
            w = mx.load(str(path))
        except Exception as e:  # mlx raises RuntimeError/ValueError for missing/corrupt files
            raise ModelLoadError(f"{path}: cannot read the VAD weights ({e})") from None
        bad = [k for k, shape in _SHAPES.items() if k not in w or tuple(w[k].shape) != shape]
        if bad:
            raise ModelLoadError(f"{path}: not Silero VAD 16 kHz weights (bad tensor {bad[0]})")
        self.w = {k: v.astype(mx.float32) for k, v in w.items()}
        # LSTM input projection and both biases are applied to all frames at once
        self._w_ih_t = mx.contiguous(self.w["lstm.weight_ih"].T)
        self._w_hh_t = mx.contiguous(self.w["lstm.weight_hh"].T)
        self._bias = self.w["lstm.bias_ih"] + self.w["lstm.bias_hh"]
        mx.eval(self.w, self._w_ih_t, self._w_hh_t, self._bias)

    def features(self, windows: mx.array) -> mx.array:
        """``(n, 576)`` frames with context -> ``(n, 128)`` encoder outputs (frames independent)."""
        x = mx.concatenate([windows, windows[:, -2:-CONTEXT - 2:-1]], axis=1)  # reflect right by 64
        spec = mx.conv1d(x[:, :, None], self.w["stft.weight"], stride=128)  # (n, 4, 258)
        x = mx.sqrt(spec[..., :129] ** 2 + spec[..., 129:] ** 2)
        for i, stride in enumerate(_STRIDES):
            x = mx.conv1d(x, self.w[f"encoder.{i}.weight"], stride=stride, padding=1)
            x = mx.maximum(x + self.w[f"encoder.{i}.bias"], 0.0)
        return x[:, 0, :]  # the time axis is down to 1

    def probabilities(self, windows: mx.array, h: mx.array, c: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Speech probability of each frame, run in order; returns ``(probs, h, c)``."""
        gates_in = self.features(windows) @ self._w_ih_t + self._bias  # (n, 512)
        hs = []
        for i in range(windows.shape[0]):
            gates = gates_in[i:i + 1] + h @ self._w_hh_t
            i_g, f_g, g_g, o_g = mx.split(gates, 4, axis=1)  # PyTorch order: input, forget, cell, output
            c = mx.sigmoid(f_g) * c + mx.sigmoid(i_g) * mx.tanh(g_g)
            h = mx.sigmoid(o_g) * mx.tanh(c)
            hs.append(h)
        hidden = mx.maximum(mx.concatenate(hs, axis=0), 0.0)
        logits = hidden @ self.w["head.weight"][0].T + self.w["head.bias"]
        return mx.sigmoid(logits)[:, 0], h, c


class VadStream:
    """Feeds arbitrary-sized chunks through the model 512 samples at a time."""

    def __init__(self, model: SileroVAD | None = None):
        self.model = model or _default_model()
        self.reset()

    def reset(self) -> None:
        self._h = mx.zeros((1, 128))
        self._c = mx.zeros((1, 128))
        self._tail = np.zeros(CONTEXT, np.float32)  # context + not-yet-complete frame
        self.frames = 0  # frames processed so far

    def process(self, chunk: np.ndarray) -> np.ndarray:
        """Probabilities for every frame completed by ``chunk`` (possibly none)."""
        buf = np.concatenate([self._tail, np.asarray(chunk, np.float32).reshape(-1)])
        n = (buf.size - CONTEXT) // FRAME
        if n == 0:
            self._tail = buf
            return np.zeros(0, np.float32)
        windows = np.lib.stride_tricks.sliding_window_view(buf[:CONTEXT + n * FRAME], CONTEXT + FRAME)[::FRAME]
        probs, self._h, self._c = self.model.probabilities(mx.array(windows), self._h, self._c)
        mx.eval(probs, self._h, self._c)
        self._tail = buf[n * FRAME:].copy()
        self.frames += n
        return np.array(probs)


_default: SileroVAD | None = None


def _default_model() -> SileroVAD:
    global _default
    if _default is None:
        _default = SileroVAD()
    return _default


@dataclass
class SpeechBoundary:
    kind: str  # "start" or "end"
    sample: int  # first speech sample (start) or first sample after speech (end)


class SpeechSegmenter:
    """Hysteresis on frame probabilities: speech starts at a frame >= ``threshold`` and ends
    once probabilities stay below ``threshold - 0.15`` for ``min_silence_ms``.

    Boundaries are raw frame edges, without padding; the end is the start of the first
    silent frame.
    """

    def __init__(self, threshold: float = 0.5, min_silence_ms: int = 600, sample_rate: int = 16000):
        self.threshold = threshold
        self.neg_threshold = max(threshold - 0.15, 0.01)
        self.min_silence = min_silence_ms * sample_rate // 1000
        self.frame = 0
        self.in_speech = False
        self.silence_since: int | None = None  # sample where the current dip below started

    def push(self, probs: np.ndarray) -> list[SpeechBoundary]:
        out: list[SpeechBoundary] = []
        for p in probs:
            start = self.frame * FRAME
            self.frame += 1
            if p >= self.threshold:
                self.silence_since = None
                if not self.in_speech:
                    self.in_speech = True
                    out.append(SpeechBoundary("start", start))
            elif p < self.neg_threshold and self.in_speech:
                if self.silence_since is None:
                    self.silence_since = start
                if self.frame * FRAME - self.silence_since >= self.min_silence:
                    out.append(SpeechBoundary("end", self.silence_since))
                    self.in_speech, self.silence_since = False, None
        return out

    @property
    def speech_end_if_silent(self) -> int | None:
        """Where speech would end if the current silence lasted: the pending end, or None."""
        return self.silence_since if self.in_speech else None


def speech_segments(audio: np.ndarray, min_silence_ms: int = 600, threshold: float = 0.5) -> list[tuple[int, int]]:
    """``(start, end)`` sample ranges of speech in a whole recording."""
    probs = VadStream().process(np.concatenate([np.asarray(audio, np.float32), np.zeros(FRAME, np.float32)]))
    seg = SpeechSegmenter(threshold, min_silence_ms)
    bounds = seg.push(probs)
    if seg.in_speech:
        bounds.append(SpeechBoundary("end", seg.silence_since or len(audio)))
    starts = [b.sample for b in bounds if b.kind == "start"]
    ends = [min(b.sample, len(audio)) for b in bounds if b.kind == "end"]
    return list(zip(starts, ends, strict=True))
