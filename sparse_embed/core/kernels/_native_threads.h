// Work split over XLA's CPU thread pool, for the FFI kernels of _native_cpu.cc and _native_keys.cc.
#ifndef SPARSE_EMBED_NATIVE_THREADS_H_
#define SPARSE_EMBED_NATIVE_THREADS_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace {

// Runs fn(i) for i in [0, n): on the calling thread and on up to threads - 1 threads of XLA's pool, each taking
// the next index from a shared counter. The caller only waits for helpers that took an index, so a busy pool
// (other devices' programs) never blocks it; a helper that starts late finds nothing left and touches nothing.
struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
  std::mutex mu;
  std::condition_variable done;
  int64_t n = 0;
  const std::function<void(int64_t)>* fn = nullptr;
};

void drain(Shared& s) {
  for (int64_t i; (i = s.next.fetch_add(1)) < s.n;) (*s.fn)(i);
}

void parallel_for(xla::ffi::ThreadPool& pool, int64_t threads, int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  int64_t helpers = std::min<int64_t>(threads - 1, n - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; i++) fn(i);
    return;
  }
  auto shared = std::make_shared<Shared>();
  shared->n = n;
  shared->fn = &fn;
  for (int64_t h = 0; h < helpers; h++) {
    pool.Schedule([shared] {
      shared->active.fetch_add(1);
      drain(*shared);
      if (shared->active.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->done.notify_all();
      }
    });
  }
  drain(*shared);
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->done.wait(lock, [&] { return shared->active.load() == 0; });
}

int64_t thread_count(xla::ffi::ThreadPool& pool, int64_t requested) {
  int64_t available = std::max<int64_t>(pool.num_threads(), 1);  // as many as XLA's pool: one per core
  return requested > 0 ? std::min(requested, available) : available;
}

}  // namespace

#endif  // SPARSE_EMBED_NATIVE_THREADS_H_
