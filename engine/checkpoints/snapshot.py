"""Take a KV snapshot from live caches and rebuild fresh caches from one (engine thread only).

A snapshot holds new array handles that view the live buffers (``keys[..., :offset, :]``).
MLX arrays are values: the live cache's later writes either copy (the buffer is shared, so it
cannot be donated) or rebind its own handle, so a snapshot never changes after it is taken.
Caches are read through ``CheckpointCache`` (engine.generation's caches declare their kind), so
this package imports no cache class of the engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from engine.checkpoints import format as fmt
from engine.checkpoints.format import HostCheckpoint, HostLayer

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache

CLASSES = ("StaticKVCache", "WindowKVCache", "QuantizedKVCache")
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16,
           "uint8": mx.uint8}  # uint8: the CPU's 8-bit KV rows (kv_cache.Q8), stored as they are


class CheckpointCache(Protocol):
    """What a layer cache offers to be checkpointed (besides mlx_lm's ``QuantizedKVCache``).

    ``checkpoint_kind`` "StaticKVCache": ``keys``/``values`` buffers (B, H, capacity, D) valid up
    to ``offset``, growth block ``step``. "WindowKVCache": a ring of ``window`` slots; ``state``
    gives the last min(offset, window) positions in time order and ``restore_ordered(keys,
    values, offset)`` refills it."""

    checkpoint_kind: ClassVar[str]
    offset: int


class UnsupportedCache(ValueError):
    """A cache type the checkpoint store cannot snapshot (it is then simply not stored)."""


@dataclass
class LayerState:
    cls: str  # one of CLASSES
    offset: int  # tokens the layer has seen
    window: int | None  # WindowKVCache ring size
    keys: tuple[mx.array, ...]  # (k,) for float caches; (packed, scales, biases) when quantized
    values: tuple[mx.array, ...]
    quant: tuple[int, int] | None = None  # QuantizedKVCache (group_size, bits)
    # StaticKVCache: the live (keys, values) buffers the views are of, for ``restore(take=True)``
    base: tuple[mx.array, mx.array] | None = None

    @property
    def kv_len(self) -> int:
        return int(self.keys[0].shape[2])


@dataclass
class Snapshot:
    layers: list[LayerState]
    nbytes: int  # memory the snapshot keeps alive (whole live buffers, not just the views)

    @property
    def offset(self) -> int:
        return self.layers[0].offset

    @property
    def trimmable(self) -> bool:
        return all(layer.cls != "WindowKVCache" for layer in self.layers)


def layout(cache: list) -> list[tuple[str, int | None]]:
    """(class name, window) per layer: what a checkpoint must match to restore into ``cache``."""
    return [(name, getattr(c, "window", None) if name == "WindowKVCache" else None)
            for c, name in ((c, _class_name(c)) for c in cache)]


def _class_name(c) -> str:
    kind = getattr(type(c), "checkpoint_kind", None)
    if kind in ("StaticKVCache", "WindowKVCache"):
        return kind
    if isinstance(c, QuantizedKVCache):
        return "QuantizedKVCache"
    raise UnsupportedCache(f"cannot checkpoint a {type(c).__name__}")


def capture(cache: list) -> Snapshot:
    """Snapshot every layer of ``cache`` at its current offset (cheap: views, no copies)."""
    layers: list[LayerState] = []
    held = 0
    for c in cache:
        name = _class_name(c)
        off = int(c.offset)
        if name == "WindowKVCache":
            state = c.state  # time-ordered last min(offset, window) positions (new arrays)
            if not state:
                raise UnsupportedCache("empty window cache")
            layers.append(LayerState(name, off, c.window, (state[0],), (state[1],)))
            held += state[0].nbytes + state[1].nbytes
        elif name == "StaticKVCache":
            layers.append(LayerState(name, off, None, (c.keys[..., :off, :],), (c.values[..., :off, :],),
                                     base=(c.keys, c.values)))
            held += c.keys.nbytes + c.values.nbytes
        else:
            # Always slice: the mlx_lm state property can hand back the live handles, and the
            # cache writes into those in place (``x[...] = y`` rebinds the same Python object).
            k = tuple(x[..., :off, :] for x in c.keys)
            v = tuple(x[..., :off, :] for x in c.values)
            layers.append(LayerState(name, off, None, k, v, (c.group_size, c.bits)))
            held += sum(x.nbytes for x in (*c.keys, *c.values))
    offsets = {layer.offset for layer in layers}
    if len(offsets) != 1:
        raise UnsupportedCache(f"layers disagree on the offset: {sorted(offsets)}")
    mx.eval([[*layer.keys, *layer.values] for layer in layers])
    return Snapshot(layers, held)


def restore(snap: Snapshot, use: int, fresh: list, take: bool = False) -> list:
    """Fill ``fresh`` (empty caches of the same layout) with the first ``use`` tokens of ``snap``.

    Buffers are new arrays the caller owns; Static caches get capacity rounded up to ``step``.
    ``take``: Static layers whose live buffers ``snap`` kept (``can_take``) get those buffers
    themselves, no copy; the caller then drops ``snap``, so the cache's first write after
    ``use`` goes in place (MLX donates a buffer nothing else holds, and copies one still held,
    e.g. by a pending SSD write).
    """
    if use > snap.offset or (use < snap.offset and not snap.trimmable):
        raise ValueError(f"cannot restore {use} of {snap.offset} tokens from this checkpoint")
    out = []
    for layer, c in zip(snap.layers, fresh, strict=True):
        if layer.cls == "StaticKVCache":
            dtype = getattr(c, "dtype", None)  # a float setting; Q8 rows are stored as they are
            dtype = dtype if isinstance(dtype, mx.Dtype) else None
            if take and layer.base is not None and (dtype is None or dtype == layer.base[0].dtype):
                c.keys, c.values = layer.base
            else:
                c.keys = _padded(layer.keys[0], use, c.step, dtype)
                c.values = _padded(layer.values[0], use, c.step, dtype)
            c.offset = use
        elif layer.cls == "WindowKVCache":
            c.restore_ordered(mx.array(layer.keys[0]), mx.array(layer.values[0]), layer.offset)
        else:
            c.keys = tuple(mx.array(x[..., :use, :]) for x in layer.keys)
            c.values = tuple(mx.array(x[..., :use, :]) for x in layer.values)
            c.offset = use
        out.append(c)
    mx.eval([_arrays(c) for c in out])
    return out


def can_take(snap: Snapshot) -> bool:
    """Whether ``restore(take=True)`` hands ``snap``'s buffers over for every layer."""
    return all(layer.cls == "StaticKVCache" and layer.base is not None for layer in snap.layers)


def _padded(x: mx.array, use: int, step: int, dtype: mx.Dtype | None = None) -> mx.array:
    """A new buffer holding ``x[..., :use, :]`` with room for at least one more token, in the
    cache's storage ``dtype`` (a float32 checkpoint restored into float16 caches is stored as
    the live cache would have stored it: rounded once)."""
    cap = (use // step + 1) * step
    B, H, _, D = x.shape
    head = x[..., :use, :] if dtype is None or x.dtype == dtype else x[..., :use, :].astype(dtype)
    return mx.concatenate([head, mx.zeros((B, H, cap - use, D), head.dtype)], axis=2)


def _arrays(c) -> list[mx.array]:
    k, v = c.keys, c.values
    return [*(k if isinstance(k, tuple) else (k,)), *(v if isinstance(v, tuple) else (v,))]


def host_view(x: mx.array) -> np.ndarray:
    """A numpy view of an evaluated array (bfloat16 as its uint16 bits; numpy has no bf16)."""
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
        mx.eval(x)
    return np.asarray(x)


def load_file(path: Path, check: Callable[[fmt.Header], None]) -> fmt.Loaded:
    """Read and fully verify a checkpoint file straight into MLX arrays.

    ``mx.load`` reads the safetensors payload into MLX buffers (one copy, no numpy staging);
    the SHA-256 then runs over host views of those buffers in file order.
    """
    header, _ = fmt.scan(path, check)
    try:
        arrays = mx.load(str(path))
        mx.eval(list(arrays.values()))
    except (RuntimeError, ValueError, OSError) as e:
        raise fmt.CorruptCheckpoint(f"tensors cannot be read ({e})") from None
    if set(arrays) != set(header.index):
        raise fmt.CorruptCheckpoint("the tensor table changed while reading")
    if fmt.payload_digest(header, {k: host_view(a) for k, a in arrays.items()}) != header.meta.get("payload_sha256"):
        raise fmt.CorruptCheckpoint("payload checksum mismatch")
    tokens = np.array(arrays.pop("tokens"), dtype=np.int32)
    return fmt.Loaded(header.meta, tokens, arrays)


def from_file(layers_meta: list[dict], tensors: dict[str, mx.array]) -> Snapshot:
    """A snapshot from a verified checkpoint file's tensors (decoded to the live dtype)."""
    layers = []
    nbytes = 0
    for i, head in enumerate(layers_meta):
        dtype = _DTYPES[head["dtype"]]
        parts = []
        for part in ("k", "v"):
            arrays = _decode(f"{i}.{part}", head[part], dtype, tensors)
            nbytes += sum(a.nbytes for a in arrays)
            parts.append(arrays)
        quant = (head["k"]["group_size"], head["k"]["bits"]) if head["k"]["enc"] == "mlx" else None
        layers.append(LayerState(head["class"], head["offset"], head["window"], parts[0], parts[1], quant))
    mx.eval([[*layer.keys, *layer.values] for layer in layers])
    return Snapshot(layers, nbytes)


def _decode(name: str, p: dict, dtype: mx.Dtype, tensors: dict[str, mx.array]) -> tuple[mx.array, ...]:
    enc = p["enc"]
    if enc == "raw":
        return (tensors[name],)
    if enc == "fp16":
        return (tensors[name].astype(dtype),)
    q, s, b = (tensors[f"{name}.{x}"] for x in "qsb")
    if enc == "mlx":  # a quantized live cache, kept as it was
        return q, s, b
    # Scales in the live dtype: dequantizing in float16 would add its own rounding for fp32 caches.
    return (mx.dequantize(q, s.astype(dtype), b.astype(dtype), group_size=p["group_size"], bits=p["bits"]),)


def to_host(snap: Snapshot, cid: str, tokens: np.ndarray, session_id: str | None,
            created: float) -> HostCheckpoint:
    """Numpy views of ``snap`` for the writer thread (no copies; they keep the buffers alive)."""
    layers = []
    nbytes = tokens.nbytes
    for layer in snap.layers:
        keys = tuple(host_view(x) for x in layer.keys)
        values = tuple(host_view(x) for x in layer.values)
        nbytes += sum(a.nbytes for a in (*keys, *values))
        dtype = layer.keys[1 if layer.quant else 0].dtype
        layers.append(HostLayer(layer.cls, layer.offset, layer.window, _dtype_name(dtype),
                                keys, values, layer.quant))
    return HostCheckpoint(cid, tokens, layers, session_id, created, nbytes)


def _dtype_name(dtype: mx.Dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise UnsupportedCache(f"KV dtype {dtype} is not supported")
