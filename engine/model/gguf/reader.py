"""A GGUF (v2/v3) parser: header, metadata, tensor infos, memory-mapped tensor bytes.

Layout (little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count,
then the key/value pairs, then one info per tensor (name, n_dims, dims, ggml type, offset
relative to the data section), padding to ``general.alignment`` (default 32), tensor data.
Every problem with the file becomes a one-sentence ``ModelLoadError`` naming it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.model.gguf.ggml_types import GGML_TYPES, GGMLType

import numpy as np

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# Numeric arrays at least this long come back as numpy arrays (token scores, types...).
NUMPY_ARRAY_MIN = 64

# Metadata value types: id -> (name, struct format or None for string/array).
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("uint8", "<B"), 1: ("int8", "<b"), 2: ("uint16", "<H"), 3: ("int16", "<h"),
    4: ("uint32", "<I"), 5: ("int32", "<i"), 6: ("float32", "<f"), 7: ("bool", "<?"),
    10: ("uint64", "<Q"), 11: ("int64", "<q"), 12: ("float64", "<d"),
}
_STRING, _ARRAY = 8, 9
_NUMPY_DTYPES = {k: np.dtype(fmt) for k, (_, fmt) in _SCALARS.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: ``shape`` is in numpy (row-major) order, i.e. ggml's dims reversed."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def n_values(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class GGUFFile:
    """A parsed GGUF file. Tensor bytes are views into a read-only memory map."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    _map: mmap.mmap | None = field(default=None, repr=False)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of tensor ``name`` as a uint8 array (a view; no copy)."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path}: has no tensor named {name}.")
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None


class _Cursor:
    """Sequential little-endian reads from a buffer; running off the end is 'truncated'."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {problem}.")

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"file is truncated (ends inside the {what})")
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt: str, what: str) -> Any:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        start = self.take(n, what)
        return bytes(self.buf[start : start + n]).decode("utf-8", errors="replace")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the GGUF file at ``path``; raise ``ModelLoadError`` if it is not a valid one."""
    path = Path(path)
    buf = _open_map(path)
    cur = _Cursor(buf, path)
    if cur.size < 4 or bytes(buf[:4]) != MAGIC:
        raise cur.fail("not a GGUF file (bad magic bytes)")
    cur.pos = 4
    version = cur.unpack("<I", "header")
    if version not in SUPPORTED_VERSIONS:
        raise cur.fail(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.unpack("<Q", "header")
    n_kv = cur.unpack("<Q", "header")
    # Each entry needs at least 8+4 bytes; a bigger count than fits is a corrupt header.
    if n_tensors * 12 > cur.size or n_kv * 12 > cur.size:
        raise cur.fail(f"corrupt header ({n_tensors} tensors, {n_kv} metadata entries)")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata")
        vtype = cur.unpack("<I", "metadata")
        metadata[key] = _read_value(cur, vtype, key)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment must be a power of two, got {alignment!r}")

    raw_infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, gtype, rel in raw_infos:
        if name in tensors:
            raise cur.fail(f"tensor {name} appears twice")
        tensors[name] = _check_tensor(cur, name, shape, gtype, rel, data_offset, alignment)
    return GGUFFile(path, version, metadata, tensors, alignment, data_offset, buf)


def _open_map(path: Path) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            if f.seek(0, 2) == 0:
                raise ModelLoadError(f"{path}: file is empty.")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no such file.") from None
    except IsADirectoryError:
        raise ModelLoadError(f"{path}: is a directory, expected a .gguf file.") from None
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot be read ({e.strerror or e}).") from None


def _read_value(cur: _Cursor, vtype: int, key: str) -> Any:
    if vtype in _SCALARS:
        return cur.unpack(_SCALARS[vtype][1], f"value of {key}")
    if vtype == _STRING:
        return cur.string(f"value of {key}")
    if vtype == _ARRAY:
        etype = cur.unpack("<I", f"value of {key}")
        count = cur.unpack("<Q", f"value of {key}")
        if etype in _SCALARS:
            return _read_numeric_array(cur, etype, count, key)
        if etype == _STRING:
            return _read_string_array(cur, count, key)
        if etype != _ARRAY:
            raise cur.fail(f"metadata key {key} has an array of unknown value type {etype}")
        if count * 8 > cur.size - cur.pos:  # each string/array needs >= 8 bytes
            raise cur.fail(f"file is truncated (ends inside the value of {key})")
        return [_read_value(cur, etype, key) for _ in range(count)]
    raise cur.fail(f"metadata key {key} has unknown value type {vtype}")


def _read_string_array(cur: _Cursor, count: int, key: str) -> list[str]:
    # Hot path (vocabularies of 100k+ tokens): plain locals instead of cursor methods.
    buf, pos, size = cur.buf, cur.pos, cur.size
    if count * 8 > size - pos:
        raise cur.fail(f"file is truncated (ends inside the value of {key})")
    length = struct.Struct("<Q").unpack_from
    out = []
    for _ in range(count):
        if pos + 8 > size:
            raise cur.fail(f"file is truncated (ends inside the value of {key})")
        (n,) = length(buf, pos)
        end = pos + 8 + n
        if end > size:
            raise cur.fail(f"file is truncated (ends inside the value of {key})")
        out.append(buf[pos + 8 : end].decode("utf-8", errors="replace"))
        pos = end
    cur.pos = pos
    return out


def _read_numeric_array(cur: _Cursor, etype: int, count: int, key: str) -> Any:
    dtype = _NUMPY_DTYPES[etype]
    start = cur.take(count * dtype.itemsize, f"value of {key}")
    arr = np.frombuffer(cur.buf, dtype=dtype, count=count, offset=start).copy()
    if count >= NUMPY_ARRAY_MIN:
        return arr
    return arr.tolist()


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string("tensor infos")
    n_dims = cur.unpack("<I", "tensor infos")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name} has {n_dims} dimensions (at most {MAX_DIMS} allowed)")
    dims = [cur.unpack("<Q", "tensor infos") for _ in range(n_dims)]
    gtype = cur.unpack("<I", "tensor infos")
    rel = cur.unpack("<Q", "tensor infos")
    return name, tuple(reversed(dims)), gtype, rel


def _check_tensor(
    cur: _Cursor, name: str, shape: tuple[int, ...], gtype: int, rel: int,
    data_offset: int, alignment: int,
) -> TensorInfo:
    ggml_type = GGML_TYPES.get(gtype)
    if ggml_type is None:
        raise cur.fail(f"tensor {name} has unknown ggml type {gtype}")
    if shape[-1] % ggml_type.block_size:
        raise cur.fail(
            f"tensor {name} has rows of {shape[-1]} values, not a multiple of the "
            f"{ggml_type.name} block size {ggml_type.block_size}"
        )
    if rel % alignment:
        raise cur.fail(f"tensor {name} data offset {rel} is not aligned to {alignment} bytes")
    n_values = int(np.prod(shape, dtype=object))
    nbytes = ggml_type.nbytes(n_values)
    start = data_offset + rel
    if start + nbytes > cur.size:
        raise cur.fail(
            f"file is truncated (tensor {name} needs bytes {start}..{start + nbytes}, "
            f"the file has {cur.size})"
        )
    return TensorInfo(name, shape, ggml_type, start, nbytes)
