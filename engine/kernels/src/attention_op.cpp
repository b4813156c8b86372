// The fused attention as an MLX primitive: argument checks, the graph node, and its CPU
// evaluation handing the problem to attention.cpp's kernel (or the scalar reference).
#include "attention.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/utils.h"
#include "attention_impl.h"
#include "ops.h"

namespace mlxterm {

namespace {

// K or V as the kernel reads it: rows of the last dim dense, batch entries and heads any whole
// number of rows apart (a view of the first S slots of a longer cache buffer is read in place:
// copying it cost more than the attention, 0.9 ms per layer at 4k float16 keys). Anything else
// (and every input of the scalar reference, which indexes densely) is copied to a dense array
// when the task runs.
struct KVRows {
  mx::array src, dense;  // dense: the copy's buffer, or src itself
  size_t batch, head;    // rows between batch entries / heads of what the kernel reads
  bool copy;
};

KVRows kv_rows(const mx::array& a, bool force_dense) {
  const size_t row = size_t(a.shape(3)), S = size_t(a.shape(2)), Hk = size_t(a.shape(1));
  const auto& st = a.strides();
  const bool rows_dense = (st[3] == 1 || a.shape(3) == 1) && (size_t(st[2]) == row || S == 1) &&
                          size_t(st[1]) % row == 0 && size_t(st[0]) % row == 0;
  if (rows_dense && !force_dense) return {a, a, size_t(st[0]) / row, size_t(st[1]) / row, false};
  if (a.flags().row_contiguous) return {a, a, Hk * S, S, false};
  mx::array dense(a.shape(), a.dtype(), nullptr, {});
  dense.set_data(mx::allocator::malloc(dense.nbytes()));
  return {a, dense, Hk * S, S, true};
}

// The dense copy of a strided K or V (run inside the task: the input is computed by then).
void copy_rows(const KVRows& r) {
  const mx::array& a = r.src;
  const size_t item = a.itemsize(), row = size_t(a.shape(3)) * item;
  const auto& st = a.strides();
  const auto* src = static_cast<const uint8_t*>(a.data<void>());
  auto* dst = static_cast<uint8_t*>(const_cast<void*>(r.dense.data<void>()));
  for (int b = 0; b < a.shape(0); ++b)
    for (int h = 0; h < a.shape(1); ++h)
      for (int s = 0; s < a.shape(2); ++s) {
        const uint8_t* from = src + (size_t(b) * st[0] + size_t(h) * st[1] + size_t(s) * st[2]) * item;
        if (st[3] == 1) std::memcpy(dst, from, row);
        else
          for (int d = 0; d < a.shape(3); ++d) std::memcpy(dst + d * item, from + size_t(d) * st[3] * item, item);
        dst += row;
      }
}

}  // namespace

void FlashAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  const auto &q = inputs[0], &k = inputs[1], &v = inputs[2];
  attn::Problem p;
  p.q = q.data<float>();
  p.half = k.dtype() == mx::float16;
  p.q8 = k.dtype() == mx::uint8;
  const KVRows kr = kv_rows(k, reference_), vr = kv_rows(v, reference_);
  p.k = kr.dense.data<void>();
  p.v = vr.dense.data<void>();
  p.k_batch = kr.batch, p.k_head = kr.head, p.v_batch = vr.batch, p.v_head = vr.head;
  p.mask = inputs.size() > 3 ? inputs[3].data<float>() : nullptr;
  p.out = out.data<float>();
  p.B = q.shape(0), p.H = q.shape(1), p.L = q.shape(2), p.D = q.shape(3);
  p.Hk = k.shape(1), p.S = k.shape(2), p.Dv = v.shape(3);
  p.G = 0, p.kst = p.vst = 0;
  if (p.q8) {
    p.G = q8_group(p.D, k.shape(3));
    p.Dv = q8_dim(v.shape(3), p.G);
    p.kst = size_t(k.shape(3)), p.vst = size_t(v.shape(3));
  }
  p.Bm = inputs.size() > 3 ? inputs[3].shape(0) : 1;
  p.Lm = inputs.size() > 3 ? inputs[3].shape(2) : 1;
  p.scale = scale_, p.mode = mode_, p.offset = offset_, p.window = window_, p.rotate = rotate_;
  const bool reference = reference_;
  enc.dispatch([p, reference, kr, vr]() {
    if (kr.copy) copy_rows(kr);
    if (vr.copy) copy_rows(vr);
    reference ? attn::run_reference(p) : attn::run_flash(p);
  });
}

void FlashAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxterm] the CPU kernels have no GPU implementation.");
}

std::vector<mx::Shape> FlashAttention::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = inputs[2].shape(3);
  if (inputs[1].dtype() == mx::uint8) shape.back() = q8_dim(inputs[2].shape(3), q8_group(inputs[0].shape(3), inputs[1].shape(3)));
  return {shape};
}

mx::array flash_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    int mode,
    int offset,
    int window,
    const mx::array* mask,
    bool reference,
    bool rotate,
    mx::StreamOrDevice s) {
  auto bad = [](const char* why) { throw std::invalid_argument(std::string("[mlxterm.flash_attention] ") + why); };
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) bad("q, k, v must be 4-D (B, heads, length, dim).");
  if (q.dtype() != mx::float32) bad("q must be float32.");
  if (k.dtype() != v.dtype() || (k.dtype() != mx::float32 && k.dtype() != mx::float16 && k.dtype() != mx::uint8))
    bad("k and v must both be float32, float16 or 8-bit rows (uint8).");
  const int B = q.shape(0), H = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int Hk = k.shape(1), S = k.shape(2);
  int Dv = v.shape(3), Dk = k.shape(3);
  if (k.dtype() == mx::uint8) {
    const int G = q8_group(D, k.shape(3));
    if (G <= 0 || G % 32 != 0) bad("8-bit k rows must be D int8 values + D / G float32 scales, G % 32 == 0.");
    Dv = q8_dim(v.shape(3), G);
    if (Dv <= 0 || Dv % G != 0) bad("8-bit v rows must be Dv int8 values + Dv / G float32 scales.");
    Dk = D;
  }
  if (k.shape(0) != B || v.shape(0) != B || v.shape(1) != Hk || v.shape(2) != S || Dk != D)
    bad("k must be (B, Hk, S, D) and v (B, Hk, S, Dv) for q (B, H, L, D).");
  if (Hk < 1 || H % Hk != 0) bad("query heads must be a multiple of KV heads.");
  if (D % 8 != 0 || Dv % 16 != 0) bad("head dims must be multiples of 8 (q/k) and 16 (v).");
  if (mode < 0 || mode > 2) bad("mode must be 0 (none), 1 (causal) or 2 (array mask).");
  auto st = mx::to_stream(s);
  if (st.device != mx::Device::cpu) bad("runs on the CPU stream only.");
  // K and V go in as they are (views of a cache buffer included): see kv_rows.
  std::vector<mx::array> inputs = {contiguous_in(q, st), k, v};
  if (mode == 2) {
    if (!mask || mask->ndim() != 4 || mask->shape(1) != 1 || mask->shape(3) != S ||
        (mask->shape(2) != 1 && mask->shape(2) != L) || (mask->shape(0) != 1 && mask->shape(0) != B))
      bad("mask must be (1 or B, 1, 1 or L, S).");
    inputs.push_back(mx::contiguous(mx::astype(*mask, mx::float32, st), false, st));
  }
  (void)B;
  return mx::array(
      {B, H, L, Dv}, mx::float32,
      std::make_shared<FlashAttention>(st, scale, mode, offset, window, reference, rotate), inputs);
}

}  // namespace mlxterm
