"""Whisper's 30-s window seek loop, usable on a growing buffer (streaming) or a whole file.

Per window: log-mel of ``[seek, seek + 30 s)`` (frames past the end of the audio are
zeros; a last window shorter than 30 s is encoded with a trimmed context, see
``TranscribeOptions.context_margin_s``), encoder, cross K/V once, then decoding with
temperature fallback (retry hotter when the text compresses too well, i.e. repeats, or
the mean log-probability is low, unless the window is judged silent). The window is cut
into segments at timestamp pairs and ``seek`` moves to the last timestamp (or the window
end when the text ended on a single timestamp). A window that depends only on audio
already received is decoded exactly as batch transcription of the complete audio would
decode it.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from engine.speech.decoding import Aborted, DecodeOptions, DecodeResult, decode_window
from engine.speech.loader import WhisperBundle
from engine.speech.mel import (
    FRAMES_PER_SECOND,
    HOP_LENGTH,
    N_FFT,
    N_FRAMES,
    SAMPLE_RATE,
    log_mel_window,
)
from engine.speech.threads import blas_threads
from engine.speech.tokenizer import TIME_PRECISION

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class TranscribeOptions:
    beam_size: int | None = None
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    max_initial_timestamp: float = 1.0
    # A window shorter than 30 s (the last one of a recording, or of an utterance) is
    # encoded with a trimmed context: its audio plus ``context_margin_s`` of silence,
    # at least ``min_context_s``, in whole seconds (the encoder's positional embedding is
    # sliced, as whisper.cpp's ``audio_ctx``). None: always a full 30-s window.
    context_margin_s: float | None = 2.0
    min_context_s: float = 10.0
    # OpenBLAS threads while windows are decoded (a process-wide setting, restored after;
    # see engine/speech/threads.py). None: leave it alone.
    blas_threads: int | None = 1


@dataclass
class Segment:
    start: float  # seconds from the start of the audio given to the transcriber
    end: float
    text: str
    tokens: list[int]
    temperature: float = 0.0
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0

    def as_dict(self) -> dict:
        return {"start": round(self.start, 2), "end": round(self.end, 2), "text": self.text}


@dataclass
class Timings:
    mel_ms: float = 0.0
    encode_ms: float = 0.0
    decode_ms: float = 0.0
    windows: int = 0

    def add(self, other: Timings) -> None:
        self.mel_ms += other.mel_ms
        self.encode_ms += other.encode_ms
        self.decode_ms += other.decode_ms
        self.windows += other.windows


@dataclass
class Transcript:
    text: str
    segments: list[Segment]
    timings: Timings
    audio_seconds: float


class SeekTranscriber:
    """State of the seek loop over one audio buffer that may still grow.

    ``advance(audio, final=False)`` decodes every window that lies wholly inside ``audio``;
    ``advance(audio, final=True)`` also decodes the rest, padding past the end with
    silence. ``audio`` must only ever grow (each call sees a prefix-extension of the last).
    """

    def __init__(self, bundle: WhisperBundle, options: TranscribeOptions | None = None,
                 prompt_tokens: list[int] | None = None):
        self.bundle = bundle
        self.options = options or TranscribeOptions()
        self.seek = 0  # in mel frames
        self.initial_prompt = list(prompt_tokens or [])
        self.all_tokens: list[int] = list(self.initial_prompt)
        self.prompt_reset_since = 0
        self.segments: list[Segment] = []
        self.timings = Timings()
        self._should_stop = None
        self.decoded: dict[int, list[int]] = {}  # seek -> tokens decoded for that window
        self.drafts: dict[int, list[int]] = {}  # seek -> likely tokens (an earlier look-ahead's)
        self.unfinished: tuple[int, list[int]] | None = None  # (seek, tokens) of an aborted greedy decode

    def clone(self) -> SeekTranscriber:
        """A copy to run ahead speculatively without touching this state."""
        other = copy.copy(self)
        other.all_tokens = list(self.all_tokens)
        other.segments = list(self.segments)
        other.timings = Timings()
        other.decoded = dict(self.decoded)
        other.drafts = dict(self.drafts)
        other.unfinished = None
        return other

    def window_ready(self, n_samples: int, final: bool) -> bool:
        content = n_samples // HOP_LENGTH
        if final:
            return self.seek < content
        # the window's last frame is centred on (seek + 2999) * hop and spans +-200 samples
        return content - self.seek >= N_FRAMES and n_samples >= (self.seek + N_FRAMES) * HOP_LENGTH + N_FFT // 2

    def advance(self, audio: np.ndarray, final: bool, should_stop=None) -> list[Segment]:
        """Decode all ready windows; returns the new segments (empty ones dropped).

        ``should_stop()`` is polled before each window and decoding step; if it turns true,
        :class:`~engine.speech.decoding.Aborted` is raised and this state must be dropped.
        """
        self._should_stop = should_stop
        new: list[Segment] = []
        if not self.window_ready(audio.size, final):
            return new
        with blas_threads(self.options.blas_threads):
            while self.window_ready(audio.size, final):
                if should_stop is not None and should_stop():
                    raise Aborted()
                new.extend(self._decode_next(audio))
        return [s for s in new if s.text]

    def context_frames(self, size: int) -> int:
        """Mel frames the encoder sees for a window with ``size`` frames of audio."""
        opts = self.options
        if opts.context_margin_s is None or size >= N_FRAMES:
            return N_FRAMES
        frames = max(size + round(opts.context_margin_s * FRAMES_PER_SECOND),
                     round(opts.min_context_s * FRAMES_PER_SECOND))
        return min(N_FRAMES, -(-frames // FRAMES_PER_SECOND) * FRAMES_PER_SECOND)

    def _check_stop(self) -> None:
        if self._should_stop():
            raise Aborted()

    @property
    def text(self) -> str:
        return self.bundle.tokenizer.decode(self.all_tokens[len(self.initial_prompt):]).strip()

    def _decode_next(self, audio: np.ndarray) -> list[Segment]:
        opts = self.options
        content = audio.size // HOP_LENGTH
        size = min(N_FRAMES, content - self.seek)
        offset = self.seek / FRAMES_PER_SECOND
        t0 = time.perf_counter()
        mel = log_mel_window(audio, self.seek, size, self.bundle.model.dims.n_mels, self.context_frames(size))
        t1 = time.perf_counter()
        model = self.bundle.model
        features = model.encoder(mx.array(mel)[None], self._check_stop if self._should_stop else None)
        cross = model.decoder.cross_kv(features)
        mx.eval(cross)
        t2 = time.perf_counter()
        result = self._decode_with_fallback(cross)
        self.decoded[self.seek] = result.tokens
        t3 = time.perf_counter()
        self.timings.add(Timings((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, 1))

        if opts.no_speech_threshold is not None and result.no_speech_prob > opts.no_speech_threshold:
            if opts.logprob_threshold is None or result.avg_logprob <= opts.logprob_threshold:
                self.seek += size  # silent window: skip it
                return []
        segments, advance = self._split(result, offset, size)
        self.seek += advance if advance > 0 else size  # always make progress
        for seg in segments:
            if seg.start == seg.end or not seg.text.strip():
                seg.text, seg.tokens = "", []
        self.segments.extend(s for s in segments if s.text)
        self.all_tokens.extend(t for seg in segments for t in seg.tokens)
        if not opts.condition_on_previous_text or result.temperature > 0.5:
            self.prompt_reset_since = len(self.all_tokens)
        return segments

    def _decode_with_fallback(self, cross: list) -> DecodeResult:
        opts = self.options
        prompt = self.all_tokens[self.prompt_reset_since:]
        result = None
        for i, temperature in enumerate(opts.temperatures):
            dopts = DecodeOptions(
                temperature=temperature,
                beam_size=opts.beam_size if temperature == 0.0 else None,
                max_initial_timestamp=opts.max_initial_timestamp,
                seed=self.seek * 16 + i,  # reproducible, and identical in batch and stream
            )
            greedy = temperature == 0.0 and not opts.beam_size
            draft = self.drafts.get(self.seek) if greedy else None
            try:
                result = decode_window(self.bundle, cross, prompt, dopts, self._should_stop, draft)
            except Aborted as e:
                if greedy and e.tokens:
                    self.unfinished = (self.seek, e.tokens)
                raise
            too_repetitive = (opts.compression_ratio_threshold is not None
                              and result.compression_ratio > opts.compression_ratio_threshold)
            too_unlikely = opts.logprob_threshold is not None and result.avg_logprob < opts.logprob_threshold
            silent = (opts.no_speech_threshold is not None and result.no_speech_prob > opts.no_speech_threshold
                      and too_unlikely)
            if silent or not (too_repetitive or too_unlikely):
                break
        return result

    def _split(self, result: DecodeResult, offset: float, size: int) -> tuple[list[Segment], int]:
        """Segments of one window and how many frames to seek forward."""
        tok = self.bundle.tokenizer
        tokens = result.tokens
        is_ts = [tok.is_timestamp(t) for t in tokens]
        single_ending = is_ts[-2:] == [False, True]
        cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]

        def make(toks: list[int], start: float, end: float) -> Segment:
            return Segment(start=start, end=end, text=tok.decode(toks).strip(), tokens=list(toks),
                           temperature=result.temperature, avg_logprob=result.avg_logprob,
                           no_speech_prob=result.no_speech_prob)

        if cuts:
            if single_ending:
                cuts.append(len(tokens))
            segments, last = [], 0
            for cut in cuts:
                piece = tokens[last:cut]
                segments.append(make(piece, offset + tok.timestamp_seconds(piece[0]),
                                     offset + tok.timestamp_seconds(piece[-1])))
                last = cut
            if single_ending:
                return segments, size
            # seek to the last complete timestamp; the rest is decoded again next window
            frames_per_token = round(TIME_PRECISION * FRAMES_PER_SECOND)
            return segments, (tokens[last - 1] - tok.special.timestamp_begin) * frames_per_token
        duration = size / FRAMES_PER_SECOND
        stamps = [t for t, ts in zip(tokens, is_ts, strict=True) if ts]
        if stamps and stamps[-1] != tok.special.timestamp_begin:
            duration = tok.timestamp_seconds(stamps[-1])
        return [make(tokens, offset, offset + duration)], size


def transcribe(bundle: WhisperBundle, audio: np.ndarray, options: TranscribeOptions | None = None,
               initial_prompt: str | None = None) -> Transcript:
    """Transcribe a whole 16 kHz mono recording."""
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    prompt = bundle.tokenizer.encode(" " + initial_prompt.strip()) if initial_prompt else None
    st = SeekTranscriber(bundle, options, prompt)
    st.advance(audio, final=True)
    return Transcript(text=st.text, segments=st.segments, timings=st.timings,
                      audio_seconds=audio.size / SAMPLE_RATE)
