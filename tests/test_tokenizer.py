"""Tokenizers from GGUF metadata and model directories, checked against pinned reference ids.

The reference ids were produced once by independent tokenizers and pinned as literals (nothing
here imports transformers or sentencepiece):

- SmolLM2-135M-Instruct.Q4_1.gguf: transformers 5.24's GGUF tokenizer converter fed the
  ``tokenizer.*`` metadata, with its pre-tokenizer replaced by SmolLM2's own
  (``Sequence([Digits(individual_digits=True), ByteLevel(add_prefix_space=False)])``:
  transformers has no entry for ``tokenizer.ggml.pre == "smollm"``).
- gemma-3-270m-q4_k_m.gguf: the same converter, cross-checked with Google's ``sentencepiece``
  on a ModelProto rebuilt from the GGUF. They agreed on every string but the one holding
  ``<start_of_turn>``/``<end_of_turn>`` (sentencepiece does not parse control tokens in text):
  there the transformers ids (105/106, as llama.cpp gives) are pinned. Our tokenizer also
  matched sentencepiece on 512 further mixed texts when this was written.
"""

from __future__ import annotations

import engine  # noqa: F401  (loads OpenBLAS before mlx is imported)

# isort: split
import json
import random
import shutil
from pathlib import Path

from engine.errors import ModelLoadError
from engine.model.catalog import model_path
from engine.model.gguf.reader import read_gguf
from engine.model.tokenizer import PRE_TOKENIZER_SPLITS, Tokenizer

import mlx.core as mx
import pytest

# fmt: off
SMOLLM2_REFERENCE: dict[str, list[int]] = {
    "Hello world": [19556, 905],
    " leading space": [2899, 1898],
    "trailing space ": [4861, 4966, 1898, 216],
    "multiple   spaces  between": [30404, 256, 5600, 216, 826],
    "   ": [333],
    "line1\nline2\n\n\nline3": [1311, 33, 198, 1311, 34, 1116, 198, 1311, 35],
    "\ttab\tseparated\t\tvalues": [197, 15999, 197, 19509, 483, 197, 197, 6347],
    "mixed \t\n whitespace \r\n end": [35781, 216, 197, 198, 13938, 6525, 216, 2738, 1112],
    "Ünïcödé àccents: café, naïve, résumé": [
        142, 246, 94, 25972, 83, 7466, 84, 2756, 25782, 509, 547, 42, 37366, 28, 15486, 46494, 28,
        412, 2756, 5422, 2756,
    ],
    "日本語のテキストと中文字符": [
        23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226,
        7365, 118, 28589, 29184, 36518, 40562, 116,
    ],
    "emoji 🎉🚀 and ZWJ 👩\u200d💻 flags 🇫🇷": [
        391, 33777, 15107, 232, 227, 10813, 244, 218, 284, 1777, 71, 58, 15107, 235, 119, 321,
        231, 10813, 236, 136, 13198, 15107, 225, 121, 10813, 225, 132,
    ],
    "digits 0 12 345 6789 1234567890 3.14159": [
        37307, 216, 32, 216, 33, 34, 216, 35, 36, 37, 216, 38, 39, 40, 41, 216, 33, 34, 35, 36,
        37, 38, 39, 40, 41, 32, 216, 35, 30, 33, 36, 33, 37, 41,
    ],
    "year:\n    1996 and  2024, x=10": [
        3610, 42, 2367, 33, 41, 41, 38, 284, 256, 34, 32, 34, 36, 28, 1792, 45, 33, 32,
    ],
    "def f(x):\n    return x**2  # square\n": [
        1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 5222, 198,
    ],
    "rare \ue000 𪚲 chars": [42386, 216, 185, 218, 218, 216, 187, 120, 244, 127, 42040],
    "<start_of_turn>user\nHi<end_of_turn>\n": [
        44, 3738, 79, 1714, 79, 20589, 46, 4093, 198, 26843, 44, 486, 79, 1714, 79, 20589, 46,
        198,
    ],
    "<|im_start|>user\nHi<|im_end|>\n": [1, 4093, 198, 26843, 2, 198],
}
GEMMA_REFERENCE: dict[str, list[int]] = {
    "Hello world": [9259, 1902],
    " leading space": [5830, 2557],
    "trailing space ": [136697, 2557, 236743],
    "multiple   spaces  between": [43819, 139, 35220, 138, 19195],
    "   ": [139],
    "line1\nline2\n\n\nline3": [1257, 236770, 107, 1257, 236778, 109, 1257, 236800],
    "\ttab\tseparated\t\tvalues": [255968, 4823, 255968, 74010, 255969, 7558],
    "mixed \t\n whitespace \r\n end": [63258, 236743, 255968, 107, 118364, 236743, 251, 107, 1345],
    "Ünïcödé àccents: café, naïve, résumé": [
        238194, 236749, 238527, 236755, 55515, 236859, 1608, 767, 876, 236787, 33443, 236764,
        120362, 236764, 118515,
    ],
    "日本語のテキストと中文字符": [94951, 236945, 95830, 237032, 237103, 31818, 238741],
    "emoji 🎉🚀 and ZWJ 👩\u200d💻 flags 🇫🇷": [
        67906, 204906, 242015, 532, 1491, 236824, 236863, 236743, 243767, 237243, 244862, 22680,
        236743, 246598, 242644,
    ],
    "digits 0 12 345 6789 1234567890 3.14159": [
        67161, 236743, 236771, 236743, 236770, 236778, 236743, 236800, 236812, 236810, 236743,
        236825, 236832, 236828, 236819, 236743, 236770, 236778, 236800, 236812, 236810, 236825,
        236832, 236828, 236819, 236771, 236743, 236800, 236761, 236770, 236812, 236770, 236810,
        236819,
    ],
    "year:\n    1996 and  2024, x=10": [
        3704, 236787, 107, 140, 236770, 236819, 236819, 236825, 532, 138, 236778, 236771, 236778,
        236812, 236764, 1123, 236784, 236770, 236771,
    ],
    "def f(x):\n    return x**2  # square\n": [
        2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 1018, 236778, 138, 236865, 6281,
        107,
    ],
    "rare \ue000 𪚲 chars": [43128, 236743, 245863, 236743, 478, 408, 392, 416, 56256],
    "<start_of_turn>user\nHi<end_of_turn>\n": [105, 2364, 107, 10979, 106, 107],
    "<|im_start|>user\nHi<|im_end|>\n": [
        236820, 236909, 548, 236779, 3041, 111038, 2364, 107, 10979, 236820, 236909, 548, 236779,
        643, 111038, 107,
    ],
}
# fmt: on

@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> Tokenizer:
    # mx.load gives mx.array scalars/arrays: the loader must accept those too
    _, metadata = mx.load(str(smollm2_path), return_metadata=True)
    return Tokenizer.from_gguf_metadata(metadata, str(smollm2_path))


@pytest.fixture(scope="session")
def gemma(gemma_path: Path) -> Tokenizer:
    # mx.load cannot read Q4_K files; engine.model.gguf.reader gives ints, bools and numpy arrays
    return Tokenizer.from_gguf_metadata(read_gguf(gemma_path).metadata, str(gemma_path))


# --- real vocabularies ---------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("text", list(SMOLLM2_REFERENCE))
def test_smollm2_matches_reference_ids(smollm2: Tokenizer, text: str) -> None:
    assert smollm2.encode(text) == SMOLLM2_REFERENCE[text]
    assert smollm2.decode(SMOLLM2_REFERENCE[text]) == text


@pytest.mark.e2e
@pytest.mark.parametrize("text", list(GEMMA_REFERENCE))
def test_gemma_matches_reference_ids(gemma: Tokenizer, text: str) -> None:
    assert gemma.encode(text) == GEMMA_REFERENCE[text]
    assert gemma.decode(GEMMA_REFERENCE[text]) == text


@pytest.mark.e2e
def test_smollm2_special_tokens(smollm2: Tokenizer) -> None:
    assert smollm2.encode("<|im_start|>") == [1]
    assert smollm2.encode("<|im_end|>") == [2]
    assert smollm2.vocab_size == 49152
    assert smollm2.bos_id == 1
    assert smollm2.eos_ids == {0, 2}  # <|endoftext|>, <|im_end|> (the GGUF's eos)
    assert smollm2.token_to_id("<|im_end|>") == 2 and smollm2.id_to_token(1) == "<|im_start|>"
    # this GGUF says add_bos_token = false
    assert smollm2.encode("Hi", add_special_tokens=True) == smollm2.encode("Hi")
    assert smollm2.decode([1, 4093, 198, 26843, 2], skip_special=True) == "user\nHi"
    assert smollm2.reasoning_markers is None


@pytest.mark.e2e
def test_smollm2_gguf_chat_template_renders_chatml(smollm2: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert smollm2.chat_template is not None
    assert smollm2.chat_template.render(messages, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # without a system turn the template injects its default one
    assert smollm2.chat_template.render(messages[1:], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    )


@pytest.mark.e2e
def test_gemma_special_tokens(gemma: Tokenizer) -> None:
    assert gemma.encode("<start_of_turn>") == [105]
    assert gemma.encode("<end_of_turn>") == [106]
    assert gemma.vocab_size == 262144
    assert gemma.bos_id == 2
    assert gemma.eos_ids == {1, 106}  # <eos>, <end_of_turn>
    assert gemma.encode("Hello world", add_special_tokens=True) == [2, 9259, 1902]  # add_bos_token
    assert gemma.decode([2, 105, 9259, 106], skip_special=True) == "Hello"
    assert gemma.decode([2, 105, 9259, 106]) == "<bos><start_of_turn>Hello<end_of_turn>"
    assert gemma.chat_template is None  # the base model's GGUF carries none
    assert gemma.id_to_token(140) == "    "  # user-defined whitespace run, stored with real spaces


# --- streaming -----------------------------------------------------------------------------------


def _random_ids(tok: Tokenizer, texts: list[str], rng: random.Random) -> list[int]:
    """Slices of real encodings (emoji, CJK, byte fallback) mixed with arbitrary ids, including
    ones that are half a UTF-8 character or a lone byte, and special tokens."""
    specials = sorted(tok.special_ids)
    ids: list[int] = []
    for _ in range(rng.randrange(1, 30)):
        r = rng.random()
        if r < 0.5:
            enc = tok.encode(rng.choice(texts))
            start = rng.randrange(len(enc))
            ids += enc[start : start + rng.randrange(1, 8)]
        elif r < 0.9:
            ids.append(rng.randrange(tok.vocab_size))
        else:
            ids.append(rng.choice(specials))
    return ids


def _stream(tok: Tokenizer, ids: list[int], skip_special: bool) -> str:
    detok = tok.new_detokenizer(skip_special=skip_special)
    return "".join(detok.add(i) for i in ids) + detok.flush()


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["smollm2", "gemma"])
def test_streaming_concatenates_to_decode(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    rng = random.Random(1234)
    texts = list(SMOLLM2_REFERENCE)
    for _ in range(150):
        ids = _random_ids(tok, texts, rng)
        for skip in (False, True):
            assert _stream(tok, ids, skip) == tok.decode(ids, skip_special=skip), ids


@pytest.mark.e2e
def test_streaming_never_splits_a_character(smollm2: Tokenizer, gemma: Tokenizer) -> None:
    text = "🎉 日本 𪚲!"
    for tok in (smollm2, gemma):
        detok = tok.new_detokenizer()
        chunks = [detok.add(i) for i in tok.encode(text)] + [detok.flush()]
        assert "".join(chunks) == text
        assert all("\ufffd" not in c for c in chunks)
    # Gemma spells 𪚲 with four byte-fallback tokens: nothing comes out until the run ends
    detok = gemma.new_detokenizer()
    assert [detok.add(i) for i in [478, 408, 392, 416]] == ["", "", "", ""]
    assert detok.add(56256) == "𪚲 chars"
    detok = gemma.new_detokenizer()
    assert detok.add(478) == "" and detok.flush() == "\ufffd"  # a lone 0xF0 byte


# --- small synthetic vocabularies (fast, cover paths the real files do not) ----------------------


def _spm_metadata(**extra) -> dict:
    """A SentencePiece-style vocabulary with scores, as plain Python lists."""
    words = ["\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "bc", "\u2581abc", "abc"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *words, "<tool>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(words), 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))] + [0.0]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        **extra,
    }


def test_sentencepiece_space_prefix_and_byte_fallback() -> None:
    tok = Tokenizer.from_gguf_metadata(_spm_metadata(), "tiny.gguf")
    id_of = tok.token_to_id
    # add_space_prefix defaults on for SentencePiece (llama.cpp): "ab" is read as "▁ab"
    assert tok.encode("ab") == [id_of("\u2581ab")]
    assert tok.encode("ab abc") == [id_of("\u2581ab"), id_of("\u2581abc")]
    # and a space is prefixed again after a special token, as llama.cpp does
    assert tok.encode("<s>ab<tool>c") == [
        1,
        id_of("\u2581ab"),
        id_of("<tool>"),
        id_of("\u2581"),
        id_of("c"),
    ]
    assert tok.encode("é") == [id_of("\u2581"), 3 + 0xC3, 3 + 0xA9]  # byte fallback
    assert tok.encode("ab", add_special_tokens=True)[0] == 1  # BOS by default
    for text in ["ab abc", "abc", " a", "é b", "cab  ba"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text  # the prefix space is stripped again
        assert _stream(tok, ids, False) == text
    off = Tokenizer.from_gguf_metadata(
        _spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}), "t"
    )
    assert off.encode("ab") == [id_of("ab")]


def _gpt2_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode stand-ins, in byte order (written out independently)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _byte_level_metadata(pre: str) -> dict:
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": _gpt2_alphabet(),
        "tokenizer.ggml.merges": [],
    }


def test_every_pre_tokenizer_regex_compiles_and_round_trips() -> None:
    text = "Hello, World! It's 2024: x=3.14;\n\tcafé 日本 🎉  end  "
    for pre in PRE_TOKENIZER_SPLITS:
        tok = Tokenizer.from_gguf_metadata(_byte_level_metadata(pre), f"{pre}.gguf")
        assert tok.decode(tok.encode(text)) == text, pre
        assert len(tok.encode(text)) == len(text.encode()), pre  # one token per byte, no merges


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt-2", ["abc", "Ġ12345", "ĊĠĠ", "Ġx"]),
        ("smollm", ["abc", "Ġ", "1", "2", "3", "4", "5", "ĊĠĠ", "Ġx"]),  # digits split first
        ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5", "Ċ", "ĠĠ", "Ġx"]),
        ("llama-bpe", ["abc", "Ġ", "123", "45", "Ċ", "ĠĠ", "Ġx"]),
        ("default", ["abc", "Ġ", "123", "45", "ĊĠĠ", "Ġx"]),  # llama.cpp's fallback list
    ],
)
def test_pre_tokenizer_splits_like_llama_cpp(pre: str, pieces: list[str]) -> None:
    tok = Tokenizer.from_gguf_metadata(_byte_level_metadata(pre), f"{pre}.gguf")
    got = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("abc 12345\n   x")]
    assert got == pieces


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, "not supported"),
        ({"tokenizer.ggml.model": "gpt2"}, "has no tokenizer"),
        (
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]},
            "no tokenizer.ggml.merges",
        ),
        (
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.tokens": ["a"],
                "tokenizer.ggml.merges": ["a q"],
            },
            "inconsistent",
        ),
        ({**_spm_metadata(), "tokenizer.ggml.scores": [0.0]}, "scores"),
        ({**_spm_metadata(), "tokenizer.ggml.token_type": [1]}, "differ in length"),
        ({**_spm_metadata(), "tokenizer.ggml.token_type": ["x"]}, "not numbers"),
        ({**_spm_metadata(), "tokenizer.ggml.tokens": "abc"}, "list of strings"),
        ({**_spm_metadata(), "tokenizer.chat_template": "{% if %}"}, "not valid Jinja"),
    ],
)
def test_bad_gguf_metadata_is_one_clear_sentence(metadata: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message) as err:
        Tokenizer.from_gguf_metadata(metadata, "broken.gguf")
    assert str(err.value).startswith("broken.gguf") and "\n" not in str(err.value)


# --- model directories ----------------------------------------------------------------------------


@pytest.fixture
def whisper_dir(tmp_path: Path) -> Path:
    """A real byte-level tokenizer.json (Whisper's) plus a chat template and EOS we add."""
    src = model_path("whisper-tiny.en") / "tokenizer.json"
    shutil.copy(src, tmp_path / "tokenizer.json")
    config = {
        "bos_token": "<|startoftranscript|>",
        "eos_token": {"content": "<|endoftext|>"},
        "chat_template": "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [50257, 50362]}))
    return tmp_path


@pytest.mark.e2e
def test_hf_dir_byte_level(whisper_dir: Path) -> None:
    tok = Tokenizer.from_hf_dir(whisper_dir)
    assert tok.bos_id == tok.token_to_id("<|startoftranscript|>")
    assert {tok.token_to_id("<|endoftext|>"), 50362} <= tok.eos_ids
    assert tok.chat_template.render([{"role": "user", "content": "hi"}]) == "hi<|endoftext|>"
    rng = random.Random(7)
    for _ in range(50):
        ids = _random_ids(tok, ["héllo wörld 🎉", "日本語", " spaced  out "], rng)
        assert _stream(tok, ids, True) == tok.decode(ids, skip_special=True)
        assert _stream(tok, ids, False) == tok.decode(ids)


def test_hf_dir_sentencepiece_and_fallback_decoders(tmp_path: Path) -> None:
    from tokenizers import decoders

    tok = Tokenizer.from_gguf_metadata(_spm_metadata(), "tiny.gguf")
    texts = ["ab abc", "é b", "cab  ba", "<s>ab<tool>"]
    rng = random.Random(3)
    for decoder in (None, decoders.WordPiece(cleanup=False)):  # None keeps the SPM decoder
        if decoder is not None:
            tok.backend.decoder = decoder
        tok.backend.save(str(tmp_path / "tokenizer.json"))
        loaded = Tokenizer.from_hf_dir(tmp_path)
        kind = type(loaded.new_detokenizer()).__name__
        assert kind == ("PieceStreamDetokenizer" if decoder is None else "WindowDetokenizer")
        for _ in range(50):
            ids = _random_ids(loaded, texts, rng)
            assert _stream(loaded, ids, False) == loaded.decode(ids), (kind, ids)


def test_hf_dir_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_reasoning_markers_from_vocab_or_template() -> None:
    md = _spm_metadata()
    md["tokenizer.ggml.tokens"] = [*md["tokenizer.ggml.tokens"], "<think>", "</think>"]
    md["tokenizer.ggml.scores"] = [*md["tokenizer.ggml.scores"], 0.0, 0.0]
    md["tokenizer.ggml.token_type"] = [*md["tokenizer.ggml.token_type"], 4, 4]
    tok = Tokenizer.from_gguf_metadata(md, "think.gguf")
    assert tok.reasoning_markers == ("<think>", "</think>")
    assert tok.encode("<think>") == [tok.token_to_id("<think>")]
    plain = Tokenizer.from_gguf_metadata(_spm_metadata(), "plain.gguf")
    assert plain.reasoning_markers is None
    templated = _spm_metadata(**{"tokenizer.chat_template": "{{ '<think>\\n\\n</think>' }}"})
    assert Tokenizer.from_gguf_metadata(templated, "t.gguf").reasoning_markers == (
        "<think>",
        "</think>",
    )
