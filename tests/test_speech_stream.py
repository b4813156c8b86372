"""Streaming dictation and microphone capture.

Audio reaches the session through ``MicrophoneCapture`` driven by a stand-in for the
``sounddevice`` module whose input stream plays a clip in real time from its own thread,
i.e. through the same callback path a microphone uses.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
import types

from engine.speech.capture import MicrophoneCapture, input_available
from engine.speech.errors import AudioInputError, NoAudioInputDevice
from engine.speech.stream import DictationConfig, DictationSession

import numpy as np
import pytest


class _PortAudioError(Exception):
    pass


def fake_sounddevice(clip: np.ndarray | None = None, has_input: bool = True, speed: float = 1.0):
    """A ``sounddevice`` stand-in; its InputStream plays ``clip`` in blocks, in real time."""
    mod = types.SimpleNamespace(PortAudioError=_PortAudioError, streams=[])

    def query_devices(kind=None):
        if not has_input:
            raise _PortAudioError("Error querying device -1")
        return {"name": "fake mic", "max_input_channels": 1}

    class InputStream:
        def __init__(self, samplerate, channels, dtype, blocksize, device, callback):
            assert (samplerate, channels, dtype) == (16000, 1, "float32")
            self.blocksize, self.callback = blocksize, callback
            self.finished = threading.Event()
            self.last_block_at = None
            self._stop = False
            mod.streams.append(self)

        def start(self):
            threading.Thread(target=self._play, daemon=True).start()

        def _play(self):
            t0 = time.perf_counter()
            for i in range(0, clip.size, self.blocksize):
                # PortAudio delivers a block once it has been recorded
                delay = t0 + (i + self.blocksize) / 16000 / speed - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                if self._stop:
                    break
                block = np.zeros((self.blocksize, 1), np.float32)
                part = clip[i:i + self.blocksize]
                block[:part.size, 0] = part
                self.callback(block, self.blocksize, None, None)
                self.last_block_at = time.perf_counter()
            self.finished.set()

        def stop(self):
            self._stop = True

        def close(self):
            pass

    mod.query_devices = query_devices
    mod.InputStream = InputStream
    return mod


# --- capture ----------------------------------------------------------------------------


def test_no_portaudio_or_no_device_is_a_clear_error(monkeypatch):
    mic = MicrophoneCapture(lambda block: None)
    try:
        import sounddevice  # noqa: F401
    except OSError:  # this machine: PortAudio is not installed
        with pytest.raises(NoAudioInputDevice, match="no audio input"):
            mic.start()
        assert input_available() is False
    monkeypatch.setitem(sys.modules, "sounddevice", fake_sounddevice(has_input=False))
    with pytest.raises(NoAudioInputDevice, match="no audio input device found"):
        mic.start()
    assert input_available() is False
    assert issubclass(NoAudioInputDevice, AudioInputError)


def test_capture_delivers_mono_float_blocks(monkeypatch):
    clip = np.arange(8000, dtype=np.float32) / 8000
    sd = fake_sounddevice(clip, speed=50.0)
    monkeypatch.setitem(sys.modules, "sounddevice", sd)
    blocks = []
    assert input_available() is True
    with MicrophoneCapture(blocks.append, block_ms=100):
        assert sd.streams[0].finished.wait(5)
    assert all(b.shape == (1600,) and b.dtype == np.float32 for b in blocks)
    assert np.array_equal(np.concatenate(blocks)[:clip.size], clip)


# --- session machinery without Whisper --------------------------------------------------


def test_model_error_becomes_an_event_not_a_crash():
    events = []
    session = DictationSession(events.append, DictationConfig(model="/no/such/model"))
    session.feed(np.zeros(16000, np.float32))
    assert session.finish(timeout=30) == ""
    assert session.done and "no such speech model" in session.error
    kinds = [e.kind for e in events]
    assert "error" in kinds and kinds[-1] == "done"


def test_silence_only_take_and_cancel():
    events = []
    # the model is never touched when the VAD hears no speech
    session = DictationSession(events.append, bundle=object())
    for _ in range(4):
        session.audio_callback(np.zeros((4000, 1), np.float32), 4000, None, None)
    assert session.finish(timeout=30) == "" and session.error is None
    kinds = [e.kind for e in events]
    assert kinds.count("level") >= 1 and "speech_start" not in kinds and kinds[-1] == "done"
    other = DictationSession(bundle=object())
    other.feed(np.zeros(1000, np.float32))
    t = time.perf_counter()
    other.cancel()
    assert other.done and time.perf_counter() - t < 25  # generous: a loaded 2-core machine
    other.feed(np.zeros(10, np.float32))  # ignored after the take ended


# --- end to end -------------------------------------------------------------------------


@pytest.mark.e2e
def test_stream_matches_batch_and_finishes_fast(tmp_path_factory, monkeypatch):
    if not (shutil.which("espeak-ng") and shutil.which("sox")):
        pytest.skip("espeak-ng and sox synthesize the speech clip")
    from engine.speech.loader import load_whisper
    from engine.speech.transcribe import transcribe

    from app.benches.speech import clip as synthesized

    bundle = load_whisper("whisper-tiny.en", cache_root=tmp_path_factory.getbasetemp() / "whisper-cache")
    clip = synthesized("passage")
    assert clip.size > 30 * 16000  # crosses the 30-s window boundary
    t = time.perf_counter()
    batch = transcribe(bundle, clip)
    batch_s = time.perf_counter() - t

    # count encoder passes (one per decoded window) and when they start
    from engine.speech.whisper_model import AudioEncoder

    encoder_starts = []
    original_call = AudioEncoder.__call__

    def counting_call(self, mel, between_layers=None):
        encoder_starts.append(time.perf_counter())
        return original_call(self, mel, between_layers)

    monkeypatch.setattr(AudioEncoder, "__call__", counting_call)

    # the user stops talking, then releases the key about a second later
    take = np.concatenate([clip, np.zeros(16000, np.float32)])
    sd = fake_sounddevice(take)
    monkeypatch.setitem(sys.modules, "sounddevice", sd)
    events = []
    session = DictationSession(lambda e: events.append((time.perf_counter(), e)), bundle=bundle)
    with MicrophoneCapture(session.feed, block_ms=1000):  # 1-s chunks, in real time
        assert sd.streams[0].finished.wait(120)
    text = session.finish()
    latency = time.perf_counter() - sd.streams[0].last_block_at
    t0 = events[0][0]
    for at, e in events:
        if e.kind != "level":
            print(f"  {at - t0:6.2f}s {e.kind:12} audio {e.time:5.2f}s {e.text[:60]!r}")
    after = sum(t > sd.streams[0].last_block_at for t in encoder_starts)
    print(f"finish latency {latency:.2f} s after the last chunk (batch transcription took {batch_s:.1f} s); "
          f"{len(encoder_starts)} encoder passes, {after} after the last chunk")

    assert session.error is None
    assert text == batch.text
    kinds = [e.kind for _, e in events]
    assert kinds[-1] == "done" and kinds.count("speech_start") == 1 and kinds.count("speech_end") == 1
    assert kinds.count("level") >= 10 and "partial" in kinds
    finals = [e.text for _, e in events if e.kind == "final"]
    assert " ".join(finals).split() == text.split()
    # Most of the work happened while the audio was arriving: at most the last window is
    # encoded after it (batch transcription needs two). The wall-clock latency (target
    # 0.5 s; measured 0.01-0.1 s here, see docs/speech.md and `mlxterm bench speech`) is
    # printed, not asserted: it depends on the shared machine's load.
    assert after <= 1


# --- streaming == batch, whatever the chunking ------------------------------------------

CHUNKINGS = {"0.1s": 1600, "0.25s": 4000, "1s": 16000, "random": None}


def _take(kind: str) -> np.ndarray:
    from app.benches.speech import clip

    a = clip("short")
    lead = np.zeros(8000, np.float32)
    if kind == "plain":
        return np.concatenate([lead, a, np.zeros(8000, np.float32)])
    if kind == "trailing_silence":
        return np.concatenate([lead, a, np.zeros(4 * 16000, np.float32)])
    b = clip("paragraph")[: 6 * 16000]  # two utterances split by a 1.5-s pause
    return np.concatenate([lead, a, np.zeros(24000, np.float32), b, np.zeros(8000, np.float32)])


def _stream(bundle, take: np.ndarray, chunking: str, monkeypatch) -> tuple[DictationSession, list]:
    """Feed ``take`` as fast as the session takes it; record each utterance's exact audio span."""
    spans = []
    real_close = DictationSession._close_utterance

    def close(self, utt, audio):
        spans.append((utt.start, utt.end, self.text))  # the text so far is the prompt
        return real_close(self, utt, audio)

    monkeypatch.setattr(DictationSession, "_close_utterance", close)
    session = DictationSession(bundle=bundle)
    rng = np.random.default_rng(5)
    i = 0
    while i < take.size:
        n = CHUNKINGS[chunking] or int(rng.integers(160, 24000))
        session.feed(take[i:i + n])
        i += n
    session.finish(timeout=300)
    return session, spans


@pytest.mark.e2e
@pytest.mark.parametrize("kind,chunking", [
    *(("plain", c) for c in CHUNKINGS), ("trailing_silence", "1s"), ("two_utterances", "0.25s"),
    ("two_utterances", "random"),
])  # a subset of the 12 combinations (all pass; see the issue-14 note) keeps CI short
def test_streaming_equals_batch_on_the_same_audio(kind, chunking, monkeypatch, tmp_path_factory):
    """Each utterance's streamed segments (tokens, timestamps, times) equal a batch
    transcription of exactly that audio with the same prompt, for every chunk size."""
    if not (shutil.which("espeak-ng") and shutil.which("sox")):
        pytest.skip("espeak-ng and sox synthesize the speech clip")
    from engine.speech.loader import load_whisper
    from engine.speech.transcribe import transcribe

    bundle = load_whisper("whisper-tiny.en", cache_root=tmp_path_factory.getbasetemp() / "whisper-cache")
    take = _take(kind)
    session, spans = _stream(bundle, take, chunking, monkeypatch)
    assert session.error is None
    assert len(spans) == (2 if kind == "two_utterances" else 1), spans
    expected = []
    for start, end, before in spans:
        batch = transcribe(bundle, take[start:end], initial_prompt=before or None)
        expected += [(round(s.start + start / 16000, 3), round(s.end + start / 16000, 3), s.text, list(s.tokens))
                     for s in batch.segments]
    streamed = [(round(s.start, 3), round(s.end, 3), s.text, list(s.tokens)) for s in session.segments]
    assert streamed == expected
    assert "send the report" in session.text.lower()
