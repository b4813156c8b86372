"""Models: GGUF and MLX-directory loading, tokenizers, detokenizers, chat templates, the
offline catalogue and the per-backend weight policy."""
