// One raw-id table's touch on two map layouts, in C++ alone (no jax): what issue 46 decided the map's layout by.
//
//   g++ -O3 -march=native -std=c++17 benchmarks/raw_ids_layouts.cc -o /tmp/raw_ids_layouts
//   /tmp/raw_ids_layouts [log2 slots = 20] [shuffled]
//
// A shard of 2^k slots holding 0.8 * 2^k distinct 40-bit ids; 78,000 distinct queries among them (W1: one table's
// distinct ids a step), in random order. Every query is found, its row read and its last-use step set. One
// thread; the caches flushed before each call; the minimum of 15 calls; arrays on 2 MiB pages (madvise).
//
// sorted: the map's layout (core/key_set.py, compact keys): low words in key order, a directory of 2^k / 16
//   exact buckets, `order` (the row of each position) and `last` by row. The queries are put in bucket order
//   (a counting sort, two buckets a bin, as _native_keys.cc), then each is searched in its bucket (an AVX-512
//   count of the keys below it), its row read from `order` and its `last` set: the map is read from low
//   addresses to high. Its parts: the sort, the walk over keys only, + `order`, + `last` (the touch).
// one line: a hash table with the key, the row and the last-use step in one 16-byte entry, four to a 64-byte
//   line, linear probing over lines: one line per id (read, and written back), at random; the line of the
//   query 16 further on prefetched.
// `shuffled`: rows in random order (as admissions give them), else in key order (as load_id_tables gives them).
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <class T>
struct HugePages {  // an allocator of 2 MiB-aligned blocks, advised onto huge pages
  using value_type = T;
  HugePages() = default;
  template <class U>
  HugePages(const HugePages<U>&) {}
  T* allocate(size_t n) {
    const size_t bytes = (n * sizeof(T) + (size_t(2) << 20) - 1) & ~((size_t(2) << 20) - 1);
    void* p = std::aligned_alloc(size_t(2) << 20, bytes);
    madvise(p, bytes, MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  bool operator==(const HugePages&) const { return true; }
  bool operator!=(const HugePages&) const { return false; }
};
template <class T>
using Array = std::vector<T, HugePages<T>>;

uint64_t mix(uint64_t z) {  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

struct Sorted {  // the map's layout, compact keys
  Array<uint32_t> low;
  Array<int32_t> order, last, dir;
  uint32_t shift = 0;
  uint64_t base = 0;
  int64_t buckets = 0;
};

struct Query {
  uint64_t key;
  int32_t bucket, at;
};

// The queries in bucket order (a stable counting sort, two buckets a bin).
void sort_queries(const Sorted& s, const std::vector<uint64_t>& q, std::vector<Query>& out) {
  const int64_t bins = s.buckets / 2;
  std::vector<int32_t> next(size_t(bins + 1), 0), bucket(q.size());
  for (size_t i = 0; i < q.size(); i++) {
    bucket[i] = int32_t((q[i] >> s.shift) - s.base);
    next[size_t(bucket[i] / 2 + 1)]++;
  }
  for (int64_t b = 0; b < bins; b++) next[size_t(b + 1)] += next[size_t(b)];
  for (size_t i = 0; i < q.size(); i++) out[size_t(next[size_t(bucket[i] / 2)]++)] = Query{q[i], bucket[i], int32_t(i)};
}

// The walk over the sorted queries: kOrder reads each hit's row, kLast also sets its last-use step.
template <bool kOrder, bool kLast>
__attribute__((target("avx512f"))) void walk(Sorted& s, const std::vector<Query>& sorted, int32_t step,
                                             std::vector<int32_t>& rows) {
  const int64_t n = int64_t(sorted.size());
  for (int64_t i = 0; i < n; i++) {
    if (i + 64 < n) __builtin_prefetch(&s.low[size_t(s.dir[size_t(sorted[size_t(i + 64)].bucket)])]);
    const Query& x = sorted[size_t(i)];
    const int32_t from = s.dir[size_t(x.bucket)], to = s.dir[size_t(x.bucket + 1)];
    const __m512i want = _mm512_set1_epi32(int32_t(uint32_t(x.key)));
    int32_t below = 0;
    for (int32_t p = from; p < to; p += 16) {
      const __mmask16 m = __mmask16((1u << std::min(16, to - p)) - 1);
      below += __builtin_popcount(_mm512_mask_cmplt_epu32_mask(m, _mm512_maskz_loadu_epi32(m, &s.low[size_t(p)]),
                                                               want));
    }
    const int32_t pos = from + below;
    const bool hit = pos < to && s.low[size_t(pos)] == uint32_t(x.key);
    const int32_t row = hit ? (kOrder ? s.order[size_t(pos)] : pos) : -1;
    rows[size_t(x.at)] = row;
    if (kLast && row >= 0) s.last[size_t(row)] = step;
  }
}

struct Entry {  // the one-line layout's entry
  uint64_t key;
  int32_t row, last;
};
constexpr uint64_t kEmpty = ~uint64_t(0);

void touch_hashed(Array<Entry>& h, const std::vector<uint64_t>& q, int32_t step, std::vector<int32_t>& rows) {
  const int64_t lines = int64_t(h.size()) / 4, n = int64_t(q.size());
  for (int64_t i = 0; i < n; i++) {
    if (i + 16 < n) __builtin_prefetch(&h[size_t((mix(q[size_t(i + 16)]) & uint64_t(lines - 1)) * 4)], 1);
    int32_t row = -1;
    for (int64_t l = int64_t(mix(q[size_t(i)]) & uint64_t(lines - 1));; l = (l + 1) & (lines - 1)) {
      Entry* e = &h[size_t(l * 4)];
      int j = 0;
      for (; j < 4 && e[j].key != kEmpty && e[j].key != q[size_t(i)]; j++) {}
      if (j < 4 && e[j].key == q[size_t(i)]) row = e[j].row, e[j].last = step;
      if (j < 4) break;
    }
    rows[size_t(i)] = row;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int bits = argc > 1 ? std::atoi(argv[1]) : 20;
  const bool shuffled = argc > 2 && std::string(argv[2]) == "shuffled";
  const int64_t n = int64_t(1) << bits, queries = 78000;
  std::mt19937_64 gen(1);
  std::vector<uint64_t> keys(size_t(n * 4 / 5));
  for (auto& k : keys) k = gen() & ((uint64_t(1) << 40) - 1);
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  const int64_t live = int64_t(keys.size());
  std::vector<int32_t> row_of(static_cast<size_t>(live));  // each key's row
  for (int64_t i = 0; i < live; i++) row_of[size_t(i)] = int32_t(i);
  if (shuffled) std::shuffle(row_of.begin(), row_of.end(), gen);

  Sorted s;
  s.buckets = n / 16;
  while (((keys.back() >> s.shift) - (keys.front() >> s.shift)) >= uint64_t(s.buckets)) s.shift++;
  s.base = keys.front() >> s.shift;
  s.low.assign(size_t(n), 0), s.order.assign(size_t(n), 0), s.last.assign(size_t(n), 0);
  s.dir.assign(size_t(s.buckets + 1), 0);
  for (int64_t p = 0; p < live; p++) {
    s.low[size_t(p)] = uint32_t(keys[size_t(p)]), s.order[size_t(p)] = row_of[size_t(p)];
    s.dir[size_t(((keys[size_t(p)] >> s.shift) - s.base) + 1)]++;
  }
  for (int64_t b = 0; b < s.buckets; b++) s.dir[size_t(b + 1)] += s.dir[size_t(b)];

  Array<Entry> h(size_t(n), Entry{kEmpty, -1, 0});  // 16 bytes a slot: 0.8 entries a slot
  const int64_t lines = n / 4;
  for (int64_t p = 0; p < live; p++)
    for (int64_t l = int64_t(mix(keys[size_t(p)]) & uint64_t(lines - 1));; l = (l + 1) & (lines - 1)) {
      Entry* e = &h[size_t(l * 4)];
      int j = 0;
      for (; j < 4 && e[j].key != kEmpty; j++) {}
      if (j < 4) {
        e[j] = Entry{keys[size_t(p)], row_of[size_t(p)], 0};
        break;
      }
    }

  std::vector<uint64_t> q(keys);
  std::shuffle(q.begin(), q.end(), gen);
  q.resize(size_t(std::min(queries, live)));
  std::vector<Query> sorted(q.size());
  std::vector<int32_t> rows(q.size()), want(q.size());
  for (size_t i = 0; i < q.size(); i++)
    want[i] = row_of[size_t(std::lower_bound(keys.begin(), keys.end(), q[i]) - keys.begin())];

  std::vector<uint8_t> flush(size_t(64) << 20, 1);
  const char* names[] = {"sorted: counting sort of the queries", "sorted: walk, keys only", "sorted: walk + order",
                         "sorted: walk + order + last (the touch)", "sorted: sort + touch", "one line: touch"};
  double best[6];
  std::fill(best, best + 6, 1e9);
  for (int rep = 0; rep < 15; rep++)
    for (int v = 0; v < 6; v++) {
      if (v >= 1 && v <= 3) sort_queries(s, q, sorted);
      for (size_t i = 0; i < flush.size(); i += 64) flush[i]++;  // caches cold
      const double t0 = now();
      if (v == 0 || v == 4) sort_queries(s, q, sorted);
      if (v == 1) walk<false, false>(s, sorted, rep, rows);
      if (v == 2) walk<true, false>(s, sorted, rep, rows);
      if (v == 3 || v == 4) walk<true, true>(s, sorted, rep, rows);
      if (v == 5) touch_hashed(h, q, rep, rows);
      best[v] = std::min(best[v], now() - t0);
      if (v >= 2 && rows != want) {
        std::fprintf(stderr, "%s: a wrong row\n", names[v]);
        return 1;
      }
    }
  std::printf("2^%d slots, %lld ids, %zu queries, rows %s (min of 15, ms):\n", bits, (long long)live, q.size(),
              shuffled ? "shuffled" : "in key order");
  for (int v = 0; v < 6; v++) std::printf("  %-42s %.3f\n", names[v], best[v] * 1e3);
  return 0;
}
