"""Generation: sampling, KV caches, prefill and the compiled decode step, token constraints and
text streams (stop strings, reasoning split)."""
