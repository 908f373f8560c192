// The instruction-set levels the host kernels are built for (diff, state
// digest, FP8 quantization), and whether this CPU runs each: one check,
// at run time, for every module that dispatches on it.
#pragma once

namespace deltasync::core_internal {

enum class CpuIsa {
  kBaseline,  // x86-64 (or any other architecture): the portable kernels
  kAvx2,      // AVX2 with BMI1, BMI2 and POPCNT (Haswell on)
  kAvx512,    // the AVX2 level and AVX-512 F, BW, DQ and VL (Skylake-SP on)
};

// Whether this CPU runs kernels built for `isa`.
inline bool CpuRuns(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline: return true;
#if defined(__x86_64__)
    case CpuIsa::kAvx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
             __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
    case CpuIsa::kAvx512:
      return CpuRuns(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl");
#else
    case CpuIsa::kAvx2:
    case CpuIsa::kAvx512: return false;
#endif
  }
  return false;
}

}  // namespace deltasync::core_internal
