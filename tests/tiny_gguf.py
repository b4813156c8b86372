"""A tiny random-weight llama GGUF with a byte-level BPE tokenizer, loadable by both the engine
and llama.cpp: for tests that run the same file on both (bench serve).

The vocabulary is GPT-2's 256 byte characters, a few merges and two special tokens; weights
are F32 in llama.cpp's tensor names. Q and K are stored as they are (not permuted as llama.cpp's
converter would): both loaders read the same file, so both compute the same random model.
"""

from __future__ import annotations

from pathlib import Path

from engine.model.gguf.writer import RawTensor, write_gguf

import numpy as np

HIDDEN, LAYERS, FFN, HEADS, KV_HEADS = 64, 2, 128, 4, 2
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars, extra = [], 0
    for b in range(256):
        if b in kept:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_tiny_llama_gguf(path: Path, seed: int = 0, context: int = 8192) -> Path:
    tokens = _byte_chars() + ["".join(m) for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # normal, control
    vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    head = HIDDEN // HEADS
    tensors = {"token_embd.weight": w(vocab, HIDDEN, scale=1.0), "output_norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        tensors.update({
            f"blk.{i}.attn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.attn_q.weight": w(HEADS * head, HIDDEN),
            f"blk.{i}.attn_k.weight": w(KV_HEADS * head, HIDDEN),
            f"blk.{i}.attn_v.weight": w(KV_HEADS * head, HIDDEN),
            f"blk.{i}.attn_output.weight": w(HIDDEN, HEADS * head),
            f"blk.{i}.ffn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.ffn_gate.weight": w(FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": w(FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": w(HIDDEN, FFN),
        })
    metadata = {
        "general.architecture": "llama",
        "general.name": "tiny-llama",
        "general.file_type": 0,
        "llama.block_count": LAYERS,
        "llama.context_length": context,
        "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "llama.rope.dimension_count": head,
        "llama.vocab_size": vocab,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, np.int32),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in MERGES],
        "tokenizer.ggml.bos_token_id": tokens.index("<|im_start|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }
    raw = [RawTensor(name, a.tobytes(), "F32", a.shape) for name, a in tensors.items()]
    return write_gguf(path, metadata, raw)
