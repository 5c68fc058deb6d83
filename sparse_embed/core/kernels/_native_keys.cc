// The raw-id map's key search (core/key_set.py `find`) in C++, through XLA's typed FFI (see native_cpu.py).
//
// slots[i] = the slot of the set holding key q[i], or -1. Found as key_set.lower_bound finds it: the
// query's directory bucket (the same float32 arithmetic as `_bucket`, so the same bucket), then a binary
// search of that bucket's positions of `sorted_keys` (side by side: one or two cache lines), then `order`
// at the position found. Keys in a set are distinct, so the answer is the generic search's, bit for bit.
// Queries go in groups of kGroup, one phase at a time for the whole group (directory, bucket, search,
// order), with every phase's loads prefetched first: their cache misses overlap, three per query in all.
// Chunks of kChunk queries run on XLA's thread pool; each query's answer is its own, whatever the threads.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "_native_threads.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kChunk = 4096;  // queries per task of the thread pool

// The 64-bit key in row i of `keys [.., 2]` (two int32 words, high first).
inline uint64_t key_of(const int32_t* keys, int64_t i) {
  return (uint64_t(uint32_t(keys[2 * i])) << 32) | uint32_t(keys[2 * i + 1]);
}

// key_set._bucket: floor((value(q) - span[0]) * span[1]), NaN -> 0, clipped to [0, buckets - 1].
inline int32_t bucket_of(uint64_t key, float first, float scale, int64_t buckets) {
  const float value = float(uint32_t(key >> 32)) * 4294967296.0f + float(uint32_t(key));
  float x = std::floor((value - first) * scale);
  if (std::isnan(x)) x = 0.0f;
  return int32_t(std::min(std::max(x, 0.0f), float(buckets - 1)));
}

// Searches queries [from, to) (see the top of the file).
void search(const int32_t* k, const int32_t* ord, const int32_t* dir, const int32_t* q, int32_t* out, int64_t n,
            int64_t live, int64_t buckets, float first, float scale, int64_t from, int64_t to) {
  uint64_t want[kGroup];
  int64_t base[kGroup], len[kGroup], end[kGroup];
  int32_t bucket[kGroup];
  for (int64_t g = from; g < to; g += kGroup) {
    const int64_t m = std::min(kGroup, to - g);
    for (int64_t j = 0; j < m; j++) {
      want[j] = key_of(q, g + j);
      bucket[j] = bucket_of(want[j], first, scale, buckets);
      __builtin_prefetch(dir + bucket[j]);
    }
    int64_t longest = 0;
    for (int64_t j = 0; j < m; j++) {
      base[j] = dir[bucket[j]];
      end[j] = q[2 * (g + j)] == -1 ? base[j] : dir[bucket[j] + 1];  // a free marker finds nothing
      len[j] = end[j] - base[j];
      longest = std::max(longest, len[j]);
      __builtin_prefetch(k + 2 * std::min(base[j], n - 1));
      __builtin_prefetch(k + 2 * std::max(std::min(end[j], n) - 1, int64_t(0)));
    }
    // Branch-free halving, the same number of rounds for the whole group: the lower bound lies in
    // [base, base + len]; a round with len == 1 compares and changes nothing.
    for (; longest > 1; longest -= longest / 2)
      for (int64_t j = 0; j < m; j++) {
        const int64_t half = len[j] / 2;
        base[j] += half & -int64_t(key_of(k, std::min(base[j] + half, n - 1)) < want[j]);  // no branch
        len[j] -= half;
      }
    for (int64_t j = 0; j < m; j++) {
      const int64_t pos = base[j] + (len[j] == 1 && key_of(k, std::min(base[j], n - 1)) < want[j]);
      const bool hit = pos < end[j] && pos < live && key_of(k, std::min(pos, n - 1)) == want[j];
      base[j] = hit ? pos : -1;
      if (hit) __builtin_prefetch(ord + pos);
    }
    for (int64_t j = 0; j < m; j++) out[g + j] = base[j] >= 0 ? ord[base[j]] : -1;
  }
}

ffi::Error FindKeys(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> sorted_keys, ffi::Buffer<ffi::S32> order,
                    ffi::Buffer<ffi::S32> size, ffi::Buffer<ffi::S32> directory, ffi::Buffer<ffi::F32> span, ffi::Buffer<ffi::S32> queries,
                    ffi::ResultBuffer<ffi::S32> slots, int64_t threads) {
  const int32_t* k = sorted_keys.typed_data();
  const int32_t* ord = order.typed_data();
  const int32_t* dir = directory.typed_data();
  const int32_t* q = queries.typed_data();
  int32_t* out = slots->typed_data();
  const int64_t n = int64_t(order.element_count()), live = size.typed_data()[0];
  const int64_t buckets = int64_t(directory.element_count()) - 1, count = int64_t(slots->element_count());
  const float first = span.typed_data()[0], scale = span.typed_data()[1];
  if (n == 0 || buckets < 1) {
    std::fill(out, out + count, -1);
    return ffi::Error::Success();
  }
  parallel_for(pool, thread_count(pool, threads), (count + kChunk - 1) / kChunk, [&](int64_t c) {
    search(k, ord, dir, q, out, n, live, buckets, first, scale, c * kChunk, std::min(count, (c + 1) * kChunk));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseEmbedFindKeys, FindKeys,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sorted_keys [N, 2]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // order [N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // size []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // directory [B + 1]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // span [2]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // queries [Q, 2]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // slots [Q]
                                  .Attr<int64_t>("threads"));
