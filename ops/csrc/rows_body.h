// The row loops of rows_cpu.cpp, included twice: into namespace `plain` (a * b + c rounded twice)
// and into namespace `fused` compiled for FMA (one rounding), because PyTorch's vectorised CPU
// kernels fuse exactly where this file calls fmadd when its CPU capability is AVX2 or above, and
// round twice under DEFAULT. The including file defines kFused and includes the std headers.
// Each comment names the PyTorch expression of ds_xc/head/optim.py that the line reproduces.

template <typename T>
inline T fmadd(T a, T b, T c) {
  if constexpr (kFused) {
    return std::fma(a, b, c);
  } else {
    return a * b + c;
  }
}

// Rows are scattered over a shard of hundreds of MiB: each is a TLB miss and a few cache misses
// that the hardware prefetcher does not start across pages. Asking for the row kPrefetch
// iterations ahead (every cache line of it, for writing) keeps several rows in flight: about
// 1.8x faster SGD step on 5 * 10^4 of 5 * 10^5 rows of d = 128, float32, one thread. No effect on values.
template <typename T>
inline void prefetch_row(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off, 1, 0);
}

template <typename T>
void sgd_catch_up(T* W, T* B, const Stale& sel, const double* Q, int64_t d) {
  at::parallel_for(0, static_cast<int64_t>(sel.size()), kGrain, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      if (i + kPrefetch < b) {
        prefetch_row(W + sel[i + kPrefetch].first * d, d);
        prefetch_row(B + sel[i + kPrefetch].first * d, d);
      }
      T* wr = W + sel[i].first * d;
      T* br = B + sel[i].first * d;
      const double* q = Q + 4 * sel[i].second;
      const T q00 = static_cast<T>(q[0]), q01 = static_cast<T>(q[1]);
      const T q10 = static_cast<T>(q[2]), q11 = static_cast<T>(q[3]);
      for (int64_t j = 0; j < d; ++j) {
        const T x = wr[j], m = br[j];
        wr[j] = fmadd(x, q00, m * q01);  // torch.addcmul(b * q01, w, q00)
        br[j] = fmadd(x, q10, m * q11);  // b.mul_(q11).addcmul_(w, q10)
      }
    }
  });
}

template <typename T>
void sgd_step(T* W, T* B, const int64_t* R, int64_t n, const T* G, int64_t d, double lr, double mu, double wd,
              bool nesterov) {
  const T tlr = static_cast<T>(-lr), tmu = static_cast<T>(mu), twd = static_cast<T>(wd);
  at::parallel_for(0, n, kGrain, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      if (i + kPrefetch < b) {
        prefetch_row(W + R[i + kPrefetch] * d, d);
        prefetch_row(B + R[i + kPrefetch] * d, d);
      }
      T* wr = W + R[i] * d;
      T* br = B + R[i] * d;
      const T* gr = G + i * d;
      for (int64_t j = 0; j < d; ++j) {
        const T g = wd != 0.0 ? fmadd(wr[j], twd, gr[j]) : gr[j];  // d = g.add(p, alpha=wd)
        const T m = br[j] * tmu + g;                                // buf.mul_(mu).add_(d)
        br[j] = m;
        const T step = nesterov ? fmadd(m, tmu, g) : m;            // d.add_(buf, alpha=mu) or buf
        wr[j] = fmadd(step, tlr, wr[j]);                            // p.index_add_(0, r, d, alpha=-lr)
      }
    }
  });
}

template <typename T>
void adamw_catch_up(T* W, T* M, T* V, const Stale& sel, const double* Q, int64_t d, double b1, double b2) {
  at::parallel_for(0, static_cast<int64_t>(sel.size()), kGrain, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      if (i + kPrefetch < b) {
        prefetch_row(W + sel[i + kPrefetch].first * d, d);
        prefetch_row(M + sel[i + kPrefetch].first * d, d);
        prefetch_row(V + sel[i + kPrefetch].first * d, d);
      }
      const int64_t row = sel[i].first, k = sel[i].second;
      T* wr = W + row * d;
      T* mr = M + row * d;
      T* vr = V + row * d;
      const double* q = Q + 4 * k;
      const T q00 = static_cast<T>(q[0]), q01 = static_cast<T>(q[1]);
      const T d1 = static_cast<T>(std::pow(b1, static_cast<double>(k)));
      const T d2 = static_cast<T>(std::pow(b2, static_cast<double>(k)));
      for (int64_t j = 0; j < d; ++j) {
        const T vj = vr[j];
        const T ratio = vj > T(0) ? mr[j] / std::sqrt(vj) : T(0);  // where(v > 0, m / v.sqrt(), 0)
        wr[j] = wr[j] * q00 - ratio * q01;                          // w.mul_(q00).sub_(ratio.mul_(q01))
        mr[j] = mr[j] * d1;                                         // m * b1^k
        vr[j] = vj * d2;                                            // v * b2^k
      }
    }
  });
}

template <typename T>
void adamw_step(T* W, T* M, T* V, const int64_t* R, int64_t n, const T* G, int64_t d, double lr, double b1,
                double b2, double eps, double wd, double bc1, double bc2) {
  const T decay = static_cast<T>(1.0 - lr * wd), weight = static_cast<T>(1.0 - b1);
  const bool small = std::abs(weight) < T(0.5);  // torch's lerp: two formulas, by the weight
  const T coeff = small ? weight : weight - T(1);
  const T tb2 = static_cast<T>(b2), w2 = static_cast<T>(1.0 - b2);
  const T sbc2 = static_cast<T>(std::sqrt(bc2)), teps = static_cast<T>(eps), step = static_cast<T>(-lr / bc1);
  at::parallel_for(0, n, kGrain, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      if (i + kPrefetch < b) {
        prefetch_row(W + R[i + kPrefetch] * d, d);
        prefetch_row(M + R[i + kPrefetch] * d, d);
        prefetch_row(V + R[i + kPrefetch] * d, d);
      }
      T* wr = W + R[i] * d;
      T* mr = M + R[i] * d;
      T* vr = V + R[i] * d;
      const T* gr = G + i * d;
      for (int64_t j = 0; j < d; ++j) {
        const T g = gr[j];
        const T x = wd != 0.0 ? wr[j] * decay : wr[j];     // p.mul_(1 - lr * wd)
        const T mj = fmadd(coeff, g - mr[j], small ? mr[j] : g);  // m.lerp_(g, 1 - b1)
        const T vj = fmadd(w2 * g, g, vr[j] * tb2);          // v.mul_(b2).addcmul_(g, g, value=1 - b2)
        mr[j] = mj;
        vr[j] = vj;
        const T denom = std::sqrt(vj) / sbc2 + teps;         // (v.sqrt() / sqrt(bc2)).add_(eps)
        wr[j] = x + (step * mj) / denom;                     // p.addcdiv_(m, denom, value=-lr / bc1)
      }
    }
  });
}
