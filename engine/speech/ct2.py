"""Read a CTranslate2 Whisper ``model.bin`` and map it onto our MLX parameter names.

The file is: ``u32 version``, ``str spec_name`` (v>=2), ``u32 spec_revision``,
``u32 n_variables``, then per variable ``str name``, ``u8 rank``, ``u32 dims[rank]``,
``u8 dtype``, ``u32 n_bytes``, raw little-endian data; then ``u32 n_aliases`` and
``(str alias, str target)`` pairs. Strings are ``u16 length`` + bytes ending in NUL.

Layout differences handled here: self-attention Q/K/V are one fused matrix
(``linear_0``), cross-attention K/V are fused (``linear_1``), key biases are stored as
zeros (Whisper's keys have none), conv weights are ``(out, in, k)`` where MLX wants
``(out, k, in)``, and the output projection is an alias of the token embedding.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

from engine.errors import ModelLoadError

import numpy as np

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def read_model_bin(path: Path) -> tuple[str, dict[str, np.ndarray], dict[str, str]]:
    """``(spec_name, variables, aliases)`` of a CTranslate2 model file."""
    data = Path(path).read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        vals = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return vals[0] if len(vals) == 1 else vals

    def text() -> str:
        nonlocal pos
        n = take("H")
        s = data[pos:pos + n].rstrip(b"\0").decode("utf-8")
        pos += n
        return s

    try:
        version = take("I")
        if version > 6:
            raise ModelLoadError(f"{path}: CTranslate2 binary version {version} is not supported")
        spec = text() if version >= 2 else ""
        if version >= 2:
            take("I")  # spec revision
        variables: dict[str, np.ndarray] = {}
        for _ in range(take("I")):
            name = text()
            rank = take("B")
            shape = tuple(take("I") for _ in range(rank))
            dtype_id, n_bytes = take("B"), take("I")
            if dtype_id not in _DTYPES:
                raise ModelLoadError(f"{path}: variable {name} has unsupported dtype id {dtype_id}")
            variables[name] = np.frombuffer(data, _DTYPES[dtype_id], n_bytes // np.dtype(_DTYPES[dtype_id]).itemsize, pos).reshape(shape)
            pos += n_bytes
        aliases = {}
        if version >= 3:
            for _ in range(take("I")):
                alias = text()
                aliases[alias] = text()
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: truncated or corrupt CTranslate2 model file ({e})") from None
    return spec, variables, aliases


def _scalar(v: dict[str, np.ndarray], name: str, path: Path) -> int:
    if name not in v:
        raise ModelLoadError(f"{path}: missing {name}; not a CTranslate2 Whisper model")
    return int(v[name].reshape(-1)[0])


def convert_ct2_whisper(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(dims, weights)`` for :class:`WhisperDims` / our parameter names, in float16."""
    spec, v, aliases = read_model_bin(path)
    if spec and spec != "WhisperSpec":
        raise ModelLoadError(f"{path}: a CTranslate2 {spec} model, not Whisper")
    for name, arr in v.items():
        if name.endswith("/weight") and arr.dtype not in (np.float16, np.float32):
            raise ModelLoadError(f"{path}: quantized CTranslate2 weights ({arr.dtype}) are not supported")
    if _scalar(v, "decoder/activation", path) != 3 or _scalar(v, "decoder/pre_norm", path) != 1:
        raise ModelLoadError(f"{path}: unexpected decoder activation/normalisation for Whisper")
    target = aliases.get("decoder/projection/weight")
    if "decoder/projection/weight" in v or target not in (None, "decoder/embeddings/weight"):
        raise ModelLoadError(f"{path}: untied output projection is not supported")

    def layers(prefix: str) -> int:
        pat = re.compile(rf"^{prefix}/layer_(\d+)/")
        return 1 + max((int(m.group(1)) for n in v if (m := pat.match(n))), default=-1)

    emb = v["decoder/embeddings/weight"]
    dims = {
        "n_mels": v["encoder/conv1/weight"].shape[1],
        "n_audio_ctx": v["encoder/position_encodings/encodings"].shape[0],
        "n_audio_state": v["encoder/conv1/weight"].shape[0],
        "n_audio_head": _scalar(v, "encoder/num_heads", path),
        "n_audio_layer": layers("encoder"),
        "n_vocab": emb.shape[0],
        "n_text_ctx": v["decoder/position_encodings/encodings"].shape[0],
        "n_text_state": emb.shape[1],
        "n_text_head": _scalar(v, "decoder/num_heads", path),
        "n_text_layer": layers("decoder"),
    }
    out: dict[str, np.ndarray] = {}
    try:
        for conv in ("conv1", "conv2"):
            out[f"encoder.{conv}.weight"] = v[f"encoder/{conv}/weight"].transpose(0, 2, 1)
            out[f"encoder.{conv}.bias"] = v[f"encoder/{conv}/bias"]
        out["encoder.positional_embedding"] = v["encoder/position_encodings/encodings"]
        _layer_norm(out, "encoder.ln_post", v, "encoder/layer_norm")
        out["decoder.token_embedding.weight"] = emb
        out["decoder.positional_embedding"] = v["decoder/position_encodings/encodings"]
        _layer_norm(out, "decoder.ln", v, "decoder/layer_norm")
        for side, n in (("encoder", dims["n_audio_layer"]), ("decoder", dims["n_text_layer"])):
            for i in range(n):
                src, dst = f"{side}/layer_{i}", f"{side}.blocks.{i}"
                _self_attention(out, f"{dst}.attn", v, f"{src}/self_attention")
                _layer_norm(out, f"{dst}.attn_ln", v, f"{src}/self_attention/layer_norm")
                _linear(out, f"{dst}.mlp1", v, f"{src}/ffn/linear_0")
                _linear(out, f"{dst}.mlp2", v, f"{src}/ffn/linear_1")
                _layer_norm(out, f"{dst}.mlp_ln", v, f"{src}/ffn/layer_norm")
                if side == "decoder":
                    _cross_attention(out, f"{dst}.cross_attn", v, f"{src}/attention")
                    _layer_norm(out, f"{dst}.cross_attn_ln", v, f"{src}/attention/layer_norm")
    except KeyError as e:
        raise ModelLoadError(f"{path}: missing variable {e}; not a CTranslate2 Whisper model") from None
    return dims, {k: np.ascontiguousarray(a, dtype=np.float16) for k, a in out.items()}


def _linear(out: dict, dst: str, v: dict, src: str) -> None:
    out[f"{dst}.weight"] = v[f"{src}/weight"]
    out[f"{dst}.bias"] = v[f"{src}/bias"]


def _layer_norm(out: dict, dst: str, v: dict, src: str) -> None:
    out[f"{dst}.weight"] = v[f"{src}/gamma"]
    out[f"{dst}.bias"] = v[f"{src}/beta"]


def _self_attention(out: dict, dst: str, v: dict, src: str) -> None:
    w, b = v[f"{src}/linear_0/weight"], v[f"{src}/linear_0/bias"]
    q, k, val = np.split(w, 3, axis=0)
    qb, _kb, vb = np.split(b, 3)  # the key bias is stored as zeros (and would cancel in softmax)
    out[f"{dst}.query.weight"], out[f"{dst}.query.bias"] = q, qb
    out[f"{dst}.key.weight"] = k
    out[f"{dst}.value.weight"], out[f"{dst}.value.bias"] = val, vb
    _linear(out, f"{dst}.out", v, f"{src}/linear_1")


def _cross_attention(out: dict, dst: str, v: dict, src: str) -> None:
    _linear(out, f"{dst}.query", v, f"{src}/linear_0")
    k, val = np.split(v[f"{src}/linear_1/weight"], 2, axis=0)
    _kb, vb = np.split(v[f"{src}/linear_1/bias"], 2)
    out[f"{dst}.key.weight"] = k
    out[f"{dst}.value.weight"], out[f"{dst}.value.bias"] = val, vb
    _linear(out, f"{dst}.out", v, f"{src}/linear_2")
