// Sign codes of projections in one pass (part of the ds_xc_hamming_cpu op; bound in hamming_cpu.cpp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_simd.h"

namespace {

// Sign codes of projections z (n, b) float32, b % 8 == 0, in one pass: codes (n, b / 8) uint8 with bit
// j of row i = [z[i][j] > 0], LSB first (ds_xc_ops.hamming.pack_signs; NaN packs as 0), and
// min_abs (n,) = min_j |z[i][j]| (NaN where the row holds one, as torch.amin). The index's encoder
// needs both (the code and how far the row is from flipping a bit); as torch ops they are five
// passes over (n, b) with temporaries. AVX-512: 16 values, one compare mask = two code bytes.
// The value at j of a float32 row, or of a bf16 row (its 16 bits are the top half of the float).
inline float value(const float* z, int64_t j) { return z[j]; }
inline float value(const uint16_t* z, int64_t j) {
  const uint32_t bits = static_cast<uint32_t>(z[j]) << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

template <typename T>
void pack_row_scalar(const T* z, int64_t b, int64_t from, uint8_t* out, float& mn, bool& nan) {
  for (int64_t byte = from / 8; byte < b / 8; ++byte) {
    uint8_t v = 0;
    for (int t = 0; t < 8; ++t) {
      const float x = value(z, 8 * byte + t), a = std::fabs(x);
      v = static_cast<uint8_t>(v | (static_cast<uint8_t>(x > 0.0f) << t));
      nan = nan || a != a;
      mn = a < mn ? a : mn;
    }
    out[byte] = v;
  }
}

#ifdef DS_XC_X86_SIMD
__attribute__((target("avx512f"))) inline __m512 load16(const float* z, int64_t j) { return _mm512_loadu_ps(z + j); }
__attribute__((target("avx512f"))) inline __m512 load16(const uint16_t* z, int64_t j) {  // bf16 -> float32, exact
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(z + j));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename T>
__attribute__((target("avx512f"))) void pack_row_avx512(const T* z, int64_t b, uint8_t* out, float& mn, bool& nan) {
  __m512 m = _mm512_set1_ps(__builtin_inff());
  __mmask16 unordered = 0;
  int64_t j = 0;
  for (; j + 16 <= b; j += 16) {
    const __m512 x = load16(z, j);
    const __mmask16 gt = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
    std::memcpy(out + j / 8, &gt, 2);  // little-endian: bit t of the mask is element j + t
    const __m512 a = _mm512_abs_ps(x);
    unordered = static_cast<__mmask16>(unordered | _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q));
    m = _mm512_min_ps(m, a);
  }
  mn = _mm512_reduce_min_ps(m);
  nan = unordered != 0;
  pack_row_scalar(z, b, j, out, mn, nan);  // a last 8 values when b % 16 == 8
}

bool avx512f_enabled() {  // the scan's switch, DS_XC_HAMMING_SIMD (read once)
  static const bool on = ds_xc_simd::avx512_enabled("DS_XC_HAMMING_SIMD");
  return on;
}
#endif

template <typename T>
void pack_rows(const T* zp, int64_t n, int64_t b, uint8_t* cp, float* mp) {
#ifdef DS_XC_X86_SIMD
  const bool simd = avx512f_enabled();
#endif
  at::parallel_for(0, n, 256, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e; ++i) {
      float mn = __builtin_inff();
      bool nan = false;
#ifdef DS_XC_X86_SIMD
      if (simd) {
        pack_row_avx512(zp + i * b, b, cp + i * (b / 8), mn, nan);
      } else {
        pack_row_scalar(zp + i * b, b, 0, cp + i * (b / 8), mn, nan);
      }
#else
      pack_row_scalar(zp + i * b, b, 0, cp + i * (b / 8), mn, nan);
#endif
      mp[i] = nan ? __builtin_nanf("") : mn;
    }
  });
}

}  // namespace

// z (n, b) float32 or bfloat16 (the bf16 ANN codes: no float32 copy of the projections); min_abs float32.
std::vector<at::Tensor> pack_signs_min_abs(at::Tensor z) {
  const bool bf16 = z.scalar_type() == at::kBFloat16;
  TORCH_CHECK(z.device().is_cpu() && (z.scalar_type() == at::kFloat || bf16) && z.dim() == 2 && z.is_contiguous(),
              "z must be a contiguous 2-D float32 or bfloat16 CPU tensor, got ", z.scalar_type(), " ", z.sizes(),
              " on ", z.device());
  const int64_t n = z.size(0), b = z.size(1);
  TORCH_CHECK(b % 8 == 0, "z has ", b, " columns; pack_signs_min_abs needs a multiple of 8");
  auto codes = at::empty({n, b / 8}, z.options().dtype(at::kByte));
  auto min_abs = at::empty({n}, z.options().dtype(at::kFloat));
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* mp = min_abs.data_ptr<float>();
  if (bf16) {
    pack_rows(reinterpret_cast<const uint16_t*>(z.data_ptr<at::BFloat16>()), n, b, cp, mp);
  } else {
    pack_rows(z.data_ptr<float>(), n, b, cp, mp);
  }
  return {codes, min_abs};
}
