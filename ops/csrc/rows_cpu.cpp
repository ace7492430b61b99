// Fused row kernels of the head optimizers' lazy steps: CPU.
//
// A lazy (sparse) optimizer step touches R rows of a (L, d) weight and its state. In
// PyTorch that is a gather of each tensor's rows into fresh (R, d) copies, a few
// element-wise passes with temporaries, and a scatter back: about ten passes over (R, d)
// plus the page faults of the fresh copies. Here each row is read and written once, in
// place, by one thread (at::parallel_for over rows, so torch.set_num_threads holds).
//
// The formulas, their order of operations and where a multiply-add is fused are those of the
// PyTorch code they replace (ds_xc/head/optim.py: HeadSGD._update and _exact_apply, HeadAdamW
// ._update and _exact_apply; loops in rows_body.h), in the weight's dtype (float32 or float64),
// so the two paths give the same bits: `fused` (the caller passes whether torch's CPU
// capability fuses, i.e. is not DEFAULT) picks the FMA build of the loops, which on x86 also
// needs the CPU to have FMA. Callers (ops/rows.py) check dtypes, devices, shapes and
// contiguity; the step kernels require distinct rows (a coalesced sparse gradient) and check
// that every row is in range.
//
// Catch-up kernels take the rows with duplicates allowed: a sequential first pass keeps the
// first occurrence of each stale row and marks it current in `last` (int64 (L,)), then the
// kept rows are updated in parallel. coef (n + 1, 2, 2) float64 holds the suffix products of
// the skipped steps' matrices (ds_xc/head/lazy_exact.py); a row last updated at step a takes
// coef[steps - a]. Written tensors get their autograd version bumped, as in-place torch ops do.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_simd.h"

namespace {

using Stale = std::vector<std::pair<int64_t, int64_t>>;  // (row, skipped steps)
constexpr int64_t kGrain = 256;  // rows per task of parallel_for
constexpr int64_t kPrefetch = 4;  // rows ahead that the loops prefetch

namespace plain {
constexpr bool kFused = false;
#include "rows_body.h"
}  // namespace plain

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace fused {
constexpr bool kFused = true;
#include "rows_body.h"
}  // namespace fused
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC pop_options
#endif

bool use_fused(bool fused) {
#if defined(__x86_64__) || defined(_M_X64)
  return fused && __builtin_cpu_supports("fma");
#else
  return fused;
#endif
}

void bump(std::initializer_list<at::Tensor> written) {
  for (const auto& t : written) torch::autograd::impl::bump_version(t);
}

// The stale rows among `rows` (first occurrences), each with its skipped-step count; marks them
// current in `last`. Every row is checked before anything is marked: a refused call changes nothing.
Stale stale_rows(const at::Tensor& rows, at::Tensor& last, int64_t steps, const at::Tensor& coef) {
  const int64_t* r = rows.data_ptr<int64_t>();
  int64_t* l = last.data_ptr<int64_t>();
  const int64_t num = last.numel(), span = coef.size(0);
  for (int64_t i = 0; i < rows.numel(); ++i) {
    const int64_t row = r[i];
    TORCH_CHECK(row >= 0 && row < num, "rows_cpu catch-up: row ", row, " outside [0, ", num, ")");
    TORCH_CHECK(l[row] >= steps || steps - l[row] < span, "rows_cpu catch-up: row ", row, " skipped ",
                steps - l[row], " steps, coef covers ", span - 1);
  }
  Stale out;
  out.reserve(rows.numel());
  for (int64_t i = 0; i < rows.numel(); ++i) {
    const int64_t row = r[i];
    if (l[row] < steps) {
      out.emplace_back(row, steps - l[row]);
      l[row] = steps;
    }
  }
  return out;
}

void check_rows(const at::Tensor& rows, int64_t num) {
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < num, "rows_cpu step: row ", r[i], " outside [0, ", num, ")");
  }
}

template <typename T>
void sgd_catch_up_t(at::Tensor& w, at::Tensor& buf, const Stale& sel, const at::Tensor& coef, bool fused) {
  auto f = use_fused(fused) ? fused::sgd_catch_up<T> : plain::sgd_catch_up<T>;
  f(w.data_ptr<T>(), buf.data_ptr<T>(), sel, coef.data_ptr<double>(), w.size(1));
}

void sgd_catch_up(at::Tensor w, at::Tensor buf, at::Tensor last, at::Tensor rows, at::Tensor coef, int64_t steps,
                  bool fused) {
  const Stale sel = stale_rows(rows, last, steps, coef);
  if (w.scalar_type() == at::kDouble) {
    sgd_catch_up_t<double>(w, buf, sel, coef, fused);
  } else {
    sgd_catch_up_t<float>(w, buf, sel, coef, fused);
  }
  bump({w, buf});
}

template <typename T>
void sgd_step_t(at::Tensor& w, at::Tensor& buf, const at::Tensor& rows, const at::Tensor& grad, double lr, double mu,
                double wd, bool nesterov, bool fused) {
  auto f = use_fused(fused) ? fused::sgd_step<T> : plain::sgd_step<T>;
  f(w.data_ptr<T>(), buf.data_ptr<T>(), rows.data_ptr<int64_t>(), rows.numel(), grad.data_ptr<T>(), w.size(1), lr,
    mu, wd, nesterov);
}

void sgd_step(at::Tensor w, at::Tensor buf, at::Tensor rows, at::Tensor grad, double lr, double mu, double wd,
              bool nesterov, bool fused) {
  check_rows(rows, w.size(0));
  if (w.scalar_type() == at::kDouble) {
    sgd_step_t<double>(w, buf, rows, grad, lr, mu, wd, nesterov, fused);
  } else {
    sgd_step_t<float>(w, buf, rows, grad, lr, mu, wd, nesterov, fused);
  }
  bump({w, buf});
}

template <typename T>
void adamw_catch_up_t(at::Tensor& w, at::Tensor& m, at::Tensor& v, const Stale& sel, const at::Tensor& coef,
                      double b1, double b2, bool fused) {
  auto f = use_fused(fused) ? fused::adamw_catch_up<T> : plain::adamw_catch_up<T>;
  f(w.data_ptr<T>(), m.data_ptr<T>(), v.data_ptr<T>(), sel, coef.data_ptr<double>(), w.size(1), b1, b2);
}

void adamw_catch_up(at::Tensor w, at::Tensor m, at::Tensor v, at::Tensor last, at::Tensor rows, at::Tensor coef,
                    int64_t steps, double b1, double b2, bool fused) {
  const Stale sel = stale_rows(rows, last, steps, coef);
  if (w.scalar_type() == at::kDouble) {
    adamw_catch_up_t<double>(w, m, v, sel, coef, b1, b2, fused);
  } else {
    adamw_catch_up_t<float>(w, m, v, sel, coef, b1, b2, fused);
  }
  bump({w, m, v});
}

template <typename T>
void adamw_step_t(at::Tensor& w, at::Tensor& m, at::Tensor& v, const at::Tensor& rows, const at::Tensor& grad,
                  double lr, double b1, double b2, double eps, double wd, double bc1, double bc2, bool fused) {
  auto f = use_fused(fused) ? fused::adamw_step<T> : plain::adamw_step<T>;
  f(w.data_ptr<T>(), m.data_ptr<T>(), v.data_ptr<T>(), rows.data_ptr<int64_t>(), rows.numel(), grad.data_ptr<T>(),
    w.size(1), lr, b1, b2, eps, wd, bc1, bc2);
}

void adamw_step(at::Tensor w, at::Tensor m, at::Tensor v, at::Tensor rows, at::Tensor grad, double lr, double b1,
                double b2, double eps, double wd, double bc1, double bc2, bool fused) {
  check_rows(rows, w.size(0));
  if (w.scalar_type() == at::kDouble) {
    adamw_step_t<double>(w, m, v, rows, grad, lr, b1, b2, eps, wd, bc1, bc2, fused);
  } else {
    adamw_step_t<float>(w, m, v, rows, grad, lr, b1, b2, eps, wd, bc1, bc2, fused);
  }
  bump({w, m, v});
}

// out[i] = src[idx[i]] for rows of `row_bytes` bytes (any dtype), the row kGatherAhead iterations
// ahead prefetched: a gather of scattered rows from a large shard is a cache and TLB miss per row
// that the hardware prefetcher does not start across pages (torch's index_select waits on each).
constexpr int64_t kGatherAhead = 8;

// Asks for the `bytes` bytes at p, one cache line at a time, for reading (the gathers' rows ahead).
inline void prefetch_read(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 0);
}

void gather_rows(at::Tensor src, at::Tensor idx, at::Tensor out) {
  const int64_t n = idx.numel(), num = src.size(0);
  const int64_t* r = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < num, "rows_cpu gather: row ", r[i], " outside [0, ", num, ")");
  }
  const int64_t row_bytes = src.numel() / std::max<int64_t>(num, 1) * src.element_size();
  const char* in = static_cast<const char*>(src.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, n, kGrain, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      if (i + kGatherAhead < b) prefetch_read(in + r[i + kGatherAhead] * row_bytes, row_bytes);
      std::memcpy(o + i * row_bytes, in + r[i] * row_bytes, static_cast<size_t>(row_bytes));
    }
  });
}

// dot = x . y and sq = y . y over d floats: 16 lanes with fused multiply-adds on AVX-512F (checked at
// run time), else 8 partial sums.
#ifdef DS_XC_X86_SIMD
__attribute__((target("avx512f"))) void dot_and_square_avx512(const float* x, const float* y, int64_t d, float& dot,
                                                               float& sq) {
  __m512 s = _mm512_setzero_ps(), t = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= d; k += 16) {
    const __m512 b = _mm512_loadu_ps(y + k);
    s = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), b, s);
    t = _mm512_fmadd_ps(b, b, t);
  }
  if (k < d) {
    const __mmask16 m = static_cast<__mmask16>((1u << (d - k)) - 1u);
    const __m512 b = _mm512_maskz_loadu_ps(m, y + k);
    s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), b, s);
    t = _mm512_fmadd_ps(b, b, t);
  }
  dot = _mm512_reduce_add_ps(s);
  sq = _mm512_reduce_add_ps(t);
}

bool avx512f_rows() {  // DS_XC_ROWS_SIMD=0 forces the plain loop (read once)
  static const bool on = ds_xc_simd::avx512_enabled("DS_XC_ROWS_SIMD");
  return on;
}
#else
void dot_and_square_avx512(const float*, const float*, int64_t, float&, float&) {}
bool avx512f_rows() { return false; }
#endif

inline void dot_and_square(const float* x, const float* y, int64_t d, bool wide, float& dot, float& sq) {
  if (wide) return dot_and_square_avx512(x, y, d, dot, sq);
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0}, t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    for (int u = 0; u < 8; ++u) {
      s[u] += x[k + u] * y[k + u];
      t[u] += y[k + u] * y[k + u];
    }
  }
  dot = sq = 0.0f;
  for (int u = 0; u < 8; ++u) {
    dot += s[u];
    sq += t[u];
  }
  for (; k < d; ++k) {
    dot += x[k] * y[k];
    sq += y[k] * y[k];
  }
}

// The ANN re-rank's scores (N, R) float32: q_i . w[c_ij], divided by |w[c_ij]| (at least 1e-12)
// when cosine, -inf where c_ij = -1. Each candidate row is read once, prefetched a few ahead; in
// PyTorch it is a gather of N R rows into a buffer, a batched matmul and a norm pass over the buffer.
at::Tensor rerank_scores(at::Tensor q, at::Tensor w, at::Tensor cand, bool cosine) {
  const int64_t n = cand.size(0), r = cand.size(1), d = w.size(1), num = w.size(0);
  const int64_t* c = cand.data_ptr<int64_t>();
  for (int64_t e = 0; e < n * r; ++e) {
    TORCH_CHECK(c[e] >= -1 && c[e] < num, "rows_cpu rerank: candidate ", c[e], " outside [-1, ", num, ")");
  }
  at::Tensor out = at::empty({n, r}, w.options());
  const float* qp = q.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool wide = avx512f_rows();
  at::parallel_for(0, n * r, kGrain, [&](int64_t a, int64_t b) {
    for (int64_t e = a; e < b; ++e) {
      if (e + kGatherAhead < b && c[e + kGatherAhead] >= 0) prefetch_read(wp + c[e + kGatherAhead] * d, d * 4);
      if (c[e] < 0) {
        op[e] = -std::numeric_limits<float>::infinity();
        continue;
      }
      float dot, sq;
      dot_and_square(qp + (e / r) * d, wp + c[e] * d, d, wide, dot, sq);
      op[e] = cosine ? dot / std::max(std::sqrt(sq), 1e-12f) : dot;
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_xc fused row kernels of the head optimizers' lazy steps (CPU)";
  m.def("sgd_catch_up", &sgd_catch_up,
        "(w, buf, last, rows, coef, steps, fused): exact lazy catch-up of SGD with momentum");
  m.def("sgd_step", &sgd_step, "(w, buf, rows, grad, lr, mu, wd, nesterov, fused): SGD momentum step on rows");
  m.def("adamw_catch_up", &adamw_catch_up,
        "(w, m, v, last, rows, coef, steps, b1, b2, fused): exact lazy catch-up of AdamW");
  m.def("gather_rows", &gather_rows, "(src, idx, out): out[i] = src[idx[i]], rows prefetched ahead");
  m.def("rerank_scores", &rerank_scores, "(q, w, cand, cosine) -> (N, R) scores of candidate rows, -inf for -1");
  m.def("simd", [] { return std::string(avx512f_rows() ? "avx512" : "scalar"); }, "the re-rank's dot product path");
  m.def("adamw_step", &adamw_step,
        "(w, m, v, rows, grad, lr, b1, b2, eps, wd, bc1, bc2, fused): AdamW step on rows");
}
