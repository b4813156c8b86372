"""Tiny random-weight models saved as real MLX model directories, for fast tests.

Each directory has config.json, model.safetensors, a byte-level BPE tokenizer.json (bytes +
a few merges + ChatML special tokens) and tokenizer_config.json with a ChatML template.
"""

from __future__ import annotations

import json
from pathlib import Path

import engine  # noqa: F401  (loads OpenBLAS before mlx)

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
VOCAB = 384

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}

QWEN2_CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
}

GEMMA3_CONFIG = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 16,
    "sliding_window": 8,
    "sliding_window_pattern": 2,
    "max_position_embeddings": 4096,
}


def _byte_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert tok.get_vocab_size() <= VOCAB
    return tok


def make_model_dir(path: Path, config: dict, seed: int = 0) -> Path:
    """Write a random-weight model directory for ``config`` (an mlx_lm ModelArgs dict)."""
    from mlx_lm.utils import _get_classes

    path.mkdir(parents=True, exist_ok=True)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # Scale weights up a little so random logits are peaked enough for stable greedy tests.
    params = {k: v * 2.0 if v.ndim == 2 else v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), params, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    _byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "chat_template": CHATML,
            }
        )
    )
    return path


def write_profile(path: Path, model_dir: Path, **sections) -> Path:
    """A profile YAML for ``model_dir``; ``sections`` override/add YAML sections (dicts)."""
    import yaml

    data = {"name": path.stem, "model": {"source": str(model_dir), "weights": "fp32"}}
    data["sampling"] = {"temperature": 0.0, "max_tokens": 32}
    data["context"] = {"max_context": 512}
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def hooked_quantized(model_dir: Path):
    """The model in ``model_dir``, quantized to 4 bits (group 32) and routed to the CPU kernels."""
    from engine.kernels import hook

    import mlx.nn as nn
    from mlx_lm.utils import load_model

    model = load_model(model_dir)[0]
    nn.quantize(model, group_size=32, bits=4)
    assert hook.install(model) > 0
    return model
