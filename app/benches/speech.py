"""Speech: Whisper mel/encoder/decoder times and real-time factor on synthesized clips.

Three English clips are generated at run time with espeak-ng and resampled to 16 kHz with
sox: a short sentence, a paragraph (~12 s) and a passage (~35 s) that crosses Whisper's
30-s window. Each clip is transcribed in one batch, then (unless ``--stream-repeats 0``)
streamed into a ``DictationSession`` in real time, in ``--chunk-ms`` blocks followed by
``--trailing-ms`` of silence (the key is released that long after the clip), measuring
the finish latency: the time from the last ``feed()`` to ``finish()`` returning, plus
whether the streamed text equals the batch text. The measured table is written into
docs/benchmarks.md under "## Speech".

``--kernels-ab N`` (default 1) also measures what the engine's CPU kernels (engine/kernels)
do for Whisper: each clip's batch transcription in child processes with the kernels and with
``MLXTERM_KERNELS=off``, arms alternated kernels/off/off/kernels N times; medians and the
ratio (off / kernels: the kernels' speed-up) per clip.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path

import numpy as np

CLIPS = {
    "short": "Please send the report to my manager before lunch.",
    "paragraph": (
        "Dictation works best when the speaker talks clearly and at a steady pace. "
        "The system listens to the microphone, notices when speech begins, and writes "
        "the words into the text box as soon as they are recognized."
    ),
    "passage": (
        "The library opens at nine in the morning and closes late in the evening. "
        "Visitors can borrow books, read newspapers, or use the computers on the second floor. "
        "Every week the staff organizes a reading group for children and a writing workshop "
        "for adults. Last winter the heating system failed, and the building was closed for "
        "several days while engineers replaced the old boiler. Since then the reading rooms "
        "have been warm and quiet, and more people come to study there than ever before. "
        "The director hopes to open a small cafe next spring. Anyone who wants to help can "
        "sign up at the front desk."
    ),
}
ARMS = ("kernels", "no_kernels")  # the kernels A/B (child processes)
DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
HEADING = "## Speech"


class SynthesisError(RuntimeError):
    """espeak-ng or sox is missing or failed."""


def synthesize(text: str, voice: str = "en-us") -> np.ndarray:
    """Speak ``text`` with espeak-ng and return 16 kHz mono float32 samples (via sox)."""
    from engine.speech.audio import load_audio

    espeak, sox = shutil.which("espeak-ng"), shutil.which("sox")
    if not espeak or not sox:
        raise SynthesisError("espeak-ng and sox are needed to synthesize speech clips")
    with tempfile.TemporaryDirectory(prefix="mlxterm-tts-") as tmp:
        raw, out = Path(tmp) / "raw.wav", Path(tmp) / "clip16k.wav"
        try:
            subprocess.run([espeak, "-v", voice, "-w", str(raw), text], check=True, capture_output=True, timeout=120)
            subprocess.run([sox, str(raw), "-r", "16000", "-c", "1", "-b", "16", str(out)],
                           check=True, capture_output=True, timeout=120)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            raise SynthesisError(f"speech synthesis failed: {e}") from None
        return load_audio(out)


@cache
def clip(name: str) -> np.ndarray:
    """One of :data:`CLIPS`, synthesized once per process (read-only array)."""
    audio = synthesize(CLIPS[name])
    audio.setflags(write=False)
    return audio


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="speech model name or directory (default whisper-tiny.en)")
    parser.add_argument("--beam-size", type=int, default=None, help="beam search width (default greedy)")
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    parser.add_argument("--stream-repeats", type=int, default=3,
                        help="real-time streaming runs per clip for the finish latency (0: none; default 3)")
    parser.add_argument("--chunk-ms", type=int, default=1000, help="streaming block size (default 1000)")
    parser.add_argument("--trailing-ms", type=int, default=1000,
                        help="silence after the clip before the take ends (default 1000)")
    parser.add_argument("--clips", default=",".join(CLIPS), help="comma-separated clip names (default all)")
    parser.add_argument("--kernels-ab", type=int, default=1,
                        help="rounds of kernels vs MLXTERM_KERNELS=off child runs (A/B/B/A each; 0: none)")
    parser.add_argument("--reference-ab", type=int, default=1,
                        help="rounds of this engine vs CTranslate2 float32 (faster-whisper's engine) on the "
                             "same model and clips (A/B/B/A each; 0: none; skipped without ctranslate2)")
    parser.add_argument("--arm", choices=ARMS, default=None, help=argparse.SUPPRESS)  # child process


def stream_take(bundle, audio: np.ndarray, chunk_ms: int = 1000, trailing_ms: int = 1000,
                beam_size: int | None = None) -> dict:
    """Play ``audio`` + ``trailing_ms`` of silence into a ``DictationSession`` in real time,
    in whole ``chunk_ms`` blocks (as a microphone delivers them); returns the final text and
    the finish latency (last ``feed()`` to ``finish()`` returning)."""
    from engine.speech.stream import DictationConfig, DictationSession

    block = 16000 * chunk_ms // 1000
    take = np.concatenate([audio, np.zeros(16000 * trailing_ms // 1000, np.float32)])
    take = np.concatenate([take, np.zeros(-take.size % block, np.float32)])
    session = DictationSession(config=DictationConfig(beam_size=beam_size), bundle=bundle)
    t0 = time.perf_counter()
    for i in range(0, take.size, block):
        delay = t0 + (i + block) / 16000 - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        session.feed(take[i:i + block])
        last = time.perf_counter()
    text = session.finish()
    latency = time.perf_counter() - last
    return {"latency_s": latency, "text": text, "error": session.error}


def run_arm(args) -> dict:
    """Child process of the kernels A/B: batch-transcribe each clip once, report the times."""
    from engine import kernels
    from engine.speech.loader import DEFAULT_SPEECH_MODEL, load_whisper
    from engine.speech.transcribe import TranscribeOptions, transcribe

    bundle = load_whisper(args.model or DEFAULT_SPEECH_MODEL)
    transcribe(bundle, np.zeros(16000, np.float32))  # warm-up, as in the main run
    rows = []
    for name in args.clips.split(","):
        audio = clip(name)
        t = time.perf_counter()
        result = transcribe(bundle, audio, TranscribeOptions(beam_size=args.beam_size))
        rows.append({"clip": name, "total_ms": (time.perf_counter() - t) * 1e3,
                     "encode_ms": result.timings.encode_ms, "decode_ms": result.timings.decode_ms,
                     "text": result.text})
    return {"bench": "speech", "arm": args.arm, "kernels": kernels.available(), "clips": rows}


def _arm_in_subprocess(args, arm: str) -> dict:
    """One arm in a fresh process: MLXTERM_KERNELS is read when the kernels are imported."""
    import json
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MLXTERM_KERNELS"}
    if arm == "no_kernels":
        env["MLXTERM_KERNELS"] = "off"
    cmd = [sys.executable, "-m", "app", "bench", "speech", "--json", "--arm", arm, "--clips", args.clips]
    if args.model:
        cmd += ["--model", args.model]
    if args.beam_size:
        cmd += ["--beam-size", str(args.beam_size)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"speech bench arm {arm} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def kernels_ab(args) -> dict:
    """Whisper with and without the CPU kernels: per clip median batch times and the ratio."""
    import statistics

    runs = [_arm_in_subprocess(args, arm) for arm in ("kernels", "no_kernels", "no_kernels", "kernels") * args.kernels_ab]
    if not any(r["kernels"] for r in runs if r["arm"] == "kernels"):
        return {"skipped": "CPU kernels unavailable in this install"}
    rows = []
    for name in args.clips.split(","):
        row: dict = {"clip": name}
        for arm in ARMS:
            mine = [c for r in runs if r["arm"] == arm for c in r["clips"] if c["clip"] == name]
            for key in ("total_ms", "encode_ms", "decode_ms"):
                row[f"{arm}_{key}"] = round(statistics.median(c[key] for c in mine), 1)
            row[f"{arm}_texts"] = sorted({c["text"] for c in mine})
        row["speedup"] = round(row["no_kernels_total_ms"] / row["kernels_total_ms"], 3)
        row["encode_speedup"] = round(row["no_kernels_encode_ms"] / row["kernels_encode_ms"], 3)
        row["same_text"] = row["kernels_texts"] == row["no_kernels_texts"]
        rows.append(row)
    return {"rounds": args.kernels_ab, "runs_per_arm": 2 * args.kernels_ab, "clips": rows}


def ctranslate2_transcribe(model, bundle, audio: np.ndarray) -> list[int]:
    """faster-whisper's way on CTranslate2: each 30-s window of ``audio`` padded to 30 s, its
    log-mel (this engine's front end, Whisper's recipe) encoded whole, decoded greedily with
    timestamps; the windows' token ids (no seek by the last timestamp: a clip's windows are
    fixed, which costs CTranslate2 nothing it would otherwise do)."""
    from engine.speech.mel import CHUNK_SECONDS, SAMPLE_RATE, log_mel_spectrogram

    import ctranslate2

    span = CHUNK_SECONDS * SAMPLE_RATE
    tokens: list[int] = []
    for start in range(0, audio.size, span):
        window = np.zeros(span, np.float32)
        piece = audio[start:start + span]
        window[:piece.size] = piece
        mel = log_mel_spectrogram(window)[:3000].T  # (n_mels, frames), as CTranslate2 takes it
        out = model.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(mel[None], np.float32)),
                             [bundle.tokenizer.sot_sequence], beam_size=1, max_length=448, suppress_blank=True,
                             max_initial_timestamp_index=50)
        tokens += out[0].sequences_ids[0]
    return tokens


def reference_ab(args, bundle) -> dict:
    """This engine's batch transcription vs CTranslate2 float32 with 2 threads (the engine under
    faster-whisper) on the same model and clips, alternated ours/ct2/ct2/ours; per clip medians,
    ratio = ours / ct2, and the WER of each."""
    import statistics

    from engine.speech.loader import model_dir
    from engine.speech.transcribe import TranscribeOptions, transcribe
    from engine.speech.wer import word_error_rate

    try:
        import ctranslate2
    except ImportError:
        return {"skipped": "ctranslate2 is not installed (the test extra)"}
    src = model_dir(args.model) if args.model else model_dir("whisper-tiny.en")
    if not (src / "model.bin").is_file():
        return {"skipped": f"{src} is not a CTranslate2 model"}
    ct2 = ctranslate2.models.Whisper(str(src), device="cpu", compute_type="float32", intra_threads=2)
    tok, eot = bundle.tokenizer, bundle.tokenizer.special.eot
    rows = []
    for name in args.clips.split(","):
        audio = clip(name)
        ctranslate2_transcribe(ct2, bundle, audio)  # warm-up
        times: dict[str, list[float]] = {"ours": [], "ct2": []}
        texts: dict[str, str] = {}
        for arm in ("ours", "ct2", "ct2", "ours") * args.reference_ab:
            t = time.perf_counter()
            if arm == "ours":
                texts[arm] = transcribe(bundle, audio, TranscribeOptions()).text
            else:
                texts[arm] = tok.decode([t for t in ctranslate2_transcribe(ct2, bundle, audio) if t < eot]).strip()
            times[arm].append((time.perf_counter() - t) * 1e3)
        ours, ref = statistics.median(times["ours"]), statistics.median(times["ct2"])
        rows.append({"clip": name, "ours_ms": round(ours, 1), "ct2_ms": round(ref, 1), "ratio": round(ours / ref, 3),
                     "ours_wer": round(word_error_rate(CLIPS[name], texts["ours"]), 3),
                     "ct2_wer": round(word_error_rate(CLIPS[name], texts["ct2"]), 3), "ct2_text": texts["ct2"]})
    return {"rounds": args.reference_ab, "runs_per_arm": 2 * args.reference_ab,
            "ctranslate2": ctranslate2.__version__, "clips": rows}


def run(args) -> dict:
    from engine.speech.loader import DEFAULT_SPEECH_MODEL, load_whisper
    from engine.speech.transcribe import TranscribeOptions, transcribe
    from engine.speech.wer import word_error_rate

    if args.arm:
        return run_arm(args)
    model = args.model or DEFAULT_SPEECH_MODEL
    t0 = time.perf_counter()
    bundle = load_whisper(model)
    load_s = time.perf_counter() - t0
    transcribe(bundle, np.zeros(16000, np.float32))  # warm-up: first-call allocations
    rows = []
    for name in args.clips.split(","):
        text, audio = CLIPS[name], clip(name)
        t = time.perf_counter()
        result = transcribe(bundle, audio, TranscribeOptions(beam_size=args.beam_size))
        total = time.perf_counter() - t
        tm = result.timings
        rows.append({
            "clip": name, "audio_s": round(result.audio_seconds, 2), "windows": tm.windows,
            "mel_ms": round(tm.mel_ms, 1), "encode_ms": round(tm.encode_ms, 1),
            "decode_ms": round(tm.decode_ms, 1), "total_ms": round(total * 1e3, 1),
            "real_time_factor": round(total / result.audio_seconds, 3),
            "wer": round(word_error_rate(text, result.text), 3), "text": result.text,
        })
        if args.stream_repeats > 0:
            takes = [stream_take(bundle, audio, args.chunk_ms, args.trailing_ms, args.beam_size)
                     for _ in range(args.stream_repeats)]
            latencies = sorted(t["latency_s"] for t in takes)
            rows[-1]["stream"] = {
                "finish_latency_s": [round(x, 3) for x in latencies],
                "finish_latency_median_s": round(latencies[len(latencies) // 2], 3),
                "same_as_batch": all(t["text"] == result.text for t in takes),
                "wer": [round(word_error_rate(text, t["text"]), 3) for t in takes],
                "errors": [t["error"] for t in takes if t["error"]],
            }
    result = {"bench": "speech", "model": model, "beam_size": args.beam_size, "load_s": round(load_s, 2),
              "machine": _machine(), "load_avg_1m": round(os.getloadavg()[0], 2), "clips": rows,
              "stream": {"repeats": args.stream_repeats, "chunk_ms": args.chunk_ms, "trailing_ms": args.trailing_ms}}
    if args.reference_ab > 0:
        result["reference_ab"] = reference_ab(args, bundle)
    if args.kernels_ab > 0:
        result["kernels_ab"] = kernels_ab(args)
        result["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    result["summary"] = _table(result)
    if not args.no_doc:
        write_section(result["summary"])
    return result


def _machine() -> str:
    from engine import blas

    cores = os.cpu_count()
    return f"{platform.machine()} {cores} cores, {platform.system()}, BLAS: {blas.status().get('path') or 'MLX default'}"


def _table(result: dict) -> str:
    lines = [
        f"Model `{result['model']}` (fp32, MLX CPU), "
        f"{'beam ' + str(result['beam_size']) if result['beam_size'] else 'greedy'} decoding; "
        f"{result['machine']}; model load {result['load_s']} s; "
        f"1-min load average {result['load_avg_1m']} when measured (shared machine).",
        "",
        "| clip | audio s | windows | mel ms | encode ms | decode ms | total ms | RTF | WER |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["clips"]:
        lines.append(f"| {r['clip']} | {r['audio_s']} | {r['windows']} | {r['mel_ms']} | {r['encode_ms']} "
                     f"| {r['decode_ms']} | {r['total_ms']} | {r['real_time_factor']} | {r['wer']} |")
    st = result.get("stream", {})
    if st.get("repeats"):
        lines += [
            "",
            f"Streaming: the clip fed to a `DictationSession` in real time in {st['chunk_ms']}-ms blocks, "
            f"then {st['trailing_ms']} ms of silence; finish latency = last `feed()` to `finish()` "
            f"returning, over {st['repeats']} runs.",
            "",
            "| clip | finish latency median s | all runs s | text == batch | WER |",
            "|---|---:|---|---|---:|",
        ]
        for r in result["clips"]:
            sr = r["stream"]
            lines.append(f"| {r['clip']} | {sr['finish_latency_median_s']} | "
                         f"{', '.join(str(x) for x in sr['finish_latency_s'])} | "
                         f"{'yes' if sr['same_as_batch'] else 'no'} | {max(sr['wer'])} |")
    ref = result.get("reference_ab") or {}
    lines += _ab_section(
        ref, "CTranslate2 reference",
        f"This engine vs CTranslate2 {ref.get('ctranslate2')} float32, 2 threads (faster-whisper's engine: every "
        f"30-s window padded and encoded whole, greedy), same model and clips, arms alternated ours/ct2/ct2/ours "
        f"x {ref.get('rounds')}, medians of {ref.get('runs_per_arm')} runs; ratio = ours / ct2.",
        ["clip", "ours ms", "CTranslate2 ms", "ratio", "WER ours", "WER CTranslate2"],
        lambda r: [r["clip"], r["ours_ms"], r["ct2_ms"], f"{r['ratio']}x", r["ours_wer"], r["ct2_wer"]])
    ab = result.get("kernels_ab") or {}
    lines += _ab_section(
        ab, "CPU kernels A/B",
        f"CPU kernels (engine/kernels) vs `MLXTERM_KERNELS=off`: batch transcription in child processes, arms "
        f"alternated kernels/off/off/kernels x {ab.get('rounds')}, medians of {ab.get('runs_per_arm')} runs per "
        f"arm; speed-up = off / kernels.",
        ["clip", "kernels total ms", "off total ms", "speed-up", "encode ms kernels / off", "encode speed-up",
         "same text"],
        lambda r: [r["clip"], r["kernels_total_ms"], r["no_kernels_total_ms"], f"{r['speedup']}x",
                   f"{r['kernels_encode_ms']} / {r['no_kernels_encode_ms']}", f"{r['encode_speedup']}x",
                   "yes" if r["same_text"] else "no"])
    return "\n".join(lines)


def _ab_section(ab: dict, name: str, intro: str, header: list[str], cells) -> list[str]:
    """Markdown lines for one A/B comparison: the intro and a row per clip (``cells(row)``), or
    the reason it was skipped, or nothing when it did not run."""
    if ab.get("clips"):
        lines = ["", intro, "", "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
        return lines + ["| " + " | ".join(str(c) for c in cells(r)) + " |" for r in ab["clips"]]
    return ["", f"{name}: skipped ({ab['skipped']})."] if ab.get("skipped") else []


def write_section(body: str, doc: Path = DOC) -> None:
    """Replace the "## Speech" section of the benchmarks doc (other sections untouched)."""
    from engine.atomic import atomic_write_text

    old = doc.read_text(encoding="utf-8") if doc.is_file() else "# Benchmarks\n"
    section = f"{HEADING}\n\nMeasured with `mlxterm bench speech`.\n\n{body}\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == HEADING), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        rest = "".join(lines[end:])
        new = "".join(lines[:start]) + section + ("\n" + rest if rest else "")
    atomic_write_text(doc, new)
    doc.chmod(0o644)  # atomic writes create 0600 temp files; this is a shared doc
