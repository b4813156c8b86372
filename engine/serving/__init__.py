"""Serving: the engine thread and its scheduler, the runner that owns a loaded model, the
``Engine`` facade, request events and the prompt cache (KV reuse through checkpoints)."""
