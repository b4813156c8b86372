"""``mlxterm transcribe FILE``: speech to text with Whisper (MLX)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("transcribe", help="transcribe a WAV/FLAC file with Whisper")
    p.add_argument("file", type=Path, help="audio file (WAV; FLAC and others need sox)")
    p.add_argument("--stream", action="store_true",
                   help="feed the file through the streaming dictation pipeline (VAD + partials)")
    p.add_argument("--json", action="store_true", help="print text, segments and timings as JSON")
    p.add_argument("--beam-size", type=int, default=None, metavar="N", help="beam search width (default greedy)")
    p.add_argument("--model", default=None, metavar="NAME_OR_PATH",
                   help="speech model name or directory (default whisper-tiny.en)")
    p.set_defaults(func=handle)


def handle(args) -> int:
    from engine.errors import MlxtermError
    from engine.speech.audio import load_audio
    from engine.speech.loader import DEFAULT_SPEECH_MODEL, load_whisper

    if args.beam_size is not None and args.beam_size < 1:
        raise MlxtermError(f"--beam-size must be at least 1, got {args.beam_size}")
    t0 = time.perf_counter()
    audio = load_audio(args.file)
    bundle = load_whisper(args.model or DEFAULT_SPEECH_MODEL)
    t1 = time.perf_counter()
    if args.stream:
        result = _streamed(bundle, audio, args)
    else:
        result = _batch(bundle, audio, args)
    total_ms = (time.perf_counter() - t1) * 1e3
    audio_s = audio.size / 16000
    result["timings"].update(audio_s=round(audio_s, 3), total_ms=round(total_ms, 1),
                             load_ms=round((t1 - t0) * 1e3, 1),
                             real_time_factor=round(total_ms / 1e3 / audio_s, 4) if audio_s else None)
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        print(result["text"])
    return 0


def _timings(t) -> dict:
    return {"mel_ms": round(t.mel_ms, 1), "encode_ms": round(t.encode_ms, 1),
            "decode_ms": round(t.decode_ms, 1), "windows": t.windows}


def _batch(bundle, audio, args) -> dict:
    from engine.speech.transcribe import TranscribeOptions, transcribe

    r = transcribe(bundle, audio, TranscribeOptions(beam_size=args.beam_size))
    return {"text": r.text, "segments": [s.as_dict() for s in r.segments], "timings": _timings(r.timings)}


def _streamed(bundle, audio, args) -> dict:
    """Feed the file in 100-ms blocks at once (no real-time pacing), printing finals to stderr."""
    from engine.errors import MlxtermError
    from engine.speech.stream import DictationConfig, DictationSession

    finals: list[str] = []

    def on_event(ev) -> None:
        if ev.kind == "final" and ev.text:
            finals.append(ev.text)
            print(f"[{ev.time:6.2f}s] {ev.text}", file=sys.stderr)

    session = DictationSession(on_event, DictationConfig(beam_size=args.beam_size), bundle=bundle)
    for i in range(0, audio.size, 1600):
        session.feed(audio[i:i + 1600])
    t = time.perf_counter()
    text = session.finish()
    if session.error:
        raise MlxtermError(session.error)
    timings = _timings(session.timings)  # includes look-ahead work that was discarded
    timings["finish_ms"] = round((time.perf_counter() - t) * 1e3, 1)
    return {"text": text, "segments": [s.as_dict() for s in session.segments], "timings": timings}
