// A persistent worker pool for the CPU kernels.
//
// Why not std::thread per call or OpenMP: a decode step runs ~200 small matmuls, so waking
// threads must cost microseconds. Workers spin briefly (a spinning worker that outlives the
// gap between two kernels steals the core MLX's own stream thread needs) and then sleep on a
// condition variable. Work is handed out as chunks from one atomic counter, so a core that is
// busy with someone else's process simply takes fewer chunks; results never depend on which
// thread ran a chunk.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <immintrin.h>

namespace mlxterm {

class Pool {
 public:
  static Pool& get();

  // Run fn(chunk) for chunk in [0, n_chunks) on the calling thread and the workers.
  void run(int n_chunks, const std::function<void(int)>& fn);

  int threads() const { return n_threads_; }
  void set_threads(int n);

  ~Pool();

 private:
  Pool();
  void start(int n);
  void stop();
  void worker();

  int n_threads_ = 1;
  std::vector<std::thread> workers_;
  // (generation << 32) | next chunk index; a worker only takes chunks of the generation it saw.
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> quit_{false};
  int n_chunks_ = 0;
  const std::function<void(int)>* job_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::mutex run_mu_;  // one job at a time (several MLX streams may call in)
};

}  // namespace mlxterm
