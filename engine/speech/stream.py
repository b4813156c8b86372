"""Streaming dictation: audio chunks in, partial/final text events out.

A :class:`DictationSession` is one take (push-to-talk press to release). ``feed(chunk)``
only copies the chunk onto a queue, so it is safe to call from the audio callback thread.
Two worker threads do the rest:

Design notes, measurements and history: docs/engine-notes.md (stream.py).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import MlxtermError
from engine.speech.decoding import Aborted, merge_draft
from engine.speech.loader import DEFAULT_SPEECH_MODEL, WhisperBundle, load_whisper
from engine.speech.mel import SAMPLE_RATE
from engine.speech.transcribe import SeekTranscriber, Segment, Timings, TranscribeOptions
from engine.speech.vad import SpeechSegmenter, VadStream

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

EVENT_KINDS = ("level", "speech_start", "speech_end", "partial", "final", "error", "done")


@dataclass(frozen=True)
class DictationConfig:
    model: str = DEFAULT_SPEECH_MODEL
    min_silence_ms: int = 600  # a pause this long ends an utterance
    speech_pad_ms: int = 300  # audio kept before speech starts and after it ends
    vad_threshold: float = 0.5
    partial_interval_s: float = 1.0  # new audio needed before another partial decode
    beam_size: int | None = None


@dataclass(frozen=True)
class DictationEvent:
    kind: str
    text: str = ""
    time: float = 0.0  # seconds of audio into the take
    level: float = 0.0


@dataclass
class _Utterance:
    """A stretch of speech; sample indices are into the take's audio."""

    start: int
    end: int | None = None  # set when the utterance is closed
    settled_end: int | None = None  # where it ends if the current pause goes on
    transcriber: SeekTranscriber | None = None
    spec: SeekTranscriber | None = None  # look-ahead decoded to spec_key[1]
    spec_key: tuple[int, int] | None = None  # (transcriber seek, end sample) of spec
    committed: int = 0  # segments already sent as final
    drafts: dict[int, list[int]] = field(default_factory=dict)  # seek -> latest look-ahead tokens


_END, _CANCEL = "end", "cancel"


class DictationSession:
    """One dictation take: create, ``feed`` audio, then ``finish()`` or ``cancel()``."""

    def __init__(self, on_event: Callable[[DictationEvent], None] | None = None,
                 config: DictationConfig | None = None, bundle: WhisperBundle | None = None,
                 vad: VadStream | None = None):
        self.config = config or DictationConfig()
        self.events: queue.Queue[DictationEvent] = queue.Queue()
        self._on_event = on_event or self.events.put
        self._bundle = bundle
        self._vad = vad
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._cancelled = False
        self._cond = threading.Condition()
        self._audio = np.zeros(SAMPLE_RATE * 30, np.float32)  # grows by doubling
        self._n = 0  # samples received (guarded by _cond)
        self._utts: list[_Utterance] = []  # in order; all but the last are closed
        self._listening = True  # the listener has not finished yet
        self._texts: list[str] = []  # texts of finished utterances
        self.segments: list[Segment] = []  # finished segments, times from the take's start
        self.timings = Timings()  # all Whisper work, look-ahead included
        self.error: str | None = None
        self._done = threading.Event()
        self._listener = threading.Thread(target=self._guard, args=(self._listen,), name="dictation-vad", daemon=True)
        self._transcriber = threading.Thread(target=self._guard, args=(self._transcribe,), name="dictation-asr", daemon=True)
        self._listener.start()
        self._transcriber.start()

    # -- producer side (any thread) ------------------------------------------------------

    def feed(self, chunk: np.ndarray) -> None:
        """Queue 16 kHz mono float32 samples (``(n,)`` or ``(n, channels)``). Cheap."""
        if self._closed:
            return
        a = np.asarray(chunk, dtype=np.float32)
        self._inbox.put(a.mean(axis=1) if a.ndim == 2 else a.reshape(-1).copy())

    def audio_callback(self, indata, frames, time_info, status) -> None:
        """``sounddevice.InputStream`` callback signature; hands the block to :meth:`feed`."""
        self.feed(indata)

    def finish(self, timeout: float | None = None) -> str:
        """End the take and wait (up to ``timeout`` s) for the final text."""
        if not self._closed:
            self._closed = True
            self._inbox.put(_END)
        self._done.wait(timeout)
        return self.text

    def cancel(self) -> None:
        """Drop the take: queued audio is discarded and nothing more is transcribed."""
        self._closed = self._cancelled = True
        self._inbox.put(_CANCEL)
        with self._cond:
            self._cond.notify_all()
        self._done.wait()

    @property
    def text(self) -> str:
        """Text of the utterances finished so far."""
        return " ".join(t for t in self._texts if t)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # -- shared helpers ------------------------------------------------------------------

    def _emit(self, kind: str, text: str = "", level: float = 0.0, sample: int | None = None) -> None:
        t = (self._n if sample is None else sample) / SAMPLE_RATE
        try:
            self._on_event(DictationEvent(kind, text=text, time=t, level=level))
        except Exception:  # a broken consumer must not kill the workers
            log.exception("dictation event handler failed")

    def _guard(self, body: Callable[[], None]) -> None:
        try:
            body()
        except Exception as e:  # report, never crash the app
            if not isinstance(e, MlxtermError):
                log.exception("dictation worker failed")
            if self.error is None:
                self.error = str(e) if isinstance(e, MlxtermError) else f"dictation failed: {type(e).__name__}: {e}"
                self._emit("error", text=self.error)
            self._cancelled = True
            self._inbox.put(_CANCEL)  # wake the listener if it is waiting for audio
            with self._cond:
                self._listening = False
                self._cond.notify_all()
        finally:
            # A thread that used MLX must drop its streams before it ends (MLX teardown).
            mx.synchronize()
            mx.clear_streams()
            if threading.current_thread() is self._transcriber:
                self._listener.join()
                self._done.set()
                self._emit("done", text=self.text)

    @property
    def _pad(self) -> int:
        return self.config.speech_pad_ms * SAMPLE_RATE // 1000

    # -- listener thread: audio, VAD, utterance boundaries ------------------------------

    def _listen(self) -> None:
        vad = self._vad or VadStream()
        segmenter = SpeechSegmenter(self.config.vad_threshold, self.config.min_silence_ms)
        while True:
            items = [self._inbox.get()]
            while True:
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if self._cancelled or any(x is _CANCEL for x in items):
                break
            chunks = [x for x in items if isinstance(x, np.ndarray)]
            if chunks:
                self._append(np.concatenate(chunks))
                last = chunks[-1]
                self._emit("level", level=float(np.sqrt(np.mean(last**2))) if last.size else 0.0)
                new = self._audio[self._n - sum(c.size for c in chunks):self._n]
                for b in segmenter.push(vad.process(new)):
                    self._boundary(b.kind, b.sample)
                self._settle(segmenter.speech_end_if_silent)
            if any(isinstance(x, str) and x == _END for x in items):
                self._end_take(segmenter.speech_end_if_silent)
                break
        with self._cond:
            self._listening = False
            self._cond.notify_all()

    def _append(self, new: np.ndarray) -> None:
        with self._cond:
            if self._n + new.size > self._audio.size:
                grown = np.zeros(max(self._audio.size * 2, self._n + new.size), np.float32)
                grown[:self._n] = self._audio[:self._n]
                self._audio = grown  # the transcriber's views of the old buffer stay valid
            self._audio[self._n:self._n + new.size] = new
            self._n += new.size
            self._cond.notify_all()

    def _boundary(self, kind: str, sample: int) -> None:
        self._emit("speech_" + kind, sample=sample)
        with self._cond:
            open_utt = self._utts[-1] if self._utts and self._utts[-1].end is None else None
            if kind == "start" and open_utt is None:
                prev_end = self._utts[-1].end if self._utts else 0
                self._utts.append(_Utterance(start=max(prev_end, sample - self._pad)))
            elif kind == "end" and open_utt is not None:
                open_utt.end = min(sample + self._pad, self._n)
            self._cond.notify_all()

    def _settle(self, pause_start: int | None) -> None:
        """Record where the open utterance ends if the current pause lasts (None: talking)."""
        with self._cond:
            if self._utts and self._utts[-1].end is None:
                utt = self._utts[-1]
                utt.settled_end = (pause_start + self._pad
                                   if pause_start is not None and pause_start + self._pad <= self._n else None)
                self._cond.notify_all()

    def _end_take(self, pause_start: int | None) -> None:
        end = None
        with self._cond:
            if self._utts and self._utts[-1].end is None:
                end = self._n if pause_start is None else min(pause_start + self._pad, self._n)
                self._utts[-1].end = end
                self._cond.notify_all()
        if end is not None:
            self._emit("speech_end", sample=end)

    # -- transcriber thread: Whisper on utterances ---------------------------------------

    def _transcribe(self) -> None:
        bundle = self._bundle or load_whisper(self.config.model)
        index = 0  # utterance being worked on
        while True:
            with self._cond:
                while True:
                    if self._cancelled:
                        return
                    if index < len(self._utts):
                        utt = self._utts[index]
                        end = utt.end if utt.end is not None else (utt.settled_end or self._n)
                        audio = self._audio[utt.start:end]
                        closed, settled = utt.end is not None, utt.settled_end is not None
                        if closed or self._needs_work(utt, end, settled):
                            break
                    elif not self._listening:
                        return
                    self._cond.wait()
            if utt.transcriber is None:
                utt.transcriber = self._new_transcriber(bundle)
            try:
                if closed:
                    self._close_utterance(utt, audio)
                    index += 1
                else:
                    self._look_ahead(utt, audio, settled)
            except Aborted:
                if self._cancelled:
                    return
                raise

    def _new_transcriber(self, bundle: WhisperBundle) -> SeekTranscriber:
        # the take's earlier text is the prompt, as Whisper conditions on previous text
        prompt = bundle.tokenizer.encode(" " + self.text) if self.text else None
        return SeekTranscriber(bundle, TranscribeOptions(beam_size=self.config.beam_size), prompt)

    def _needs_work(self, utt: _Utterance, end: int, settled: bool) -> bool:
        tr = utt.transcriber
        seek = tr.seek if tr else 0
        if tr is not None and tr.window_ready(end - utt.start, final=False):
            return True  # a complete 30-s window to commit
        if utt.spec_key == (seek, end):
            return False  # this exact audio is already decoded ahead
        if settled:
            return True
        done_to = utt.spec_key[1] if utt.spec_key and utt.spec_key[0] == seek else utt.start
        return end - done_to >= self.config.partial_interval_s * SAMPLE_RATE

    def _look_ahead(self, utt: _Utterance, audio: np.ndarray, settled: bool) -> None:
        tr = utt.transcriber
        tr.drafts = dict(utt.drafts)  # the latest look-ahead drafts the windows decoded next
        committed = self._advance(tr, audio, False, self._is_cancelled)
        if committed:
            utt.committed = len(tr.segments)
            self._emit("final", text=" ".join(s.text for s in committed))
            return  # re-evaluate: more audio may have arrived meanwhile
        key = (tr.seek, utt.start + audio.size)
        spec = tr.clone()
        try:
            self._advance(spec, audio, True, lambda: self._stale(utt, key, settled))
        except Aborted:
            self._keep_drafts(utt, spec)
            return
        self._keep_drafts(utt, spec)
        utt.spec, utt.spec_key = spec, key
        self._emit("partial", text=" ".join(s.text for s in spec.segments[utt.committed:]))

    @staticmethod
    def _keep_drafts(utt: _Utterance, spec: SeekTranscriber) -> None:
        """Remember a look-ahead's tokens per window as drafts, even from abandoned work:
        an unfinished decode of newer audio is continued by the older complete one."""
        utt.drafts.update(spec.decoded)
        if spec.unfinished is not None:
            seek, tokens = spec.unfinished
            utt.drafts[seek] = merge_draft(tokens, utt.drafts.get(seek))

    def _advance(self, tr: SeekTranscriber, audio: np.ndarray, final: bool, should_stop) -> list[Segment]:
        try:
            return tr.advance(audio, final=final, should_stop=should_stop)
        finally:
            self.timings.add(tr.timings)
            tr.timings = Timings()

    def _is_cancelled(self) -> bool:
        return self._cancelled

    def _stale(self, utt: _Utterance, key: tuple[int, int], settled: bool) -> bool:
        """Whether look-ahead decoding of ``key`` has become useless.

        Look-ahead to a settled end is useless once the utterance ends elsewhere or the
        speaker resumes; a mere partial (talking) yields to a different settled end and to
        committing a complete window (needed work).
        """
        if self._cancelled:
            return True
        known_end = utt.end if utt.end is not None else utt.settled_end
        if known_end is not None:
            return known_end != key[1]
        if settled:
            return True
        return utt.transcriber.window_ready(self._n - utt.start, final=False)

    def _close_utterance(self, utt: _Utterance, audio: np.ndarray) -> None:
        tr = utt.transcriber
        if utt.spec is not None and utt.spec_key == (tr.seek, utt.end):
            tr = utt.spec  # decoded ahead on exactly this audio: adopt it
        else:
            tr.drafts = dict(utt.drafts)
            self._advance(tr, audio, True, self._is_cancelled)
        self._texts.append(tr.text)
        offset = utt.start / SAMPLE_RATE
        self.segments.extend(Segment(s.start + offset, s.end + offset, s.text, s.tokens, s.temperature,
                                     s.avg_logprob, s.no_speech_prob) for s in tr.segments)
        self._emit("final", text=" ".join(s.text for s in tr.segments[utt.committed:]), sample=utt.end)
