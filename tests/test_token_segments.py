"""Long prompts tokenized by their pieces between added tokens (engine/model/token_segments.py):
the same ids as encoding the whole text, on every byte-level pre-tokenizer family and the real
SmolLM2 vocabulary, cached pieces reused, the cache bounded, unsafe pipelines left whole."""

import random
from pathlib import Path

from engine.model import token_segments
from engine.model.gguf import read_gguf
from engine.model.token_segments import SegmentCache
from engine.model.tokenizer import PRE_TOKENIZER_SPLITS, Tokenizer

import pytest

from tests.test_tokenizer import _byte_level_metadata

PIECES = [
    "Hello", " world", "\n", "\n\n", "  ", "\t", "\r\n", " ", "12345", "café", "日本語", "🎉", "'s", "don't",
    "def f(x):\n    return x + 1\n", "<|im_start|>", "<|im_end|>", "<|endoftext|>", " <|im_start|>",
    "<|im_end|>\n", "<|im_start|><|im_end|>", "<|im_", "im_end|>", "<im_start>", "<|im_start", "|>",
]


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 1200))) for _ in range(n)]


def _with_markers(pre: str) -> Tokenizer:
    md = _byte_level_metadata(pre)
    tokens = md["tokenizer.ggml.tokens"] + ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    md.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * 256 + [3, 3, 3]})
    return Tokenizer.from_gguf_metadata(md, f"{pre}.gguf")


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZER_SPLITS))
def test_pieces_give_the_whole_texts_ids_on_every_byte_level_family(pre):
    tok = _with_markers(pre)
    cache = SegmentCache.for_backend(tok.backend)
    assert cache is not None
    for text in _texts(20, seed=len(pre)):
        want = tok.backend.encode(text, add_special_tokens=False).ids
        assert cache.encode(text) == want
        assert cache.encode(text) == want  # from the cache


def test_real_vocabulary_and_a_follow_up_reuses_the_conversation(smollm2_path: Path, monkeypatch):
    tok = Tokenizer.from_gguf_metadata(read_gguf(smollm2_path).metadata, str(smollm2_path))
    assert tok.segments() is not None
    for text in _texts(60, seed=7):
        assert tok.segments().encode(text) == tok.backend.encode(text, add_special_tokens=False).ids
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "word " * 300}
                for i in range(12)]
    text = tok.chat_template.render(messages, add_generation_prompt=True)
    assert len(text) >= token_segments.MIN_CHARS
    assert tok.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids
    calls = []
    real = tok.backend.encode_batch

    def counting(pieces, **kw):
        calls.append(list(pieces))
        return real(pieces, **kw)

    monkeypatch.setattr(tok.segments(), "backend", type("B", (), {"encode_batch": staticmethod(counting)})())
    more = messages + [{"role": "user", "content": "and the last question?"}]
    text2 = tok.chat_template.render(more, add_generation_prompt=True)
    assert tok.encode(text2) == tok.backend.encode(text2, add_special_tokens=False).ids
    assert calls == [["user\nand the last question?"]]  # only the new message's piece was tokenized


def test_short_texts_and_special_token_requests_encode_whole(smollm2_path: Path, monkeypatch):
    tok = Tokenizer.from_gguf_metadata(read_gguf(smollm2_path).metadata, str(smollm2_path))
    monkeypatch.setattr(tok.segments(), "encode", lambda text: pytest.fail("segmented"))
    tok.encode("<|im_start|>user\nhi<|im_end|>")
    tok.encode("x " * 4000, add_special_tokens=True)


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(token_segments, "MAX_CACHED_CHARS", 4000)
    tok = _with_markers("qwen2")
    cache = tok.segments()
    for i in range(50):
        text = f"<|im_start|>piece {i} " + "abc " * 100 + "<|im_end|>"
        assert cache.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids
    assert cache._chars <= 4000 and len(cache._pieces) < 50


def test_pipelines_that_cross_the_cuts_are_left_whole(gemma_path: Path):
    # Gemma's SentencePiece normalizer (spaces -> U+2581) and its thousands of added tokens:
    # not a byte-level pipeline, so no piecewise encoding.
    tok = Tokenizer.from_gguf_metadata(read_gguf(gemma_path).metadata, str(gemma_path))
    assert tok.segments() is None
