"""ggml block decoding: hand-built blocks (from the ggml byte layouts) -> expected floats,
MLX affine triples -> ``mx.dequantize`` bit-exact, and where ``mx.load`` goes wrong."""

import engine  # loads OpenBLAS before mlx is imported

# isort: split
from engine.model.gguf import quants
from engine.model.gguf.ggml_types import BY_NAME
from engine.model.gguf.writer import RawTensor, write_gguf

import mlx.core as mx
import numpy as np
import pytest

F32 = np.float32
rng = np.random.default_rng(1234)


def f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def f16v(x: float) -> F32:
    """The float32 value a float16 field decodes to."""
    return F32(np.float16(x))


# --- encoders written straight from ggml-common.h, one block at a time (slow, obvious) ---


def enc_q4_0(d, q):  # q: 32 ints 0..15; w = d*(q-8)
    qs = bytes(q[j] | (q[j + 16] << 4) for j in range(16))
    return f16(d) + qs, [f16v(d) * F32(v - 8) for v in q]


def enc_q4_1(d, m, q):  # w = d*q + m
    qs = bytes(q[j] | (q[j + 16] << 4) for j in range(16))
    return f16(d) + f16(m) + qs, [f16v(d) * F32(v) + f16v(m) for v in q]


def _q5_low_high(q):
    qh = sum(((v >> 4) & 1) << j for j, v in enumerate(q)).to_bytes(4, "little")
    qs = bytes((q[j] & 15) | ((q[j + 16] & 15) << 4) for j in range(16))
    return qh, qs


def enc_q5_0(d, q):  # q: 0..31; w = d*(q-16)
    qh, qs = _q5_low_high(q)
    return f16(d) + qh + qs, [f16v(d) * F32(v - 16) for v in q]


def enc_q5_1(d, m, q):
    qh, qs = _q5_low_high(q)
    return f16(d) + f16(m) + qh + qs, [f16v(d) * F32(v) + f16v(m) for v in q]


def enc_q8_0(d, q):  # q: int8
    return f16(d) + np.array(q, np.int8).tobytes(), [f16v(d) * F32(v) for v in q]


def _k_scale_bytes(sc, mn):
    """Pack 8 six-bit scales and mins the way get_scale_min_k4 unpacks them."""
    s = [0] * 12
    for j in range(4):
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6)
        s[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6)
        s[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4)
    return bytes(s)


def _k_expected(d, dmin, sc, mn, q):
    return [
        (f16v(d) * F32(sc[i // 32])) * F32(v) - f16v(dmin) * F32(mn[i // 32])
        for i, v in enumerate(q)
    ]


def _k_nibble_bytes(q):  # per 64 values: 32 bytes, low nibble = first 32, high = next 32
    return bytes(
        (q[64 * c + i] & 15) | ((q[64 * c + 32 + i] & 15) << 4) for c in range(4) for i in range(32)
    )


def enc_q4_k(d, dmin, sc, mn, q):  # 256 values, 8 sub-blocks of 32
    data = f16(d) + f16(dmin) + _k_scale_bytes(sc, mn) + _k_nibble_bytes(q)
    return data, _k_expected(d, dmin, sc, mn, q)


def enc_q5_k(d, dmin, sc, mn, q):  # q: 0..31
    qh = bytes(sum(((q[32 * k + i] >> 4) & 1) << k for k in range(8)) for i in range(32))
    data = f16(d) + f16(dmin) + _k_scale_bytes(sc, mn) + qh + _k_nibble_bytes(q)
    return data, _k_expected(d, dmin, sc, mn, q)


def enc_q6_k(d, sc, q):  # q: 0..63 (value q-32); sc: 16 int8, one per 16 values
    ql, qh = bytearray(128), bytearray(64)
    for h in range(2):
        for i in range(32):
            a, b, c, e = (q[128 * h + 32 * k + i] for k in range(4))
            ql[64 * h + i] = (a & 15) | ((c & 15) << 4)
            ql[64 * h + 32 + i] = (b & 15) | ((e & 15) << 4)
            qh[32 * h + i] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
    data = bytes(ql) + bytes(qh) + np.array(sc, np.int8).tobytes() + f16(d)
    return data, [(f16v(d) * F32(sc[i // 16])) * F32(v - 32) for i, v in enumerate(q)]


def _ints(n, lo, hi):
    """Random ints that always include both ends (exercise every bit)."""
    v = rng.integers(lo, hi + 1, size=n)
    v[0], v[-1] = lo, hi
    return [int(x) for x in v]


def make_blocks(name, n_blocks):
    """(raw bytes as uint8 array, expected float32 values) for n_blocks random blocks."""
    data, expected = b"", []
    for _ in range(n_blocks):
        d, m = float(rng.uniform(-0.1, 0.1)), float(rng.uniform(-0.5, 0.5))
        if name == "Q4_0":
            blk, exp = enc_q4_0(d, _ints(32, 0, 15))
        elif name == "Q4_1":
            blk, exp = enc_q4_1(d, m, _ints(32, 0, 15))
        elif name == "Q5_0":
            blk, exp = enc_q5_0(d, _ints(32, 0, 31))
        elif name == "Q5_1":
            blk, exp = enc_q5_1(d, m, _ints(32, 0, 31))
        elif name == "Q8_0":
            blk, exp = enc_q8_0(d, _ints(32, -128, 127))
        elif name == "Q4_K":
            blk, exp = enc_q4_k(d, m, _ints(8, 0, 63), _ints(8, 0, 63), _ints(256, 0, 15))
        elif name == "Q5_K":
            blk, exp = enc_q5_k(d, m, _ints(8, 0, 63), _ints(8, 0, 63), _ints(256, 0, 31))
        elif name == "Q6_K":
            blk, exp = enc_q6_k(d, _ints(16, -128, 127), _ints(256, 0, 63))
        else:
            raise AssertionError(name)
        data += blk
        expected += exp
    return np.frombuffer(data, np.uint8), np.array(expected, F32)


BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_block_types_decode_to_spec_values(name):
    t = BY_NAME[name]
    rows, cols = 3, 2 * max(t.block_size, 64)
    raw, expected = make_blocks(name, rows * cols // t.block_size)
    assert len(raw) == t.nbytes(rows * cols)
    dense = quants.dequantize(raw, name, (rows, cols))
    assert dense.dtype == F32 and dense.shape == (rows, cols)
    np.testing.assert_array_equal(dense.ravel(), expected)


def test_float_types_decode():
    x = rng.normal(size=(4, 8)).astype(F32)
    np.testing.assert_array_equal(quants.dequantize(x.view(np.uint8).ravel(), "F32", x.shape), x)
    h = x.astype(np.float16)
    np.testing.assert_array_equal(
        quants.dequantize(h.view(np.uint8).ravel(), "F16", x.shape), h.astype(F32)
    )
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16 = top half of the float32 bits
    expected = (bf.astype(np.uint32) << 16).view(F32)
    got = quants.dequantize(bf.view(np.uint8).ravel(), "BF16", x.shape)
    np.testing.assert_array_equal(got, expected)
    assert np.abs(got - x).max() <= np.abs(x).max() / 128  # and it is close to the original


def test_dequantize_into_float16_rounds_the_float32_values():
    raw, expected = make_blocks("Q4_K", 2)
    got = quants.dequantize(raw, "Q4_K", (2, 256), np.float16)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got.ravel(), expected.astype(np.float16))


@pytest.mark.parametrize("name", sorted(quants.AFFINE_TYPES))
def test_affine_triples_are_lossless_through_mx_dequantize(name):
    t = BY_NAME[name]
    rows, cols = 4, 512
    raw, expected = make_blocks(name, rows * cols // t.block_size)
    a = quants.to_affine(raw, name, (rows, cols))
    assert a.group_size == 32 and a.bits == {"Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5}.get(name, 4)
    assert a.weight.dtype == np.uint32 and a.weight.shape == (rows, cols * a.bits // 32)
    assert a.scales.shape == a.biases.shape == (rows, cols // 32)
    back = mx.dequantize(
        mx.array(a.weight), mx.array(a.scales), mx.array(a.biases), group_size=32, bits=a.bits
    )
    np.testing.assert_array_equal(np.array(back), quants.dequantize(raw, name, (rows, cols)))
    np.testing.assert_array_equal(np.array(back).ravel(), expected)


def test_q6_k_has_no_affine_form():
    raw, _ = make_blocks("Q6_K", 1)
    with pytest.raises(engine.errors.ModelLoadError, match="Q6_K"):
        quants.to_affine(raw, "Q6_K", (1, 256))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_matches_mx_quantize(bits):
    top = 2**bits - 1
    q = rng.integers(0, top + 1, size=(16, 32)).astype(np.uint8)
    q[:, 0], q[:, 1] = 0, top  # each group spans the full range, so scale is +-1
    wq, scales, biases = mx.quantize(mx.array(q.astype(F32)), group_size=32, bits=bits)
    s, b = np.array(scales), np.array(biases)
    q_mx = np.round((q.astype(F32) - b) / s).astype(np.uint8)  # the ints mx chose
    np.testing.assert_array_equal(np.array(wq), quants.pack(q_mx, bits))
    ones, zeros = mx.ones((16, 1)), mx.zeros((16, 1))
    unpacked = mx.dequantize(mx.array(quants.pack(q, bits)), ones, zeros, group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(unpacked), q.astype(F32))


def test_unsupported_type_is_a_model_load_error():
    with pytest.raises(engine.errors.ModelLoadError, match="IQ2_XS"):
        quants.dequantize(np.zeros(74, np.uint8), "IQ2_XS", (1, 256))


# --- mx.load's own GGUF path, checked against our decoder ---


def _mx_load_single(tmp_path, name, raw, shape):
    path = write_gguf(tmp_path / f"{name}.gguf", {"general.architecture": "test"},
                      [RawTensor("w", raw.tobytes(), name, shape)])
    return mx.load(str(path))


def test_mx_load_q4_k_applies_even_sub_block_scales_to_odd_ones(tmp_path):
    """mx.load (this MLX) turns Q4_K into float16 with sub-block 2k's scale/min also used for
    sub-block 2k+1. That is why K-quants never go through mx.load."""
    rows, cols = 2, 512
    raw, _ = make_blocks("Q4_K", rows * cols // 256)
    mine = quants.dequantize(raw, "Q4_K", (rows, cols)).reshape(-1, 8, 32)
    theirs = np.array(_mx_load_single(tmp_path, "Q4_K", raw, (rows, cols))["w"].astype(mx.float32))
    theirs = theirs.reshape(-1, 8, 32)
    np.testing.assert_array_equal(theirs[:, 0::2], mine[:, 0::2].astype(np.float16))
    assert np.abs(theirs[:, 1::2] - mine[:, 1::2]).max() > 0.1  # odd sub-blocks are wrong...
    q, scales, biases = quants._q4_k(raw.reshape(-1, 144))  # ...exactly like this:
    scales, biases = scales.reshape(-1, 8, 1).copy(), biases.reshape(-1, 8, 1).copy()
    scales[:, 1::2], biases[:, 1::2] = scales[:, 0::2], biases[:, 0::2]
    wrong = q.reshape(-1, 8, 32).astype(F32) * scales + biases
    np.testing.assert_array_equal(theirs, wrong.astype(np.float16))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_mx_load_agrees_for_legacy_types(tmp_path, name):
    """An independent decoder (ggml's, inside MLX) gives the same packed triples."""
    rows, cols = 3, 256
    raw, _ = make_blocks(name, rows * cols // 32)
    w = _mx_load_single(tmp_path, name, raw, (rows, cols))
    a = quants.to_affine(raw, name, (rows, cols))
    np.testing.assert_array_equal(np.array(w["w"]), a.weight)
    np.testing.assert_array_equal(np.array(w["w.scales"].astype(mx.float32)), a.scales)
    np.testing.assert_array_equal(np.array(w["w.biases"].astype(mx.float32)), a.biases)


def test_mx_load_agrees_for_q6_k_and_rejects_q5(tmp_path):
    raw, _ = make_blocks("Q6_K", 2)
    theirs = np.array(_mx_load_single(tmp_path, "Q6_K", raw, (2, 256))["w"])
    np.testing.assert_array_equal(theirs, quants.dequantize(raw, "Q6_K", (2, 256), np.float16))
    raw5, _ = make_blocks("Q5_0", 8)
    with pytest.raises(RuntimeError):
        _mx_load_single(tmp_path, "Q5_0", raw5, (1, 256))
