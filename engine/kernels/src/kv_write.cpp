// The K/V write of batched decode steps and prompt forwards (see kv_write.h for why).
#include "kv_write.h"

#include <cstring>

#include <immintrin.h>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"
#include "ops.h"

namespace mlxterm {

namespace {

// `out` as `buf`: the same buffer when MLX lets it be reused (nothing else holds it, row
// contiguous), else a row-contiguous copy.
void take_buffer(const mx::array& buf, mx::array& out) {
  if (buf.is_donatable() && buf.flags().row_contiguous) {
    out.copy_shared_buffer(buf);
    return;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
}

// Copy `buf` (any strides, 4 dims) into the row-contiguous `out` (when not shared).
void copy_general(const mx::array& buf, mx::array& out) {
  const size_t es = buf.itemsize();
  const auto& sh = buf.shape();
  const auto& st = buf.strides();
  const char* src = buf.data<char>();
  char* dst = out.data<char>();
  if (buf.flags().row_contiguous) {
    std::memcpy(dst, src, out.nbytes());
    return;
  }
  // A buffer cut to a smaller capacity (a slice along the position axis) keeps its rows of D
  // contiguous: one memcpy per row then, else per element.
  const size_t row = st[3] == 1 ? size_t(sh[3]) * es : es;
  size_t o = 0;
  for (int a = 0; a < sh[0]; ++a)
    for (int b = 0; b < sh[1]; ++b)
      for (int c = 0; c < sh[2]; ++c) {
        const int64_t at = a * st[0] + b * st[1] + c * st[2];
        if (st[3] == 1) {
          std::memcpy(dst + o, src + at * es, row);
          o += row;
          continue;
        }
        for (int d = 0; d < sh[3]; ++d, o += es) std::memcpy(dst + o, src + (at + d * st[3]) * es, es);
      }
}

// n floats (stride `st`) to float16 with F16C: round to nearest even, as MLX's conversion
// (fp16.h, the FP16 library's) does for every number and infinity; NaN lanes then take MLX's
// NaN (sign | 0x7D00) instead of the instruction's payload-keeping one, so the same bits for
// every input. The scalar MLX cast was ~2% of a prompt forward (perf, SmolLM2 280 tokens).
void cast_f16(const float* src, int64_t st, uint16_t* dst, int n) {
  int d = 0;
  if (st == 1) {
    const __m256i nan = _mm256_set1_epi32(0x7D00);
    for (; d + 8 <= n; d += 8) {
      const __m256 v = _mm256_loadu_ps(src + d);
      __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 unord = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
      if (!_mm256_testz_ps(unord, unord)) {  // rare: build MLX's NaN from the sign bits
        const __m256i sign = _mm256_srli_epi32(_mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(int(0x80000000u))), 16);
        const __m256i q = _mm256_or_si256(sign, nan);
        const __m128i q16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        const __m256i m32 = _mm256_castps_si256(unord);
        const __m128i m16 = _mm_packs_epi32(_mm256_castsi256_si128(m32), _mm256_extracti128_si256(m32, 1));
        h = _mm_blendv_epi8(h, q16, m16);
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), h);
    }
  }
  for (; d < n; ++d) {
    const mx::float16_t h = static_cast<mx::float16_t>(src[d * st]);
    std::memcpy(dst + d, &h, sizeof(h));
  }
}

// Rows l of head h, batch row b of `x` (B, H, L, D) at positions pos[b] + l of `out` (B, H,
// S, D), each row outside [0, S) skipped: a byte copy when the dtypes agree, else float32 cast
// to out's dtype (float16: cast_f16; bfloat16: MLX's own conversion) -- astype's bits.
void write_rows(const mx::array& x, mx::array& out, const int32_t* pos) {
  const int B = out.shape(0), H = out.shape(1), S = out.shape(2), D = out.shape(3);
  const int L = x.shape(2);
  const auto& xs = x.strides();
  const bool same = x.dtype() == out.dtype();
  const size_t es = out.itemsize();
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int l = 0; l < L; ++l) {
        const int p = pos[b] + l;
        if (p < 0 || p >= S) continue;
        const size_t at = ((size_t(b) * H + h) * S + p) * D;
        const int64_t from = b * xs[0] + h * xs[1] + l * xs[2];
        if (same) {
          const char* src = x.data<char>();
          if (xs[3] == 1) {
            std::memcpy(out.data<char>() + at * es, src + from * es, D * es);
          } else {
            for (int d = 0; d < D; ++d) std::memcpy(out.data<char>() + (at + d) * es, src + (from + d * xs[3]) * es, es);
          }
          continue;
        }
        const float* src = x.data<float>() + from;
        if (out.dtype() == mx::float16) {
          cast_f16(src, xs[3], out.data<uint16_t>() + at, D);
        } else {
          auto* dst = out.data<mx::bfloat16_t>() + at;
          for (int d = 0; d < D; ++d) dst[d] = static_cast<mx::bfloat16_t>(src[d * xs[3]]);
        }
      }
}

}  // namespace

void KvWriteRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& buf = inputs[0];
  take_buffer(buf, out);
  const bool shared = out.data_shared_ptr() == buf.data_shared_ptr();
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  // Weak copies, as MLX's own CPU ops capture arrays: the graph keeps them alive until done.
  enc.dispatch([buf = mx::array::unsafe_weak_copy(buf), x = mx::array::unsafe_weak_copy(inputs[1]),
                pos = mx::array::unsafe_weak_copy(inputs[2]), out = mx::array::unsafe_weak_copy(out),
                shared]() mutable {
    if (!shared) copy_general(buf, out);
    write_rows(x, out, pos.data<int32_t>());
  });
}

void KvWriteRows::eval_gpu(const std::vector<mx::array>&, mx::array&) { gpu_unsupported(); }

mx::array kv_write_rows(const mx::array& buf, const mx::array& x, const mx::array& pos, mx::StreamOrDevice s) {
  auto st = cpu_stream(s, "kv_write_rows");
  const auto T = buf.dtype();
  const bool fits = buf.ndim() == 4 && x.ndim() == 4 && x.shape(0) == buf.shape(0) && x.shape(1) == buf.shape(1) &&
                    x.shape(3) == buf.shape(3) &&
                    (x.dtype() == T || (x.dtype() == mx::float32 && (T == mx::float16 || T == mx::bfloat16)));
  if (!fits)
    throw std::invalid_argument("[mlxterm.kv_write_rows] buf (B, H, S, D), rows (B, H, L, D) of its dtype or float32.");
  if (pos.ndim() != 1 || pos.shape(0) != buf.shape(0) || pos.dtype() != mx::int32)
    throw std::invalid_argument("[mlxterm.kv_write_rows] pos must be int32 (B,).");
  return mx::array(buf.shape(), T, std::make_shared<KvWriteRows>(st), {buf, x, contiguous_in(pos, st)});
}

}  // namespace mlxterm
