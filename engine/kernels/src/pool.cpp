#include "pool.h"

#include <algorithm>
#include <cstdlib>
#include <sched.h>

namespace mlxterm {

namespace {
// How long an idle worker spins before sleeping. Measured: past ~20 us a spinning worker
// competes with the thread that runs the ops between two matmuls (norms, RoPE, softmax).
constexpr std::chrono::microseconds kSpin{20};

// After the spin, how long an idle worker keeps polling with sched_yield() before it sleeps.
// A yield hands the core to any other runnable thread, so unlike a longer spin it does not
// steal the core the ops between two kernels need, and the next job finds the worker awake
// instead of paying a futex wake-up and the scheduler's latency (a decode step's ~150 jobs
// mostly come < 500 us apart). Measured on SmolLM2 decode under load ~2-3: 0 us 58-62 tok/s,
// 500 us 69-77 tok/s, with less CPU per token.
constexpr std::chrono::microseconds kYield{500};

// The CPUs this process may use (taskset narrows them; set_threads changes the pool later).
int default_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    return n > 0 ? n : 1;
  }
  unsigned n = std::thread::hardware_concurrency();
  return n ? int(n) : 1;
}
}  // namespace

Pool& Pool::get() {
  static Pool pool;
  return pool;
}

Pool::Pool() { start(default_threads()); }

Pool::~Pool() { stop(); }

void Pool::start(int n) {
  n_threads_ = n < 1 ? 1 : n;
  quit_ = false;
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this] { worker(); });
}

void Pool::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    quit_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void Pool::set_threads(int n) {
  std::lock_guard<std::mutex> run_lk(run_mu_);
  if (n == n_threads_) return;
  stop();
  start(n);
}

void Pool::run(int n_chunks, const std::function<void(int)>& fn) {
  if (n_chunks <= 0) return;
  std::lock_guard<std::mutex> run_lk(run_mu_);
  if (n_threads_ == 1 || n_chunks == 1) {
    for (int c = 0; c < n_chunks; ++c) fn(c);
    return;
  }
  job_ = &fn;
  n_chunks_ = n_chunks;
  done_.store(0, std::memory_order_relaxed);
  uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ticket_.store(gen << 32, std::memory_order_release);
  }
  if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
  int mine = 0;
  for (;;) {
    uint64_t t = ticket_.fetch_add(1, std::memory_order_acq_rel);
    int c = int(t & 0xffffffffu);
    if (c >= n_chunks) break;
    fn(c);
    ++mine;
  }
  done_.fetch_add(mine, std::memory_order_acq_rel);
  while (done_.load(std::memory_order_acquire) < n_chunks) _mm_pause();
  // Close this generation before the next run rewrites job_ and n_chunks_: a worker that
  // loaded the exhausted ticket (gen, i) and then reads the *next* job's larger n_chunks_
  // would otherwise claim chunk i of the next job under the old generation (its CAS still
  // matching) and count it in the next run's done_ -- that run could then return while the
  // chunk still runs. With the index parked past any chunk count the stale CAS fails.
  ticket_.store((gen << 32) | 0x7fffffffu, std::memory_order_release);
  job_ = nullptr;
}

void Pool::worker() {
  uint64_t seen = 0;
  const auto spin = kSpin, yield = kYield;
  for (;;) {
    auto t0 = std::chrono::steady_clock::now();
    uint64_t gen;
    int spins = 0;
    bool yielding = false;
    for (;;) {
      gen = ticket_.load(std::memory_order_acquire) >> 32;
      if (gen != seen || quit_.load(std::memory_order_relaxed)) break;
      if (yielding) {
        sched_yield();
      } else {
        _mm_pause();
        if ((++spins & 63) != 0) continue;
      }
      const auto now = std::chrono::steady_clock::now();
      if (!yielding && now - t0 > spin && yield.count() > 0) {
        yielding = true;
        t0 = now;
        continue;
      }
      if (now - t0 > (yielding ? yield : spin)) {
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1, std::memory_order_acq_rel);
        cv_.wait(lk, [&] {
          return (ticket_.load(std::memory_order_acquire) >> 32) != seen || quit_.load();
        });
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        spins = 0;
        yielding = false;
        t0 = std::chrono::steady_clock::now();
      }
    }
    if (quit_.load()) return;
    seen = gen;
    int mine = 0;
    for (;;) {
      // Take a chunk only while the ticket still belongs to the generation we saw.
      uint64_t t = ticket_.load(std::memory_order_acquire);
      if ((t >> 32) != gen || int(t & 0xffffffffu) >= n_chunks_) break;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      // While chunk t is unfinished the caller cannot start another job: job_ is ours.
      (*job_)(int(t & 0xffffffffu));
      ++mine;
    }
    if (mine) done_.fetch_add(mine, std::memory_order_acq_rel);
  }
}

}  // namespace mlxterm
