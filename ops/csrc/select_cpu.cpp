// Threshold selection with compaction on the CPU: the positions and values of |v| >= t.
//
// The gradient compressors' first selection pass (ds_xc/compression/bayes.py: the elements that
// get their own coin) over a float32 gradient of millions of elements. In PyTorch it is
// `a = v.abs(); idx = nonzero(a >= t)` and a gather: four passes and two full-size temporaries
// (the |v| copy and the bool mask). Here: one pass that counts the kept entries per block, an
// exclusive sum, one pass that writes (position, value) into the exact-size outputs. Blocks run in
// parallel (at::parallel_for); the output is in ascending position order and deterministic.
//
// Semantics are ds_xc_ops.triton_select.select_above_torch's for float32: the comparison is
// |v_i| >= t in float32 (t is the threshold rounded to float32 by the caller), ordered, so NaN
// entries are never kept, a NaN threshold keeps nothing and a threshold <= 0 keeps every non-NaN
// entry. The values are v's, sign included.
//
// AVX-512F (checked at run time, built without -mavx512 flags): 16 entries per compare into a
// mask; the set bits are walked one by one, which suits the sparse masks of a selection (a few
// percent kept). Without AVX-512, or with DS_XC_SELECT_SIMD=0, a scalar loop.
//
// update_score_ writes the score that `select_by: update` ranks (ds_xc/compression/score.py),
// s = v / sqrt(max(m scale, floor)) with m Adam's exp_avg_sq, in one pass over v and m instead of
// PyTorch's five (a scaled copy, a clamp, a sqrt, a division, each over millions of elements). The
// float32 operations are PyTorch's, in the same order, each correctly rounded (no reciprocal square
// root estimate): the IEEE float32 result, the same on both paths (PyTorch's vectorised sqrt can be
// 1 ulp off it). A NaN m scale stays NaN through the max, as torch.clamp propagates it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <tuple>
#include <vector>

#include "cpu_simd.h"
#ifdef DS_XC_X86_SIMD
#define DS_XC_AVX512_TARGET __attribute__((target("avx512f")))
#endif

namespace {

constexpr int64_t kBlock = 1 << 15;  // entries per block: one count and one output start each

bool simd_enabled() {
  static const bool on = ds_xc_simd::avx512_enabled("DS_XC_SELECT_SIMD");
  return on;
}

inline bool keep(float x, float t) { return std::fabs(x) >= t; }  // false for NaN x or NaN t

// Entries of x[lo, hi) kept; with idx/val non-null, also writes them there (positions as lo + j).
int64_t block_scalar(const float* x, int64_t lo, int64_t hi, float t, int64_t* idx, float* val) {
  int64_t m = 0;
  for (int64_t i = lo; i < hi; ++i) {
    if (keep(x[i], t)) {
      if (idx != nullptr) {
        idx[m] = i;
        val[m] = x[i];
      }
      ++m;
    }
  }
  return m;
}

#ifdef DS_XC_X86_SIMD
DS_XC_AVX512_TARGET int64_t block_avx512(const float* x, int64_t lo, int64_t hi, float t, int64_t* idx,
                                          float* val) {
  const __m512 tv = _mm512_set1_ps(t);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  int64_t m = 0;
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + i)), abs_mask));
    uint32_t bits = _mm512_cmp_ps_mask(a, tv, _CMP_GE_OQ);  // ordered: NaN on either side -> 0
    if (idx == nullptr) {
      m += __builtin_popcount(bits);
      continue;
    }
    while (bits != 0) {
      const int j = __builtin_ctz(bits);
      idx[m] = i + j;
      val[m] = x[i + j];
      ++m;
      bits &= bits - 1;
    }
  }
  return m + block_scalar(x, i, hi, t, idx == nullptr ? nullptr : idx + m, val == nullptr ? nullptr : val + m);
}
#endif

int64_t run_block(const float* x, int64_t lo, int64_t hi, float t, int64_t* idx, float* val) {
#ifdef DS_XC_X86_SIMD
  if (simd_enabled()) return block_avx512(x, lo, hi, t, idx, val);
#endif
  return block_scalar(x, lo, hi, t, idx, val);
}

// (idx (m,) int64 ascending, val (m,) float32): the entries of the 1-D float32 v with |v_i| >= t.
std::tuple<at::Tensor, at::Tensor> select_above(const at::Tensor& v, double threshold) {
  TORCH_CHECK(v.device().is_cpu() && v.scalar_type() == at::kFloat && v.dim() == 1 && v.is_contiguous(),
              "select_above: v must be a contiguous 1-D float32 CPU tensor, got ", v.scalar_type(), " of ", v.dim(),
              " dims on ", v.device());
  const float* x = v.data_ptr<float>();
  const float t = static_cast<float>(threshold);
  const int64_t n = v.numel();
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<int64_t> start(blocks + 1, 0);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      start[b + 1] = run_block(x, b * kBlock, std::min(n, (b + 1) * kBlock), t, nullptr, nullptr);
    }
  });
  for (int64_t b = 0; b < blocks; ++b) start[b + 1] += start[b];  // exclusive sums: each block's output start
  at::Tensor idx = at::empty({start[blocks]}, v.options().dtype(at::kLong));  // (m,)
  at::Tensor val = at::empty({start[blocks]}, v.options());                  // (m,)
  int64_t* ip = idx.data_ptr<int64_t>();
  float* vp = val.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      run_block(x, b * kBlock, std::min(n, (b + 1) * kBlock), t, ip + start[b], vp + start[b]);
    }
  });
  return {idx, val};
}

// out[i] = x[i] / sqrt(max(m[i] * scale, floor)) for i in [lo, hi), float32 throughout.
void score_scalar(const float* x, const float* m, float scale, float floor, float* out, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    float h = m[i] * scale;
    h = h < floor ? floor : h;  // a NaN h stays NaN
    out[i] = x[i] / std::sqrt(h);
  }
}

#ifdef DS_XC_X86_SIMD
DS_XC_AVX512_TARGET void score_avx512(const float* x, const float* m, float scale, float floor, float* out,
                                      int64_t lo, int64_t hi) {
  const __m512 sv = _mm512_set1_ps(scale);
  const __m512 fv = _mm512_set1_ps(floor);
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    // max_ps(a, b) = a > b ? a : b, so max(floor, h) is floor where h < floor and h otherwise (NaN h too)
    __m512 h = _mm512_max_ps(fv, _mm512_mul_ps(_mm512_loadu_ps(m + i), sv));
    _mm512_storeu_ps(out + i, _mm512_div_ps(_mm512_loadu_ps(x + i), _mm512_sqrt_ps(h)));
  }
  score_scalar(x, m, scale, floor, out, i, hi);
}
#endif

// out = v / sqrt(max(exp_avg_sq * scale, floor)): three contiguous 1-D float32 CPU tensors of one size.
void update_score_(const at::Tensor& v, const at::Tensor& exp_avg_sq, double scale, double floor, at::Tensor& out) {
  for (const at::Tensor* t : {&v, &exp_avg_sq, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 1 && t->is_contiguous(),
                "update_score_: v, exp_avg_sq and out must be contiguous 1-D float32 CPU tensors, got ",
                t->scalar_type(), " of ", t->dim(), " dims on ", t->device());
  }
  TORCH_CHECK(exp_avg_sq.numel() == v.numel() && out.numel() == v.numel(), "update_score_: sizes differ: v ",
              v.numel(), ", exp_avg_sq ", exp_avg_sq.numel(), ", out ", out.numel());
  const float* x = v.data_ptr<float>();
  const float* m = exp_avg_sq.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), fl = static_cast<float>(floor);
  at::parallel_for(0, v.numel(), kBlock, [&](int64_t lo, int64_t hi) {
#ifdef DS_XC_X86_SIMD
    if (simd_enabled()) return score_avx512(x, m, sc, fl, o, lo, hi);
#endif
    score_scalar(x, m, sc, fl, o, lo, hi);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("select_above", &select_above, "(v, threshold) -> (idx, val): the entries with |v| >= threshold");
  m.def("update_score_", &update_score_,
        "(v, exp_avg_sq, scale, floor, out): out = v / sqrt(max(exp_avg_sq * scale, floor)), float32");
  m.def("simd_enabled", &simd_enabled, "whether the AVX-512 path runs");
}
