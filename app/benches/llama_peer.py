"""llama.cpp as the benches' peer: an in-process llama.cpp server (PyPI ``xllamacpp``, the
``peer`` extra) on the same GGUF, and one timed completion on it.

Shared by ``bench engine`` (one slot, a fresh prompt per run) and ``bench resume --long-context``
(two slots that each keep their own context, so the decodes at ~100 tokens and at N tokens can
alternate in chunks on one server). The wheel is an AVX2 build; docs/benchmarks-log.md (round 9)
compares a native build as well.
"""

from __future__ import annotations

import time
from pathlib import Path

MISSING = "xllamacpp not installed (pip install -e '.[peer]')"
KV_TYPES = ("f16", "q8_0")


def start_server(path: Path, n_ctx: int, threads: int, *, read: bool = False, slots: int = 1,
                 kv_type: str = "f16"):
    """(server, load seconds) for the GGUF at ``path``, or (None, reason) when xllamacpp is not
    installed. ``n_ctx`` is per slot. ``read``: the weights read into memory instead of mmapped.
    ``slots`` > 1: each slot gets its own K/V (not one buffer that every decode step would scan
    whole) and keeps its context between requests (no RAM prompt cache swapping them out).
    ``kv_type`` "q8_0": 8-bit K and V, with flash attention on (llama.cpp needs it for a
    quantized V); "f16" is llama.cpp's default cache, flash attention left on its default."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type must be one of {KV_TYPES}, not {kv_type!r}")
    try:
        import xllamacpp as xl
    except ImportError:
        return None, MISSING
    p = xl.CommonParams()
    p.model.path = str(path)
    p.n_ctx = -(-n_ctx // 256) * 256 * slots  # llama.cpp splits it evenly between the slots
    p.n_batch = p.n_ubatch = 512
    p.n_parallel = slots
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.warmup = False
    if read:
        p.load_mode = xl.llama_load_mode.LLAMA_LOAD_MODE_NONE
    if slots > 1:
        p.kv_unified = False
        p.cache_ram_mib = 0
    if kv_type == "q8_0":
        p.cache_type_k = p.cache_type_v = xl.ggml_type.GGML_TYPE_Q8_0
        p.flash_attn_type = xl.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_ENABLED
    t = time.perf_counter()
    server = xl.Server(p)
    return server, time.perf_counter() - t


def complete(server, prompt: list[int], n: int, *, slot: int | None = None, cache_prompt: bool = False) -> dict:
    """Greedy completion of ``n`` tokens (EOS ignored) after the token ids ``prompt``; returns
    llama.cpp's timings: ``prompt_n``/``prompt_ms`` (the prompt tokens it evaluated) and
    ``predicted_n``/``predicted_ms``/``predicted_per_second`` (the decode steps after the first
    token, which the prompt's evaluation yields). ``slot`` pins the request to that slot;
    ``cache_prompt`` reuses the slot's cached prefix of ``prompt``."""
    req = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True, "cache_prompt": cache_prompt}
    if slot is not None:
        req["id_slot"] = slot
    r = server.handle_completions(req)
    if "timings" not in r:
        raise RuntimeError(f"llama.cpp completion failed: {r}")
    return r["timings"]
