"""What a checkpoint's KV depends on: the exact weights, how they run, and the code that ran them.

A checkpoint is restored only under an identical fingerprint. The weights hash is the SHA-256
of the model file(s), remembered in ``cache_dir()/weights-sha256.json`` keyed by (path, size,
mtime_ns) so a large file is hashed once, not at every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from engine import paths
from engine.atomic import atomic_write_text
from engine.checkpoints.format import VERSION
from engine.kvrows import Q8_FORMAT
from engine.model.gguf import cache as gguf_cache
from engine.model.gguf.cache import CONVERTER_VERSION

log = logging.getLogger(__name__)
HASH_CACHE = "weights-sha256.json"


@dataclass(frozen=True)
class Fingerprint:
    weights_sha256: str
    weight_format: str  # quantized, fp32, fp16, bf16
    kv_format: str  # live KV: "dense" (dtype follows the weights), "fp16", e.g. "q8-g64" (GPU), "q8hrows-g64" (CPU)
    checkpoint_format: str  # storage: same, fp16, q8, q4
    backend: str  # cpu, metal, cuda (kernels differ numerically)
    engine_version: str  # mlxterm, mlx-lm, checkpoint format and GGUF converter versions
    mlx_version: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @property
    def key(self) -> str:
        """Short stable id: the name of this fingerprint's directory in the SSD tier."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_files(path: Path) -> list[Path]:
    """The files whose bytes define a model: a GGUF file, or a directory's config and weights."""
    path = Path(path)
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf"))
    config = path / "config.json"
    return ([config] if config.is_file() else []) + files


def weights_sha256(path: Path) -> str:
    """SHA-256 over the model's files (each file's hash cached by path, size and mtime)."""
    cache_file = paths.cache_dir() / HASH_CACHE
    try:
        known = json.loads(cache_file.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    total = hashlib.sha256()
    changed = False
    for f in model_files(path):
        st = f.stat()
        key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        digest = known.get(key)
        if not isinstance(digest, str):
            digest = _file_sha256(f)
            known[key] = digest
            changed = True
        total.update(f"{f.name}:{digest}\n".encode())
    if changed:
        try:
            atomic_write_text(cache_file, json.dumps(known, indent=0, sort_keys=True))
        except OSError as e:  # only a speed-up: hashing again next time is fine
            log.debug("cannot save weight hashes to %s: %s", cache_file, e)
    return total.hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def make_fingerprint(model_path: Path, weight_format: str, kv_format: str = "dense",
                     checkpoint_format: str = "same", backend: str | None = None) -> Fingerprint:
    from engine.model.weight_policy import backend as current_backend

    import mlx.core as mx

    return Fingerprint(
        weights_sha256=weights_sha256(model_path),
        weight_format=weight_format,
        kv_format=kv_format,
        checkpoint_format=checkpoint_format,
        backend=backend or current_backend(),
        # The GGUF conversion too (its version and mode): another one (e.g. Q6_K blocks kept
        # instead of re-quantized) changes the weights the K/V came from.
        engine_version=(f"mlxterm {_version('mlxterm')}; mlx-lm {_version('mlx-lm')}; ckpt v{VERSION}; "
                        f"gguf v{CONVERTER_VERSION} {gguf_cache.mode(weight_format) or weight_format}"),
        mlx_version=mx.__version__,
    )


def live_kv_format(kv_cache_config, backend: str, model=None, weight_format: str | None = None) -> str:
    """The live KV format a profile runs with; engine.serving.prompt_cache.new_cache makes its
    caches from this answer, so checkpoints and live caches always agree.

    GPUs run the quantized formats live. On the CPU, ``fp16`` (the schema's default) stores K/V
    as float16 where the engine's fused attention reads them: for the loaded ``model``, when
    its attention is routed there; without it, when the kernels are built and the weights
    load as ``quantized``/``hybrid`` (the formats the loader routes). Half the bytes per decode
    step at long context. ``q8`` stores each token's K/V per head as 8-bit rows
    (engine.generation.kv_cache.Q8, "q8hrows-g<group>": K rotated) under the same condition, when the head
    dims fit the kernel (group 32/64/128 dividing the head dim): ~0.56 of fp16's bytes and
    int8 dot products at decode. Everything else on the CPU keeps K/V as computed ("dense").
    Checkpoints made before a format existed carry another name and simply miss.
    """
    fmt = kv_cache_config.format
    if backend != "cpu":
        return f"{fmt}-g{kv_cache_config.group_size}" if fmt in ("q8", "q4") else "dense"
    if fmt not in ("fp16", "q8"):
        return "dense"
    from engine import kernels
    from engine.kernels.attention import reads_fp16_kv

    if model is not None:
        ok = reads_fp16_kv(model)
    else:
        ok = kernels.available() and weight_format in ("quantized", "hybrid")
    if not ok:
        return "dense"
    if fmt == "q8":
        g = kv_cache_config.group_size
        head = _head_dim(model) if model is not None else None
        ok = g % 32 == 0 and (head is None or head % g == 0)
        return f"{Q8_FORMAT}-g{g}" if ok else "fp16"
    return "fp16"


def _head_dim(model) -> int | None:
    args = getattr(model, "args", None)
    if args is None:
        return None
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def fingerprint_for_profile(profile, model=None) -> Fingerprint:
    """The fingerprint of ``profile``'s model as the engine would run it: without loading it,
    or for the loaded ``model`` (its attention decides the live KV format)."""
    from engine.model.catalog import resolve_source
    from engine.model.weight_policy import backend, choose_weights

    be = backend()
    weights = choose_weights(profile.model.weights)
    return make_fingerprint(
        resolve_source(profile.model.source, profile.base_dir),
        weights,
        live_kv_format(profile.kv_cache, be, model, weights),
        profile.kv_cache.checkpoint_format,
        be,
    )
