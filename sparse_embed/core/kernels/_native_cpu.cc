// The native CPU kernel of the lookup's per-shard work, called through XLA's typed FFI (see native_cpu.py).
//
// forward:  partials[d, row] = sum over the entries (col, row, value) that source d sent this shard of
//           value * clip(table[col]), in entry order (each output row's entries are contiguous: preprocess
//           writes segments sorted by row).
// backward: the entries, as self-contained records (col, output row, value), sorted by col with a stable
//           radix sort: the table is then updated in address order (neighbouring rows share pages and DRAM
//           rows, which entry order's random jumps do not), each distinct row once, from its run of records in
//           entry order: its gradient summed, the optimizer applied to the row and its slots, written back in
//           place (the table and slots are aliased to the outputs), with the loads of the rows after it
//           prefetched.
//
// Work is cut into pieces whose boundaries depend only on the inputs (the backward's: buckets of rows, each
// sorted and updated by one thread); each piece writes rows no other piece writes, and runs on whichever thread
// takes it. So results do not depend on the thread count. The CPython module only hands the handlers to Python
// as capsules (`handlers()`).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include <sys/mman.h>

#include "xla/ffi/api/ffi.h"
#include "_native_isa.h"
#include "_native_threads.h"

namespace ffi = xla::ffi;

namespace {

// Buffer types without a comma, so that they can appear in the handler-binding macros below.
using I32Matrix = ffi::Buffer<ffi::S32, 2>;
using F32Vector = ffi::Buffer<ffi::F32, 1>;
using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using F32Cube = ffi::Buffer<ffi::F32, 3>;

template <typename A, typename B>
bool same_dims(const A& a, const B& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// ------------------------------------------------------------------ element types

// The hot loops (forward and backward chunks) run through with_isa (_native_isa.h): compiled for AVX-512, AVX2
// and the baseline, run on the best the CPU has. Every instruction set gives the same results: elementwise IEEE
// operations, no FMA contraction, reductions in a fixed order (lane_sum).

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as XLA's convert
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return bf16_to_f32(*p); }
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) { *p = f32_to_bf16(x); }

// How a row is prefetched: for reading into L1 (the update loop's gradient rows), for reading into L2 (the
// forward's gathers), or for writing (the update loop's table and slot rows: locality 1, which GCC emits as
// `prefetcht2` for targets without PREFETCHW, as ours are; the L1 hint made no difference there).
// The forward's gathers are capped by the misses a core keeps in flight, and which hint overlaps more of them
// depends on the CPU's caches: the L2 hint was chosen on a Zen 4 (1 MiB of L2 per core); an earlier CPU favoured
// the L1 hint. The update loop's prefetches gained nothing from the L2 hint, for any of its rows.
enum class Prefetch { kReadL1, kReadL2, kWrite };

// Prefetches the `bytes` bytes of a row starting at `p`.
template <Prefetch kKind>
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) {
    if constexpr (kKind == Prefetch::kWrite)
      __builtin_prefetch(c + o, 1, 1);
    else
      __builtin_prefetch(c + o, 0, kKind == Prefetch::kReadL2 ? 2 : 3);
  }
}

// ------------------------------------------------------------------ huge pages

// Tables and slots are large arrays read and written at random rows: on 4 KiB pages nearly every row costs a
// TLB miss and a page walk (in a VM, a two-level one). A 2 MiB page covers 512 small ones per TLB entry, so
// most of those misses and walks go.
// XLA allocates the buffers, so the kernel asks Linux to back them with huge pages itself: the third time it
// sees a buffer (a donated table is the same buffer every step), it marks it MADV_HUGEPAGE and collapses it
// (MADV_COLLAPSE, Linux >= 6.1), in 2 MiB pieces over the thread pool; once per buffer, as the collapse copies
// every page of it.
// A buffer freed and another allocated at the same address (a new table of the same size: a restore, a new
// model, the next benchmark) is a fresh mapping on small pages again. MADV_HUGEPAGE made [lo, hi) a mapping of
// its own (Linux splits a mapping where its flags change), so every kProbe-th later sighting looks the address up
// in /proc/self/maps: a mapping that no longer starts at lo is a fresh one, and is collapsed (less and less often
// should that keep happening, e.g. if something else merged the mapping).
// Advice only: it changes no value, and a kernel without THP or MADV_COLLAPSE just refuses it.
namespace hugepages {

constexpr uintptr_t kHuge = uintptr_t(2) << 20;
constexpr size_t kMinBytes = size_t(64) << 20;  // smaller arrays are not worth the collapse
constexpr int64_t kSightings = 3;
constexpr int64_t kProbe = 8;
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

struct Seen {
  int64_t calls = 0, next_probe = kSightings, backoff = kProbe;  // backoff: calls to the next probe after a fresh one
};
std::mutex mu;
std::unordered_map<uintptr_t, Seen> seen;  // by buffer start
bool unsupported = false;

// Marks [lo, hi) MADV_HUGEPAGE and collapses it, piece by piece over the pool.
void collapse(ffi::ThreadPool& pool, int64_t threads, uintptr_t lo, uintptr_t hi) {
  if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE) != 0) return;
  std::atomic<bool> failed{false};
  parallel_for(pool, threads, int64_t((hi - lo) / kHuge), [&](int64_t i) {
    if (!failed && madvise(reinterpret_cast<void*>(lo + uintptr_t(i) * kHuge), kHuge, MADV_COLLAPSE) != 0 &&
        errno == EINVAL)
      failed = true;  // no MADV_COLLAPSE here (other errors, e.g. no free huge page, just skip a piece)
  });
  if (failed) {
    std::lock_guard<std::mutex> lock(mu);
    unsupported = true;
  }
}

// Whether the mapping holding address lo starts there (true if /proc/self/maps cannot be read).
bool mapping_starts_at(uintptr_t lo) {
  FILE* f = std::fopen("/proc/self/maps", "r");
  if (!f) return true;
  char line[4608];  // a line: two addresses, flags, offset, device, inode, a path of at most PATH_MAX
  bool found = true;
  while (std::fgets(line, sizeof line, f)) {
    unsigned long start, end;
    if (std::sscanf(line, "%lx-%lx", &start, &end) == 2 && start <= lo && lo < end) {
      found = start == lo;
      break;
    }
  }
  std::fclose(f);
  return found;
}

void advise(ffi::ThreadPool& pool, int64_t threads, const void* data, size_t bytes) {
  const uintptr_t lo = (uintptr_t(data) + kHuge - 1) & ~(kHuge - 1), hi = (uintptr_t(data) + bytes) & ~(kHuge - 1);
  if (bytes < kMinBytes || hi <= lo) return;
  bool first;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (unsupported || seen.size() > 4096) return;
    Seen& b = seen[uintptr_t(data)];
    if (++b.calls < b.next_probe) return;
    first = b.calls == kSightings;
    b.next_probe = b.calls + kProbe;
  }
  if (!first) {  // collapsed before: a fresh mapping at the same address?
    if (mapping_starts_at(lo)) return;
    std::lock_guard<std::mutex> lock(mu);
    Seen& b = seen[uintptr_t(data)];
    b.next_probe = b.calls + b.backoff, b.backoff *= 2;
  }
  collapse(pool, threads, lo, hi);
}

}  // namespace hugepages

// ------------------------------------------------------------------ max_norm

// The sum of f(x[j]) in a fixed order: 8 running sums (lane j % 8), combined pairwise. The order does not
// depend on the instruction set, and the loop vectorizes without reassociation.
template <typename T, typename F>
inline float lane_sum(const T* x, int64_t dim, F f) {
  float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t j = 0;
  for (; j + 8 <= dim; j += 8)
    for (int l = 0; l < 8; l++) part[l] += f(load(x + j + l));
  for (int l = 0; j < dim; j++, l++) part[l] += f(load(x + j));
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

template <typename T>
inline float sum_squares(const T* x, int64_t dim) {
  return lane_sum(x, dim, [](float v) { return v * v; });
}

// Whether no element is NaN or inf (exponent bits all ones): the largest exponent field, an integer max that
// vectorizes without a float sum's chain of dependent adds (the update checks each touched row and its slots).
inline bool all_finite(const float* x, int64_t dim) {
  uint32_t top = 0;
  for (int64_t j = 0; j < dim; j++) {
    uint32_t u;
    std::memcpy(&u, x + j, 4);
    top = std::max(top, u & 0x7f800000u);
  }
  return top != 0x7f800000u;
}

// The factor that brings a row's L2 norm to at most max_norm (1 when max_norm <= 0: no clipping), and the norm.
template <typename T>
inline float clip_scale(const T* row, int64_t dim, float max_norm, float* norm_out) {
  if (max_norm <= 0.0f) return 1.0f;
  float norm = std::sqrt(sum_squares(row, dim));
  *norm_out = norm;
  return norm > max_norm ? max_norm / (norm > 0.0f ? norm : 1.0f) : 1.0f;
}
// f(std::integral_constant<int64_t, dim>) for the common row widths, else with 0 (a width known only at run
// time): the hot loops over a row, compiled for a width known at compile time, are unrolled and keep the row in
// registers.
template <class F>
inline void with_width(int64_t dim, const F& f) {
  switch (dim) {
    case 16: return f(std::integral_constant<int64_t, 16>{});
    case 32: return f(std::integral_constant<int64_t, 32>{});
    case 64: return f(std::integral_constant<int64_t, 64>{});
    case 128: return f(std::integral_constant<int64_t, 128>{});
    default: return f(std::integral_constant<int64_t, 0>{});
  }
}

// ------------------------------------------------------------------ forward

constexpr int64_t kForwardChunk = 4096;  // entries per work chunk
constexpr int64_t kPrefetch = 32;         // entries ahead to prefetch

struct Range {
  int64_t d, begin, end;  // entries [begin, end) of source d's segment
  int64_t row_lo, row_hi;  // the output rows [row_lo, row_hi) of source d this chunk writes (zeros where none)
  bool sorted;             // the segment's row_ids ascend (else one chunk pools into a zeroed block)
};

// Chunks of each source's segment, cut at changes of row_id (entries of one output row stay in one chunk), or
// one chunk per segment when its row_ids are not sorted. Each output row belongs to exactly one chunk.
std::vector<Range> forward_chunks(const int32_t* rows, int64_t D, int64_t C, int64_t rpd) {
  std::vector<Range> out;
  for (int64_t d = 0; d < D; d++) {
    const int32_t* r = rows + d * C;
    bool sorted = true;
    for (int64_t k = 1; k < C && sorted; k++) sorted = r[k - 1] <= r[k];
    int64_t begin = 0, row_lo = 0;
    do {
      int64_t end = sorted ? std::min(C, begin + kForwardChunk) : C;
      while (end < C && r[end] == r[end - 1]) end++;
      const int64_t row_hi = end < C ? std::min<int64_t>(std::max(r[end], 0), rpd) : rpd;
      out.push_back({d, begin, end, row_lo, std::max(row_lo, row_hi), sorted});
      begin = end, row_lo = std::max(row_lo, row_hi);
    } while (begin < C);
  }
  return out;
}

// Rows of every source, `[D, rpd, dim]`, in one array or cut into consecutive blocks of rows (one per feature)
// that are arrays of their own, `[D, n_b, dim]` each: the forward's outputs and the backward's gradients.
template <typename F>
struct RowBlocks {
  std::vector<F*> data;             // each block's array
  std::vector<int64_t> starts{0};  // the first row of each block, then rpd
  int64_t dim;

  // Appends a block with dimensions `d`; false if they are not [D, n, dim].
  bool add(F* block, ffi::Span<const int64_t> d, int64_t D) {
    if (d.size() != 3 || d[0] != D || d[2] != dim) return false;
    data.push_back(block);
    starts.push_back(starts.back() + d[1]);
    return true;
  }
  int64_t rpd() const { return starts.back(); }
  // Row `row` (< rpd) of source d.
  F* row(int64_t d, int64_t row) const {
    size_t b = 0;
    while (row >= starts[b + 1]) b++;
    const int64_t n = starts[b + 1] - starts[b];
    return data[b] + (d * n + row - starts[b]) * dim;
  }
  // Zeroes rows [lo, hi) of source d.
  void zero(int64_t d, int64_t lo, int64_t hi) const {
    for (int64_t r = lo; r < hi; r++) std::memset(row(d, r), 0, size_t(dim) * sizeof(float));
  }
};
using Outputs = RowBlocks<float>;

// Pools the entries [r.begin, r.end) of source r.d's segment (cols, rows, vals point at the segment's start)
// into output rows [r.row_lo, r.row_hi), rows without entries zero. Each run of entries of one output row is
// summed in entry order into `acc`: a local array for a width kDim known at compile time (kept in registers),
// else the output row itself (kDim = 0), starting from zero (or from the row, for an unsorted segment, whose
// rows may come in several runs).
template <typename T, int64_t kDim, bool kClip>
inline void pool_range(const T* table, int64_t num_rows, const int32_t* cols, const int32_t* rows,
                       const float* vals, float max_norm, const Outputs& out, Range r) {
  const int64_t dim = kDim > 0 ? kDim : out.dim, rpd = out.rpd();
  if (!r.sorted) out.zero(r.d, r.row_lo, r.row_hi);
  int64_t next = r.row_lo;  // sorted: the first output row not yet written
  float local[kDim > 0 ? kDim : 1];
  for (int64_t k = r.begin; k < r.end;) {
    const uint32_t row = uint32_t(rows[k]);
    int64_t e = k + 1;
    while (e < r.end && uint32_t(rows[e]) == row) e++;
    if (row >= uint64_t(rpd)) {  // padding
      k = e;
      continue;
    }
    float* dst = out.row(r.d, row);
    float* acc = kDim > 0 ? local : dst;
    if (r.sorted) {
      out.zero(r.d, next, row);
      next = row + 1;
      for (int64_t j = 0; j < dim; j++) acc[j] = 0.0f;
    } else if (kDim > 0) {
      for (int64_t j = 0; j < dim; j++) acc[j] = dst[j];
    }
    for (; k < e; k++) {
      if (k + kPrefetch < r.end) {
        uint32_t c = uint32_t(cols[k + kPrefetch]);
        if (c < uint64_t(num_rows))
          prefetch_row<Prefetch::kReadL2>(table + int64_t(c) * dim, dim * int64_t(sizeof(T)));
      }
      const uint32_t c = uint32_t(cols[k]);
      if (c >= uint64_t(num_rows)) continue;  // padding
      const T* src = table + int64_t(c) * dim;
      float v = vals[k], norm = 0.0f;
      float scale = kClip ? clip_scale(src, dim, max_norm, &norm) : 1.0f;
      if (scale == 1.0f) {
        for (int64_t j = 0; j < dim; j++) acc[j] += load(src + j) * v;
      } else {
        for (int64_t j = 0; j < dim; j++) acc[j] += (load(src + j) * scale) * v;
      }
    }
    if (kDim > 0)
      for (int64_t j = 0; j < dim; j++) dst[j] = acc[j];
  }
  if (r.sorted) out.zero(r.d, next, r.row_hi);
}

template <typename T>
void pool_range_any(const T* table, int64_t num_rows, const int32_t* cols, const int32_t* rows, const float* vals,
                    float max_norm, const Outputs& out, Range r) {
  with_isa([&] {
    with_width(out.dim, [&](auto width) {
      constexpr int64_t kDim = decltype(width)::value;
      max_norm > 0.0f ? pool_range<T, kDim, true>(table, num_rows, cols, rows, vals, max_norm, out, r)
                      : pool_range<T, kDim, false>(table, num_rows, cols, rows, vals, max_norm, out, r);
    });
  });
}

template <typename T>
void forward_impl(ffi::ThreadPool& pool, int64_t threads, const T* table, int64_t num_rows, const int32_t* cols,
                  const int32_t* rows, const float* vals, int64_t D, int64_t C, float max_norm, const Outputs& out) {
  std::vector<Range> chunks = forward_chunks(rows, D, C, out.rpd());
  parallel_for(pool, threads, int64_t(chunks.size()), [&](int64_t i) {
    Range r = chunks[i];
    int64_t off = r.d * C;  // entries of source d start at d * C
    pool_range_any(table, num_rows, cols + off, rows + off, vals + off, max_norm, out, r);
  });
}

// The results after the token: the output rows of every source, `[D, n_b, dim]` per block b.
ffi::Error Forward(ffi::ThreadPool pool, ffi::AnyBuffer table, I32Matrix cols, I32Matrix rows, F32Matrix vals,
                   ffi::Result<F32Vector> token, ffi::RemainingRets blocks, float max_norm, int64_t threads,
                   int64_t huge_pages) {
  auto td = table.dimensions();
  auto cd = cols.dimensions();
  if (td.size() != 2 || !same_dims(rows.dimensions(), cd) || !same_dims(vals.dimensions(), cd) || blocks.size() < 1)
    return ffi::Error::InvalidArgument("sparse_embed forward: inconsistent shapes");
  int64_t D = cd[0], C = cd[1], dim = td[1], R = td[0];
  Outputs out{{}, {0}, dim};
  for (size_t b = 0; b < blocks.size(); b++) {
    auto o = blocks.get<F32Cube>(b);
    if (!o.has_value() || !out.add((*o)->typed_data(), (*o)->dimensions(), D))
      return ffi::Error::InvalidArgument("sparse_embed forward: outputs must be float32 [D, n, dim]");
  }
  int64_t n = thread_count(pool, threads);
  if (huge_pages) hugepages::advise(pool, n, table.untyped_data(), table.size_bytes());
  if (table.element_type() == ffi::F32) {
    forward_impl(pool, n, table.typed_data<float>(), R, cols.typed_data(), rows.typed_data(), vals.typed_data(), D,
                 C, max_norm, out);
  } else if (table.element_type() == ffi::BF16) {
    forward_impl(pool, n, reinterpret_cast<const uint16_t*>(table.untyped_data()), R, cols.typed_data(),
                 rows.typed_data(), vals.typed_data(), D, C, max_norm, out);
  } else {
    return ffi::Error::InvalidArgument("sparse_embed forward: tables must be float32 or bfloat16");
  }
  token->typed_data()[0] = 0.0f;  // the backward's input: orders its in-place writes after these reads
  return ffi::Error::Success();
}

// ------------------------------------------------------------------ optimizers

// The optimizers update_row has a case for: (enumerator, the case name that an optimizer's `native()` declares in
// core/optimizers.py). An optimizer's code is its place in this list; Python reads {name: code} from `optimizers()`.
// Adding one: an entry here, its case in update_row (a missing case does not compile: -Wswitch is an error there)
// and its `native()` in core/optimizers.py (tests/core/test_native_encoding.py checks the three agree).
#define SPARSE_EMBED_OPTIMIZERS(X)          \
  X(kSGD, "sgd")                            \
  X(kAdagrad, "adagrad")                    \
  X(kRowwiseAdagrad, "rowwise_adagrad")     \
  X(kAdam, "adam")                          \
  X(kAdagradMomentum, "adagrad_momentum")   \
  X(kFTRL, "ftrl")                          \
  X(kLaProp, "laprop")

#define SPARSE_EMBED_ENUMERATOR(k, name) k,
#define SPARSE_EMBED_ONE(k, name) +1
enum Optimizer : int64_t { SPARSE_EMBED_OPTIMIZERS(SPARSE_EMBED_ENUMERATOR) };
constexpr int64_t kNumOptimizers = 0 SPARSE_EMBED_OPTIMIZERS(SPARSE_EMBED_ONE);
#undef SPARSE_EMBED_ONE
#undef SPARSE_EMBED_ENUMERATOR

struct Options {
  Optimizer optimizer;
  float max_norm;         // <= 0: none
  bool skip_nonfinite;
  bool clip_gradient;
  float clip_g_lo, clip_g_hi;
  float weight_decay;
  bool clip_weight;
  float clip_w_lo, clip_w_hi;
  bool linear;            // apply each occurrence on its own (SGD with no options on an f32 table)
  const float* hyper;     // the optimizer's constants (see native_cpu.py)
  const float* scalars;   // per step: learning rate first, then the optimizer's step-dependent factors
};

// Copies a row of n floats: n is 0, 1 or the row's width (kDim when known at compile time, see with_width). Inline,
// and for a known width a loop of fixed length: GCC turns a loop of variable length into a memcpy call, and a call
// per slot row (four per Adam row) costs more than copying a row this short.
template <int64_t kDim>
inline void copy_row(float* dst, const float* src, int64_t n) {
  if (n == 1) {
    *dst = *src;
  } else if constexpr (kDim > 0) {
    if (n == kDim)
      for (int64_t j = 0; j < kDim; j++) dst[j] = src[j];
  } else {
    for (int64_t j = 0; j < n; j++) dst[j] = src[j];
  }
}

inline float clipf(float x, float lo, float hi) { return std::min(std::max(x, lo), hi); }

// One row's update, in the order of the generic kernel: clip_gradient, the rule, weight decay, clip_weight.
// `w` holds the old row (f32), `g` its summed gradient, `tmp` is [3 * dim] scratch; slot pointers point at copies of
// the row's (f32) slot rows. Every loop is free of branches, so that it vectorizes.
// kDim: the row width when known at compile time (see with_width), else 0 and `width`.
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"  // every optimizer has its case
template <int64_t kDim>
void update_row(const Options& o, int64_t width, float* w, float* g, float* tmp, float* s0, float* s1) {
  const int64_t dim = kDim > 0 ? kDim : width;
  const float lr = o.scalars[0];
  const float* h = o.hyper;
  if (o.clip_gradient)
    for (int64_t j = 0; j < dim; j++) g[j] = clipf(g[j], o.clip_g_lo, o.clip_g_hi);
  const bool decays = o.weight_decay != 0.0f;
  float* before = tmp;  // the old row, for weight decay
  if (decays) copy_row<kDim>(before, w, dim);
  switch (o.optimizer) {
    case kSGD:
      for (int64_t j = 0; j < dim; j++) {
        float old = w[j];
        w[j] = old - lr * g[j];
      }
      break;
    case kAdagrad:
      for (int64_t j = 0; j < dim; j++) {
        float old = w[j], acc = s0[j] + g[j] * g[j];
        s0[j] = acc;
        w[j] = old - (lr * g[j]) * (1.0f / std::sqrt(acc));
      }
      break;
    case kRowwiseAdagrad: {
      float acc = s0[0] + sum_squares(g, dim) / float(dim);
      s0[0] = acc;
      const float scale = lr / (std::sqrt(acc) + h[0]);  // one division per row (the generic rule's order too)
      for (int64_t j = 0; j < dim; j++) {
        float old = w[j];
        w[j] = old - g[j] * scale;
      }
      break;
    }
    case kAdam: {  // h: 1-b1, 1-b2; scalars: lr, alpha_t, eps_t
      const float alpha = o.scalars[1], eps = o.scalars[2];
      for (int64_t j = 0; j < dim; j++) {
        float old = w[j];
        float m = s0[j] + h[0] * (g[j] - s0[j]);
        float v = s1[j] + h[1] * (g[j] * g[j] - s1[j]);
        s0[j] = m;
        s1[j] = v;
        w[j] = old - (alpha * m) / (std::sqrt(v) + eps);
      }
      break;
    }
    case kAdagradMomentum: {  // h: momentum, beta2, 1-beta2, epsilon, -1/exponent, nesterov
      // As FTRL below: the default exponent 2 (1/sqrt, several times cheaper than pow) in the rule's own pass;
      // any other exponent through a scratch row, its pow in a pass of its own.
      const bool root = h[4] == -0.5f, decays = h[1] != 1.0f;
      float* p = tmp + dim;  // the accumulator's power, per element
      auto accumulate = [&](auto decay, int64_t j) {
        return decltype(decay)::value ? h[1] * s0[j] + h[2] * (g[j] * g[j]) : s0[j] + g[j] * g[j];
      };
      if (!root) {
        for (int64_t j = 0; j < dim; j++)
          s0[j] = decays ? accumulate(std::true_type{}, j) : accumulate(std::false_type{}, j);
        for (int64_t j = 0; j < dim; j++) p[j] = std::pow(s0[j] + h[3], h[4]);
      }
      auto rule = [&](auto nesterov, auto is_root, auto decay) {
        for (int64_t j = 0; j < dim; j++) {
          float pj;
          if constexpr (decltype(is_root)::value) {
            const float acc = accumulate(decay, j);
            s0[j] = acc;
            pj = 1.0f / std::sqrt(acc + h[3]);
          } else {
            pj = p[j];
          }
          const float m = h[0] * s1[j] + pj * g[j];
          s1[j] = m;
          if constexpr (decltype(nesterov)::value)
            w[j] = w[j] - lr * (h[0] * m + pj * g[j]);
          else
            w[j] = w[j] - lr * m;
        }
      };
      auto with_nesterov = [&](auto is_root, auto decay) {
        h[5] != 0.0f ? rule(std::true_type{}, is_root, decay) : rule(std::false_type{}, is_root, decay);
      };
      if (!root)
        with_nesterov(std::false_type{}, std::false_type{});
      else
        decays ? with_nesterov(std::true_type{}, std::true_type{}) : with_nesterov(std::true_type{}, std::false_type{});
      break;
    }
    case kFTRL: {  // h: k = -learning_rate_power, l1, l2, beta, multiply_linear_by_learning_rate
      // linear is kept in units of 1/lr unless multiplied by it: a rate of 0 (a schedule's warmup) has no finite
      // state; the row and its slots stay as they are (the generic rule does the same)
      if (h[4] == 0.0f && lr == 0.0f) break;
      const float k = h[0], l1 = h[1], l2 = h[2], beta = h[3];
      // The accumulator's power before and after: for the default power -0.5 a sqrt in the rule's own pass
      // (passes through scratch rows, one per quantity, would store and reload every element); else pow in a
      // pass of its own (a call in the rule's loop would keep all of it from vectorizing).
      const bool root = k == 0.5f;
      float *pow_old = tmp + dim, *pow_new = tmp + 2 * dim;
      if (!root) {
        for (int64_t j = 0; j < dim; j++) {
          pow_old[j] = s0[j];
          s0[j] = s0[j] + g[j] * g[j];
          pow_new[j] = s0[j];
        }
        for (int64_t j = 0; j < dim; j++) pow_old[j] = std::pow(pow_old[j], k), pow_new[j] = std::pow(pow_new[j], k);
      }
      auto rule = [&](auto mult, auto no_l1, auto is_root) {
        for (int64_t j = 0; j < dim; j++) {
          const float old = w[j];
          float p_old, p_new;
          if constexpr (decltype(is_root)::value) {
            const float acc_old = s0[j], acc = acc_old + g[j] * g[j];
            s0[j] = acc;
            p_old = std::sqrt(acc_old), p_new = std::sqrt(acc);
          } else {  // s0 updated above
            p_old = pow_old[j], p_new = pow_new[j];
          }
          const float delta_p = p_new - p_old;
          float linear, l1s, denom;
          if constexpr (decltype(mult)::value) {
            linear = (s1[j] + lr * g[j]) - delta_p * old;
            l1s = lr * l1;
            denom = (p_new + beta) + (2.0f * lr) * l2;
          } else {
            linear = (s1[j] + g[j]) - (delta_p / lr) * old;
            l1s = l1;
            denom = (p_new + beta) / lr + 2.0f * l2;
          }
          float numer;
          if constexpr (decltype(no_l1)::value)
            numer = -linear;
          else
            numer = clipf(linear, -l1s, l1s) - linear;
          s1[j] = linear;
          w[j] = numer / denom;
        }
      };
      auto with_root = [&](auto mult, auto no_l1) {
        root ? rule(mult, no_l1, std::true_type{}) : rule(mult, no_l1, std::false_type{});
      };
      auto with_l1 = [&](auto mult) {
        l1 == 0.0f ? with_root(mult, std::true_type{}) : with_root(mult, std::false_type{});
      };
      h[4] != 0.0f ? with_l1(std::true_type{}) : with_l1(std::false_type{});
      break;
    }
    case kLaProp: {  // h: b1, sqrt(1-b1^2), eps; scalars: lr, d, 1-d
      const float d = o.scalars[1], one_minus_d = o.scalars[2];
      for (int64_t j = 0; j < dim; j++) {
        float old = w[j];
        float nu = d * s1[j] + one_minus_d * (g[j] * g[j] + h[2]);
        float mu = h[0] * s0[j] + (h[1] * g[j]) * (1.0f / std::sqrt(nu));
        s0[j] = mu;
        s1[j] = nu;
        w[j] = old - lr * mu;
      }
      break;
    }
  }
  if (decays) {  // w - (lr * weight_decay) * old, after the rule, as the generic kernel
    const float decay = lr * o.weight_decay;
    for (int64_t j = 0; j < dim; j++) w[j] = w[j] - decay * before[j];
  }
  if (o.clip_weight)
    for (int64_t j = 0; j < dim; j++) w[j] = clipf(w[j], o.clip_w_lo, o.clip_w_hi);
}
#pragma GCC diagnostic pop

// Adds to acc [dim] the gradient of one entry through the forward's max_norm clipping of row x: with
// gv = g * v (the entry's activation gradient times its gain), scale * (gv - (x.gv / norm^2) x) if the row was
// clipped, else gv. Entry by entry, as the generic kernel sums them.
void add_clipped_grad(const float* x, float scale, float norm, float max_norm, const float* g, float v, float* acc,
                      int64_t dim) {
  if (!(norm > max_norm)) {
    for (int64_t j = 0; j < dim; j++) acc[j] += scale * (g[j] * v);
    return;
  }
  float dot = 0.0f;
  for (int64_t j = 0; j < dim; j++) dot += x[j] * (g[j] * v);
  const float radial = dot / (norm * norm);
  for (int64_t j = 0; j < dim; j++) acc[j] += scale * ((g[j] * v) - radial * x[j]);
}
// ------------------------------------------------------------------ backward

// One received entry as the backward needs it, self-contained so that the update loop reads records in order
// and never looks anything up by entry index.
struct Record {
  uint32_t col;      // row of this shard's table
  uint32_t out_row;  // row of the [D * rpd] activation gradients: d * rpd + row_id
  float value;       // the gain
};

// The buffers of one backward call: the sort's records and buckets (see sort_buckets), the non-finite flags.
struct Buffers {
  std::vector<Record> records;
  std::vector<int64_t> buckets;
  std::vector<uint8_t> bad;  // per output row: its gradient holds a NaN/inf (SGD with skip_nonfinite)
  std::vector<const float*> grad_rows;  // per output row: where its gradient is (Grads::rows)
};

// Buffers kept between calls (no fresh pages each step), as many as calls ever ran at once: a call takes one
// and gives it back, whichever thread runs it.
class BufferPool {
 public:
  std::unique_ptr<Buffers> take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return std::make_unique<Buffers>();
    std::unique_ptr<Buffers> s = std::move(free_.back());
    free_.pop_back();
    return s;
  }
  void give(std::unique_ptr<Buffers> s) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(s));
  }
  struct Lease {  // gives its buffers back when it goes out of scope
    BufferPool& pool;
    std::unique_ptr<Buffers> buffers;
    ~Lease() { pool.give(std::move(buffers)); }
  };

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<Buffers>> free_;
};

BufferPool buffer_pool;

constexpr int64_t kSortBlock = 1 << 16;  // entries a thread counts and places at a time in the first pass
constexpr size_t kKeepSpare = size_t(1) << 18;  // entries a thread keeps room for between buckets

// The valid entries (col < num_rows, row_id < rpd) as records sorted by col, stable (entry order within a col),
// handed over bucket by bucket: `use(records, size)` gets each bucket's records (whole cols, in order) on the
// thread that sorted them, while they are in its cache.
// A most-significant-digit pass writes each entry's record into one of up to 256 buckets by the top bits of its
// col (in parallel over fixed blocks of entries, each block's records in entry order), reading the entries once,
// in order; then each bucket is sorted by the remaining bits with least-significant-digit passes of at most 11
// bits (buckets are small: they stay in cache; their second buffer is the thread's, a bucket's size). The call's
// buffer is 12 bytes per entry. (Sorting 8-byte keys `col << 32 | entry` instead would then gather each bucket's
// row ids and values by entry, at random: a cache miss per entry where the records move in streams.)
template <typename Use>
void sort_buckets(ffi::ThreadPool& pool, int64_t threads, const int32_t* cols, const int32_t* rows, const float* vals,
                  int64_t D, int64_t C, int64_t rpd, int64_t num_rows, Buffers& s, const Use& use) {
  // The count and scatter loops read what they need from locals, not through the lambdas' references: their
  // stores (counts, records) could alias those, and the compiler would load them again on every entry.
  const int64_t n = D * C, blocks = (n + kSortBlock - 1) / kSortBlock;
  // Calls f(k, col, row_id) for each valid entry k (col < num_rows, row_id < rpd) of block b, in order.
  const auto for_valid = [cols, rows, num_rows, rpd, n](int64_t b, auto&& f) {
    const int32_t *cs = cols, *rs = rows;
    const uint64_t nr = uint64_t(num_rows), np = uint64_t(rpd);
    for (int64_t k = b * kSortBlock, end = std::min(n, (b + 1) * kSortBlock); k < end; k++) {
      const uint32_t col = uint32_t(cs[k]), row = uint32_t(rs[k]);
      if (col < nr && row < np) f(k, col, row);
    }
  };
  // The digits cover the bits of the table's rows, or of the largest col present if it has fewer: ids in a
  // small part of a large table (the first 10^5 rows of 10^7) would otherwise fall in a bucket or two, one
  // thread's work, sorted by passes over empty bits (so the same ids would cost more in a larger table).
  // Counted again only then.
  const auto bit_width = [](uint64_t x) {  // the bits of x
    int b = 0;
    while (b < 64 && (x >> b) != 0) b++;
    return b;
  };
  int bits = bit_width(uint64_t(num_rows - 1)), low = 0;
  int64_t nb = 0;
  std::vector<int64_t> count;                           // [block, bucket]
  std::vector<uint32_t> block_max(size_t(blocks), 0);  // each block's largest col
  for (;;) {
    const int top = std::min(bits, 8);
    low = bits - top, nb = int64_t(1) << top;  // bucket = col >> low
    count.assign(size_t(blocks * nb), 0);
    parallel_for(pool, threads, blocks, [&](int64_t b) {
      int64_t* c = count.data() + b * nb;
      const int shift = low;
      uint32_t largest = 0;
      for_valid(b, [c, shift, &largest](int64_t, uint32_t col, uint32_t) {
        c[col >> shift]++;
        largest = std::max(largest, col);
      });
      block_max[size_t(b)] = largest;
    });
    const int present = bit_width(blocks ? *std::max_element(block_max.begin(), block_max.end()) : 0);
    if (present >= bits) break;
    bits = present;
  }
  s.buckets.assign(size_t(nb + 1), 0);  // bucket starts; then each (block, bucket)'s first slot, in place
  for (int64_t bucket = 0, at = 0; bucket < nb; bucket++) {
    s.buckets[bucket] = at;
    for (int64_t b = 0; b < blocks; b++) std::swap(at, count[b * nb + bucket]), at += count[b * nb + bucket];
    s.buckets[bucket + 1] = at;
  }
  s.records.resize(size_t(s.buckets[nb]) + 1);
  Record* records = s.records.data();
  // k / C (the entry's source) without a division per entry: exact for k < 2**32 and 1 < C < 2**32 (Lemire et
  // al., "Faster remainder by direct computation", 2019): a multiply and a shift, where a 64-bit division is
  // many times a multiply's cost, once per entry in the sort's hottest loop.
  const uint64_t inverse_c = C > 1 ? ~uint64_t(0) / uint64_t(C) + 1 : 0;
  parallel_for(pool, threads, blocks, [&](int64_t b) {
    int64_t* at = count.data() + b * nb;
    Record* out = records;
    const float* vs = vals;
    const uint64_t inv = inverse_c, per_source = uint64_t(rpd);
    const int shift = low;
    for_valid(b, [at, out, vs, inv, per_source, shift](int64_t k, uint32_t col, uint32_t row) {
      const uint64_t source = inv ? uint64_t((__uint128_t(inv) * uint64_t(k)) >> 64) : uint64_t(k);  // 0: C == 1
      // Each bucket's records are written in a stream of their own (up to 256 at once); a store that misses
      // stalls the loop, so the stream's line 16 records (3 lines) ahead is asked for first, and the misses of
      // the streams overlap (the distance matters little: 8 or 32 ahead do as well).
      const int64_t p = at[col >> shift]++;
      __builtin_prefetch(out + p + 16, 1, 3);
      out[p] = Record{col, uint32_t(source * per_source + row), vs[k]};
    });
  });
  const int passes = (low + 10) / 11, digit = passes ? (low + passes - 1) / passes : 0;
  parallel_for(pool, threads, nb, [&](int64_t bucket) {
    const int64_t lo = s.buckets[bucket], size = s.buckets[bucket + 1] - lo;
    if (size == 0) return;
    thread_local std::vector<Record> spare;  // the passes' other buffer: a bucket's size, not the batch's
    if (spare.size() < size_t(size)) spare.resize(size_t(size));  // grown only
    Record *a = records + lo, *t = spare.data();
    uint32_t c[(1 << 11) + 1];  // a local array: its stores alias nothing the loops read
    const uint32_t mask = (uint32_t(1) << digit) - 1;
    for (int shift = 0; shift < low; shift += digit) {
      std::fill(c, c + mask + 2, 0u);
      for (int64_t i = 0; i < size; i++) {
        // The first pass reads the bucket from the batch-sized array, from memory: a line asked for every 4
        // records (a line holds 5 and a third: none skipped), 64 records ahead, so its misses overlap.
        if (shift == 0 && (i & 3) == 0) __builtin_prefetch(a + i + 64, 0, 3);
        c[((a[i].col >> shift) & mask) + 1]++;
      }
      for (uint32_t i = 1; i <= mask + 1; i++) c[i] += c[i - 1];
      for (int64_t i = 0; i < size; i++) t[c[(a[i].col >> shift) & mask]++] = a[i];
      std::swap(a, t);
    }
    use(static_cast<const Record*>(a), size);
    if (spare.capacity() > kKeepSpare) std::vector<Record>().swap(spare);  // a rare huge bucket (skewed ids)
  });
}

struct State {  // the table and up to two slot arrays, updated in place
  void* table;
  float* slot[2];
  int64_t width[2];
};

struct Grads {
  const float* const* rows;  // [D * rpd]: each output row's activation gradient (in one array or in blocks)
  const uint8_t* bad;        // [D * rpd]: the row holds a NaN/inf (SGD with skip_nonfinite), or null
  int64_t dim;
  const float* row(const Record& r) const { return rows[r.out_row]; }
};

// The update of one table row from its run of records (in entry order), on copies: `w` [dim] holds the row
// (f32), `s0`, `s1` its slot rows (widths w0, w1; 0: none); `g` [dim], `tmp` [3 * dim] are scratch. Returns false
// if the row and its slots must keep their values (under skip_nonfinite: a NaN/inf gradient, or an update that
// is not finite, e.g. a finite gradient whose square overflows into Adagrad's accumulator).
template <int64_t kDim>
inline bool update_copy(const Options& o, const Grads& gr, const Record* group, int64_t size, float* w, float* s0,
                        float* s1, int64_t w0, int64_t w1, float* g, float* tmp) {
  const int64_t dim = kDim > 0 ? kDim : gr.dim;
  if (o.linear) {  // SGD, each occurrence on its own in entry order: row += -lr * (g_k * v_k)
    for (int64_t i = 0; i < size && gr.bad; i++)
      if (gr.bad[group[i].out_row]) return false;
    const float neg_lr = -o.scalars[0];
    for (int64_t i = 0; i < size; i++) {
      const float *gk = gr.row(group[i]), v = group[i].value;
      for (int64_t j = 0; j < dim; j++) w[j] = w[j] + neg_lr * (gk[j] * v);
    }
    return true;
  }
  if (o.max_norm > 0.0f) {  // the row's gradient, summed in entry order, from zero
    for (int64_t j = 0; j < dim; j++) g[j] = 0.0f;
    float norm = 0.0f;
    const float scale = clip_scale(w, dim, o.max_norm, &norm);
    for (int64_t i = 0; i < size; i++)
      add_clipped_grad(w, scale, norm, o.max_norm, gr.row(group[i]), group[i].value, g, dim);
  } else {  // the same sum; its first term written directly (0 + x: the same bits, no separate zeroing pass)
    const float *g0 = gr.row(group[0]), v0 = group[0].value;
    for (int64_t j = 0; j < dim; j++) g[j] = 0.0f + g0[j] * v0;
    for (int64_t i = 1; i < size; i++) {
      const float *gk = gr.row(group[i]), v = group[i].value;
      for (int64_t j = 0; j < dim; j++) g[j] += gk[j] * v;
    }
  }
  if (o.skip_nonfinite && !all_finite(g, dim)) return false;
  update_row<kDim>(o, dim, w, g, tmp, s0, s1);
  return !o.skip_nonfinite || (all_finite(w, dim) && all_finite(s0, w0) && all_finite(s1, w1));
}

constexpr int64_t kRowsAhead = 32;        // distinct rows ahead whose table and slot rows are prefetched
constexpr int64_t kAhead = 64;            // records ahead whose gradient rows are prefetched

// Updates the rows of records [0, m) (whole runs of one col), in order: each row and its slots are copied out,
// updated and written back. Loads are prefetched a fixed distance ahead, a little with each row: one more row
// (first record of a run) and the gradient rows of the records up to kAhead past this row's. Spread so, the
// prefetches never come in bursts that fill the core's miss buffers and stall it (updating rows in batches of
// 32, with each batch's prefetches issued together, stalls on those bursts). Rows go by distinct rows, not records:
// a hot row's many records would hide the rows after it.
template <typename T, int64_t kDim>
inline void update_range(const Options& o, const Grads& gr, const Record* recs, int64_t m, const State& st) {
  const int64_t dim = kDim > 0 ? kDim : gr.dim, w0 = st.slot[0] ? st.width[0] : 0, w1 = st.slot[1] ? st.width[1] : 0;
  // The copies of the row and its slots (width dim or 1, see decode_state) and update_copy's scratch. For a
  // width known at compile time, local arrays: distinct objects, so the compiler needs no aliasing checks and
  // keeps them in registers; else one heap buffer.
  constexpr int64_t kLocal = kDim > 0 ? kDim : 1;
  float local_w[kLocal], local_g[kLocal], local_tmp[3 * kLocal], local_s0[kLocal], local_s1[kLocal];
  float *w = local_w, *s0 = local_s0, *s1 = local_s1, *g = local_g, *tmp = local_tmp;
  std::vector<float> heap(kDim > 0 ? 0 : size_t(5 * dim + w0 + w1));
  if constexpr (kDim == 0) w = heap.data(), s0 = w + dim, s1 = s0 + w0, g = s1 + w1, tmp = g + dim;
  T* table = static_cast<T*>(st.table);
  int64_t next_row = 0, next_grad = 0;  // the next row and the next record whose loads are not yet asked for
  auto prefetch_rows = [&](int64_t rows) {
    for (; rows > 0 && next_row < m; rows--) {
      const uint32_t col = recs[next_row].col;
      prefetch_row<Prefetch::kWrite>(table + int64_t(col) * dim, dim * int64_t(sizeof(T)));
      if (w0) prefetch_row<Prefetch::kWrite>(st.slot[0] + int64_t(col) * w0, w0 * 4);
      if (w1) prefetch_row<Prefetch::kWrite>(st.slot[1] + int64_t(col) * w1, w1 * 4);
      while (++next_row < m && recs[next_row].col == col) {
      }
    }
  };
  prefetch_rows(kRowsAhead);
  for (int64_t b = 0; b < m;) {
    const int64_t col = recs[b].col;
    int64_t e = b + 1;
    while (e < m && recs[e].col == col) e++;
    prefetch_rows(1);
    for (; next_grad < std::min(e + kAhead, m); next_grad++)
      prefetch_row<Prefetch::kReadL1>(gr.row(recs[next_grad]), dim * 4);
    T* row = table + col * dim;
    for (int64_t j = 0; j < dim; j++) w[j] = load(row + j);
    copy_row<kDim>(s0, st.slot[0] + col * w0, w0);
    copy_row<kDim>(s1, st.slot[1] + col * w1, w1);
    // else the row and its slots keep their values
    if (update_copy<kDim>(o, gr, recs + b, e - b, w, s0, s1, w0, w1, g, tmp)) {
      for (int64_t j = 0; j < dim; j++) store(row + j, w[j]);
      copy_row<kDim>(st.slot[0] + col * w0, s0, w0);
      copy_row<kDim>(st.slot[1] + col * w1, s1, w1);
    }
    b = e;
  }
}

// Updates the rows of one bucket's sorted records (see sort_buckets): each row on one thread, in a fixed order,
// whatever the thread count (a row's records are never split between buckets).
template <typename T>
void update_bucket(const Options& o, const Grads& gr, const Record* recs, int64_t m, const State& st) {
  with_isa([&] {
    with_width(gr.dim, [&](auto width) { update_range<T, decltype(width)::value>(o, gr, recs, m, st); });
  });
}

enum Flags : int64_t { kSkipNonfinite = 1, kClipGradient = 2, kClipWeight = 4, kLinear = 8 };

// The table and its slots (the remaining arguments from `first` on), aliased to the results: the state to
// update in place.
ffi::Error decode_state(ffi::RemainingArgs& in, size_t first, ffi::RemainingRets& out, State& st, int64_t& num_rows,
                        int64_t& dim, ffi::DataType& dtype) {
  if (in.size() < first || in.size() - first != out.size() || out.size() < 1 || out.size() > 3)
    return ffi::Error::InvalidArgument("sparse_embed backward: expected a table and up to two slots");
  for (size_t i = 0; i < out.size(); i++) {
    auto a = in.get<ffi::AnyBuffer>(first + i);
    auto r = out.get<ffi::AnyBuffer>(i);
    if (!a.has_value() || !r.has_value()) return ffi::Error::InvalidArgument("sparse_embed backward: bad state");
    if ((*r)->untyped_data() != a->untyped_data())  // aliased as a rule; copy if XLA gave a separate buffer
      std::memcpy((*r)->untyped_data(), a->untyped_data(), a->size_bytes());
    auto d = a->dimensions();
    if (d.size() != 2 || (i > 0 && (d[0] != num_rows || a->element_type() != ffi::F32 || (d[1] != 1 && d[1] != dim))))
      return ffi::Error::InvalidArgument("sparse_embed backward: slots must be float32 [rows, 1 or dim]");
    if (i == 0) {
      num_rows = d[0], dim = d[1], dtype = a->element_type(), st.table = (*r)->untyped_data();
    } else {
      st.slot[i - 1] = static_cast<float*>((*r)->untyped_data()), st.width[i - 1] = d[1];
    }
  }
  return ffi::Error::Success();
}

// The remaining arguments: the activation gradients of every source, `[D, n_b, dim]` per block b of output
// rows (`blocks` of them: one array, or one per feature), then the table and its slots.
ffi::Error Backward(ffi::ThreadPool pool, I32Matrix cols, I32Matrix rows, F32Matrix vals, F32Vector scalars,
                    ffi::AnyBuffer /*token: orders this call after the forward's reads*/,
                    ffi::RemainingArgs args, ffi::RemainingRets state_out, int64_t blocks, int64_t optimizer,
                    int64_t flags, float max_norm, ffi::Span<const float> options, ffi::Span<const float> hyper,
                    int64_t threads, int64_t huge_pages) {
  auto cd = cols.dimensions();
  State st{};
  int64_t num_rows = 0, dim = 0;
  ffi::DataType dtype = ffi::F32;
  if (blocks < 1 || size_t(blocks) > args.size())
    return ffi::Error::InvalidArgument("sparse_embed backward: expected the gradients in one or more blocks");
  if (ffi::Error err = decode_state(args, size_t(blocks), state_out, st, num_rows, dim, dtype); err.failure())
    return err;
  const int64_t D = cd[0];
  RowBlocks<const float> grads{{}, {0}, dim};
  for (int64_t b = 0; b < blocks; b++) {
    auto g = args.get<F32Cube>(size_t(b));
    if (!g.has_value() || !grads.add(g->typed_data(), g->dimensions(), D))
      return ffi::Error::InvalidArgument("sparse_embed backward: gradients must be float32 [D, n, dim]");
  }
  const int64_t rpd = grads.rpd();
  if (!same_dims(rows.dimensions(), cd) || !same_dims(vals.dimensions(), cd) || options.size() != 5)
    return ffi::Error::InvalidArgument("sparse_embed backward: inconsistent shapes");
  if (optimizer < 0 || optimizer >= kNumOptimizers)
    return ffi::Error::InvalidArgument("sparse_embed backward: unknown optimizer code");
  if (cd[0] * cd[1] >= (int64_t(1) << 32) || D * rpd >= (int64_t(1) << 32))
    return ffi::Error::InvalidArgument("sparse_embed backward: 2**32 or more entries or output rows");
  Options o{Optimizer(optimizer), max_norm, (flags & kSkipNonfinite) != 0, (flags & kClipGradient) != 0,
            options[0], options[1], options[2], (flags & kClipWeight) != 0, options[3], options[4],
            (flags & kLinear) != 0, hyper.begin(), scalars.typed_data()};
  const int64_t nt = thread_count(pool, threads);
  if (huge_pages) {
    hugepages::advise(pool, nt, st.table, size_t(num_rows * dim) * (dtype == ffi::F32 ? 4 : 2));
    for (int i = 0; i < 2; i++)
      if (st.slot[i]) hugepages::advise(pool, nt, st.slot[i], size_t(num_rows * st.width[i]) * 4);
  }
  if (dtype != ffi::F32 && dtype != ffi::BF16)
    return ffi::Error::InvalidArgument("sparse_embed backward: tables must be float32 or bfloat16");
  BufferPool::Lease lease{buffer_pool, buffer_pool.take()};
  Buffers& buf = *lease.buffers;
  buf.grad_rows.resize(size_t(D * rpd) + 1);
  for (int64_t d = 0; d < D; d++)
    for (int64_t r = 0; r < rpd; r++) buf.grad_rows[size_t(d * rpd + r)] = grads.row(d, r);
  Grads gr{buf.grad_rows.data(), nullptr, dim};
  if (o.linear && o.skip_nonfinite) {  // checked per output row, once, rather than per entry
    buf.bad.resize(size_t(D * rpd) + 1);
    uint8_t* b = buf.bad.data();
    parallel_for(pool, nt, D, [&](int64_t d) {
      for (int64_t r = d * rpd; r < (d + 1) * rpd; r++) b[r] = !all_finite(gr.rows[r], dim);
    });
    gr.bad = b;
  }
  const bool bf16 = dtype == ffi::BF16;
  sort_buckets(pool, nt, cols.typed_data(), rows.typed_data(), vals.typed_data(), D, cd[1], rpd, num_rows, buf,
               [&](const Record* recs, int64_t m) {
                 if (bf16)
                   update_bucket<uint16_t>(o, gr, recs, m, st);
                 else
                   update_bucket<float>(o, gr, recs, m, st);
               });
  return ffi::Error::Success();
}

// ------------------------------------------------------------------ an array left uninitialized

// An output that XLA allocates and this leaves as it is: the state a restore reads every row into (see
// sparse_embed/io/direct.py), where XLA's zero fill would fault in every page on one thread before the reads
// (which fault them in on several, a chunk at a time, with MADV_POPULATE_WRITE). Not on huge pages: faulting
// those in costs more here (compaction) than the TLB misses they save; a training step's kernel collapses a
// table's pages later (hugepages::advise).
ffi::Error Uninitialized(ffi::Result<ffi::AnyBuffer> out) {
  (void)out;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseEmbedUninitialized, Uninitialized, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseEmbedForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<I32Matrix>()
                                  .Arg<I32Matrix>()
                                  .Arg<F32Matrix>()
                                  .Ret<F32Vector>()
                                  .RemainingRets()
                                  .Attr<float>("max_norm")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("huge_pages"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseEmbedBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<I32Matrix>()
                                  .Arg<I32Matrix>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Vector>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("blocks")
                                  .Attr<int64_t>("optimizer")
                                  .Attr<int64_t>("flags")
                                  .Attr<float>("max_norm")
                                  .Attr<ffi::Span<const float>>("options")
                                  .Attr<ffi::Span<const float>>("hyper")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("huge_pages"));

// ------------------------------------------------------------------ Python module

extern "C" XLA_FFI_Error* SparseEmbedFindKeys(XLA_FFI_CallFrame* call_frame);  // _native_keys.cc
extern "C" XLA_FFI_Error* SparseEmbedTouchKeysMany(XLA_FFI_CallFrame* call_frame);  // _native_keys.cc
extern "C" XLA_FFI_Error* SparseEmbedInsertKeys(XLA_FFI_CallFrame* call_frame);  // _native_keys.cc
extern "C" XLA_FFI_Error* SparseEmbedUniqueKeys(XLA_FFI_CallFrame* call_frame);  // _native_keys.cc
extern "C" XLA_FFI_Error* SparseEmbedTakeRows(XLA_FFI_CallFrame* call_frame);  // _native_keys.cc

static PyObject* handlers(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  if (!d) return nullptr;
  const struct {
    const char* name;
    void* fn;
  } targets[] = {{"forward", reinterpret_cast<void*>(SparseEmbedForward)},
                 {"backward", reinterpret_cast<void*>(SparseEmbedBackward)},
                 {"find_keys", reinterpret_cast<void*>(SparseEmbedFindKeys)},
                 {"touch_keys_many", reinterpret_cast<void*>(SparseEmbedTouchKeysMany)},
                 {"insert_keys", reinterpret_cast<void*>(SparseEmbedInsertKeys)},
                 {"unique_keys", reinterpret_cast<void*>(SparseEmbedUniqueKeys)},
                 {"take_rows", reinterpret_cast<void*>(SparseEmbedTakeRows)},
                 {"uninitialized", reinterpret_cast<void*>(SparseEmbedUninitialized)}};
  for (const auto& t : targets) {
    PyObject* capsule = PyCapsule_New(t.fn, nullptr, nullptr);
    if (!capsule || PyDict_SetItemString(d, t.name, capsule) < 0) {
      Py_XDECREF(capsule);
      Py_DECREF(d);
      return nullptr;
    }
    Py_DECREF(capsule);
  }
  return d;
}

static PyObject* native_isa(PyObject*, PyObject*) { return PyUnicode_FromString(isa_name(process_isa())); }

static PyObject* cap_isa(PyObject*, PyObject* arg) {
  int cap = -1;
  if (arg != Py_None) {
    const char* name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : nullptr;
    for (Isa isa : {Isa::kBaseline, Isa::kAvx2, Isa::kAvx512})
      if (name && std::string(name) == isa_name(isa)) cap = static_cast<int>(isa);
    if (cap < 0) {
      PyErr_Format(PyExc_ValueError, "cap_isa takes 'avx512', 'avx2', 'baseline' or None, got %R", arg);
      return nullptr;
    }
  }
  sparse_embed_isa_cap.store(cap, std::memory_order_relaxed);
  return native_isa(nullptr, nullptr);
}

static PyObject* optimizers(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  if (!d) return nullptr;
#define SPARSE_EMBED_ENTRY(k, name)                                        \
  {                                                                        \
    PyObject* code = PyLong_FromLongLong(k);                               \
    if (!code || PyDict_SetItemString(d, name, code) < 0) {                \
      Py_XDECREF(code);                                                    \
      Py_DECREF(d);                                                        \
      return nullptr;                                                      \
    }                                                                      \
    Py_DECREF(code);                                                       \
  }
  SPARSE_EMBED_OPTIMIZERS(SPARSE_EMBED_ENTRY)
#undef SPARSE_EMBED_ENTRY
  return d;
}

static PyMethodDef methods[] = {
    {"handlers", handlers, METH_NOARGS, "handlers() -> {name: PyCapsule of an XLA FFI handler}"},
    {"isa", native_isa, METH_NOARGS,
     "isa() -> 'avx512', 'avx2' or 'baseline': the instruction set of the hot loops in this process"},
    {"cap_isa", cap_isa, METH_O,
     "cap_isa(name or None) -> isa(): the hot loops run on no more than `name` from now on (None: no cap)"},
    {"optimizers", optimizers, METH_NOARGS,
     "optimizers() -> {case name: code}: the optimizers the backward has a case for (see Optimizer.native())"},
    {nullptr, nullptr, 0, nullptr},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native_cpu", "The native CPU kernel's XLA FFI handlers (see _native_cpu.cc).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__native_cpu(void) { return PyModule_Create(&module); }
