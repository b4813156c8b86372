"""A minimal GGUF v3 writer: for tests and tiny fixture models, not for conversion.

Tensors are given as already-encoded bytes plus their ggml type and numpy-order shape;
metadata values are typed from Python (see ``_value_type``) unless wrapped in ``Typed``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.atomic import atomic_write_bytes
from engine.model.gguf.ggml_types import BY_NAME

import numpy as np

_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
        10: "<Q", 11: "<q", 12: "<d"}
_NP_TYPE = {np.dtype(np.uint8): 0, np.dtype(np.int8): 1, np.dtype(np.uint16): 2,
            np.dtype(np.int16): 3, np.dtype(np.uint32): 4, np.dtype(np.int32): 5,
            np.dtype(np.float32): 6, np.dtype(np.bool_): 7, np.dtype(np.uint64): 10,
            np.dtype(np.int64): 11, np.dtype(np.float64): 12}


@dataclass(frozen=True)
class Typed:
    """A metadata value with an explicit GGUF value type id (e.g. 10 for uint64)."""

    type_id: int
    value: Any


@dataclass
class RawTensor:
    name: str
    data: bytes
    type_name: str | int  # ggml type name, e.g. "Q4_K" (or a raw type id)
    shape: tuple[int, ...]  # numpy order (ggml dims reversed)


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value_type(v: Any) -> int:
    if isinstance(v, bool):
        return 7
    if isinstance(v, int):
        return 4 if 0 <= v < 2**32 else 11
    if isinstance(v, float):
        return 6
    if isinstance(v, str):
        return 8
    if isinstance(v, (list, tuple, np.ndarray)):
        return 9
    raise TypeError(f"no GGUF type for {type(v).__name__}")


def _value(vtype: int, v: Any) -> bytes:
    if vtype in _FMT:
        return struct.pack(_FMT[vtype], v)
    if vtype == 8:
        return _string(v)
    if isinstance(v, np.ndarray):
        etype = _NP_TYPE[v.dtype]
        return struct.pack("<IQ", etype, len(v)) + v.astype(_FMT[etype]).tobytes()
    etype = _value_type(v[0]) if len(v) else 4
    if etype == 4 and any(isinstance(x, int) and not 0 <= x < 2**32 for x in v):
        etype = 11
    return struct.pack("<IQ", etype, len(v)) + b"".join(_value(etype, x) for x in v)


def encode_gguf(
    metadata: dict[str, Any], tensors: Iterable[RawTensor], alignment: int = 32,
    version: int = 3,
) -> bytes:
    """The bytes of a GGUF file with these metadata entries and tensors."""
    tensors = list(tensors)
    meta = dict(metadata)
    if alignment != 32:
        meta["general.alignment"] = Typed(4, alignment)
    out = [b"GGUF", struct.pack("<IQQ", version, len(tensors), len(meta))]
    for key, v in meta.items():
        vtype, v = (v.type_id, v.value) if isinstance(v, Typed) else (_value_type(v), v)
        out.append(_string(key) + struct.pack("<I", vtype) + _value(vtype, v))
    offset, blobs = 0, []
    for t in tensors:
        dims = list(reversed(t.shape))
        out.append(_string(t.name) + struct.pack("<I", len(dims)))
        out.append(struct.pack(f"<{len(dims)}Q", *dims))
        type_id = BY_NAME[t.type_name].id if isinstance(t.type_name, str) else t.type_name
        out.append(struct.pack("<IQ", type_id, offset))
        pad = -len(t.data) % alignment
        blobs.append(t.data + b"\0" * pad)
        offset += len(t.data) + pad
    head = b"".join(out)
    head += b"\0" * (-len(head) % alignment)
    return head + b"".join(blobs)


def write_gguf(
    path: str | Path, metadata: dict[str, Any], tensors: Iterable[RawTensor],
    alignment: int = 32,
) -> Path:
    """Write a GGUF file atomically; returns its path."""
    path = Path(path)
    atomic_write_bytes(path, encode_gguf(metadata, tensors, alignment))
    return path
