// The fused attention's causal prompt forward with the decode's bits (attention.cpp runs it for
// causal calls without a window and more than one query, unless set_attn_rows(false)).
#include "attention.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "attention_impl.h"
#include "pool.h"

namespace mlxterm {

namespace {

std::atomic<bool>& rows_switch() {
  static std::atomic<bool> on{true};
  return on;
}

}  // namespace

namespace attn {

// A causal prompt forward (no window) with the decode's bits: every query position runs as
// the decode step at that position runs -- its query heads of a KV head as one row set (the
// decode kernels), its keys [0, i + offset + 1) split as a one-position call splits them, each
// split's blocks in order, the splits merged alike -- so the prompt's attention output, and
// with it every later layer's K/V, equal what a token-by-token decode computes and stores
// (issue 30, item 4: a checkpoint replayed cold gives the same answer). The decode's key mask
// adds 0 to a visible key's score, which changes no value. Positions whose keys end in the
// same block split alike, so a task takes up to kRowsGroup of them for one split and reads
// (and, float16, widens) each K/V block once for all of them.
constexpr int kRowsGroup = 32;

void run_flash_rows(const Problem& p) {
  const int rep = p.H / p.Hk;
  struct Group {
    int b, kvh, i0, ni, n_splits, per, part;  // part: first (split, position) part slot, or -1
  };
  struct Task {
    int group, sp;
  };
  std::vector<Group> groups;
  std::vector<Task> tasks;
  int n_parts = 0;
  auto end_of = [&](int i) { return std::min(p.S, i + p.offset + 1); };  // keys position i sees
  for (int b = 0; b < p.B; ++b)
    for (int i0 = 0; i0 < p.L;) {
      const int w = (end_of(i0) - 1) / kBlock;  // its last key block
      int i1 = i0 + 1;
      while (i1 < p.L && i1 - i0 < kRowsGroup && (end_of(i1) - 1) / kBlock == w) ++i1;
      const int blocks = w + 1;
      const int n_splits = key_splits(p.Hk, blocks);
      const int per = (blocks + n_splits - 1) / n_splits;
      for (int kvh = 0; kvh < p.Hk; ++kvh) {
        const int part = n_splits > 1 ? n_parts : -1;
        if (n_splits > 1) n_parts += n_splits * (i1 - i0);
        for (int sp = 0; sp < n_splits; ++sp) tasks.push_back({int(groups.size()), sp});
        groups.push_back({b, kvh, i0, i1 - i0, n_splits, per, part});
      }
      i0 = i1;
    }
  thread_local std::vector<float> kept_part;
  std::vector<float>& part = kept_part;
  const size_t part_stride = size_t(rep) * (p.Dv + 2);
  if (part.size() < size_t(n_parts) * part_stride) part.resize(size_t(n_parts) * part_stride);
  Pool& pool = Pool::get();
  pool.run(int(tasks.size()), [&](int ti) {
    thread_local std::vector<Scratch> scs;
    thread_local std::vector<Split> splits;
    const Group& g = groups[tasks[ti].group];
    const int sp = tasks[ti].sp;
    if (int(scs.size()) < g.ni) scs.resize(g.ni);
    const int s0 = sp * g.per * kBlock, s1 = (sp + 1) * g.per * kBlock;
    int khi = 0;
    for (int j = 0; j < g.ni; ++j) {
      const int e = end_of(g.i0 + j);
      const Split t{g.b, g.kvh, g.i0 + j, 1, std::min(e, s0), std::min(e, s1)};
      if (rep > 8) run_split(p, t, scs[j]);  // the decode's own many-head tiles, position by position
      else begin_split(p, t, scs[j], false);
      khi = std::max(khi, std::min(e, s1));
    }
    if (rep > 8) khi = s0;  // done above
    const HeadKV h = head_kv(p, g.b, g.kvh);
    const Prefetch none{};
    for (int kb = s0; kb < khi; kb += kBlock) {
      auto split_of = [&](int j) {
        const int e = end_of(g.i0 + j);
        return Split{g.b, g.kvh, g.i0 + j, 1, std::min(e, s0), std::min(e, s1)};
      };
      auto keys_of = [&](int j) { return std::min(kBlock, std::min(end_of(g.i0 + j), s1) - kb); };
      if (p.q8) {
        for (int j = 0; j < g.ni; ++j)
          decode_block_q8(p, split_of(j), scs[j], rep, kb, keys_of(j), h.k8 + size_t(kb) * p.kst,
                          h.v8 + size_t(kb) * p.vst, none);
        continue;
      }
      // Every position's scores over the block, then every position's value sums: the K block
      // stays in L1 across positions, then the V block (run position by position, each re-read
      // both from L2). Where every position sees the whole block (all but a group's last
      // block), several positions' rows share each pass over the keys (decode_block_rows).
      // Each position's arithmetic is the decode's, in the decode's order; float16 rows are
      // widened in registers as the decode widens them (half the bytes to keep in L1).
      auto block = [&](const auto* kblk, const auto* vblk) {
        if (keys_of(0) == keys_of(g.ni - 1)) {  // keys_of grows with j: all equal
          splits.clear();
          for (int j = 0; j < g.ni; ++j) splits.push_back(split_of(j));
          decode_block_rows(p, splits.data(), scs.data(), g.ni, rep, kb, keys_of(0), kblk, vblk);
          return;
        }
        for (int j = 0; j < g.ni; ++j) decode_scores(p, scs[j], rep, keys_of(j), kblk, none);
        for (int j = 0; j < g.ni; ++j) decode_pv(p, split_of(j), scs[j], rep, kb, keys_of(j), vblk);
      };
      if (p.half) block(h.k16 + size_t(kb) * p.D, h.v16 + size_t(kb) * p.Dv);
      else block(h.kf32 + size_t(kb) * p.D, h.vf32 + size_t(kb) * p.Dv);
    }
    for (int j = 0; j < g.ni; ++j) {
      const Split t{g.b, g.kvh, g.i0 + j, 1, 0, 0};
      float* dst = g.part < 0 ? nullptr : part.data() + (size_t(g.part) + size_t(sp) * g.ni + j) * part_stride;
      finish_rows(p, t, scs[j], rep, dst);
    }
  });
  if (n_parts == 0) return;
  pool.run(int(groups.size()), [&](int gi) {
    const Group& g = groups[gi];
    if (g.part < 0) return;
    for (int j = 0; j < g.ni; ++j)
      for (int r = 0; r < rep; ++r)
        merge_row(part.data() + (size_t(g.part) + j) * part_stride + size_t(r) * (p.Dv + 2), size_t(g.ni) * part_stride,
                  g.n_splits, p.Dv, out_row(p, g.b, g.kvh * rep + r, g.i0 + j));
  });
}

}  // namespace attn

bool attn_rows_on() { return rows_switch().load(std::memory_order_relaxed); }
bool set_attn_rows(bool on) { return rows_switch().exchange(on); }

}  // namespace mlxterm
