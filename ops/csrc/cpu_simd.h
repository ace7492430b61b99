// Run-time switches of the CPU ops' AVX-512 paths: one place for every op (hamming, pack, rows,
// softmax, select).
//
// The ops are built without -mavx512 flags, so that a build cached on a shared home directory also
// runs on an older CPU of the same architecture: the vector functions carry target attributes and
// are called only where the CPU reports the features. Each op has an environment variable that,
// set to 0, forces its scalar path (the tests compare both). Read once per process by the callers'
// function-local statics. The builders hash this header into their flags (ops/builders.py): torch's
// JIT cache hashes the sources and the flags, not the headers they include.
#pragma once

#include <cstdlib>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DS_XC_X86_SIMD 1  // AVX-512 intrinsics compile here (functions with target attributes)
#endif

namespace ds_xc_simd {

// False when the environment variable `name` is set and starts with '0'.
inline bool env_allows(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || v[0] != '0';
}

// Whether the CPU runs AVX-512F (and, with `vpopcntdq`, AVX-512 VPOPCNTDQ).
inline bool cpu_has_avx512(bool vpopcntdq = false) {
#ifdef DS_XC_X86_SIMD
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && (!vpopcntdq || __builtin_cpu_supports("avx512vpopcntdq"));
#else
  (void)vpopcntdq;
  return false;
#endif
}

// The vector path of an op: allowed by its environment variable `name` and run by the CPU.
inline bool avx512_enabled(const char* name, bool vpopcntdq = false) {
  return env_allows(name) && cpu_has_avx512(vpopcntdq);
}

}  // namespace ds_xc_simd
