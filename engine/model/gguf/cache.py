"""Converted-GGUF cache: the MLX arrays a GGUF file converts to, kept as one safetensors file.

Turning ggml blocks into MLX affine triples (engine.model.gguf.quants) is numpy work over every
weight, seconds per load; reading the converted arrays back is one file read. The entry for a
GGUF lives in ``cache_dir()/gguf`` and is keyed by the file's resolved path, size and mtime,
the conversion mode (weight format, CPU kernels on/off), ``CONVERTER_VERSION`` and MLX's
version, so an edited/replaced GGUF or a changed converter misses and reconverts; the entry of
an older key for the same file is removed when the new one is written (one per file and mode).
Writes are atomic (engine.atomic). A cache file that cannot be read back (truncated, corrupt,
wrong tensors) is removed with one warning and the GGUF converted again.
``MLXTERM_GGUF_CACHE=off`` turns the cache off (benchmarks of the conversion itself).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from engine.atomic import atomic_write
from engine.paths import cache_dir
from engine.settings import current

import mlx.core as mx

log = logging.getLogger(__name__)

# Bump when the conversion's output changes (tensor names, layouts, re-quantization).
# 2: Q6_K re-quantized to symmetric 8-bit, float16 scales; 3: Q6_K heads and FFN downs kept
# as their own blocks (bits 6 in the bits map: engine.kernels.q6k).
CONVERTER_VERSION = 3

Converted = tuple[dict[str, mx.array], dict[str, int]]  # arrays by mlx_lm name, bits by module


def enabled() -> bool:
    return current().gguf_cache


def mode(weights: str) -> str | None:
    """The cache mode of a load in ``weights`` format, or None when that format is not cached.

    Only the packed format is cached: it is what loads by default, and the dense ones would be
    several times the GGUF's size on disk."""
    from engine import kernels

    if weights != "quantized":
        return None
    if not kernels.available():
        return "quantized"
    # A kernel build without the Q6_K op converts Q6_K to 8 bits: another entry.
    return "quantized+kernels+q6k" if kernels.has("q6k_matmul") else "quantized+kernels"


def entry_path(path: Path, mode: str) -> Path:
    """Where the converted arrays of ``path`` in ``mode`` are (or would be) cached."""
    path = path.resolve()
    st = path.stat()
    where = hashlib.sha256(f"{path}|{mode}".encode()).hexdigest()[:12]
    key = hashlib.sha256(
        f"{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}|mlx {mx.__version__}".encode()
    ).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}.{where}.{key}.safetensors"


def load(path: Path, mode: str) -> Converted | None:
    """The cached conversion of ``path``, or None (absent, off, or unreadable: then removed)."""
    if not enabled():
        return None
    entry = entry_path(path, mode)
    if not entry.exists():
        return None
    try:
        arrays, meta = mx.load(str(entry), return_metadata=True)
        bits = {k: int(v) for k, v in json.loads(meta["mlxterm.bits"]).items()}
        if int(meta.get("mlxterm.converter", -1)) != CONVERTER_VERSION or not arrays:
            raise ValueError("converter version or contents differ")
        mx.eval(arrays)  # read now: a truncated file fails here, not inside the model
    except Exception as e:  # any unreadable file: the GGUF is the source of truth
        discard(entry, f"unreadable ({e})")
        return None
    return arrays, bits


def save(path: Path, mode: str, converted: Converted) -> None:
    """Cache ``converted`` for ``path``; a failure (disk full, read-only cache) only warns."""
    if not enabled():
        return
    arrays, bits = converted
    try:
        entry = entry_path(path, mode)
        meta = {"mlxterm.bits": json.dumps(bits), "mlxterm.converter": str(CONVERTER_VERSION),
                "mlxterm.source": str(path.resolve())}
        atomic_write(entry, lambda f: mx.save_safetensors(f, arrays, metadata=meta))
        prefix = entry.name.rsplit(".", 2)[0]  # stem.where: older keys of the same file and mode
        for old in entry.parent.glob(f"{prefix}.*.safetensors"):
            if old != entry:
                old.unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not cache the converted weights of %s: %s", path, e)


def discard(entry: Path, why: str) -> None:
    log.warning("converted-weights cache %s is %s; converting the GGUF again", entry, why)
    entry.unlink(missing_ok=True)
