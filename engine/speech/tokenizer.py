"""Whisper's byte-level BPE tokenizer (``tokenizer.json`` via ``tokenizers``) and special ids."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError

from tokenizers import Tokenizer

TIME_PRECISION = 0.02  # seconds per timestamp token


@dataclass(frozen=True)
class SpecialTokens:
    eot: int
    sot: int
    transcribe: int
    translate: int | None
    sot_prev: int
    sot_lm: int | None
    no_speech: int
    no_timestamps: int
    timestamp_begin: int
    language: int | None  # <|en|> for multilingual models, None for English-only ones


class WhisperTokenizer:
    """Text <-> ids for one Whisper model; timestamp ids start at ``timestamp_begin``."""

    def __init__(self, path: Path, n_vocab: int, language: str = "en"):
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"{path}: cannot read the Whisper tokenizer ({e})") from None
        self.multilingual = n_vocab >= 51865
        get = self._tok.token_to_id
        no_ts = get("<|notimestamps|>")
        eot, sot = get("<|endoftext|>"), get("<|startoftranscript|>")
        if no_ts is None or eot is None or sot is None:
            raise ModelLoadError(f"{path}: not a Whisper tokenizer (special tokens missing)")
        no_speech = get("<|nospeech|>") or get("<|nocaptions|>")
        lang = get(f"<|{language}|>") if self.multilingual else None
        if self.multilingual and lang is None:
            raise ModelLoadError(f"{path}: the tokenizer has no language token for {language!r}")
        self.special = SpecialTokens(
            eot=eot, sot=sot, transcribe=get("<|transcribe|>"), translate=get("<|translate|>"),
            sot_prev=get("<|startofprev|>"), sot_lm=get("<|startoflm|>"),
            no_speech=no_speech, no_timestamps=no_ts, timestamp_begin=no_ts + 1, language=lang,
        )
        if self.special.timestamp_begin + 1501 > n_vocab:
            raise ModelLoadError(f"{path}: tokenizer and model vocabularies do not match")
        self.n_vocab = n_vocab

    @property
    def sot_sequence(self) -> list[int]:
        """Prompt start: ``<|sot|>`` (English-only) or ``<|sot|><|lang|><|transcribe|>``."""
        s = self.special
        return [s.sot] if not self.multilingual else [s.sot, s.language, s.transcribe]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of the ordinary tokens in ``ids`` (timestamps and special tokens dropped)."""
        return self._tok.decode([t for t in ids if t < self.special.eot])

    def is_timestamp(self, token: int) -> bool:
        return token >= self.special.timestamp_begin

    def timestamp_seconds(self, token: int) -> float:
        return (token - self.special.timestamp_begin) * TIME_PRECISION

    def non_speech_tokens(self) -> list[int]:
        """Symbol tokens Whisper suppresses by default (its ``suppress_tokens="-1"`` list)."""
        symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
        symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
        miscellaneous = set("♩♪♫♬♭♮♯")
        result = {self.encode(" -")[0], self.encode(" '")[0]}
        for symbol in symbols + sorted(miscellaneous):
            for ids in (self.encode(symbol), self.encode(" " + symbol)):
                if len(ids) == 1 or symbol in miscellaneous:
                    result.add(ids[0])
        return sorted(result)
