"""The checkpoint file: a safetensors file whose metadata carries a JSON header.

Layout (plain safetensors, so ``mx.load`` / ``safetensors`` can open it too)::

    u64 little-endian N | N bytes of JSON (space padded to 8 bytes) | payload

The JSON maps tensor names to dtype/shape/data_offsets and holds ``__metadata__`` with
``mlxterm.checkpoint`` (our header as a JSON string: fingerprint, tokens count, per-layer
cache class/offset/window/encoding, the payload's SHA-256) and ``mlxterm.header_sha256``
(over that string and the tensor table), so any flipped byte anywhere is detected.

Tensors: ``tokens`` (int32, the exact token ids covered), then per layer ``{i}.k`` / ``{i}.v``
(raw or fp16), or ``{i}.k.q|s|b`` (packed codes, scales, biases) for quantized encodings.
This module is numpy-only: the writer thread uses it and must not run MLX.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from engine.checkpoints import quant
from engine.errors import MlxtermError

import numpy as np

FORMAT = "mlxterm-kv-checkpoint"
VERSION = 1
SUFFIX = ".safetensors"
MAX_HEADER = 64 * 1024 * 1024
META_KEY, HASH_KEY = "mlxterm.checkpoint", "mlxterm.header_sha256"

# safetensors dtype -> numpy dtype of the bytes (BF16 is carried as its uint16 bits).
ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32,
             "I32": np.int32, "U8": np.uint8}
LIVE_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint32": "U32", "uint8": "U8"}


class CorruptCheckpoint(MlxtermError):
    """A checkpoint file failed verification; the message says which check."""


@dataclass
class HostLayer:
    """One layer's K/V as numpy views (taken on the engine thread), for the writer."""

    cls: str
    offset: int
    window: int | None
    dtype: str  # live dtype name: float32, float16, bfloat16 (quantized caches: scales dtype)
    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    quant: tuple[int, int] | None = None  # QuantizedKVCache (group_size, bits)


@dataclass
class HostCheckpoint:
    cid: str
    tokens: np.ndarray  # int32
    layers: list[HostLayer]
    session_id: str | None
    created: float
    nbytes: int = 0


@dataclass
class Header:
    meta: dict[str, Any]
    index: dict[str, dict[str, Any]]
    data_start: int
    file_size: int


@dataclass
class Loaded:
    meta: dict[str, Any]
    tokens: np.ndarray
    tensors: dict[str, np.ndarray] = field(default_factory=dict)


# -- encoding (writer thread) ------------------------------------------------------------
def encode(ck: HostCheckpoint, storage: str, group_size: int) -> tuple[list, list[dict]]:
    """(tensors, layer headers) for ``ck`` in ``storage`` (same, fp16, q8 or q4)."""
    tensors: list[tuple[str, np.ndarray, str]] = [("tokens", ck.tokens, "I32")]
    layers = []
    for i, layer in enumerate(ck.layers):
        head = {"class": layer.cls, "offset": layer.offset, "window": layer.window,
                "dtype": layer.dtype}
        for part, arrays in (("k", layer.keys), ("v", layer.values)):
            head[part] = _encode_part(f"{i}.{part}", layer, arrays, storage, group_size, tensors)
        layers.append(head)
    return tensors, layers


def _encode_part(name, layer: HostLayer, arrays, storage, group_size, out) -> dict:
    if layer.quant is not None:  # a quantized live cache is stored as it is
        q, s, b = arrays
        st = LIVE_ST[layer.dtype]
        out += [(f"{name}.q", q, "U32"), (f"{name}.s", s, st), (f"{name}.b", b, st)]
        g, bits = layer.quant
        return {"enc": "mlx", "group_size": g, "bits": bits, "shape": _float_shape(q.shape, bits)}
    x = arrays[0]
    shape = list(x.shape)
    if layer.dtype == "uint8":  # 8-bit KV rows (the CPU's live q8): already compact, exact as is
        storage = "same"
    if storage in ("q8", "q4"):
        bits = 8 if storage == "q8" else 4
        g = quant.pick_group_size(x.shape[-1], group_size)
        packed = quant.quantize(x, layer.dtype, g, bits) if g else None
        if packed is not None:
            q, s, b = packed
            out += [(f"{name}.q", q, "U32"), (f"{name}.s", s, "F16"), (f"{name}.b", b, "F16")]
            return {"enc": storage, "group_size": g, "bits": bits, "shape": shape}
        storage = "fp16"  # head_dim fits no group size, or values overflow float16 scales
    if storage == "fp16" and layer.dtype != "float16":
        h = quant.encode_fp16(x, layer.dtype)
        if h is not None:
            out.append((name, h, "F16"))
            return {"enc": "fp16", "shape": shape}
    out.append((name, x, LIVE_ST[layer.dtype]))
    return {"enc": "raw", "shape": shape}


def _float_shape(packed_shape, bits: int) -> list[int]:
    return [*packed_shape[:-1], packed_shape[-1] * 32 // bits]


def write(f: BinaryIO, meta: dict[str, Any], tensors: list[tuple[str, np.ndarray, str]]) -> int:
    """Write the file to ``f``; returns its size. Hashes the payload first (header comes first)."""
    digest = hashlib.sha256()
    index: dict[str, dict[str, Any]] = {}
    pos = 0
    for name, arr, st in tensors:
        n = arr.size * np.dtype(ST_DTYPES[st]).itemsize
        index[name] = {"dtype": st, "shape": list(arr.shape), "data_offsets": [pos, pos + n]}
        pos += n
        for block in _blocks(arr):
            digest.update(block)
    meta = dict(meta, payload_sha256=digest.hexdigest(), payload_bytes=pos)
    meta_text = json.dumps(meta, sort_keys=True, separators=(",", ":"))
    header = {"__metadata__": {META_KEY: meta_text, HASH_KEY: _header_hash(meta_text, index)},
              **index}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for _, arr, _ in tensors:
        for block in _blocks(arr):
            f.write(block)
    return 8 + len(raw) + pos


def _blocks(a: np.ndarray) -> Iterator[memoryview]:
    """C-order contiguous byte blocks of ``a`` without copying (a strided view goes row by row)."""
    if a.flags.c_contiguous:
        yield memoryview(a.reshape(-1)).cast("B")
        return
    for sub in a:
        yield from _blocks(sub)


def _header_hash(meta_text: str, index: dict) -> str:
    table = json.dumps(index, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256((meta_text + "\n" + table).encode()).hexdigest()


# -- reading and verification --------------------------------------------------------------
def read_header(f: BinaryIO, file_size: int) -> Header:
    """Parse and check the header of an open checkpoint file (everything but the payload hash)."""
    if file_size < 8:
        raise CorruptCheckpoint("file is shorter than a header")
    (n,) = struct.unpack("<Q", f.read(8))
    if n < 2 or n > MAX_HEADER or 8 + n > file_size:
        raise CorruptCheckpoint(f"header length {n} does not fit a {file_size}-byte file")
    try:
        index = json.loads(f.read(n))
        extra = index.pop("__metadata__")
        meta_text, stored = extra[META_KEY], extra[HASH_KEY]
        if _header_hash(meta_text, index) != stored:
            raise CorruptCheckpoint("header checksum mismatch")
        meta = json.loads(meta_text)
        if not isinstance(meta, dict):
            raise TypeError("metadata is not an object")
    except CorruptCheckpoint:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpoint(f"header is not checkpoint JSON ({e})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CorruptCheckpoint(f"not a version-{VERSION} {FORMAT} file")
    _check_table(index, file_size - 8 - n)
    return Header(meta, index, 8 + n, file_size)


def _check_table(index: dict, payload_size: int) -> None:
    """Tensors tile the payload exactly: right byte sizes, no gaps, nothing cut off."""
    pos = 0
    for name, t in sorted(index.items(), key=lambda kv: _offsets(kv)[0]):
        st, shape, (b, e) = t.get("dtype"), t.get("shape"), _offsets((name, t))
        if st not in ST_DTYPES or not _is_shape(shape):
            raise CorruptCheckpoint(f"tensor {name!r} has a bad dtype or shape")
        if b != pos or e - b != math.prod(shape) * np.dtype(ST_DTYPES[st]).itemsize:
            raise CorruptCheckpoint(f"tensor {name!r} has bad data offsets")
        pos = e
    if pos != payload_size:
        raise CorruptCheckpoint(f"payload is {payload_size} bytes, the header says {pos} (truncated?)")


def _offsets(kv) -> tuple[int, int]:
    off = kv[1].get("data_offsets") if isinstance(kv[1], dict) else None
    if not (isinstance(off, list) and len(off) == 2 and all(isinstance(x, int) for x in off)):
        raise CorruptCheckpoint(f"tensor {kv[0]!r} has no valid data offsets")
    return off[0], off[1]


def _is_shape(shape) -> bool:
    return isinstance(shape, list) and all(isinstance(x, int) and x >= 0 for x in shape)


def read_tokens(f: BinaryIO, header: Header) -> np.ndarray:
    t = header.index.get("tokens")
    n = header.meta.get("n_tokens")
    if t is None or t["dtype"] != "I32" or t["shape"] != [n]:
        raise CorruptCheckpoint("token ids are missing or do not match the token count")
    b, e = t["data_offsets"]
    f.seek(header.data_start + b)
    return np.frombuffer(f.read(e - b), np.int32)


def scan(path: Path, check: Callable[[Header], None]) -> tuple[Header, np.ndarray]:
    """Header and token ids of ``path``; ``check`` vets the header (the payload is not read)."""
    with open(path, "rb") as f:
        header = read_header(f, os.fstat(f.fileno()).st_size)
        check(header)
        return header, read_tokens(f, header)


def load(path: Path, check: Callable[[Header], None]) -> Loaded:
    """Read and fully verify ``path``: header, ``check``, tensor table, payload SHA-256."""
    with open(path, "rb") as f:
        header = read_header(f, os.fstat(f.fileno()).st_size)
        check(header)
        tokens = read_tokens(f, header).copy()
        f.seek(header.data_start)
        size = header.file_size - header.data_start
        payload = np.empty(size, np.uint8)
        if f.readinto(memoryview(payload)) != size:
            raise CorruptCheckpoint("file ended early")
    if hashlib.sha256(memoryview(payload)).hexdigest() != header.meta.get("payload_sha256"):
        raise CorruptCheckpoint("payload checksum mismatch")
    tensors = {}
    for name, t in header.index.items():
        b, e = t["data_offsets"]
        tensors[name] = payload[b:e].view(ST_DTYPES[t["dtype"]]).reshape(t["shape"])
    return Loaded(header.meta, tokens, tensors)


def payload_digest(header: Header, tensors: Mapping[str, np.ndarray]) -> str:
    """SHA-256 of the payload rebuilt from ``tensors`` (host views, in file order)."""
    digest = hashlib.sha256()
    for name, t in sorted(header.index.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, e = t["data_offsets"]
        a = tensors.get(name)
        if a is None or a.nbytes != e - b:
            raise CorruptCheckpoint(f"tensor {name} does not match the header")
        for block in _blocks(a):
            digest.update(block)
    return digest.hexdigest()


def check_layers(meta: dict, index: dict[str, dict], layout: list[tuple[str, int | None]] | None) -> None:
    """Per-layer classes, offsets and the tensor table agree with each other and with ``layout``."""
    layers, n = meta.get("layers"), meta.get("n_tokens")
    if not isinstance(layers, list) or (layout is not None and len(layers) != len(layout)):
        raise CorruptCheckpoint("layer count does not match the model")
    for i, head in enumerate(layers):
        cls, window = head.get("class"), head.get("window")
        if layout is not None and (cls, window) != tuple(layout[i]):
            raise CorruptCheckpoint(f"layer {i} is a {cls} (window {window}); the model has {layout[i]}")
        if head.get("offset") != n:
            raise CorruptCheckpoint(f"layer {i} offset does not match the token count")
        kv_len = min(n, window) if cls == "WindowKVCache" else n
        for part in ("k", "v"):
            _check_part(f"{i}.{part}", head.get(part) or {}, kv_len, index)


def _check_part(name: str, p: dict, kv_len: int, index: dict) -> None:
    shape, enc = p.get("shape"), p.get("enc")
    if not _is_shape(shape) or len(shape) != 4 or shape[2] != kv_len:
        raise CorruptCheckpoint(f"tensor {name!r} does not cover the checkpoint's tokens")
    if enc in ("raw", "fp16"):
        t = index.get(name)
        if t is None or t["shape"] != shape or (enc == "fp16" and t["dtype"] != "F16"):
            raise CorruptCheckpoint(f"tensor {name!r} is missing or has the wrong shape")
        return
    g, bits = p.get("group_size"), p.get("bits")
    if enc not in ("q8", "q4", "mlx") or bits not in (2, 3, 4, 5, 6, 8) or not g:
        raise CorruptCheckpoint(f"tensor {name!r} has an unknown encoding")
    q, s, b = (index.get(f"{name}.{x}") for x in "qsb")
    lead, d = shape[:-1], shape[-1]
    if (q is None or s is None or b is None or q["dtype"] != "U32"
            or q["shape"] != [*lead, d * bits // 32]
            or s["shape"] != [*lead, d // g] or b["shape"] != [*lead, d // g]):
        raise CorruptCheckpoint(f"quantized tensor {name!r} has the wrong shapes")
