// The raw-id map's key search (core/key_set.py `find` and `touch`) in C++, through XLA's typed FFI (see
// native_cpu.py).
//
// slots[i] = the slot of the set holding key q[i], or -1. Found as key_set.lower_bound finds it: the
// query's directory bucket (the same float32 arithmetic as `_bucket`, so the same bucket), then the lower
// bound among that bucket's positions of `sorted_keys` (side by side: one or two cache lines), then `order`
// at the position found. Keys in a set are distinct, so the answer is the generic search's, bit for bit.
// The lower bound is a count of the bucket's keys below the query with AVX-512 where the CPU has it (a few
// vector compares instead of ~5 halving rounds, each waiting on the load of the last), else a branch-free binary
// search (_native_isa.h: the process's instruction set). Both give the same position.
// `touch_keys_many` also sets last[slot] = step for each key found that is not stale (last >= stale_before),
// in place: the train step's last-use update, without a scatter of its own (for several sets in one call).
//
// The queries are first put in bucket order (a counting sort), so the searches walk the directory, the keys
// and `order` from low addresses to high: neighbouring queries share cache lines and the hardware prefetcher
// runs ahead. They then go in groups of kGroup, one phase at a time for the whole group (directory, bucket,
// search), with every phase's loads prefetched first, so that their cache misses overlap; the dependent
// loads after the search (`order`, then `last`) are done one and two groups later (see `search`).
// Chunks of kChunk sorted queries run on XLA's thread pool; each query's answer is its own, whatever the
// threads (the queries are distinct keys, so no two touch one slot).
// A compact set (sorted_keys [N]: low words; key_set's module docstring) has exact buckets, (key >> shift) -
// base; a bucket's keys share their high word, so the search compares low words (sixteen per AVX-512 compare).
// A query outside the buckets' range has bucket -1: it finds nothing.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "_native_isa.h"
#include "_native_threads.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kAhead = 64;  // queries between a bucket's prefetch and its search
constexpr int64_t kChunk = 4096;  // queries per task of the thread pool
constexpr size_t kKeepScratch = size_t(64) << 20;  // a thread keeps its sort's scratch up to this size

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "key_of reads a key's two words as one integer");

// The 64-bit key in row i of `keys [.., 2]` (two int32 words, high first): one load, the words swapped.
inline uint64_t key_of(const int32_t* keys, int64_t i) {
  uint64_t x;
  std::memcpy(&x, keys + 2 * i, sizeof x);
  return (x << 32) | (x >> 32);
}

// key_set._value: the key as a float32 number (the product is exact: one rounding, as in XLA).
inline float value_of(uint64_t key) { return float(uint32_t(key >> 32)) * 4294967296.0f + float(uint32_t(key)); }

// key_set._bucket: floor((value(q) - span[0]) * span[1]), NaN -> 0, clipped to [0, buckets - 1]. Without
// std::floor (a libm call on baseline x86-64): below 1 the clip gives 0 either way, and from there on floor is
// the truncation of a float conversion.
inline int32_t bucket_of(uint64_t key, float first, float scale, int64_t buckets) {
  const float x = (value_of(key) - first) * scale, top = float(buckets - 1);
  return x >= top ? int32_t(buckets - 1) : x >= 1.0f ? int32_t(x) : 0;  // NaN compares false: 0
}

struct Set {
  const int32_t* keys;    // sorted_keys [n, 2] (compact: [n])
  const int32_t* order;   // [n]
  const int32_t* dir;     // [buckets + 1]
  int64_t n, live, buckets;
  float first, scale;     // wide: span
  bool compact;
  uint32_t shift;         // compact: span
  uint64_t base;
};

// A compact set's bucket of a key (-1: outside the buckets' range).
inline int32_t compact_bucket(uint64_t key, uint32_t shift, uint64_t base, int64_t buckets) {
  const uint64_t x = key >> shift;  // shift <= 32
  return x >= base && x - base < uint64_t(buckets) ? int32_t(x - base) : -1;
}

// How a search reads the keys: the wide layout's 64-bit keys, or a compact one's low words.
struct WideKeys {
  using Key = uint64_t;
  static Key at(const int32_t* k, int64_t i) { return key_of(k, i); }
  static Key want(uint64_t key) { return key; }
  static const int32_t* addr(const int32_t* k, int64_t i) { return k + 2 * i; }
};
struct CompactKeys {
  using Key = uint32_t;
  static Key at(const int32_t* k, int64_t i) { return uint32_t(k[i]); }
  static Key want(uint64_t key) { return uint32_t(key); }
  static const int32_t* addr(const int32_t* k, int64_t i) { return k + i; }
};

struct Touch {  // last-use update of touch_keys (last == nullptr: find only)
  int32_t* last;
  int32_t step, stale_before;
};

struct Query {  // a query in sorted order: its key, bucket and index
  uint64_t key;
  int32_t bucket, at;
};

// The answers of one group of queries on their way out: positions found (-1: none), then slots.
struct Pending {
  int64_t m = 0;
  int32_t at[kGroup];
  int64_t pos[kGroup];
  int32_t slot[kGroup];
};

// The lower bounds of one group's queries: pos[j] = the first position in [base[j], end[j]] whose key is not
// below want[j] (end[j] if none), for keys sorted and distinct.
template <class Keys>
struct Halving {  // portable: branch-free halving, the same number of rounds for the whole group
  static void lower_bounds(const int32_t* k, int64_t n, int64_t m, const uint64_t* want, const int64_t* base,
                           const int64_t* end, int64_t* pos) {
    int64_t len[kGroup], longest = 0;
    for (int64_t j = 0; j < m; j++) {
      pos[j] = base[j];
      len[j] = end[j] - base[j];
      longest = std::max(longest, len[j]);
    }
    // The lower bound lies in [pos, pos + len]; a round with len == 1 compares and changes nothing.
    for (; longest > 1; longest -= longest / 2)
      for (int64_t j = 0; j < m; j++) {
        const int64_t half = len[j] / 2;
        pos[j] += half & -int64_t(Keys::at(k, std::min(pos[j] + half, n - 1)) < Keys::want(want[j]));  // no branch
        len[j] -= half;
      }
    for (int64_t j = 0; j < m; j++)
      pos[j] += len[j] == 1 && Keys::at(k, std::min(pos[j], n - 1)) < Keys::want(want[j]);
  }
};

#if defined(__x86_64__)
struct Avx512Count {  // the keys below want[j], eight per compare (masked loads: nothing read past the bucket)
  // The first 24 keys of a bucket (a bucket holds ~13) in three compares under one mask and one count,
  // whatever its length (mask bits clear past its end): no loop and no branch for all but the rare longer
  // bucket. (A loop of three, counting each compare, would add a branch and a dependent count per compare.)
  static constexpr int64_t kFixed = 24;
  // The bits of `in` whose key among the eight at `at` is below w.
  __attribute__((target("avx512f"), always_inline)) static uint32_t below(const int32_t* at, __mmask8 in,
                                                                          __m512i w) {
    const __m512i keys = _mm512_maskz_rol_epi64(in, _mm512_maskz_loadu_epi64(in, at), 32);  // words swapped
    return _mm512_mask_cmplt_epu64_mask(in, keys, w);
  }
  // The keys of [i, to) below w, at most kFixed of them: bit r of the result is key i + r's.
  __attribute__((target("avx512f"), always_inline)) static uint32_t below(const int32_t* k, int64_t i, int64_t to,
                                                                          __m512i w) {
    const uint32_t in = uint32_t((uint64_t(1) << std::clamp<int64_t>(to - i, 0, kFixed)) - 1);
    const int32_t* at = k + 2 * i;
    return below(at, __mmask8(in), w) | below(at + 16, __mmask8(in >> 8), w) << 8 |
           below(at + 32, __mmask8(in >> 16), w) << 16;
  }
  __attribute__((target("avx512f"))) static void lower_bounds(const int32_t* k, int64_t n, int64_t m,
                                                               const uint64_t* want, const int64_t* base,
                                                               const int64_t* end, int64_t* pos) {
    for (int64_t j = 0; j < m; j++) {
      const __m512i w = _mm512_set1_epi64(int64_t(want[j]));
      const int64_t from = base[j], to = std::min(end[j], n);
      int64_t count = __builtin_popcount(below(k, from, to, w));
      for (int64_t i = from + kFixed; i < to; i += kFixed) count += __builtin_popcount(below(k, i, to, w));
      pos[j] = from + count;
    }
  }
};

struct Avx512CountCompact {  // Avx512Count on a compact set's low words: sixteen per compare
  static constexpr int64_t kFixed = 32;
  __attribute__((target("avx512f"), always_inline)) static uint32_t below(const int32_t* k, int64_t i, int64_t to,
                                                                          __m512i w) {
    const uint32_t in = uint32_t((uint64_t(1) << std::clamp<int64_t>(to - i, 0, kFixed)) - 1);
    const __m512i a = _mm512_maskz_loadu_epi32(__mmask16(in), k + i);
    const __m512i b = _mm512_maskz_loadu_epi32(__mmask16(in >> 16), k + i + 16);
    return uint32_t(_mm512_mask_cmplt_epu32_mask(__mmask16(in), a, w)) |
           uint32_t(_mm512_mask_cmplt_epu32_mask(__mmask16(in >> 16), b, w)) << 16;
  }
  __attribute__((target("avx512f"))) static void lower_bounds(const int32_t* k, int64_t n, int64_t m,
                                                               const uint64_t* want, const int64_t* base,
                                                               const int64_t* end, int64_t* pos) {
    for (int64_t j = 0; j < m; j++) {
      const __m512i w = _mm512_set1_epi32(int32_t(uint32_t(want[j])));
      const int64_t from = base[j], to = std::min(end[j], n);
      int64_t count = __builtin_popcount(below(k, from, to, w));
      for (int64_t i = from + kFixed; i < to; i += kFixed) count += __builtin_popcount(below(k, i, to, w));
      pos[j] = from + count;
    }
  }
};
#endif

// Searches the sorted queries [from, to) (see the top of the file). Software-pipelined over groups: while one
// group searches its buckets, the group before reads `order` at the positions it found (prefetched when it
// found them) and the one before that updates `last` (prefetched when its slots were known), so the misses of
// those dependent loads overlap a whole group's search instead of stalling it.
// Returns how many of them it did not find, free markers aside.
template <class Keys, class LowerBound>
int64_t search(const Set& s, const Query* sorted, const Touch& t, int32_t* out, int64_t from, int64_t to) {
  const int32_t* k = s.keys;
  const int64_t n = s.n;
  uint64_t want[kGroup];
  int64_t base[kGroup], end[kGroup], pos[kGroup];
  Pending buf[3];  // this group and the last (positions found; swapped each round), the one before (slots)
  Pending *now = &buf[0], *found = &buf[1], *slotted = &buf[2];
  int64_t hits = 0, markers = 0;
  auto touch = [&](const Pending& p) {
    if (t.last)
      for (int64_t j = 0; j < p.m; j++)
        if (p.slot[j] >= 0 && t.last[p.slot[j]] >= t.stale_before) t.last[p.slot[j]] = t.step;
  };
  auto take_slots = [&](const Pending& p, Pending& into) {  // order at the positions found; prefetch last
    into.m = p.m;
    for (int64_t j = 0; j < p.m; j++) {
      into.slot[j] = p.pos[j] >= 0 ? s.order[p.pos[j]] : -1;
      out[p.at[j]] = into.slot[j];
      if (t.last && into.slot[j] >= 0) __builtin_prefetch(t.last + into.slot[j], 1);
    }
  };
  for (int64_t g = from; g < to; g += kGroup) {
    const int64_t m = std::min(kGroup, to - g);
    now->m = m;
    for (int64_t j = 0; j < m; j++) {
      now->at[j] = sorted[g + j].at;
      want[j] = sorted[g + j].key;
      // The bucket of the query kAhead further on: its keys are on their way when its group comes.
      const int64_t ahead = std::min(g + j + kAhead, to - 1);
      const int32_t* first = Keys::addr(k, std::min<int64_t>(s.dir[std::max(sorted[ahead].bucket, 0)], n - 1));
      __builtin_prefetch(first);
      __builtin_prefetch(first + 16);
    }
    for (int64_t j = 0; j < m; j++) {
      const int32_t b = sorted[g + j].bucket;  // -1: outside a compact set's range
      base[j] = b < 0 ? 0 : s.dir[b];
      end[j] = b < 0 || int32_t(want[j] >> 32) == -1 ? base[j] : s.dir[b + 1];  // a free marker finds nothing
      __builtin_prefetch(Keys::addr(k, std::min(base[j], n - 1)));
      __builtin_prefetch(Keys::addr(k, std::max(std::min(end[j], n) - 1, int64_t(0))));
    }
    LowerBound::lower_bounds(k, n, m, want, base, end, pos);
    for (int64_t j = 0; j < m; j++) {
      const bool hit = pos[j] < end[j] && pos[j] < s.live &&
                       Keys::at(k, std::min(pos[j], n - 1)) == Keys::want(want[j]);
      now->pos[j] = hit ? pos[j] : -1;
      hits += hit;
      markers += int32_t(want[j] >> 32) == -1;
      if (hit) __builtin_prefetch(s.order + pos[j]);
    }
    touch(*slotted);               // the group before last: its last-use steps
    take_slots(*found, *slotted);  // the last group: its slots
    std::swap(found, now);         // this group's positions are the next round's last group
  }
  touch(*slotted);
  take_slots(*found, *slotted);
  touch(*slotted);
  return (to - from) - hits - markers;
}

// search on the process's instruction set: with AVX-512, its vector count; else halving.
int64_t search_on_isa(const Set& s, const Query* sorted, const Touch& t, int32_t* out, int64_t from, int64_t to) {
#if defined(__x86_64__)
  if (process_isa() == Isa::kAvx512)
    return run_avx512([&] {
      return s.compact ? search<CompactKeys, Avx512CountCompact>(s, sorted, t, out, from, to)
                       : search<WideKeys, Avx512Count>(s, sorted, t, out, from, to);
    });
#endif
  return with_isa([&] {
    return s.compact ? search<CompactKeys, Halving<CompactKeys>>(s, sorted, t, out, from, to)
                     : search<WideKeys, Halving<WideKeys>>(s, sorted, t, out, from, to);
  });
}

// Scratch of the counting sort, kept per calling thread (devices of one process call from their own threads).
struct Scratch {
  std::vector<int32_t> bucket, start;
  std::vector<Query> sorted;
};

// Finds (and with t.last, touches) every query; see the top of the file. Returns how many it did not find,
// free markers (hi word -1: they find nothing) aside. The markers after the last key (where a batch's distinct
// ids and `unique_keys` leave them: the padding of the queries' static size) are answered without the sort and
// search.
int64_t find_all(ffi::ThreadPool& pool, int64_t threads, const Set& s, const int32_t* q, int64_t count,
                 const Touch& t, int32_t* out) {
  const int64_t all = count;
  while (count > 0 && q[2 * (count - 1)] == -1) count--;
  std::fill(out + count, out + all, -1);
  if (s.n == 0 || s.buckets < 1) {
    std::fill(out, out + count, -1);
    int64_t missing = 0;
    for (int64_t i = 0; i < count; i++) missing += q[2 * i] != -1;
    return missing;
  }
  // A stable counting sort by bucket >> shift (at most max(count / 2, 4096) bins, so a large set with few
  // queries costs no more: fewer bins keep the counts in cache, more put the queries closer to bucket order),
  // its two passes split over the threads: the order is the same for any number of parts.
  int shift = 0;
  while ((s.buckets >> shift) > std::max<int64_t>(count / 2, 4096)) shift++;
  const int64_t bins = ((s.buckets - 1) >> shift) + 1, nt = thread_count(pool, threads);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(nt, count / kChunk));
  thread_local Scratch scratch;
  scratch.bucket.resize(count);
  scratch.sorted.resize(count);  // the search reads them front to back
  scratch.start.assign(parts * bins, 0);
  int32_t* bucket = scratch.bucket.data();
  int32_t* start = scratch.start.data();  // [parts, bins]: counts, then where each part's next query goes
  Query* sorted = scratch.sorted.data();
  const auto part = [&](int64_t p) { return std::make_pair(p * count / parts, (p + 1) * count / parts); };
  parallel_for(pool, nt, parts, [&](int64_t p) {
    int32_t* counts = start + p * bins;
    const auto [from, to] = part(p);
    with_isa([&] {  // on the process's instruction set: the bucket pass vectorises
      if (s.compact)
        for (int64_t i = from; i < to; i++) bucket[i] = compact_bucket(key_of(q, i), s.shift, s.base, s.buckets);
      else
        for (int64_t i = from; i < to; i++) bucket[i] = bucket_of(key_of(q, i), s.first, s.scale, s.buckets);
    });
    for (int64_t i = from; i < to; i++) counts[std::max(bucket[i], 0) >> shift]++;  // apart: the loop above vectorises
  });
  for (int64_t b = 0, before = 0; b < bins; b++)
    for (int64_t p = 0; p < parts; p++) {
      const int32_t c = start[p * bins + b];
      start[p * bins + b] = int32_t(before);
      before += c;
    }
  parallel_for(pool, nt, parts, [&](int64_t p) {
    int32_t* next = start + p * bins;
    for (auto [i, to] = part(p); i < to; i++)
      sorted[next[std::max(bucket[i], 0) >> shift]++] = Query{key_of(q, i), bucket[i], int32_t(i)};
  });
  std::atomic<int64_t> missing{0};
  parallel_for(pool, nt, (count + kChunk - 1) / kChunk, [&](int64_t c) {
    missing += search_on_isa(s, sorted, t, out, c * kChunk, std::min(count, (c + 1) * kChunk));
  });
  if (scratch.sorted.capacity() * sizeof(Query) > kKeepScratch) scratch = Scratch();  // a rare huge call
  return missing;
}

// The result an argument is aliased to (the usual case; else, when XLA gave a separate buffer, a copy of it).
template <class In, class Out>
auto* in_place(In& in, Out& out) {
  if (in.untyped_data() != out->untyped_data()) std::copy_n(in.typed_data(), in.element_count(), out->typed_data());
  return out->typed_data();
}

// A set's span: wide, float32 [2] (first, scale); compact, int32 [3] (shift, base's high and low word).
Set set_of(ffi::Buffer<ffi::S32>& sorted_keys, ffi::Buffer<ffi::S32>& order, ffi::Buffer<ffi::S32>& size,
           ffi::Buffer<ffi::S32>& directory, ffi::AnyBuffer& span) {
  Set s{sorted_keys.typed_data(), order.typed_data(), directory.typed_data(), int64_t(order.element_count()),
        size.typed_data()[0], int64_t(directory.element_count()) - 1, 0.0f, 0.0f, sorted_keys.dimensions().size() == 1,
        0, 0};
  if (s.compact) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(span.untyped_data());
    s.shift = w[0], s.base = uint64_t(w[1]) << 32 | w[2];
  } else {
    s.first = span.typed_data<float>()[0], s.scale = span.typed_data<float>()[1];
  }
  return s;
}

ffi::Error FindKeys(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> sorted_keys, ffi::Buffer<ffi::S32> order,
                    ffi::Buffer<ffi::S32> size, ffi::Buffer<ffi::S32> directory, ffi::AnyBuffer span,
                    ffi::Buffer<ffi::S32> queries, ffi::ResultBuffer<ffi::S32> slots, int64_t threads) {
  find_all(pool, threads, set_of(sorted_keys, order, size, directory, span), queries.typed_data(),
           int64_t(slots->element_count()), Touch{nullptr, 0, 0}, slots->typed_data());
  return ffi::Error::Success();
}

// touch_keys for several sets in one call (a train step's raw-id stacks): with at least as many sets as
// threads, each set's touch runs on one thread and the sets spread over the pool (one call keeps both cores
// busy throughout, where XLA ran the stacks' touch_keys one after another, each joining its own helpers);
// with fewer, one after another on all threads. The same answers either way.
// Args: step, then per set (sorted_keys, order, size, directory, span, queries, stale_before, last[, slot_of,
// values]); results per set (slots, last (aliased), missing[, rows, gains]). With `entries`, each set also hands
// its entries their rows (key_set.entry_rows: rows[e] = slots[slot_of[e]], or N (the set's size) where there is
// none; gains[e] = values[e] there, else 0), in the same pass: no gather and select of their own.
ffi::Error TouchKeysMany(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> step, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, int64_t threads, int64_t entries) {
  const int64_t n_args = entries ? 10 : 8, n_rets = entries ? 5 : 3, sets = int64_t(rets.size()) / n_rets;
  if (int64_t(args.size()) != n_args * sets || int64_t(rets.size()) != n_rets * sets)
    return ffi::Error::InvalidArgument("sparse_embed touch_keys_many: 8 arguments and 3 results per set (with "
                                       "entries: 10 and 5)");
  struct Job {
    Set set;
    const int32_t* queries;
    int64_t count;
    Touch touch;
    int32_t *slots, *missing;
    const int32_t* slot_of = nullptr;  // with entries
    const float* values = nullptr;
    int32_t* rows = nullptr;
    float* gains = nullptr;
    int64_t n_entries = 0;
  };
  std::vector<Job> jobs;
  for (int64_t i = 0; i < sets; i++) {
    auto arg = [&](int64_t k) { return args.get<ffi::Buffer<ffi::S32>>(size_t(n_args * i + k)); };
    auto ret = [&](int64_t k) { return rets.get<ffi::Buffer<ffi::S32>>(size_t(n_rets * i + k)); };
    auto keys = arg(0), order = arg(1), size = arg(2), dir = arg(3), queries = arg(5), stale = arg(6), last = arg(7);
    auto span = args.get<ffi::AnyBuffer>(size_t(n_args * i + 4));
    auto slots = ret(0), last_out = ret(1), missing = ret(2);
    if (!keys.has_value() || !order.has_value() || !size.has_value() || !dir.has_value() || !span.has_value() ||
        !queries.has_value() || !stale.has_value() || !last.has_value() || !slots.has_value() ||
        !last_out.has_value() || !missing.has_value())
      return ffi::Error::InvalidArgument("sparse_embed touch_keys_many: a set's buffers have the wrong types");
    Job job{set_of(*keys, *order, *size, *dir, *span), queries->typed_data(), int64_t((*slots)->element_count()),
            Touch{in_place(*last, *last_out), step.typed_data()[0], stale->typed_data()[0]},
            (*slots)->typed_data(), (*missing)->typed_data()};
    if (entries) {
      auto slot_of = arg(8);
      auto rows = ret(3);
      auto values = args.get<ffi::Buffer<ffi::F32>>(size_t(n_args * i + 9));
      auto gains = rets.get<ffi::Buffer<ffi::F32>>(size_t(n_rets * i + 4));
      if (!slot_of.has_value() || !values.has_value() || !rows.has_value() || !gains.has_value() ||
          slot_of->element_count() != values->element_count() ||
          (*rows)->element_count() != slot_of->element_count())
        return ffi::Error::InvalidArgument("sparse_embed touch_keys_many: a set's entries have the wrong types");
      job.slot_of = slot_of->typed_data(), job.values = values->typed_data();
      job.rows = (*rows)->typed_data(), job.gains = (*gains)->typed_data();
      job.n_entries = int64_t(slot_of->element_count());
    }
    jobs.push_back(job);
  }
  const int64_t nt = thread_count(pool, threads);
  const auto run = [&](int64_t i, int64_t on) {
    const Job& j = jobs[size_t(i)];
    *j.missing = int32_t(find_all(pool, on, j.set, j.queries, j.count, j.touch, j.slots));
    const int32_t none = int32_t(j.set.n);
    for (int64_t e = 0; e < j.n_entries; e++) {
      const int32_t at = j.slot_of[e];
      const int32_t row = at >= 0 && at < j.count && j.slots[at] >= 0 ? j.slots[at] : none;
      j.rows[e] = row;
      j.gains[e] = row < none ? j.values[e] : 0.0f;
    }
  };
  if (sets >= nt)
    parallel_for(pool, nt, sets, [&](int64_t i) { run(i, 1); });
  else
    for (int64_t i = 0; i < sets; i++) run(i, nt);
  return ffi::Error::Success();
}

// --- insert (key_set.insert): the same slots, set and counts, bit for bit, in O(N) passes without a sort of
// the set. The generic version's O(N) scatters go over the whole set at random on XLA:CPU, on every step
// that admits an id; here: the live keys that go are compacted out (front to back), the new keys merged in
// (back to front, from the first insertion point on), the free slots rewritten only when a slot was freed, and
// the directory updated by bucket counts while the span (the smallest and largest key) stays put.

struct InsertScratch {  // per calling thread, like Scratch
  std::vector<std::pair<uint64_t, int32_t>> add;  // wanted keys in key order, with their query index
  std::vector<int32_t> lru, avail, delta, count;  // lru: the slots evicted, by slot
  std::vector<uint8_t> mark;  // by slot
};

// key_set._least_recent's choice among the slots `candidate(slot)` says: into sc.lru, by slot, the `need` of
// them (or all, if fewer) used longest ago, ties in key order. Sequential passes over the slots (count, then a
// histogram of their steps or, for a range over 2**20, a selection; then the choice); the ties at the
// threshold step, if some must go, by a pass over the positions that stops once they are found.
template <class Candidate>
void choose_least_recent(Candidate candidate, const int32_t* order, const int32_t* last, int64_t n, int64_t live,
                         int64_t need, InsertScratch& sc) {
  int64_t candidates = 0;
  int32_t lo = INT32_MAX, hi = INT32_MIN;
  for (int64_t slot = 0; slot < n; slot++)
    if (candidate(slot)) candidates++, lo = std::min(lo, last[slot]), hi = std::max(hi, last[slot]);
  sc.lru.clear();
  if (candidates <= need) {
    for (int64_t slot = 0; slot < n; slot++)
      if (candidate(slot)) sc.lru.push_back(int32_t(slot));
    return;
  }
  int32_t t;  // the threshold: the need-th smallest step
  const uint64_t range = uint64_t(int64_t(hi) - lo) + 1;
  if (range <= (uint64_t(1) << 20)) {
    sc.count.assign(size_t(range), 0);
    for (int64_t slot = 0; slot < n; slot++)
      if (candidate(slot)) sc.count[size_t(last[slot] - lo)]++;
    int64_t v = 0;
    for (int64_t seen = 0; seen + sc.count[size_t(v)] < need; v++) seen += sc.count[size_t(v)];
    t = int32_t(lo + v);
  } else {
    sc.count.clear();
    for (int64_t slot = 0; slot < n; slot++)
      if (candidate(slot)) sc.count.push_back(last[slot]);
    std::nth_element(sc.count.begin(), sc.count.begin() + (need - 1), sc.count.end());
    t = sc.count[size_t(need - 1)];
  }
  uint8_t* tied = (sc.mark.assign(size_t(n), 0), sc.mark.data());
  for (int64_t slot = 0; slot < n; slot++)
    if (last[slot] <= t && candidate(slot)) {
      if (last[slot] < t) sc.lru.push_back(int32_t(slot));
      else tied[slot] = 1;
    }
  const int64_t below = int64_t(sc.lru.size());
  for (int64_t p = 0, ties = need - below; p < live && ties > 0; p++)
    if (tied[order[p]]) sc.lru.push_back(order[p]), ties--;
  std::sort(sc.lru.begin() + below, sc.lru.end());
  std::inplace_merge(sc.lru.begin(), sc.lru.begin() + below, sc.lru.end());
}

// key_set._least_recent: the candidates are the slots of live keys, not removed, with last < now. A slot is
// live when its last-use step is not -1 (insert frees slots so), which holds for every slot when as many
// hold a step as there are live keys; else (a caller's step of -1) the live slots are marked from the positions.
void least_recent(const int32_t* order, const int32_t* last, const bool* removed, int64_t n, int64_t live,
                  int64_t now, int64_t need, InsertScratch& sc) {
  auto fresh = [&](int64_t slot) { return last[slot] < now && !(removed && removed[slot]); };
  if (std::count_if(last, last + n, [](int32_t v) { return v != -1; }) == live)
    return choose_least_recent([&](int64_t slot) { return last[slot] != -1 && fresh(slot); }, order, last, n, live,
                               need, sc);
  std::vector<uint8_t> is_live(size_t(n), 0);  // rare: no scratch kept for it
  for (int64_t p = 0; p < live; p++) is_live[order[p]] = 1;
  choose_least_recent([&](int64_t slot) { return is_live[slot] && fresh(slot); }, order, last, n, live, need, sc);
}

// with_directory's span: the smallest and the largest live key (position 0 and size - 1, clipped).
inline std::pair<float, float> span_of(const int32_t* k, int64_t n, int64_t size, int64_t buckets) {
  const float first = value_of(key_of(k, 0)), last = value_of(key_of(k, std::clamp<int64_t>(size - 1, 0, n - 1)));
  return {first, last > first ? float(buckets) / std::max(last - first, 1e-30f) : 0.0f};
}

// key_set.insert on a wide set, in place (see above); returns how many live keys it evicted.
struct WideSet {
  int32_t *k, *order, *dir, *last, *size;  // sorted_keys [n, 2], order [n], directory [buckets + 1], last [n], size
  float* span;                            // [2]
  int64_t n, buckets;
};

int64_t insert_wide(const WideSet& w, int64_t capacity, const int32_t* queries, const bool* wanted,
                    const bool* gone_in, int64_t q, int64_t now, int32_t* slots) {
  int32_t *k = w.k, *order = w.order, *dir = w.dir, *last = w.last, *size = w.size;
  float* span = w.span;
  const int64_t n = w.n, buckets = w.buckets, live = size[0];
  static thread_local InsertScratch scratch;
  InsertScratch& sc = scratch;  // one thread-local lookup (each would be a call: this is a shared library)
  sc.add.clear();
  for (int64_t j = 0; j < q; j++)
    if (wanted[j]) sc.add.push_back({key_of(queries, j), int32_t(j)});
  std::sort(sc.add.begin(), sc.add.end());
  const int64_t want_n = int64_t(sc.add.size());
  int64_t n_removed = 0;
  if (gone_in) n_removed = std::count(gone_in, gone_in + n, true);
  if (want_n == 0 && n_removed == 0) return 0;  // nothing changes

  // Slots on offer, in this order: free ones (the first `capacity`), removed ones, least recently used ones.
  const int64_t free = std::max<int64_t>(capacity - live, 0);
  sc.avail.clear();
  for (int64_t j = 0; j < std::min(free, q) && live + j < n; j++) sc.avail.push_back(order[live + j]);
  const int64_t from_free = int64_t(sc.avail.size());
  for (int64_t slot = 0; gone_in && slot < n && int64_t(sc.avail.size()) - from_free < q; slot++)
    if (gone_in[slot]) sc.avail.push_back(int32_t(slot));
  const int64_t need = std::max<int64_t>(want_n - free - n_removed, 0);
  if (need > 0) least_recent(order, last, gone_in, n, live, now, need, sc);
  else sc.lru.clear();
  const int64_t evicted = int64_t(sc.lru.size());
  sc.avail.insert(sc.avail.end(), sc.lru.begin(), sc.lru.end());
  const int64_t inserted = std::min<int64_t>(want_n, int64_t(sc.avail.size()));  // the smallest keys get slots
  for (int64_t r = 0; r < inserted; r++) slots[sc.add[size_t(r)].second] = sc.avail[size_t(r)];

  // Compact the survivors (front to back: each moves down), counting the buckets of the keys that go.
  const auto [first, scale] = std::make_pair(span[0], span[1]);
  sc.delta.assign(size_t(buckets + 1), 0);
  int64_t kept = live;
  if (n_removed || evicted) {
    sc.mark.assign(size_t(n), 0);
    for (int64_t slot = 0; gone_in && slot < n; slot++) sc.mark[slot] = gone_in[slot];
    for (int32_t slot : sc.lru) sc.mark[slot] = 1;
    kept = 0;
    for (int64_t p = 0; p < live; p++) {
      if (sc.mark[order[p]]) {
        sc.delta[bucket_of(key_of(k, p), first, scale, buckets) + 1]--;
        continue;
      }
      k[2 * kept] = k[2 * p], k[2 * kept + 1] = k[2 * p + 1], order[kept] = order[p];
      kept++;
    }
  }
  // Merge the new keys in (back to front: each survivor moves up); a new key goes before an equal old one.
  const int64_t total = kept + inserted;
  for (int64_t w = total - 1, p = kept - 1, i = inserted - 1; i >= 0; w--) {
    if (p >= 0 && key_of(k, p) >= sc.add[size_t(i)].first) {
      k[2 * w] = k[2 * p], k[2 * w + 1] = k[2 * p + 1], order[w] = order[p];
      p--;
    } else {
      const uint64_t key = sc.add[size_t(i)].first;
      k[2 * w] = int32_t(uint32_t(key >> 32)), k[2 * w + 1] = int32_t(uint32_t(key));
      order[w] = sc.avail[size_t(i)];
      sc.delta[bucket_of(key, first, scale, buckets) + 1]++;
      i--;
    }
  }
  // The free positions: the slots in no live position, by slot. Untouched (but for the free slots taken, at
  // their front) when no live key went, or when the new keys took every slot on offer and every slot freed
  // was live (so they took all the freed ones).
  const bool untouched = (kept == live && inserted <= from_free) ||
                         (inserted == int64_t(sc.avail.size()) && n_removed <= q && live - kept == n_removed + evicted);
  if (!untouched) {
    sc.mark.assign(size_t(n), 0);
    for (int64_t p = 0; p < total; p++) sc.mark[order[p]] = 1;
    for (int64_t slot = 0, w = total; slot < n; slot++)
      if (!sc.mark[slot]) order[w++] = int32_t(slot);
  }
  std::fill(k + 2 * total, k + 2 * std::max(total, live), -1);
  size[0] = int32_t(total);
  // The directory: by the bucket counts' changes while the span stays put, else rebuilt (with_directory).
  const auto [new_first, new_scale] = span_of(k, n, total, buckets);
  if (live > 0 && new_first == first && new_scale == scale) {
    for (int64_t b = 0, moved = 0; b <= buckets; b++) dir[b] += int32_t(moved += sc.delta[size_t(b)]);
  } else {
    span[0] = new_first, span[1] = new_scale;
    std::fill(dir, dir + buckets + 1, 0);
    for (int64_t p = 0; p < total; p++) dir[bucket_of(key_of(k, p), new_first, new_scale, buckets) + 1]++;
    for (int64_t b = 0; b < buckets; b++) dir[b + 1] += dir[b];
  }
  // Last-use steps: the freed slots free, the new keys' now (key_set.insert's scatters, in their order).
  for (int64_t j = from_free; j < from_free + std::min(n_removed, q); j++) last[sc.avail[size_t(j)]] = -1;
  for (int32_t slot : sc.lru) last[slot] = -1;
  for (int64_t r = 0; r < inserted; r++) last[sc.avail[size_t(r)]] = int32_t(now);
  return evicted;
}

// A compact set's keys, widened (their high words from the buckets: key_set.full_keys) into wide [n, 2].
void widen(const int32_t* low, const int32_t* dir, const int32_t* span, int64_t live, int64_t buckets,
           int32_t* wide) {
  const uint32_t shift = uint32_t(span[0]);
  const uint64_t base = uint64_t(uint32_t(span[1])) << 32 | uint32_t(span[2]);
  for (int64_t b = 0, p = 0; b < buckets && p < live; b++)
    for (const uint32_t hi = uint32_t(((base + uint64_t(b)) << shift) >> 32); p < std::min<int64_t>(dir[b + 1], live); p++)
      wide[2 * p] = int32_t(hi), wide[2 * p + 1] = low[p];
}

// key_set.compacted: a wide set's live keys [live, 2] as low words, with the exact directory and its span.
void compact(const int32_t* wide, int64_t live, int64_t n, int64_t buckets, int32_t* low, int32_t* dir,
             int32_t* span) {
  uint32_t shift = 0;
  uint64_t base = 0;
  if (live > 0) {
    const uint64_t first = key_of(wide, 0), last = key_of(wide, live - 1);
    shift = 32;  // the smallest shift that puts the keys' range in the buckets (one does, below 2**compact_bits)
    for (uint32_t t = 0; t <= 32; t++)
      if ((last >> t) - (first >> t) < uint64_t(buckets)) {
        shift = t;
        break;
      }
    base = first >> shift;
  }
  span[0] = int32_t(shift), span[1] = int32_t(uint32_t(base >> 32)), span[2] = int32_t(uint32_t(base));
  std::fill(dir, dir + buckets + 1, 0);
  for (int64_t p = 0; p < live; p++) {
    low[p] = wide[2 * p + 1];
    dir[std::min<uint64_t>((key_of(wide, p) >> shift) - base, uint64_t(buckets - 1)) + 1]++;
  }
  std::fill(low + live, low + n, 0);
  for (int64_t b = 0; b < buckets; b++) dir[b + 1] += dir[b];
}

ffi::Error InsertKeys(ffi::Buffer<ffi::S32> keys_in, ffi::Buffer<ffi::S32> order_in, ffi::Buffer<ffi::S32> size_in,
                      ffi::Buffer<ffi::S32> dir_in, ffi::AnyBuffer span_in, ffi::Buffer<ffi::S32> last_in,
                      ffi::Buffer<ffi::S32> capacity, ffi::Buffer<ffi::S32> queries, ffi::Buffer<ffi::PRED> want,
                      ffi::Buffer<ffi::PRED> removed, ffi::Buffer<ffi::S32> step,
                      ffi::ResultBuffer<ffi::S32> keys_out, ffi::ResultBuffer<ffi::S32> order_out,
                      ffi::ResultBuffer<ffi::S32> size_out, ffi::ResultBuffer<ffi::S32> dir_out,
                      ffi::Result<ffi::AnyBuffer> span_out, ffi::ResultBuffer<ffi::S32> last_out,
                      ffi::ResultBuffer<ffi::S32> slots_out, ffi::ResultBuffer<ffi::S32> evicted_out) {
  int32_t *k = in_place(keys_in, keys_out), *order = in_place(order_in, order_out);
  int32_t *dir = in_place(dir_in, dir_out), *last = in_place(last_in, last_out);
  int32_t* size = in_place(size_in, size_out);
  if (span_in.untyped_data() != span_out->untyped_data())
    std::memcpy(span_out->untyped_data(), span_in.untyped_data(), span_in.size_bytes());
  const int64_t n = int64_t(order_in.element_count()), buckets = int64_t(dir_in.element_count()) - 1;
  const int64_t q = int64_t(want.element_count());
  const bool* gone_in = removed.element_count() ? removed.typed_data() : nullptr;  // [N] by slot, or none
  int32_t* slots = slots_out->typed_data();
  std::fill(slots, slots + q, -1);
  evicted_out->typed_data()[0] = 0;
  if (n == 0) return ffi::Error::Success();
  const int64_t cap = capacity.typed_data()[0], now = step.typed_data()[0];
  if (keys_in.dimensions().size() == 2) {
    evicted_out->typed_data()[0] = int32_t(insert_wide(
        WideSet{k, order, dir, last, size, static_cast<float*>(span_out->untyped_data()), n, buckets}, cap,
        queries.typed_data(), want.typed_data(), gone_in, q, now, slots));
    return ffi::Error::Success();
  }
  // A compact set: widened, inserted into, compacted again (O(n), as the insert is).
  if (!std::any_of(want.typed_data(), want.typed_data() + q, [](bool b) { return b; }) &&
      !(gone_in && std::any_of(gone_in, gone_in + n, [](bool b) { return b; })))
    return ffi::Error::Success();  // nothing changes
  int32_t* span = static_cast<int32_t*>(span_out->untyped_data());
  std::vector<int32_t> wide(size_t(2 * n), -1), wide_dir(size_t(buckets + 1), 0);
  float wide_span[2] = {0.0f, 0.0f};  // the wide insert's directory is not used: one bucket
  widen(k, dir, span, size[0], buckets, wide.data());
  std::fill(wide_dir.begin() + 1, wide_dir.end(), size[0]);
  evicted_out->typed_data()[0] = int32_t(insert_wide(
      WideSet{wide.data(), order, wide_dir.data(), last, size, wide_span, n, buckets}, cap, queries.typed_data(),
      want.typed_data(), gone_in, q, now, slots));
  compact(wide.data(), size[0], n, buckets, k, dir, span);
  return ffi::Error::Success();
}


// --- unique (key_set.unique): the distinct keys of q [Q, 2] in key order (free markers, hi = -1, dropped),
// then free markers; inverse[i] = the index of q[i]'s key among them (Q for a free marker). By an LSD radix
// sort of (key, index) on 16-bit digits, skipping the digits all keys share: linear, where XLA:CPU's sort
// compares (O(Q log Q)).
constexpr int64_t kSmallSort = 4096;

ffi::Error UniqueKeys(ffi::Buffer<ffi::S32> queries, ffi::ResultBuffer<ffi::S32> keys_out,
                      ffi::ResultBuffer<ffi::S32> inverse_out) {
  const int64_t q = int64_t(inverse_out->element_count());
  const int32_t* in = queries.typed_data();
  int32_t *keys = keys_out->typed_data(), *inverse = inverse_out->typed_data();
  static thread_local std::vector<std::pair<uint64_t, int32_t>> scratch_a, scratch_b;
  static thread_local std::vector<int32_t> scratch_count;
  auto &a = scratch_a, &b = scratch_b;
  std::vector<int32_t>& count = scratch_count;
  a.resize(size_t(q)), b.resize(size_t(q));
  for (int64_t i = 0; i < q; i++) a[size_t(i)] = {key_of(in, i), int32_t(i)};
  if (q < kSmallSort) std::sort(a.begin(), a.end());  // below that, the histograms cost more than they save
  for (int shift = 0; shift < 64 && q >= kSmallSort; shift += 16) {
    count.assign(65537, 0);
    for (int64_t i = 0; i < q; i++) count[((a[size_t(i)].first >> shift) & 0xFFFF) + 1]++;
    if (std::any_of(count.begin() + 1, count.end(), [&](int32_t c) { return c == q; })) continue;  // one digit
    for (int d = 0; d < 65536; d++) count[d + 1] += count[d];
    for (int64_t i = 0; i < q; i++) b[size_t(count[(a[size_t(i)].first >> shift) & 0xFFFF]++)] = a[size_t(i)];
    std::swap(a, b);
  }
  constexpr uint64_t kFree = uint64_t(0xFFFFFFFF) << 32;  // hi = -1 and above: a free marker
  int64_t distinct = 0;
  for (int64_t i = 0; i < q; i++) {
    const auto [key, at] = a[size_t(i)];
    if (key >= kFree) {
      inverse[at] = int32_t(q);
      continue;
    }
    if (distinct == 0 || key != a[size_t(i - 1)].first) {
      keys[2 * distinct] = int32_t(uint32_t(key >> 32)), keys[2 * distinct + 1] = int32_t(uint32_t(key));
      distinct++;
    }
    inverse[at] = int32_t(distinct - 1);
  }
  std::fill(keys + 2 * distinct, keys + 2 * q, -1);
  if (a.capacity() * sizeof(a[0]) > kKeepScratch) a = {}, b = {};  // a rare huge call
  return ffi::Error::Success();
}

}  // namespace

// The arguments of find_keys: the set, then the queries.
static auto set_and_queries() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32>>()   // sorted_keys [N, 2]
      .Arg<ffi::Buffer<ffi::S32>>()   // order [N]
      .Arg<ffi::Buffer<ffi::S32>>()   // size []
      .Arg<ffi::Buffer<ffi::S32>>()   // directory [B + 1]
      .Arg<ffi::AnyBuffer>()          // span: float32 [2] (compact: int32 [3])
      .Arg<ffi::Buffer<ffi::S32>>();  // queries [Q, 2]
}

// --- take (key_set.take): out[e] = values[index[e]] for an index in [0, Q) and a value >= 0 (a row), else fill;
// the map's rows per entry, in chunks over the pool (in place of an XLA:CPU gather, one per table and step).
constexpr int64_t kTakeChunk = 16384;

ffi::Error TakeRows(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> values, ffi::Buffer<ffi::S32> index,
                    ffi::Buffer<ffi::S32> fill, ffi::ResultBuffer<ffi::S32> out, int64_t threads) {
  const int32_t *v = values.typed_data(), *ix = index.typed_data();
  const int64_t q = int64_t(values.element_count()), e = int64_t(index.element_count());
  const int32_t f = fill.typed_data()[0];
  int32_t* o = out->typed_data();
  parallel_for(pool, thread_count(pool, threads), (e + kTakeChunk - 1) / kTakeChunk, [&](int64_t c) {
    for (int64_t i = c * kTakeChunk, to = std::min(e, i + kTakeChunk); i < to; i++)
      o[i] = ix[i] >= 0 && ix[i] < q && v[ix[i]] >= 0 ? v[ix[i]] : f;
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseEmbedFindKeys, FindKeys,
                              set_and_queries()
                                  .Ret<ffi::Buffer<ffi::S32>>()  // slots [Q]
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseEmbedTouchKeysMany, TouchKeysMany,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // step []
                                  .RemainingArgs()               // per set: see TouchKeysMany
                                  .RemainingRets()
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("entries"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseEmbedInsertKeys, InsertKeys,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sorted_keys [N, 2] (aliased with result 0)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // order [N] (result 1)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // size [] (result 2)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // directory [B + 1] (result 3)
                                  .Arg<ffi::AnyBuffer>()          // span (result 4; see set_of)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // last [N] (result 5)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // capacity []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // keys [Q, 2]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // want [Q]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // removed [N] by slot, or [0]: none
                                  .Arg<ffi::Buffer<ffi::S32>>()   // step []
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()    // slots [Q]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // evicted []

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseEmbedTakeRows, TakeRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // values [Q]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // index [E]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // fill []
                                  .Ret<ffi::Buffer<ffi::S32>>()  // [E]
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseEmbedUniqueKeys, UniqueKeys,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // queries [Q, 2]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // keys [Q, 2]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // inverse [Q]
