"""Text <-> token ids for a model, on the Rust ``tokenizers`` library.

Two sources:

- GGUF metadata (llama.cpp's ``tokenizer.ggml.*`` keys). A GGUF holds no ``tokenizer.json``,
  so the tokenizer is rebuilt from the vocabulary the way llama.cpp reads it: byte-level BPE
  (``gpt2``) split by the pre-tokenizer regexes named in ``tokenizer.ggml.pre``, or
  SentencePiece-style BPE (``llama``) whose merges are recovered from the token scores.
- An MLX / Hugging Face model directory (``tokenizer.json`` + ``tokenizer_config.json``).

Control and user-defined tokens become added tokens, so ``<|im_start|>`` or ``<start_of_turn>``
in prompt text encodes to its single id.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.model import token_segments
from engine.model.chat_template import ChatTemplate
from engine.model.detokenizer import (
    ByteStreamDetokenizer,
    Detokenizer,
    PieceStreamDetokenizer,
    WindowDetokenizer,
)
from engine.model.token_segments import SegmentCache

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

log = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# Tokens that end a turn when the model emits them (llama.cpp's end-of-generation list).
END_OF_TURN_TEXTS = (
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
    "<end_of_utterance>",
)

# Start/end markers of hidden reasoning, when a model has them.
REASONING_MARKERS = (("<think>", "</think>"),)

# --- pre-tokenizer regexes for byte-level vocabularies, keyed by tokenizer.ggml.pre --------------
# Written in the tokenizer.json (Oniguruma) spelling; llama.cpp applies a list of them in order,
# each splitting the pieces the previous one produced.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class _Split:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is not cut (llama3, tekken)
    add_bos: bool = False  # llama.cpp's default when the GGUF has no add_bos_token key


def _family(names: str, split: _Split) -> dict[str, _Split]:
    return {name: split for name in names.split()}


PRE_TOKENIZER_SPLITS: dict[str, _Split] = {
    "default": _Split(_DEFAULT),
    **_family(
        "gpt-2 phi-2 jina-es jina-de gigachat jina-v1-en jina-v2-es jina-v2-de jina-v2-code "
        "roberta-bpe a.x-4.0 mellum mpt olmo jais trillion granite-docling exaone4",
        _Split((_GPT2,)),
    ),
    **_family(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
        _Split((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    **_family("dbrx smaug-bpe glm4 chatglm-bpe", _Split((_LLAMA3,))),
    **_family("qwen2 deepseek-r1-qwen kormo megrez stablelm2 hunyuan grok-2", _Split((_QWEN2,))),
    **_family(
        "smollm starcoder refact command-r codeshell exaone minerva-7b", _Split((r"\p{N}", _GPT2))
    ),
    "falcon": _Split((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    "deepseek-coder": _Split(
        (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
    ),
    "deepseek-v3": _Split(_DEEPSEEK3),
    "hunyuan-dense": _Split(_DEEPSEEK3),
    "tekken": _Split((_TEKKEN,), ignore_merges=True, add_bos=True),
    **_family("gpt-4o llama4 minimax-m2", _Split((_GPT4O,))),
    **_family("poro-chat bloom gpt3-finnish", _Split((r" ?[^(\s|.,!?…。，、।۔،)]+",))),
}


@dataclass(frozen=True)
class _PieceScheme:
    """How the batch decoder turns one token into bytes (mirrored by the stream detokenizer)."""

    kind: str  # "byte_level", "sentencepiece", or "window" (unknown decoder: re-decode)
    byte_fallback: bool = False  # "<0xNN>" tokens are raw bytes
    strip_leading_space: bool = False  # one leading space of the output is removed


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids, chat template and stream detokenizer."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        source: str,
        bos_id: int | None,
        eos_ids: Iterable[int],
        chat_template: ChatTemplate | None,
        scheme: _PieceScheme,
        vocab_size: int | None = None,
        prepend_bos: bool = False,
        append_eos_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.source = source
        self.bos_id = bos_id
        self.eos_ids: set[int] = set(eos_ids)
        self.chat_template = chat_template
        self._scheme = scheme
        self._vocab_size = vocab_size
        self._prepend_bos = prepend_bos and bos_id is not None
        self._append_eos_id = append_eos_id
        self.special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self._byte_decoder = _byte_decoder()
        self._pieces: dict[int, str | bytes] = {}
        # Long prompts reuse the ids of pieces already tokenized (a conversation's earlier
        # turns); made at the first long prompt, not at load.
        self._segments: SegmentCache | None | bool = False

    # --- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str) -> Tokenizer:
        """Build from the ``tokenizer.*`` keys of a GGUF file (``source`` names it in errors)."""
        return _from_gguf(cls, metadata, source)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from ``tokenizer.json`` (+ ``tokenizer_config.json``) in a model directory."""
        return _from_hf_dir(cls, Path(path))

    # --- API -----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token text in it (e.g. ``<|im_start|>``) becomes its
        id. ``add_special_tokens`` adds the BOS (and EOS) the model's tokenizer asks for; leave
        it off for rendered chat prompts, whose templates write BOS themselves."""
        segments = self.segments() if not add_special_tokens and len(text) >= token_segments.MIN_CHARS else None
        if segments is not None:
            ids = segments.encode(text)
        else:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self._prepend_bos:
                ids = [self.bos_id, *ids]
            if self._append_eos_id is not None:
                ids.append(self._append_eos_id)
        return ids

    def segments(self) -> SegmentCache | None:
        """The piecewise encoder of long prompts (token_segments), or None for this pipeline."""
        if self._segments is False:
            self._segments = SegmentCache.for_backend(self.backend)
        return self._segments

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is not None:
            return self._vocab_size
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    @property
    def reasoning_markers(self) -> tuple[str, str] | None:
        """``(start, end)`` of hidden reasoning (e.g. ``<think>``/``</think>``) when the
        vocabulary has both as single tokens or the chat template writes them."""
        template = self.chat_template.source if self.chat_template else ""
        for start, end in REASONING_MARKERS:
            in_vocab = self.token_to_id(start) is not None and self.token_to_id(end) is not None
            if in_vocab or (start in template and end in template):
                return start, end
        return None

    def new_detokenizer(self, skip_special: bool = False) -> Detokenizer:
        """A fresh incremental detokenizer whose output concatenates to
        ``decode(ids, skip_special)``."""
        scheme = self._scheme
        if scheme.kind == "window":
            return WindowDetokenizer(lambda ids: self.decode(ids, skip_special))
        skip = self.special_ids if skip_special else frozenset()
        cls = ByteStreamDetokenizer if scheme.kind == "byte_level" else PieceStreamDetokenizer
        return cls(self.piece, skip=skip, strip_leading_space=scheme.strip_leading_space)

    def piece(self, token_id: int) -> str | bytes:
        """What one token contributes to the decoded text, cached per id: bytes for byte-level
        tokens and byte-fallback tokens, text otherwise."""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._make_piece(token_id)
        return piece

    def _make_piece(self, token_id: int) -> str | bytes:
        token = self.backend.id_to_token(int(token_id))
        if token is None:
            return b"" if self._scheme.kind == "byte_level" else ""
        if self._scheme.kind == "byte_level":
            table = self._byte_decoder
            # like the ByteLevel decoder: map the whole token, or keep it as UTF-8 if any
            # character is outside the byte alphabet
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
            return token.encode()
        if self._scheme.byte_fallback and _BYTE_TOKEN.fullmatch(token):
            return bytes([int(token[3:5], 16)])
        return token.replace(SPM_SPACE, " ")


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-ins for the 256 byte values, reversed."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in keep]
    table = {chr(b): b for b in keep}
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


# --- GGUF --------------------------------------------------------------------------------------


class _Meta:
    """Typed access to GGUF metadata whose arrays may be lists, numpy arrays or mx.arrays."""

    def __init__(self, metadata: Mapping[str, Any], source: str) -> None:
        self.md = metadata
        self.source = source

    def text(self, key: str, default: str | None = None) -> str | None:
        value = self.md.get(key)
        return default if value is None else str(value)

    def integer(self, key: str) -> int | None:
        value = self.md.get(key)
        return None if value is None else int(self._array(key, value, np.int64))

    def flag(self, key: str, default: bool) -> bool:
        value = self.md.get(key)
        return default if value is None else bool(self._array(key, value, np.bool_))

    def strings(self, key: str) -> list[str] | None:
        value = self.md.get(key)
        if value is None:
            return None
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise self.fail(f"{key} should be a list of strings.")
        return [str(v) for v in value]

    def numbers(self, key: str, dtype: type) -> np.ndarray | None:
        value = self.md.get(key)
        return None if value is None else self._array(key, value, dtype).reshape(-1)

    def _array(self, key: str, value: Any, dtype: type) -> np.ndarray:
        try:  # lists, numpy arrays and mx.arrays all convert
            return np.asarray(value, dtype=dtype)
        except (TypeError, ValueError):
            raise self.fail(f"{key} holds {type(value).__name__} values, not numbers.") from None

    def fail(self, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: {problem}")


def _from_gguf(cls: type[Tokenizer], metadata: Mapping[str, Any], source: str) -> Tokenizer:
    meta = _Meta(metadata, source)
    kind = meta.text("tokenizer.ggml.model")
    tokens = meta.strings("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise meta.fail("the GGUF has no tokenizer (tokenizer.ggml.model / tokens are missing).")
    # llama.cpp renames empty tokens so that every id has a distinct text
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types = meta.numbers("tokenizer.ggml.token_type", np.int32)
    if types is None:
        types = np.full(len(tokens), NORMAL, dtype=np.int32)
    if len(types) != len(tokens):
        raise meta.fail("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length.")

    pre = meta.text("tokenizer.ggml.pre", "default")
    if kind == "gpt2":
        backend = _byte_level_backend(meta, tokens, pre)
        scheme = _PieceScheme("byte_level")
        add_bos_default = PRE_TOKENIZER_SPLITS.get(pre, _Split(())).add_bos
    elif kind == "llama":
        add_space_prefix = meta.flag("tokenizer.ggml.add_space_prefix", True)
        backend = _sentencepiece_backend(meta, tokens, types, add_space_prefix)
        scheme = _PieceScheme("sentencepiece", True, add_space_prefix)
        add_bos_default = True
    else:
        raise meta.fail(
            f"tokenizer model {kind!r} is not supported (supported: gpt2 byte-level BPE, "
            "llama SentencePiece BPE)."
        )
    _register_vocab_specials(backend, tokens, types)

    def token_id(key: str) -> int | None:
        i = meta.integer(key)
        return i if i is not None and 0 <= i < len(tokens) else None

    bos_id = token_id("tokenizer.ggml.bos_token_id")
    eos_id = token_id("tokenizer.ggml.eos_token_id")
    ends = {token_id(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")} - {None}
    ends |= {i for i, t in enumerate(tokens) if t in _END_SET}
    template = meta.text("tokenizer.chat_template")
    chat = None
    if template:
        specials = {"bos_token": "" if bos_id is None else tokens[bos_id]}
        specials["eos_token"] = "" if eos_id is None else tokens[eos_id]
        chat = ChatTemplate(template, special_tokens=specials, origin=f"{source} chat template")
    add_eos = meta.flag("tokenizer.ggml.add_eos_token", False)
    return cls(
        backend,
        source=source,
        bos_id=bos_id,
        eos_ids=ends,
        chat_template=chat,
        scheme=scheme,
        vocab_size=len(tokens),
        prepend_bos=meta.flag("tokenizer.ggml.add_bos_token", add_bos_default),
        append_eos_id=eos_id if add_eos else None,
    )


_END_SET = frozenset(END_OF_TURN_TEXTS)


def _vocab(tokens: list[str]) -> dict[str, int]:
    # built back to front so that a duplicated text keeps its first id
    n = len(tokens)
    return dict(zip(reversed(tokens), range(n - 1, -1, -1), strict=True))


def _bpe(
    meta: _Meta, vocab: dict[str, int], merges: list[tuple[str, str]], **kw: Any
) -> models.BPE:
    try:
        return models.BPE(vocab=vocab, merges=merges, **kw)
    except Exception as e:  # the Rust side reports e.g. a merge naming an unknown token
        raise meta.fail(f"the tokenizer vocabulary is inconsistent ({e}).") from None


def _byte_level_backend(meta: _Meta, tokens: list[str], pre: str) -> tokenizers.Tokenizer:
    merges_text = meta.strings("tokenizer.ggml.merges")
    if merges_text is None:
        raise meta.fail("the byte-level BPE tokenizer has no tokenizer.ggml.merges.")
    merges = []
    for m in merges_text:
        left, sep, right = m.partition(" ")
        if not sep:
            raise meta.fail(f"tokenizer.ggml.merges holds a malformed entry {m!r}.")
        merges.append((left, right))
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        log.warning(
            "%s: unknown pre-tokenizer %r; using llama.cpp's default split", meta.source, pre
        )
        split = PRE_TOKENIZER_SPLITS["default"]
    model = _bpe(meta, _vocab(tokens), merges, ignore_merges=split.ignore_merges)
    tok = tokenizers.Tokenizer(model)
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in split.regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_backend(
    meta: _Meta, tokens: list[str], types: np.ndarray, add_space_prefix: bool
) -> tokenizers.Tokenizer:
    scores = meta.numbers("tokenizer.ggml.scores", np.float32)
    if scores is None or len(scores) != len(tokens):
        raise meta.fail(
            "the SentencePiece tokenizer needs one tokenizer.ggml.scores entry per token."
        )
    unk_id = meta.integer("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    vocab = _vocab(tokens)
    model = _bpe(
        meta,
        vocab,
        merges_from_scores(tokens, scores, types),
        unk_token=unk,
        byte_fallback=True,
        fuse_unk=True,
    )
    tok = tokenizers.Tokenizer(model)
    # llama.cpp prefixes a space to every stretch of text (also after a special token)
    steps = [normalizers.Prepend(SPM_SPACE)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPM_SPACE)])
    out = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        out.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(out)
    return tok


def merges_from_scores(
    tokens: list[str], scores: np.ndarray, types: np.ndarray
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging.

    SentencePiece BPE repeatedly joins the adjacent pair whose concatenation is the best-scoring
    normal token. Listing every split of every normal token into two normal tokens, best
    result first, gives a merge table under which ordinary BPE makes the same choices.
    """
    normal = np.flatnonzero(types == NORMAL)
    order = normal[np.argsort(-scores[normal], kind="stable")]  # best score first, then by id
    pieces = {tokens[i] for i in normal.tolist()}
    merges: list[tuple[str, str]] = []
    for i in order.tolist():
        t = tokens[i]
        merges += [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in pieces and t[k:] in pieces]
    return merges


def _register_vocab_specials(
    backend: tokenizers.Tokenizer, tokens: list[str], types: np.ndarray
) -> None:
    """Control/unknown tokens become special added tokens (matched whole in text, skipped by
    ``skip_special``); user-defined ones become plain added tokens (matched whole, always shown).
    """
    special = [tokens[i] for i in np.flatnonzero((types == CONTROL) | (types == UNKNOWN)).tolist()]
    user = [tokens[i] for i in np.flatnonzero(types == USER_DEFINED).tolist()]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


# --- Hugging Face / MLX directory ------------------------------------------------------------


def _from_hf_dir(cls: type[Tokenizer], path: Path) -> Tokenizer:
    file = path / "tokenizer.json"
    if not file.is_file():
        raise ModelLoadError(f"{path}: no tokenizer.json in the model directory.")
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:
        raise ModelLoadError(f"{file}: the tokenizer cannot be read ({e}).") from None
    config = _read_json(path / "tokenizer_config.json")

    model_config = _read_json(path / "config.json")
    bos_text = _token_text(config.get("bos_token"))
    eos_text = _token_text(config.get("eos_token"))
    bos_id = backend.token_to_id(bos_text) if bos_text else None
    if bos_id is None and isinstance(model_config.get("bos_token_id"), int):
        bos_id = model_config["bos_token_id"]
    ends: set[int] = set()
    if eos_text and backend.token_to_id(eos_text) is not None:
        ends.add(backend.token_to_id(eos_text))
    ends |= _ids(model_config.get("eos_token_id"))
    ends |= _ids(_read_json(path / "generation_config.json").get("eos_token_id"))
    for i, tok in backend.get_added_tokens_decoder().items():
        if tok.special and tok.content in _END_SET:
            ends.add(i)

    template_source = _hf_chat_template(path, config)
    chat = None
    if template_source:
        specials = {"bos_token": bos_text or "", "eos_token": eos_text or ""}
        chat = ChatTemplate(
            template_source, special_tokens=specials, origin=f"{path} chat template"
        )
    return cls(
        backend,
        source=str(path),
        bos_id=bos_id,
        eos_ids=ends,
        chat_template=chat,
        scheme=_scheme_from_decoder(_decoder_spec(backend)),
    )


def _decoder_spec(backend: tokenizers.Tokenizer) -> dict[str, Any] | None:
    # the decoder's own JSON, without re-parsing a tokenizer.json of tens of megabytes
    return None if backend.decoder is None else json.loads(backend.decoder.__getstate__())


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e}).") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str) and template:
        return template
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) and template else None


def _scheme_from_decoder(decoder: Any) -> _PieceScheme:
    """Recognise the decoders whose per-token output is known; anything else re-decodes."""
    if not isinstance(decoder, dict):
        return _PieceScheme("window")
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    if [s.get("type") for s in steps] == ["ByteLevel"]:
        return _PieceScheme("byte_level")
    byte_fallback = strip = spm_space = False
    for step in steps:
        kind = step.get("type")
        if kind == "ByteFallback":
            byte_fallback = True
        elif (
            kind == "Replace"
            and step.get("pattern") == {"String": SPM_SPACE}
            and step.get("content") == " "
        ):
            spm_space = True
        elif kind == "Metaspace" and step.get("replacement") == SPM_SPACE:
            spm_space = True
            prefix = step.get(
                "prepend_scheme", "always" if step.get("add_prefix_space", True) else "never"
            )
            strip = strip or prefix != "never"
        elif (
            kind == "Strip"
            and step.get("content") == " "
            and step.get("stop") == 0
            and step.get("start") in (0, 1)
        ):
            strip = strip or step.get("start") == 1
        elif kind != "Fuse":
            return _PieceScheme("window")
    return (
        _PieceScheme("sentencepiece", byte_fallback, strip) if spm_space else _PieceScheme("window")
    )
