"""The engine's CPU kernels: an MLX C++ extension (``_ext``) with fast quantized matmul.

MLX's CPU backend on x86 runs scalar, single-threaded kernels; this extension adds MLX
primitives with AVX2/FMA kernels (VNNI where the CPU has it) on a small persistent thread
pool. They are used only when all of these hold, else MLX's own ops run (``status()`` says
why, once): the default device is the CPU, the CPU has AVX2+FMA (checked here, before the
module is loaded, since it is built with those instructions), ``MLXTERM_KERNELS`` is not
off (engine.settings), and the module was built (``python -m engine.kernels.build``; setup.sh does it).
Layouts, dispatch and how to add a kernel: docs/kernels.md.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from engine.settings import current

import mlx.core as mx

_state: dict[str, Any] = {"checked": False, "ext": None, "reason": None}

# MLX affine formats the quantized matmul kernel reads directly.
QMM_BITS = (4, 5, 8)
QMM_GROUPS = (32, 64, 128)


def _cpu_flags() -> set[str]:
    if not sys.platform.startswith("linux"):
        return set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _load() -> Any:
    if _state["checked"]:
        return _state["ext"]
    _state["checked"] = True
    wanted = current().kernels
    if not wanted.enabled:
        _state["reason"] = "turned off by MLXTERM_KERNELS=off"
        return None
    flags = _cpu_flags()
    if not {"avx2", "fma", "f16c", "bmi2"} <= flags:
        _state["reason"] = "this CPU lacks AVX2/FMA (or is not x86 Linux)"
        return None
    try:
        ext = importlib.import_module("engine.kernels._ext")
    except ImportError as e:
        _state["reason"] = (
            "the kernel extension is not built (run ./setup.sh or "
            f"python -m engine.kernels.build): {e}"
        )
        return None
    if hasattr(ext, "configure"):
        ext.configure(isa=wanted.isa)  # before any kernel call fixes the instruction set
    elif wanted.isa:  # a build from before configure(): rebuild to narrow it
        _state["reason"] = "the kernel extension is out of date (python -m engine.kernels.build)"
        return None
    _state["ext"] = ext
    return ext


def _required() -> Any:
    """The extension, for a kernel call: raises (saying why) when it cannot run."""
    ext = _load()
    if ext is None:
        raise RuntimeError(f"CPU kernels unavailable: {_state['reason']}")
    return ext


def available() -> bool:
    """True when the kernels can run for the current default device."""
    return _load() is not None and mx.default_device() == mx.cpu


def status() -> dict[str, Any]:
    """{"available", "reason" (why not, else None), "isa", "amx", "prefill", "activations",
    "threads"}; "amx": many-row matmuls run on AMX-INT8 tiles (src/qmm_amx.cpp); "prefill": the
    path non-exact matmuls of 16+ rows take now -- "amx", "vnni512" (src/qmm_gemm512.cpp),
    "int8 many rows" (AVX2 / AVX-VNNI: the decode row path over every row; all three the
    decode rows' bits) or "float panels"; "activations": what the int8 paths quantize
    activations to, "int8" or "int16" (``set_x16``)."""
    ext = _load()
    on_cpu = mx.default_device() == mx.cpu
    reason = _state["reason"] if ext is None else (None if on_cpu else "default device is not the CPU")
    return {
        "available": ext is not None and on_cpu,
        "reason": reason,
        "isa": ext.isa() if ext is not None else None,
        "amx": ext.amx() if ext is not None else False,
        "prefill": prefill_path(),
        "activations": ("int16" if ext.x16() else "int8") if ext is not None else None,
        "threads": ext.threads() if ext is not None else None,
    }


def note() -> str | None:
    """One line for the user, the first time only, when the CPU backend runs without the
    kernels; else None."""
    if mx.default_device() != mx.cpu or available() or _state.get("said"):
        return None
    _state["said"] = True
    return f"CPU kernels off ({_state['reason']}); running the fp32 + OpenBLAS path"


def set_amx(on: bool) -> bool:
    """Run non-exact many-row matmuls on AMX-INT8 tiles (where the CPU and OS allow) or on the
    float panels (A/B measurements); returns the previous setting."""
    ext = _load()
    return bool(ext.set_amx(on)) if ext is not None else False


def set_shared_job(on: bool) -> bool:
    """Hand the many-row q/k/v (gate/up) matmuls on one input to the kernel pool as one job (the
    same bits, fewer waits) or one job per matmul (A/B measurements); returns the previous
    setting; on by default."""
    ext = _load()
    return bool(ext.set_shared_job(on)) if ext is not None else False


def set_vnni_gemm(on: bool) -> bool:
    """Run non-exact many-row matmuls that AMX does not take on the AVX512-VNNI GEMM (int8
    activations, the row path's bits; on AVX2 / AVX-VNNI the row path itself over every row) or
    on the float panels (A/B measurements); returns the previous setting; on by default."""
    ext = _load()
    return bool(ext.set_vnni_gemm(on)) if ext is not None else False


def set_small_rows(on: bool) -> bool:
    """Run int8 matmuls of 2..8 rows (a batch's decode step) on AVX2 without VNNI on the few-row
    path (each weight block decoded in registers once for all rows, the one-row paths' bits) or
    on the panel path (A/B measurements); returns the previous setting; on by default."""
    ext = _load()
    return bool(ext.set_small_rows(on)) if ext is not None else False


def set_rows4(on: bool) -> bool:
    """Run one-row 4-bit int8 matmuls (even block count) row by row (each weight row's block pair
    against x split into even and odd values) or on the
    transposing one-row path (A/B measurements; the same bits); returns the previous setting;
    on by default."""
    ext = _load()
    return bool(ext.set_rows4(on)) if ext is not None else False


def set_attn_rows(on: bool) -> bool:
    """Run causal prompt attention (no sliding window) position by position with the decode
    step's kernels, key splits and merge -- a cold prefill then writes the K/V a token-by-token
    decode wrote, bit for bit -- or on the faster many-query tiles (A/B measurements); returns
    the previous setting; on by default."""
    ext = _load()
    return bool(ext.set_attn_rows(on)) if ext is not None else False


def set_x16(on: bool) -> bool:
    """Quantize activations for the int8 matmul paths (decode rows, the VNNI GEMM) to 16 bits
    per 32-block, as two int8 parts with two integer dot products per block, instead of 8 bits.
    The int8 rounding of activations is SmolLM2-135M's whole perplexity gap to fp32 (+0.3%
    mean, +-0.35% over rounding-noise realisations on a 338-token text); 16 bits removes it, at
    ~2x the integer work (prefill is compute-bound: ~-30% tok/s; decode streams weights: a few
    %). Rows stay bit-identical to solo rows and prefill rows to decode rows; AMX steps aside
    (its tiles take int8 only). Returns the previous setting; off by default."""
    ext = _load()
    return bool(ext.set_x16(on)) if ext is not None else False


def set_amx_min_rows(rows: int) -> int:
    """Rows from which non-exact matmuls run on AMX tiles (default 16, at least 2; the qmm
    bench lowers it); returns the previous value, 0 without the kernels."""
    ext = _load()
    return int(ext.set_amx_min_rows(int(rows))) if ext is not None else 0


def set_int8_prefill(on: bool) -> tuple[bool, bool]:
    """Both int8 many-row paths (AMX and the VNNI GEMM) on or off: off, prefill runs on the
    float panels. Returns the previous (amx, vnni_gemm) settings for restore_int8_prefill."""
    return set_amx(on), set_vnni_gemm(on)


def restore_int8_prefill(was: tuple[bool, bool]) -> None:
    """Undo set_int8_prefill."""
    set_amx(was[0])
    set_vnni_gemm(was[1])


def prefill_path(rows: int = 16) -> str | None:
    """The path a non-exact quantized matmul of ``rows`` rows takes now: "amx", "vnni512",
    "int8 many rows", "float panels", "int8 few rows" (2..8 rows on AVX2: the few-row path) or
    "int8 rows" (the decode row path, below 16 rows); None without the kernels."""
    ext = _load()
    return str(ext.qmm_path(rows)) if ext is not None else None


def set_threads(n: int) -> None:
    """Threads of the kernel pool (default: the CPUs this process may use)."""
    ext = _load()
    if ext is not None:
        ext.set_threads(int(n))


def supports_qmm(bits: int, group_size: int, K: int) -> bool:
    return bits in QMM_BITS and group_size in QMM_GROUPS and K % group_size == 0


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    exact: bool = False,
    symmetric: bool = False,
) -> mx.array:
    """``x @ mx.dequantize(w, scales, biases, group_size, bits).T`` as a float32 array.

    ``exact`` multiplies float32 activations (for tests); the default quantizes activations
    to int8 per block of 32 (as llama.cpp does), about 0.5% RMS error per product.
    ``symmetric``: the caller vouches that ``biases == -2**(bits - 1) * scales`` exactly (see
    ``symmetric``); the decode path then never reads the biases (same results).
    """
    ext = _required()
    return ext.quantized_matmul(x, w, scales, biases, group_size, bits, exact, symmetric)


def masked_softmax(scores: mx.array, causal_offset: int | None = None, mask: mx.array | None = None) -> mx.array:
    """Softmax over the last axis of float32 (B, H, L, S) scores; ``causal_offset`` lets query
    i see keys j <= i + offset; ``mask`` is additive, shaped (B or 1, 1, L, S)."""
    ext = _required()
    if mask is not None:
        return ext.masked_softmax(scores, 2, 0, mask)
    if causal_offset is not None:
        return ext.masked_softmax(scores, 1, causal_offset, None)
    return ext.masked_softmax(scores, 0, 0, None)


def flash_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    causal_offset: int | None = None,
    window: int = 0,
    mask: mx.array | None = None,
    reference: bool = False,
    rotate_q: bool = False,
) -> mx.array:
    """Fused ``softmax(scale * q @ k^T + mask) @ v``: q float32 (B, H, L, D), k/v float32 or
    float16 (B, Hk, S, D|Dv), H % Hk == 0, D % 8 == 0, Dv % 16 == 0; float32 (B, H, L, Dv) out.
    ``causal_offset``: query i sees keys j <= i + offset (``window`` > 0: and j > i + offset -
    window); ``mask``: additive float (B or 1, 1, 1 or L, S). ``reference`` runs the scalar
    reference (tests). ``rotate_q``: q times ``kvrows.q8_rotate``'s Walsh-Hadamard matrix
    first, inside the kernel (what q8 K rows, stored rotated, need; up to float rounding the
    same as rotating q with that MLX op, one op per layer less). Fully masked rows give zeros."""
    ext = _required()
    rot = bool(rotate_q)
    if mask is not None:
        return ext.flash_attention(q, k, v, float(scale), 2, 0, 0, mask, reference, rot)
    if causal_offset is not None:
        return ext.flash_attention(q, k, v, float(scale), 1, int(causal_offset), int(window), None, reference, rot)
    return ext.flash_attention(q, k, v, float(scale), 0, 0, 0, None, reference, rot)


def q8_pack(x: mx.array, group: int) -> mx.array:
    """Float (..., D) -> 8-bit KV rows, uint8 (..., D + 4 * D / group), as one CPU op (see
    engine.kvrows.q8_pack, whose MLX ops give the same bytes)."""
    ext = _required()
    return ext.q8_pack(x, int(group))


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm`` as one CPU primitive (float32 ``x``)."""
    ext = _required()
    return ext.rms_norm(x, weight, float(eps))


def rope(
    x: mx.array, dims: int, *, traditional: bool, base: float, scale: float, offset: int | mx.array
) -> mx.array:
    """``mx.fast.rope`` (default frequencies) as one CPU primitive on float32 (B, H, T, D)
    ``x``; ``offset`` an int, a scalar array or one per batch row."""
    ext = _required()
    if not isinstance(offset, mx.array):
        offset = mx.array(int(offset), dtype=mx.int32)
    return ext.rope(x, offset, int(dims), bool(traditional), float(base), float(scale))


def quantized_swiglu(x: mx.array, gate: Any, up: Any, exact: bool = False) -> mx.array:
    """``silu(gate(x)) * up(x)`` for two bias-free ``nn.QuantizedLinear`` of one format, as
    one CPU primitive (float32 out): activations quantized once, both matmuls in one job."""
    ext = _required()
    return ext.quantized_swiglu(x, *qparams(gate), *qparams(up), gate.group_size, gate.bits, exact,
                                symmetric(gate), symmetric(up))


DENSE_ROWS = 16  # the extension's kDenseMinRows (src/ops.cpp)


def dense_rows() -> int:
    """Rows at which the quantized matmul leaves its per-row int8 path for the many-row paths."""
    return DENSE_ROWS


def half_scales(lin: Any) -> bool:
    """Give quantized layer ``lin`` float16 copies of its float32 scales and biases for the
    kernels when both convert exactly (a GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0's own d and m are
    float16), so the decode matmul reads 20 instead of 24 bytes per 32 4-bit weights (36
    instead of 40 at 8 bits): decode streams the weights, bytes are time. The copies are used
    while the module's arrays are the ones they were made from (or ``release_float_scales``'
    expressions of them). Returns whether copies were made."""
    s, b = lin["scales"], lin["biases"] if "biases" in lin else None
    if b is None or s.dtype != mx.float32 or b.dtype != mx.float32:
        return False
    s16, b16 = s.astype(mx.float16), b.astype(mx.float16)
    same = mx.array_equal(s16.astype(mx.float32), s) and mx.array_equal(b16.astype(mx.float32), b)
    if not same.item():
        return False
    # A GGUF Q8_0/Q4_0/Q5_0 stores a scale only: its bias is -2^(bits-1) * scale, exactly. The
    # kernels then never read the biases (symmetric()), so none are kept: the scales stand in
    # their slot (2 bytes per 32 weights; 26 MiB of Qwen2.5-Coder-0.5B's Q5_0/Q8_0 layers).
    zero = float(-(2 ** (lin.bits - 1)))
    sym = bool(mx.array_equal(b, s * zero).item())
    if sym:
        b16 = s16
    mx.eval(s16, b16)
    object.__setattr__(lin, "_kernel_half", (s, b, s16, b16, sym))  # not a parameter
    return True


def k_scales(lin: Any) -> bool:
    """Give quantized layer ``lin`` (group 32, 4 or 5 bits, K a multiple of 256) a copy of its
    float32 scales and biases in a GGUF K-quant's own form (engine/kernels/kscales.py) when they
    factor exactly as Q4_K/Q5_K's d * sc and -(dmin * m): the decode matmul then reads 18.5
    instead of 24 bytes per 32 4-bit weights, for the same values. Kept as ``half_scales``'
    copies are (same staleness rule). Returns whether it was made."""
    from engine.kernels import kscales

    import numpy as np

    if lin.group_size != 32 or lin.bits not in (4, 5) or "biases" not in lin:
        return False
    s, b = lin["scales"], lin["biases"]
    if s.dtype != mx.float32 or b.dtype != mx.float32 or s.ndim != 2 or s.shape[1] % kscales.SUPER:
        return False
    ext = _load()
    if ext is not None and hasattr(ext, "kscales_pack"):  # kscales.pack's bytes, in C++ (load time)
        packed = ext.kscales_pack(s, b)
        if packed.size == 0:
            return False
    else:
        rec = kscales.pack(np.array(s), np.array(b))
        if rec is None:
            return False
        packed = mx.array(rec)
    mx.eval(packed)
    object.__setattr__(lin, "_kernel_half", (s, b, packed, packed, False))  # not a parameter
    return True


def compact_scales(lin: Any) -> str | None:
    """The most compact exact scale form the kernels read for ``lin``: K-quant records
    (``k_scales``), else float16 copies (``half_scales``); returns "kquant", "float16" or None
    (the float32 arrays as they are)."""
    if k_scales(lin):
        return "kquant"
    if half_scales(lin):
        return "float16"
    return None


def expand_scales(lin: Any, rows: mx.array | None = None) -> tuple[mx.array, mx.array] | None:
    """The float32 (scales, biases) of ``lin`` computed from its compact copies (K-quant records
    or float16; the same bits as the module's float32 arrays they were made from), lazily; only
    ``rows`` of them when given (an embedding lookup). None without compact copies."""
    half = _half(lin)
    if half is None:
        return None
    s, b = half[2], half[3]
    if s.dtype == mx.uint8:  # K-quant records, passed as both
        from engine.kernels import kscales

        return kscales.unpack_mx(s if rows is None else s[rows])
    if rows is not None:
        s, b = s[rows], b[rows]
    s = s.astype(mx.float32)
    if half[4]:  # symmetric: no biases kept, they are -2^(bits-1) * scale
        return s, s * float(-(2 ** (lin.bits - 1)))
    return s, b.astype(mx.float32)


def release_float_scales(lin: Any) -> bool:
    """Drop ``lin``'s float32 scales and biases where compact copies stand for them: the module
    keeps, in their place, unevaluated expressions of the copies (``expand_scales``), the same
    values for anything that reads them (MLX's own ops off the CPU, ``densify``) without their
    memory while only the kernels run -- 8 bytes per 32 weights, ~424 MiB of Qwen2.5-Coder
    1.5B's 1.6 GiB. Returns whether it did."""
    full = expand_scales(lin)
    if full is None:
        return False
    half = lin.__dict__["_kernel_half"]
    lin["scales"], lin["biases"] = full
    object.__setattr__(lin, "_kernel_half", (*full, *half[2:]))
    return True


def qparams(lin: Any) -> tuple[mx.array, mx.array, mx.array]:
    """(weight, scales, biases) of quantized layer ``lin`` as the kernels read them: the
    float16 copies of ``half_scales`` while they match the module's arrays."""
    if getattr(lin, "q6k_blocks", False):  # engine.kernels.q6k: the scales are in the blocks
        return lin["weight"], lin["weight"], lin["weight"]
    half = _half(lin)
    if half is not None:
        return lin["weight"], half[2], half[3]
    return lin["weight"], lin["scales"], lin["biases"]


def _half(lin: Any) -> tuple | None:
    """``half_scales``' record for ``lin`` while the module's arrays are the ones it was made
    from (a weight update makes it stale), else None."""
    half = lin.__dict__.get("_kernel_half")
    if half is None or half[0] is not lin["scales"] or half[1] is not lin["biases"]:
        return None
    return half


def symmetric(lin: Any) -> bool:
    """Whether ``qparams(lin)`` gives float16 copies whose biases are exactly
    ``-2**(bits - 1) * scales`` (Q8_0/Q4_0/Q5_0): the decode matmul then reads the scales
    only (Q8_0: 34 instead of 36 bytes per 32 weights, llama.cpp's size)."""
    half = _half(lin)
    return half is not None and half[4]


def _weights(*lins: Any) -> tuple[list[mx.array], list[int]]:
    """The layers' (weight, scales, biases) in one flat list, and their (group size, bits,
    symmetric)."""
    arrays: list[mx.array] = []
    formats: list[int] = []
    for lin in lins:
        arrays += qparams(lin)
        formats += [lin.group_size, lin.bits, int(symmetric(lin))]
    return arrays, formats


def norm_qkv_rope(
    x: mx.array,
    norm_w: mx.array,
    eps: float,
    q: Any,
    k: Any,
    v: Any,
    offset: int | mx.array,
    n_heads: int,
    n_kv_heads: int,
    *,
    rope_dims: int,
    traditional: bool,
    base: float,
    scale: float,
) -> tuple[mx.array, mx.array, mx.array]:
    """A decoder layer's attention input in one CPU primitive: ``rmsnorm(x)`` through the
    quantized ``nn.QuantizedLinear`` ``q``/``k``/``v`` (with their biases if all three have
    one), RoPE on q and k at positions ``offset + l`` (``offset`` an int, a scalar array or
    one per batch row). ``x`` float32 (B, L, D); returns q (B, n_heads, L, head_dim) and k, v
    (B, n_kv_heads, L, head_dim), float32."""
    ext = _required()
    arrays, formats = _weights(q, k, v)
    biases = [lin["bias"] for lin in (q, k, v)] if "bias" in q else []
    if not isinstance(offset, mx.array):
        offset = mx.array(int(offset), dtype=mx.int32)
    out = ext.norm_qkv_rope(
        x, norm_w, float(eps), arrays, formats, biases, offset, int(n_heads), int(n_kv_heads),
        int(rope_dims), bool(traditional), float(base), float(scale),
    )
    return out[0], out[1], out[2]


def attn_out_mlp(
    a: mx.array, h: mx.array, o: Any, norm_w: mx.array, eps: float, gate: Any, up: Any, down: Any
) -> mx.array:
    """The rest of a decoder layer in one CPU primitive: ``h1 = h + o(a)`` with ``a`` the
    attention output (B, H, L, Dv) read as (B, L, H * Dv), then ``h1 + down(silu(gate(n)) *
    up(n))`` with ``n = rmsnorm(h1)``; all linears quantized and bias-free. float32 out."""
    ext = _required()
    arrays, formats = _weights(o, gate, up, down)
    return ext.attn_out_mlp(a, h, norm_w, float(eps), arrays, formats)


def argmax_rows(x: mx.array, reference: bool = False) -> mx.array:
    """``mx.argmax(x, axis=-1)`` (the first index of each row's largest value) of float32
    ``x`` as int32, 8 lanes at a time (MLX's CPU argmax is a scalar loop, ~0.4 ms for the 8
    rows of a batched SmolLM2 step). ``reference`` runs a plain scalar loop (tests)."""
    ext = _required()
    return ext.argmax_rows(x, reference)


def half_matmul(x: mx.array, w: mx.array, bias: mx.array | None = None, reference: bool = False) -> mx.array:
    """``x @ w.T (+ bias)`` of float32 ``x`` (..., K) and float16 ``w`` (N, K) as float32, the
    weights converted in registers (MLX's CPU matmul converts float16 weights to a float32 copy
    first, every call). For few rows bound by reading the weights (Whisper's decoder steps).
    Each output's bits do not depend on the row count or the threads; ``reference`` runs the
    same operations in scalar code (tests)."""
    ext = _required()
    return ext.half_matmul(x, w, bias, reference)


def q6k_matmul(x: mx.array, w: mx.array, reference: bool = False) -> mx.array:
    """``x @ W.T`` of float32 ``x`` (..., K) with W as GGUF Q6_K blocks ``w``: uint8
    (N, K / 256 * 210) (engine.kernels.q6k). Activations are quantized to int8 per 256 values
    (llama.cpp's q8_K) and each output is one fixed sequence of exact integer block sums and
    float steps, so its bits do not depend on the row count or the threads; ``reference`` runs
    the same arithmetic in scalar code (tests)."""
    ext = _required()
    return ext.q6k_matmul(x, w, reference)


def gelu_erf(x: mx.array, reference: bool = False) -> mx.array:
    """Exact (erf) GELU ``x * Phi(x)`` of float32 ``x``, vectorised (MLX's CPU ``erf`` is a
    scalar loop, ~30 ns a value); erfc by a Chebyshev fit with fractional error < 1.2e-7.
    ``reference`` runs the same formula in scalar code (tests)."""
    ext = _required()
    return ext.gelu_erf(x, reference)


def kv_write_rows(buf: mx.array, x: mx.array, pos: mx.array) -> mx.array:
    """The (B, H, S, D) K or V buffer ``buf`` with row ``b``'s new entries (``x``: B, H, L, D)
    at positions ``pos[b] .. pos[b] + L - 1``: ``mx.put_along_axis`` along the position axis as
    one primitive that writes in place when MLX can donate the buffer. ``x`` may be float32 for
    a float16 / bfloat16 buffer (cast with ``astype``'s bits); a position outside the buffer
    writes nothing."""
    ext = _required()
    return ext.kv_write_rows(buf, x, pos)


def log_softmax(x: mx.array, reference: bool = False) -> mx.array:
    """``x - logsumexp(x)`` over the last axis of float32 ``x`` as one CPU primitive (the
    vectorised exp; MLX's CPU logsumexp runs a scalar exp, ~0.6 ms per 49k-token vocabulary).
    ``reference`` runs a double-precision scalar loop (tests)."""
    ext = _required()
    return ext.log_softmax(x, reference)


def has(op: str) -> bool:
    """Whether the loaded extension has ``op`` (a build from before it was added does not:
    callers keep MLX's ops until ``python -m engine.kernels.build`` is rerun)."""
    ext = _load()
    return ext is not None and hasattr(ext, op)


def top_p_filter(x: mx.array, top_p: float, reference: bool = False) -> mx.array:
    """Float32 ``x`` (..., V) where a token is in its row's top-p nucleus, -inf elsewhere: the
    smallest set of most probable tokens (``softmax(x)``) whose mass reaches ``top_p``, taken in
    a stable descending sort's order (equal values: lower index first; the first token always
    kept), as ``engine.generation.sampling._top_p`` keeps it, in O(V) instead of two sorts of
    the vocabulary (src/topp.cpp). ``reference`` runs a scalar full-sort loop (tests)."""
    ext = _required()
    return ext.top_p_filter(x, float(top_p), reference)
