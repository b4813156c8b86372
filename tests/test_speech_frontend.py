"""Audio front end: log-mel vs a plain reference of Whisper's recipe, resampling, file
loading, WER and the tokenizer's suppression list. No model weights needed."""

from __future__ import annotations

import shutil
import subprocess
import wave

from engine.speech.audio import load_audio, resample
from engine.speech.errors import AudioFileError
from engine.speech.mel import (
    N_FRAMES,
    N_SAMPLES,
    log_mel_spectrogram,
    log_mel_window,
    mel_filters,
    mel_power,
)
from engine.speech.wer import normalize, word_error_rate, word_errors

import numpy as np
import pytest

# --- reference: Whisper's recipe written out plainly -------------------------------------


def _ref_mel_filters(n_mels=80, n_fft=400, sr=16000):
    """librosa.filters.mel(sr, n_fft, n_mels) (Slaney scale and norm), one filter at a time."""
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, np.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp

    def hz_to_mel(f):
        return f / f_sp if f < min_log_hz else min_log_mel + np.log(f / min_log_hz) / logstep

    def mel_to_hz(m):
        return f_sp * m if m < min_log_mel else min_log_hz * np.exp(logstep * (m - min_log_mel))

    mels = np.linspace(hz_to_mel(0.0), hz_to_mel(sr / 2), n_mels + 2)
    hz = np.array([mel_to_hz(m) for m in mels])
    bins = np.arange(n_fft // 2 + 1) * sr / n_fft
    fb = np.zeros((n_mels, bins.size))
    for i in range(n_mels):
        lo, centre, hi = hz[i], hz[i + 1], hz[i + 2]
        for j, f in enumerate(bins):
            rise, fall = (f - lo) / (centre - lo), (hi - f) / (hi - centre)
            fb[i, j] = max(0.0, min(rise, fall)) * 2.0 / (hi - lo)
    return fb


def _ref_log_mel(audio, padding=0):
    """torch.stft(n_fft=400, hop=160, hann periodic, center, reflect) |.|^2, drop last frame,
    mel, log10(clamp 1e-10), max(x, max-8), (x+4)/4 -- with an explicit DFT per frame."""
    x = np.concatenate([np.asarray(audio, np.float64), np.zeros(padding)])
    x = np.pad(x, 200, mode="reflect")
    n = np.arange(400)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * n / 400)
    k = np.arange(201)[:, None]
    cos, sin = np.cos(2 * np.pi * k * n / 400), np.sin(2 * np.pi * k * n / 400)
    frames = [x[i * 160:i * 160 + 400] * window for i in range(1 + (x.size - 400) // 160)]
    power = np.array([(cos @ f) ** 2 + (sin @ f) ** 2 for f in frames])[:-1]
    mel = power @ _ref_mel_filters().T
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def _test_signal(seconds=3.2, seed=0):
    """Chirp + harmonics + noise with a stretch of exact silence (exercises the floor)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    sig = 0.3 * np.sin(2 * np.pi * (200 + 900 * t) * t) + 0.1 * np.sin(2 * np.pi * 3100 * t)
    sig += 0.02 * rng.standard_normal(t.size)
    sig[int(1.0 * 16000):int(1.6 * 16000)] = 0.0
    return sig.astype(np.float32)


def test_mel_filterbank_matches_reference_and_published_values():
    fb = mel_filters()
    assert fb.shape == (80, 201)
    assert np.abs(fb - _ref_mel_filters()).max() < 1e-8
    # Entries of Whisper's mel_filters.npz / librosa's filterbank as published elsewhere.
    for m, k, v in [(0, 1, 0.02486259490251541), (1, 2, 0.022871771827340126),
                    (9, 10, 0.006945197004824877), (39, 41, 0.011486922390758991),
                    (69, 131, 0.00487553421407938), (79, 192, 0.0031647116411477327)]:
        assert fb[m, k] == pytest.approx(v, rel=1e-6)
    assert float(fb.sum()) == pytest.approx(1.999024, rel=1e-6)


def test_log_mel_matches_reference_within_1e_5():
    audio = _test_signal()
    ref = _ref_log_mel(audio, padding=N_SAMPLES)
    ours = log_mel_spectrogram(audio, padding=N_SAMPLES)
    assert ours.shape == ref.shape == ((audio.size + N_SAMPLES) // 160, 80)
    assert np.abs(ours - ref).max() <= 1e-5


def test_single_window_equals_reference_of_padded_audio():
    audio = _test_signal(seconds=4.0, seed=1)
    padded = np.zeros(N_SAMPLES, np.float32)
    padded[:audio.size] = audio
    ref = _ref_log_mel(padded)  # whisper.log_mel_spectrogram(pad_or_trim(audio))
    assert np.abs(log_mel_window(audio, 0) - ref).max() <= 1e-5


def test_window_frames_do_not_depend_on_later_audio():
    """Streaming invariance: frames of a window are the same whether or not audio follows."""
    audio = _test_signal(seconds=6.0, seed=2)
    start, n = 137, 300  # frames 137..436 end well inside the first 5 s
    whole = mel_power(audio, start, n)
    prefix = mel_power(audio[:(start + n) * 160 + 200], start, n)
    assert np.array_equal(whole, prefix)
    win = log_mel_window(audio, start, n_valid=n)
    assert win.shape == (N_FRAMES, 80)
    assert np.all(win[n:] == 0.0) and np.all(win[:n] != 0.0)
    # a trimmed window (shorter encoder context) is the same input, cut short
    assert np.array_equal(log_mel_window(audio, start, n_valid=n, n_frames=500), win[:500])


def test_resample_preserves_tones_and_removes_aliases():
    rate_in = 22050
    t = np.arange(rate_in * 2) / rate_in
    y = resample(np.sin(2 * np.pi * 440 * t).astype(np.float32), rate_in, 16000)
    assert y.size == 32000
    ty = np.arange(y.size) / 16000
    inner = slice(1600, -1600)
    assert np.abs(y[inner] - np.sin(2 * np.pi * 440 * ty[inner])).max() < 1e-4
    # 9.5 kHz is above the new Nyquist (8 kHz): it must be filtered out, not folded to 6.5 kHz
    alias = resample(np.sin(2 * np.pi * 9500 * t).astype(np.float32), rate_in, 16000)
    assert np.sqrt(np.mean(alias[inner] ** 2)) < 1e-3
    up = resample(np.sin(2 * np.pi * 300 * np.arange(8000) / 8000).astype(np.float32), 8000, 16000)
    assert up.size == 16000
    assert np.abs(up[1600:-1600] - np.sin(2 * np.pi * 300 * np.arange(16000) / 16000)[1600:-1600]).max() < 1e-3


def _write_wav(path, data: np.ndarray, rate: int, width: int, channels: int = 1):
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(data.tobytes())


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_load_wav_sample_widths(tmp_path, width):
    t = np.arange(16000) / 16000
    x = 0.5 * np.sin(2 * np.pi * 250 * t)
    if width == 1:
        raw = np.round(x * 127 + 128).astype(np.uint8)
    elif width == 2:
        raw = np.round(x * 32767).astype("<i2")
    elif width == 3:
        ints = np.round(x * 8388607).astype("<i4")
        raw = ints.view(np.uint8).reshape(-1, 4)[:, :3].copy()
    else:
        raw = np.round(x * 2147483647).astype("<i4")
    _write_wav(tmp_path / "a.wav", raw, 16000, width)
    audio = load_audio(tmp_path / "a.wav")
    assert audio.dtype == np.float32 and audio.size == 16000
    assert np.abs(audio - x).max() < (0.01 if width == 1 else 1e-4)


def test_load_stereo_wav_resamples_and_mixes(tmp_path):
    t = np.arange(44100) / 44100
    left, right = 0.4 * np.sin(2 * np.pi * 300 * t), 0.2 * np.sin(2 * np.pi * 300 * t)
    inter = np.stack([left, right], axis=1).reshape(-1)
    _write_wav(tmp_path / "s.wav", np.round(inter * 32767).astype("<i2"), 44100, 2, channels=2)
    audio = load_audio(tmp_path / "s.wav")
    assert audio.size == 16000
    ty = np.arange(16000) / 16000
    assert np.abs(audio[1600:-1600] - 0.3 * np.sin(2 * np.pi * 300 * ty)[1600:-1600]).max() < 1e-3


def test_load_audio_errors(tmp_path, monkeypatch):
    with pytest.raises(AudioFileError, match="no such audio file"):
        load_audio(tmp_path / "missing.wav")
    bogus = tmp_path / "notes.flac"
    bogus.write_bytes(b"this is not audio at all")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(AudioFileError, match="install sox"):
        load_audio(bogus)


@pytest.mark.skipif(shutil.which("sox") is None, reason="sox is not installed")
def test_load_flac_through_sox(tmp_path):
    t = np.arange(24000) / 48000
    x = 0.25 * np.sin(2 * np.pi * 500 * t)
    _write_wav(tmp_path / "src.wav", np.round(x * 32767).astype("<i2"), 48000, 2)
    subprocess.run(["sox", str(tmp_path / "src.wav"), str(tmp_path / "clip.flac")], check=True)
    audio = load_audio(tmp_path / "clip.flac")
    assert audio.size == 8000
    ty = np.arange(8000) / 16000
    assert np.abs(audio[800:-800] - 0.25 * np.sin(2 * np.pi * 500 * ty)[800:-800]).max() < 1e-3
    garbage = tmp_path / "bad.flac"
    garbage.write_bytes(b"fLaC but not really")
    with pytest.raises(AudioFileError, match="sox cannot decode"):
        load_audio(garbage)


def test_word_error_rate():
    assert normalize("Café, OK! It's well-known.") == ["cafe", "ok", "its", "well", "known"]
    assert word_errors("the cat sat on the mat", "the cat sat on mat") == (1, 6)
    assert word_errors("a b c", "a x c d") == (2, 3)  # one substitution, one insertion
    assert word_error_rate("Hello there.", "hello there") == 0.0
    assert word_error_rate("one two", "") == 1.0


def test_tokenizer_suppression_list_matches_the_shipped_model_config():
    """Our non-speech token list plus the task tokens equals CTranslate2's suppress_ids."""
    import json

    from engine.speech.loader import model_dir
    from engine.speech.tokenizer import WhisperTokenizer

    src = model_dir("whisper-tiny.en")
    tok = WhisperTokenizer(src / "tokenizer.json", n_vocab=51864)
    s = tok.special
    assert (s.eot, s.sot, s.no_timestamps, s.timestamp_begin) == (50256, 50257, 50362, 50363)
    specials = {s.transcribe, s.translate, s.sot, s.sot_prev, s.sot_lm, s.no_speech}
    config = json.loads((src / "config.json").read_text())
    assert sorted(set(tok.non_speech_tokens()) | specials) == config["suppress_ids"]
    assert tok.encode(" ") + [s.eot] == config["suppress_ids_begin"]
    assert tok.decode(tok.encode(" Hello world") + [s.eot, s.timestamp_begin + 7]) == " Hello world"


def test_model_loading_errors(tmp_path):
    from engine.errors import ModelLoadError
    from engine.speech.loader import load_whisper, model_dir

    with pytest.raises(ModelLoadError, match="no such speech model directory or name"):
        model_dir("whisper-giant")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="neither a CTranslate2"):
        load_whisper(str(empty))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.bin").write_bytes(b"\x06\x00\x00\x00\x0c\x00WhisperSpec\x00\x03\x00\x00\x00\xff")
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_whisper(str(broken), cache_root=tmp_path / "cache")


def test_bench_rewrites_only_its_section(tmp_path):
    from app.benches.speech import write_section

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Engine\n\nE\n\n## Speech\n\nold\n\n## Resume\n\nR\n")
    write_section("NEW", doc)
    text = doc.read_text()
    assert "old" not in text and "NEW" in text
    assert text.index("## Engine") < text.index("## Speech") < text.index("NEW") < text.index("## Resume")
    assert text.endswith("## Resume\n\nR\n")
    fresh = tmp_path / "new.md"
    write_section("T", fresh)
    assert fresh.read_text().startswith("# Benchmarks\n\n## Speech\n")
