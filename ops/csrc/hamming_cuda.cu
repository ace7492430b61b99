// Hamming top-k scan over an inverted file of packed binary codes: CUDA kernel.
//
// Semantics (defined by ops/hamming_torch.py): for query i, the candidates are the rows
// of the lists probes[i, :] (-1 skipped; the Python wrapper removes repeats; probes out
// of range are skipped here, the Python check rejects them); the output is the k
// candidates of smallest (distance, id), ascending, padded with (code_bits + 1, -1).
//
// One thread block per query; every pass re-reads the probed codes (cheaper than a
// scratch buffer sized by the candidate count):
//   1. histogram of distances (shared memory, <= 1025 bins) and the largest id;
//   2. threshold t: smallest distance whose cumulative count reaches k; need = how many
//      of the candidates at t are taken;
//   3. if need < count(t): radix select, 8 bits per pass from the top byte of the largest
//      id, of the id threshold T: the candidates at t with id < T, and `need'` of those
//      with id == T (all equal (t, T) pairs, so any of them);
//   4. collect the <= k results in shared memory, sort them by rank counting (stable
//      (distance, id) order) and write them, then the padding.
// Ids must be >= 0 (checked by the Python wrapper). k <= the launcher's max_k.
// This file includes no torch header, so `nvcc -c` checks it anywhere; the binding
// (hamming_cuda_binding.cpp) does the tensor checks and passes raw pointers.
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBits = 1024;

// Code loads of 4, 8 or 16 bytes (Vec = uint32_t, uint2, uint4), chosen by alignment.
__device__ __forceinline__ int popc_xor(uint32_t a, uint32_t b) { return __popc(a ^ b); }
__device__ __forceinline__ int popc_xor(uint2 a, uint2 b) { return __popc(a.x ^ b.x) + __popc(a.y ^ b.y); }
__device__ __forceinline__ int popc_xor(uint4 a, uint4 b) {
  return __popc(a.x ^ b.x) + __popc(a.y ^ b.y) + __popc(a.z ^ b.z) + __popc(a.w ^ b.w);
}

template <typename Vec>
__device__ __forceinline__ int hamming(const Vec* q, const Vec* row, int nvec) {
  int s = 0;
  for (int w = 0; w < nvec; ++w) s += popc_xor(q[w], __ldg(row + w));
  return s;
}

struct Params {
  const uint8_t* q;        // (N, B)
  const uint8_t* codes;    // (R, B)
  const int64_t* ids;      // (R,)
  const int64_t* offsets;  // (L + 1,)
  const int64_t* probes;   // (N, P)
  int64_t nprobe, nlist;
  int nbytes, k;
  int32_t* out_d;  // (N, k)
  int64_t* out_i;  // (N, k)
};

// Calls f(d, id) for every candidate of query `qi`, threads striding over each list.
template <typename Vec, typename F>
__device__ __forceinline__ void for_each_candidate(const Params& p, int64_t qi, const Vec* qv,
                                                   int nvec, F f) {
  const int64_t* pr = p.probes + qi * p.nprobe;
  for (int64_t j = 0; j < p.nprobe; ++j) {
    const int64_t lst = pr[j];
    if (lst < 0 || lst >= p.nlist) continue;
    const int64_t end = p.offsets[lst + 1];
    for (int64_t r = p.offsets[lst] + threadIdx.x; r < end; r += blockDim.x) {
      const Vec* row = reinterpret_cast<const Vec*>(p.codes + r * p.nbytes);
      f(hamming(qv, row, nvec), p.ids[r]);
    }
  }
}

struct Select {  // block-wide selection state (shared memory)
  int t;                  // distance threshold
  long long need;         // how many at (t, id_t) are still to take
  unsigned long long id_t;  // id threshold among candidates at distance t
  bool by_id;             // whether the id threshold applies
  unsigned long long max_id;
  int count;              // results collected
  unsigned long long eq_taken;  // results taken at (t, id_t)
};

template <typename Vec>
__global__ void __launch_bounds__(kThreads) hamming_topk_kernel(Params p) {
  extern __shared__ unsigned char smem[];  // k results: int32 distances, then int64 ids
  int64_t* sel_i = reinterpret_cast<int64_t*>(smem);
  int32_t* sel_d = reinterpret_cast<int32_t*>(sel_i + p.k);
  __shared__ Vec qv[kMaxBits / (8 * sizeof(Vec))];
  __shared__ int hist[kMaxBits + 1];
  __shared__ int digits[256];
  __shared__ Select s;

  const int64_t qi = blockIdx.x;
  const int nvec = p.nbytes / static_cast<int>(sizeof(Vec));
  const int bits = p.nbytes * 8;
  const int tid = threadIdx.x;
  for (int w = tid; w < nvec; w += blockDim.x) qv[w] = reinterpret_cast<const Vec*>(p.q + qi * p.nbytes)[w];
  for (int d = tid; d <= bits; d += blockDim.x) hist[d] = 0;
  if (tid == 0) { s.max_id = 0; s.count = 0; s.eq_taken = 0; }
  __syncthreads();

  // 1. histogram of distances, largest id
  for_each_candidate(p, qi, qv, nvec, [&](int d, int64_t id) {
    atomicAdd(&hist[d], 1);
    atomicMax(&s.max_id, static_cast<unsigned long long>(id));
  });
  __syncthreads();

  // 2. distance threshold
  if (tid == 0) {
    long long total = 0;
    for (int d = 0; d <= bits; ++d) total += hist[d];
    s.t = bits + 1; s.need = 0; s.by_id = false; s.id_t = 0;
    if (total > p.k) {
      long long cum = 0;
      for (int d = 0; d <= bits; ++d) {
        if (cum + hist[d] >= p.k) { s.t = d; s.need = p.k - cum; break; }
        cum += hist[d];
      }
      if (s.need == hist[s.t]) { s.t += 1; s.need = 0; }  // all of them: no id threshold
      else s.by_id = true;
    }
  }
  __syncthreads();

  // 3. radix select of the id threshold among the candidates at distance t
  if (s.by_id) {
    const int id_bits = s.max_id ? 64 - __clzll(static_cast<long long>(s.max_id)) : 1;
    for (int shift = ((id_bits + 7) / 8 - 1) * 8; shift >= 0; shift -= 8) {
      for (int b = tid; b < 256; b += blockDim.x) digits[b] = 0;
      __syncthreads();
      const int t = s.t;
      const unsigned long long prefix = s.id_t;
      for_each_candidate(p, qi, qv, nvec, [&](int d, int64_t id) {
        const unsigned long long u = static_cast<unsigned long long>(id);
        if (d == t && (shift + 8 >= 64 || ((u ^ prefix) >> (shift + 8)) == 0))
          atomicAdd(&digits[(u >> shift) & 255], 1);
      });
      __syncthreads();
      if (tid == 0) {
        long long cum = 0;
        for (int b = 0; b < 256; ++b) {
          if (cum + digits[b] >= s.need) {
            s.id_t |= static_cast<unsigned long long>(b) << shift;
            s.need -= cum;
            break;
          }
          cum += digits[b];
        }
      }
      __syncthreads();
    }
  }

  // 4. collect, then sort by rank counting and write
  const int t = s.t;
  const bool by_id = s.by_id;
  const unsigned long long id_t = s.id_t;
  const long long need = s.need;
  for_each_candidate(p, qi, qv, nvec, [&](int d, int64_t id) {
    const unsigned long long u = static_cast<unsigned long long>(id);
    bool take = d < t || (by_id && d == t && u < id_t);
    if (!take && by_id && d == t && u == id_t) take = atomicAdd(&s.eq_taken, 1ull) < static_cast<unsigned long long>(need);
    if (take) {
      const int e = atomicAdd(&s.count, 1);
      sel_d[e] = d;
      sel_i[e] = id;
    }
  });
  __syncthreads();
  const int m = s.count;  // == min(k, number of candidates)
  int32_t* od = p.out_d + qi * p.k;
  int64_t* oi = p.out_i + qi * p.k;
  for (int e = tid; e < m; e += blockDim.x) {
    const int de = sel_d[e];
    const int64_t ie = sel_i[e];
    int rank = 0;
    for (int f = 0; f < m; ++f) {
      const int df = sel_d[f];
      const int64_t id_f = sel_i[f];
      rank += df < de || (df == de && (id_f < ie || (id_f == ie && f < e)));
    }
    od[rank] = de;
    oi[rank] = ie;
  }
  for (int e = m + tid; e < p.k; e += blockDim.x) { od[e] = bits + 1; oi[e] = -1; }
}

template <typename Vec>
cudaError_t launch(const Params& p, int64_t n, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(p.k) * (sizeof(int64_t) + sizeof(int32_t));
  hamming_topk_kernel<Vec><<<static_cast<unsigned>(n), kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

// The largest k the kernel accepts (its results live in shared memory).
extern "C" int ds_xc_hamming_cuda_max_k() { return 2048; }

extern "C" const char* ds_xc_hamming_cuda_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

// Launches the scan on `stream` (a cudaStream_t); returns a cudaError_t (0 = success).
// Pointers are device pointers; q and codes must be 4-byte aligned.
extern "C" int ds_xc_hamming_topk_ivf_cuda(const uint8_t* q, const uint8_t* codes, const int64_t* ids,
                                           const int64_t* offsets, const int64_t* probes, int64_t n,
                                           int64_t nprobe, int64_t nlist, int nbytes, int k,
                                           int32_t* out_d, int64_t* out_i, void* stream) {
  if (n == 0 || k == 0) return 0;
  if (k > ds_xc_hamming_cuda_max_k() || nbytes % 4 != 0 || nbytes > kMaxBits / 8 || n > 0x7fffffff)
    return static_cast<int>(cudaErrorInvalidValue);
  const Params p{q, codes, ids, offsets, probes, nprobe, nlist, nbytes, k, out_d, out_i};
  auto s = static_cast<cudaStream_t>(stream);
  const auto aligned = [&](int a) {
    return nbytes % a == 0 && reinterpret_cast<uintptr_t>(q) % a == 0 &&
           reinterpret_cast<uintptr_t>(codes) % a == 0;
  };
  cudaError_t err;
  if (aligned(16)) err = launch<uint4>(p, n, s);
  else if (aligned(8)) err = launch<uint2>(p, n, s);
  else err = launch<uint32_t>(p, n, s);
  return static_cast<int>(err);
}
