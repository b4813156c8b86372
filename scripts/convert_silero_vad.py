#!/usr/bin/env python
"""One-off: convert Silero VAD's 16 kHz ONNX weights to ``assets/silero_vad_16k.safetensors``.

Needs the dev-only ``onnx`` package (``.venv/bin/pip install onnx``) and the ``silero-vad``
pip package (for ``silero_vad/data/silero_vad.onnx``); the runtime needs neither.

The ONNX graph branches on the sample rate; the 16 kHz branch (``sr == 16000``) holds the
weights as Constant nodes: an STFT basis (258, 1, 256) applied as a stride-128 conv, four
conv blocks (reparametrised to plain conv + bias), an LSTM cell (PyTorch gate order
i, f, g, o) and a 1x1 conv decoder. Conv weights are stored here in MLX's (out, k, in)
layout so the runtime needs no transposes.

Usage: .venv/bin/python scripts/convert_silero_vad.py [--onnx PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# ONNX constant name suffix -> (our name, transpose for MLX conv layout)
_NAMES = {
    "stft.forward_basis_buffer": ("stft.weight", True),
    "encoder.0.reparam_conv.weight": ("encoder.0.weight", True),
    "encoder.0.reparam_conv.bias": ("encoder.0.bias", False),
    "encoder.1.reparam_conv.weight": ("encoder.1.weight", True),
    "encoder.1.reparam_conv.bias": ("encoder.1.bias", False),
    "encoder.2.reparam_conv.weight": ("encoder.2.weight", True),
    "encoder.2.reparam_conv.bias": ("encoder.2.bias", False),
    "encoder.3.reparam_conv.weight": ("encoder.3.weight", True),
    "encoder.3.reparam_conv.bias": ("encoder.3.bias", False),
    "decoder.rnn.weight_ih": ("lstm.weight_ih", False),
    "decoder.rnn.weight_hh": ("lstm.weight_hh", False),
    "decoder.rnn.bias_ih": ("lstm.bias_ih", False),
    "decoder.rnn.bias_hh": ("lstm.bias_hh", False),
    "decoder.decoder.2.weight": ("head.weight", True),
    "decoder.decoder.2.bias": ("head.bias", False),
}


def default_onnx() -> Path:
    spec = importlib.util.find_spec("silero_vad")  # locate only: importing it needs torch
    if spec is None or not spec.submodule_search_locations:
        sys.exit("silero-vad is not installed; pass --onnx PATH")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "silero_vad.onnx"


def sixteen_khz_branch(model):
    """The subgraph taken when ``sr == 16000`` (the top-level If's then-branch)."""
    for node in model.graph.node:
        if node.op_type == "If":
            for attr in node.attribute:
                if attr.name == "then_branch":
                    return attr.g
    sys.exit("unexpected ONNX graph: no sample-rate branch found")


def extract(onnx_path: Path) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    graph = sixteen_khz_branch(onnx.load(str(onnx_path)))
    found: dict[str, np.ndarray] = {}
    for node in graph.node:
        if node.op_type != "Constant":
            continue
        for suffix, (name, to_mlx) in _NAMES.items():
            if node.output[0].endswith("__" + suffix):
                arr = numpy_helper.to_array(node.attribute[0].t).astype(np.float32)
                found[name] = np.ascontiguousarray(arr.transpose(0, 2, 1) if to_mlx else arr)
    missing = sorted({n for n, _ in _NAMES.values()} - set(found))
    if missing:
        sys.exit(f"{onnx_path}: constants not found: {', '.join(missing)}")
    if found["stft.weight"].shape != (258, 256, 1):
        sys.exit(f"{onnx_path}: unexpected 16 kHz STFT basis shape {found['stft.weight'].shape}")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--onnx", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "assets" / "silero_vad_16k.safetensors")
    args = ap.parse_args(argv)
    src = args.onnx or default_onnx()
    weights = extract(src)
    from safetensors.numpy import save

    meta = {
        "source": f"silero-vad {src.name}",
        "source_sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
        "license": "MIT, Copyright (c) 2020-present Silero Team (see SILERO_VAD_LICENSE.txt)",
    }
    sys.path.insert(0, str(ROOT))
    from engine.atomic import atomic_write_bytes

    atomic_write_bytes(args.out, save(weights, metadata=meta))
    args.out.chmod(0o644)  # temp files are created 0600; this one is a shipped asset
    total = sum(a.size for a in weights.values())
    print(f"wrote {args.out} ({len(weights)} tensors, {total} parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
