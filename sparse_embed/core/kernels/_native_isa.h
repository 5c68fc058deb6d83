// The instruction set the native kernels' hot loops run on (_native_cpu.cc's forward and update loops,
// _native_keys.cc's key search): the best the CPU has (AVX-512, AVX2, the x86-64 baseline), chosen once per
// process, or a lower one with $SPARSE_EMBED_NATIVE_ISA=avx2|baseline, or below the cap `cap_isa()` sets (the
// tests run the kernels on each set in one process). Every choice computes the same values: elementwise IEEE
// operations, no FMA contraction, reductions in a fixed order.
#ifndef SPARSE_EMBED_NATIVE_ISA_H_
#define SPARSE_EMBED_NATIVE_ISA_H_

#include <atomic>
#include <cstdlib>
#include <string>

// The cap `cap_isa()` sets, an `Isa` value (-1: none): one object for every file of the extension (an inline
// variable), read at each call of a hot loop.
inline std::atomic<int> sparse_embed_isa_cap{-1};

namespace {

enum class Isa { kBaseline, kAvx2, kAvx512 };

inline Isa process_isa() {
  static const Isa best_here = [] {
    Isa best = Isa::kBaseline;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f")) best = Isa::kAvx512;
    else if (__builtin_cpu_supports("avx2")) best = Isa::kAvx2;
#endif
    const char* env = std::getenv("SPARSE_EMBED_NATIVE_ISA");
    const std::string cap = env ? env : "";
    if (cap == "baseline") return Isa::kBaseline;
    if (cap == "avx2" && best == Isa::kAvx512) return Isa::kAvx2;
    return best;
  }();
  const int cap = sparse_embed_isa_cap.load(std::memory_order_relaxed);
  return cap >= 0 && cap < static_cast<int>(best_here) ? static_cast<Isa>(cap) : best_here;
}

inline const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "baseline";
}

// f() compiled for each instruction set (flatten: everything f calls is inlined into the wrapper, so its loops
// are compiled for the wrapper's target), run on the process's.
#if defined(__x86_64__)
template <class F>
__attribute__((target("avx512f"), flatten)) auto run_avx512(const F& f) { return f(); }
template <class F>
__attribute__((target("avx2"), flatten)) auto run_avx2(const F& f) { return f(); }
#endif
template <class F>
__attribute__((flatten)) auto run_baseline(const F& f) { return f(); }

template <class F>
auto with_isa(const F& f) {
#if defined(__x86_64__)
  const Isa isa = process_isa();
  if (isa == Isa::kAvx512) return run_avx512(f);
  if (isa == Isa::kAvx2) return run_avx2(f);
#endif
  return run_baseline(f);
}

}  // namespace

#endif  // SPARSE_EMBED_NATIVE_ISA_H_
