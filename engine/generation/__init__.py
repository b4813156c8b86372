"""Generation: sampling, KV caches, prefill and the compiled decode step, token constraints,
vocabulary masks for byte-level grammars and text streams (stop strings, reasoning split)."""
