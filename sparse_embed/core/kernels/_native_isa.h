// The instruction set the native kernels' hot loops run on (_native_cpu.cc's forward and update loops,
// _native_keys.cc's key search), chosen once per process: the best the CPU has (AVX-512, AVX2, the x86-64
// baseline), or a lower one with $SPARSE_EMBED_NATIVE_ISA=avx2|baseline (tests run each that way). Every choice
// computes the same values: elementwise IEEE operations, no FMA contraction, reductions in a fixed order.
#ifndef SPARSE_EMBED_NATIVE_ISA_H_
#define SPARSE_EMBED_NATIVE_ISA_H_

#include <cstdlib>
#include <string>

namespace {

enum class Isa { kBaseline, kAvx2, kAvx512 };

inline Isa process_isa() {
  static const Isa isa = [] {
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
  return isa;
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
