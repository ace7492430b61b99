// Hamming top-k scan over an inverted file of packed binary codes: CPU kernel.
//
// Semantics (defined by ops/hamming_torch.py): for query i, the candidates are the rows
// of the lists probes[i, :] (-1 skipped; the Python wrapper removes repeats); the output
// is the k candidates of smallest (distance, id), ascending, padded with
// (code_bits + 1, -1).
//
// OpenMP over blocks of queries; inside a block the probed lists are visited in list order
// and each is scanned for every query of the block that probes it (scan_block), one pass
// per query over its probed codes (xor + 64-bit popcount, or 32-bit words when
// code_bits % 64 != 0) with a bounded selection (Selector): every candidate at distance
// <= bound enters a buffer, and a histogram of the admitted distances keeps the bound at the
// k-th smallest admitted distance. The bound starts from a sample of the query's rows (every
// 32nd row of each probed list: the distance under which ~1.5x their share of k sampled rows
// lie), so a scan admits a few hundred candidates rather than k ln(rows / k); a query that
// admits fewer than k is scanned again with an open bound (rare). Candidates above the bound
// cost one compare. At the end the k smallest pairs are sorted.
//
// On x86-64 CPUs with AVX-512 VPOPCNTDQ (checked at run time; the file is built without -mavx512
// flags, so one build runs on any x86-64), codes of 256, 512 and 1024 bits are scanned 8 rows at a
// time: xor and vpopcntq per 64-byte register, the 8 rows' word counts summed by a transposing
// reduction, and one vector compare against the bound; only the rows at or below it enter the
// selection above, in row order. The bound only falls while a list is scanned, so a row
// the vector compare rejects would be rejected by the scalar one too: the same (distance, id)
// candidates reach the selection, and the result is identical. DS_XC_HAMMING_SIMD=0 forces the
// scalar scan (tests compare both).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cstdlib>

#include "cpu_simd.h"
#ifdef DS_XC_X86_SIMD
#define DS_XC_AVX512_TARGET __attribute__((target("avx512f,avx512vpopcntdq")))
#endif

namespace {

inline int popcount(uint64_t x) { return __builtin_popcountll(x); }
inline int popcount(uint32_t x) { return __builtin_popcount(x); }

// Hamming distance to one query. NW > 0: word count fixed at compile time (unrolled).
template <typename Word, int NW>
struct Hamming {
  static constexpr int kMaxWords = 1024 / (8 * sizeof(Word));
  Word q[kMaxWords];
  int nw;

  Hamming(const uint8_t* code, int nbytes) : nw(nbytes / static_cast<int>(sizeof(Word))) {
    std::memcpy(q, code, nbytes);
  }

  inline int operator()(const uint8_t* row) const {
    const int n = NW > 0 ? NW : nw;
    int s = 0;
    for (int w = 0; w < n; ++w) {
      Word x;
      std::memcpy(&x, row + w * sizeof(Word), sizeof(Word));  // unaligned-safe load
      s += popcount(static_cast<Word>(x ^ q[w]));
    }
    return s;
  }
};

struct Args {
  const uint8_t* q;        // (N, B)
  const uint8_t* codes;    // (R, B)
  const int64_t* ids;      // (R,)
  const int64_t* offsets;  // (L + 1,)
  const int64_t* probes;   // (N, P)
  int64_t n, nprobe;
  int nbytes, k;
  int32_t* out_d;  // (N, k)
  int64_t* out_i;  // (N, k)
};

using Pair = std::pair<int32_t, int64_t>;  // (distance, id), ordered lexicographically

// The k smallest (distance, id) pairs of one query's candidates, fed one candidate at a time.
// Every candidate at distance <= bound is admitted; a histogram of the admitted distances keeps
// bound at the k-th smallest distance admitted so far (or at the starting bound while fewer than
// k are in), so it falls as soon as it can, with no sorting on the way. Pairs left above the
// bound are dropped when the buffer reaches cap (and, if ties at the bound still fill half of
// it, the k smallest pairs are kept: a dropped pair is larger than k kept ones, so it cannot be
// among the k smallest).
struct Selector {
  std::vector<Pair> buf;
  std::vector<int32_t> hist;  // admitted pairs per distance, 0..bits
  int32_t bound = 0;
  int64_t below = 0;     // admitted pairs at distance <= bound
  int64_t admitted = 0;  // pairs admitted since reset
  int k = 1;
  size_t cap = 2;

  void reset(int bits, int k_, size_t cap_, int32_t start) {
    k = k_;
    cap = cap_;
    buf.clear();
    hist.assign(bits + 1, 0);
    bound = start;
    below = admitted = 0;
  }

  inline void admit(int32_t d, int64_t id) {
    buf.emplace_back(d, id);
    ++hist[d];
    ++below;
    ++admitted;
    while (below - hist[bound] >= k) below -= hist[bound--];
    if (buf.size() >= cap) compact();
  }

  // Drops the pairs above the bound; then, if more than `over` remain, keeps the k smallest (unordered)
  // and says so.
  bool trim(size_t over) {
    const int32_t b = bound;
    buf.erase(std::remove_if(buf.begin(), buf.end(), [b](const Pair& p) { return p.first > b; }), buf.end());
    if (buf.size() <= over) return false;
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end());
    buf.resize(k);
    return true;
  }

  void compact() {
    if (!trim(cap / 2 - 1)) return;  // cut to k only while ties at the bound fill half the buffer
    std::fill(hist.begin(), hist.end(), 0);
    for (const Pair& p : buf) ++hist[p.first];
    bound = buf[k - 1].first;  // the k-th smallest pair's distance (nth_element puts the rest before)
    below = k;
  }
};

// The candidates of one query inside one list [begin, end) go through the selection.
template <typename Word, int NW>
inline void scan_rows(const Args& a, const Hamming<Word, NW>& ham, int64_t begin, int64_t end, Selector& sel) {
  const uint8_t* row = a.codes + begin * a.nbytes;
  for (int64_t r = begin; r < end; ++r, row += a.nbytes) {
    const int32_t d = ham(row);
    if (d <= sel.bound) sel.admit(d, a.ids[r]);
  }
}

#ifdef DS_XC_X86_SIMD
// Sums of the 8 qwords of each of c0..c7, as one vector [sum(c0), ..., sum(c7)].
DS_XC_AVX512_TARGET inline __m512i sum8(__m512i c0, __m512i c1, __m512i c2, __m512i c3, __m512i c4, __m512i c5,
                                        __m512i c6, __m512i c7) {
  // per 128-bit lane k: [lane k of c_i summed, lane k of c_{i+1} summed]
  const __m512i a01 = _mm512_add_epi64(_mm512_unpacklo_epi64(c0, c1), _mm512_unpackhi_epi64(c0, c1));
  const __m512i a23 = _mm512_add_epi64(_mm512_unpacklo_epi64(c2, c3), _mm512_unpackhi_epi64(c2, c3));
  const __m512i a45 = _mm512_add_epi64(_mm512_unpacklo_epi64(c4, c5), _mm512_unpackhi_epi64(c4, c5));
  const __m512i a67 = _mm512_add_epi64(_mm512_unpacklo_epi64(c6, c7), _mm512_unpackhi_epi64(c6, c7));
  // lanes (0+1, 2+3) of the first operand, then of the second: [c0 c1 | c0 c1 | c2 c3 | c2 c3] halves
  const __m512i b0 = _mm512_add_epi64(_mm512_shuffle_i64x2(a01, a23, 0x88), _mm512_shuffle_i64x2(a01, a23, 0xDD));
  const __m512i b1 = _mm512_add_epi64(_mm512_shuffle_i64x2(a45, a67, 0x88), _mm512_shuffle_i64x2(a45, a67, 0xDD));
  return _mm512_add_epi64(_mm512_shuffle_i64x2(b0, b1, 0x88), _mm512_shuffle_i64x2(b0, b1, 0xDD));
}

// Distances of rows [r, r + 8) to the query q (NZ 64-byte registers per code: 512 or 1024 bits).
template <int NZ>
DS_XC_AVX512_TARGET inline __m512i dist8(const uint8_t* row, const __m512i* q) {
  __m512i c[8];
  for (int j = 0; j < 8; ++j) {
    const uint8_t* code = row + j * 64 * NZ;
    c[j] = _mm512_popcnt_epi64(_mm512_xor_si512(_mm512_loadu_si512(code), q[0]));
    for (int z = 1; z < NZ; ++z)
      c[j] = _mm512_add_epi64(c[j], _mm512_popcnt_epi64(_mm512_xor_si512(_mm512_loadu_si512(code + 64 * z), q[z])));
  }
  return sum8(c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]);
}

// 256-bit codes: two rows per register (q doubled), 8 rows in 4 registers; the reduction yields
// rows in the order 0 2 1 3 4 6 5 7, put back by one permutation.
DS_XC_AVX512_TARGET inline __m512i dist8_256(const uint8_t* row, const __m512i* q) {
  __m512i c[4];
  for (int j = 0; j < 4; ++j) c[j] = _mm512_popcnt_epi64(_mm512_xor_si512(_mm512_loadu_si512(row + 64 * j), q[0]));
  const __m512i a = _mm512_add_epi64(_mm512_unpacklo_epi64(c[0], c[1]), _mm512_unpackhi_epi64(c[0], c[1]));
  const __m512i b = _mm512_add_epi64(_mm512_unpacklo_epi64(c[2], c[3]), _mm512_unpackhi_epi64(c[2], c[3]));
  const __m512i s = _mm512_add_epi64(_mm512_shuffle_i64x2(a, b, 0x88), _mm512_shuffle_i64x2(a, b, 0xDD));
  return _mm512_permutexvar_epi64(_mm512_set_epi64(7, 5, 6, 4, 3, 1, 2, 0), s);
}

// The vector scan of one query's rows [begin, end): 8 at a time, the rest (and the rows at or
// below the bound) through the scalar path.
template <int NW>
DS_XC_AVX512_TARGET void scan_rows_avx512(const Args& a, const Hamming<uint64_t, NW>& ham, int64_t begin,
                                          int64_t end, Selector& sel) {
  static_assert(NW == 4 || NW == 8 || NW == 16, "256, 512 or 1024 bits");
  constexpr int NZ = NW == 4 ? 1 : NW / 8;
  __m512i q[NZ];
  if (NW == 4) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ham.q));
    q[0] = _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
  } else {
    for (int z = 0; z < NZ; ++z) q[z] = _mm512_loadu_si512(ham.q + 8 * z);
  }
  const uint8_t* row = a.codes + begin * a.nbytes;
  int64_t r = begin;
  for (; r + 8 <= end; r += 8, row += 8 * a.nbytes) {
    const __m512i d = NW == 4 ? dist8_256(row, q) : dist8<NZ>(row, q);
    __mmask8 m = _mm512_cmple_epi64_mask(d, _mm512_set1_epi64(sel.bound));
    if (!m) continue;
    alignas(64) int64_t dist[8];
    _mm512_store_si512(dist, d);
    for (; m; m &= m - 1) {
      const int j = __builtin_ctz(m);
      const int32_t dj = static_cast<int32_t>(dist[j]);
      if (dj <= sel.bound) sel.admit(dj, a.ids[r + j]);  // the bound may have fallen at an earlier row
    }
  }
  scan_rows<uint64_t, NW>(a, ham, r, end, sel);
}

// The vector scan: DS_XC_HAMMING_SIMD=0 forces the scalar loops (read once).
bool avx512_scan_enabled() {
  static const bool on = ds_xc_simd::avx512_enabled("DS_XC_HAMMING_SIMD", true);
  return on;
}
#else
bool avx512_scan_enabled() { return false; }
#endif

// One query's rows of one list: the vector scan where it applies (Word = uint64_t, NW = 4, 8, 16).
template <typename Word, int NW>
inline void scan_list(const Args& a, const Hamming<Word, NW>& ham, int64_t begin, int64_t end, Selector& sel,
                      bool simd) {
#ifdef DS_XC_X86_SIMD
  if constexpr (std::is_same<Word, uint64_t>::value && (NW == 4 || NW == 8 || NW == 16)) {
    if (simd) return scan_rows_avx512<NW>(a, ham, begin, end, sel);
  }
#endif
  (void)simd;
  scan_rows<Word, NW>(a, ham, begin, end, sel);
}

// Starting bounds for a block's queries from every kSampleStride-th row of each probed list, read
// list-major like the scan: the distance under which ~1.5x the expected share of k sampled rows lie
// (plus 4). Only a guess: scan_block rescans a query that admitted fewer than k (every row at
// distance <= the starting bound is admitted, so k admitted means the k smallest are among them).
constexpr int64_t kSampleStride = 32;

template <typename Word, int NW>
void sampled_bounds(const Args& a, int64_t q0, int64_t q1, const std::vector<std::pair<int64_t, int64_t>>& pairs,
                    std::vector<int32_t>& hist, std::vector<int32_t>& out) {
  const int bits = a.nbytes * 8;
  const int64_t n = q1 - q0;
  hist.assign(n * (bits + 1), 0);
  std::vector<int64_t> rows(n, 0), sampled(n, 0);
  for (const auto& lq : pairs) {
    const int64_t i = lq.second - q0, begin = a.offsets[lq.first], end = a.offsets[lq.first + 1];
    const Hamming<Word, NW> ham(a.q + lq.second * a.nbytes, a.nbytes);
    int32_t* h = hist.data() + i * (bits + 1);
    for (int64_t r = begin; r < end; r += kSampleStride, ++sampled[i]) ++h[ham(a.codes + r * a.nbytes)];
    rows[i] += end - begin;
  }
  for (int64_t i = 0; i < n; ++i) {
    out[i] = bits;
    if (rows[i] < 8 * static_cast<int64_t>(a.k) || sampled[i] < 64) continue;  // too few rows to gain
    const int64_t want = (3 * a.k * sampled[i] + 2 * rows[i] - 1) / (2 * rows[i]) + 4;  // sampled rows under it
    int64_t seen = 0;
    const int32_t* h = hist.data() + i * (bits + 1);
    for (int32_t d = 0; d < bits; ++d) {
      if ((seen += h[d]) >= want) {
        out[i] = d;
        break;
      }
    }
  }
}

void finish_query(const Args& a, int64_t i, Selector& sel) {
  const int bits = a.nbytes * 8;
  sel.trim(static_cast<size_t>(a.k));
  std::vector<Pair>& buf = sel.buf;
  std::sort(buf.begin(), buf.end());
  int32_t* od = a.out_d + i * a.k;
  int64_t* oi = a.out_i + i * a.k;
  const int64_t m = static_cast<int64_t>(buf.size());
  for (int64_t e = 0; e < a.k; ++e) {
    od[e] = e < m ? buf[e].first : bits + 1;
    oi[e] = e < m ? buf[e].second : -1;
  }
}

// Queries [q0, q1) scanned list-major: the (list, query) pairs of the block are sorted by
// list, so each probed list is read from memory once per block and then scanned, from
// cache, for every query of the block that probes it (with a large nprobe many queries
// share a list, and a query-major scan would stream the same codes from DRAM again and
// again). Each query keeps its own selection across lists, starting from its sampled bound; the
// result, the k smallest (distance, id) pairs, does not depend on the order of the candidates.
template <typename Word, int NW>
void scan_block(const Args& a, int64_t q0, int64_t q1, size_t cap, std::vector<Selector>& sels,
                std::vector<int32_t>& hist, std::vector<std::pair<int64_t, int64_t>>& pairs) {
  const int bits = a.nbytes * 8;
  pairs.clear();
  for (int64_t i = q0; i < q1; ++i) {
    const int64_t* pr = a.probes + i * a.nprobe;
    for (int64_t j = 0; j < a.nprobe; ++j)
      if (pr[j] >= 0) pairs.emplace_back(pr[j], i);
  }
  std::sort(pairs.begin(), pairs.end());  // by list, then query
  std::vector<int32_t> start(q1 - q0);
  sampled_bounds<Word, NW>(a, q0, q1, pairs, hist, start);
  for (int64_t i = q0; i < q1; ++i) sels[i - q0].reset(bits, a.k, cap, start[i - q0]);
  const bool simd = avx512_scan_enabled();
  for (const auto& lq : pairs) {
    const int64_t i = lq.second;
    const Hamming<Word, NW> ham(a.q + i * a.nbytes, a.nbytes);
    scan_list<Word, NW>(a, ham, a.offsets[lq.first], a.offsets[lq.first + 1], sels[i - q0], simd);
  }
  for (int64_t i = q0; i < q1; ++i) {
    Selector& sel = sels[i - q0];
    if (sel.admitted < a.k && sel.bound < bits) {  // the sampled bound was too tight: again, open
      sel.reset(bits, a.k, cap, bits);
      const Hamming<Word, NW> ham(a.q + i * a.nbytes, a.nbytes);
      const int64_t* pr = a.probes + i * a.nprobe;
      for (int64_t j = 0; j < a.nprobe; ++j)
        if (pr[j] >= 0) scan_list<Word, NW>(a, ham, a.offsets[pr[j]], a.offsets[pr[j] + 1], sel, simd);
    }
    finish_query(a, i, sel);
  }
}

template <typename Word, int NW>
void scan_all(const Args& a, int num_threads) {
  const size_t cap = std::max<size_t>(4 * static_cast<size_t>(a.k), a.k + 256);
  // Block size: the queries of one thread share their lists, bounded so that the
  // selection buffers of a block stay within ~8 MiB.
  const int64_t per_thread = (a.n + num_threads - 1) / num_threads;
  const int64_t by_memory = std::max<int64_t>(1, (8 << 20) / static_cast<int64_t>(cap * sizeof(Pair)));
  const int64_t block = std::max<int64_t>(1, std::min(per_thread, by_memory));
  const int64_t nblocks = (a.n + block - 1) / block;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<Selector> sels(block);
    for (auto& s : sels) s.buf.reserve(cap);
    std::vector<int32_t> hist;  // sampled distances per query of a block
    std::vector<std::pair<int64_t, int64_t>> pairs;
    pairs.reserve(block * a.nprobe);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < nblocks; ++b)
      scan_block<Word, NW>(a, b * block, std::min(a.n, (b + 1) * block), cap, sels, hist, pairs);
  }
}

void dispatch(const Args& a, int num_threads) {
  if (a.nbytes % 8 == 0) {
    switch (a.nbytes / 8) {
      case 1: return scan_all<uint64_t, 1>(a, num_threads);
      case 2: return scan_all<uint64_t, 2>(a, num_threads);
      case 4: return scan_all<uint64_t, 4>(a, num_threads);
      case 8: return scan_all<uint64_t, 8>(a, num_threads);
      case 16: return scan_all<uint64_t, 16>(a, num_threads);
      default: return scan_all<uint64_t, 0>(a, num_threads);
    }
  }
  return scan_all<uint32_t, 0>(a, num_threads);  // code_bits % 64 == 32
}

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must be ", dim, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// Returns (dist (N, k) int32, ids (N, k) int64). Index values are checked here too,
// since a bad probe or offset would read out of bounds.
std::vector<at::Tensor> hamming_topk_ivf(at::Tensor q_codes, at::Tensor list_codes,
                                            at::Tensor list_ids, at::Tensor list_offsets,
                                            at::Tensor probes, int64_t k) {
  check_tensor(q_codes, "q_codes", at::kByte, 2);
  check_tensor(list_codes, "list_codes", at::kByte, 2);
  check_tensor(list_ids, "list_ids", at::kLong, 1);
  check_tensor(list_offsets, "list_offsets", at::kLong, 1);
  check_tensor(probes, "probes", at::kLong, 2);
  const int64_t n = q_codes.size(0), nbytes = q_codes.size(1), rows = list_codes.size(0);
  TORCH_CHECK(nbytes % 4 == 0 && nbytes >= 4 && nbytes <= 128,
              "code_bits = ", nbytes * 8, " must be a multiple of 32 in [32, 1024]");
  TORCH_CHECK(list_codes.size(1) == nbytes, "list_codes has ", list_codes.size(1),
              " bytes per code, q_codes ", nbytes);
  TORCH_CHECK(list_ids.size(0) == rows, "list_ids has ", list_ids.size(0), " entries, list_codes ", rows, " rows");
  TORCH_CHECK(probes.size(0) == n, "probes has ", probes.size(0), " rows, q_codes ", n);
  TORCH_CHECK(k >= 0 && k <= INT32_MAX, "k = ", k, " must be in [0, 2^31)");
  TORCH_CHECK(list_offsets.size(0) >= 1, "list_offsets must have nlist + 1 >= 1 entries");
  const int64_t nlist = list_offsets.size(0) - 1;
  const int64_t* off = list_offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[nlist] == rows, "list_offsets must run from 0 to rows = ", rows,
              ", got ", off[0], " to ", off[nlist]);
  for (int64_t l = 0; l < nlist; ++l)
    TORCH_CHECK(off[l] <= off[l + 1], "list_offsets must be non-decreasing, got ", off[l],
                " > ", off[l + 1], " at list ", l);
  const int64_t* pr = probes.data_ptr<int64_t>();
  for (int64_t e = 0; e < probes.numel(); ++e)
    TORCH_CHECK(pr[e] >= -1 && pr[e] < nlist, "probes must lie in [-1, ", nlist - 1, "], got ", pr[e]);

  auto out_d = at::empty({n, k}, q_codes.options().dtype(at::kInt));
  auto out_i = at::empty({n, k}, q_codes.options().dtype(at::kLong));
  if (n == 0 || k == 0) return {out_d, out_i};
  Args a{q_codes.data_ptr<uint8_t>(), list_codes.data_ptr<uint8_t>(), list_ids.data_ptr<int64_t>(),
         off, pr, n, probes.size(1), static_cast<int>(nbytes), static_cast<int>(k),
         out_d.data_ptr<int32_t>(), out_i.data_ptr<int64_t>()};
  const int num_threads = std::max(1, at::get_num_threads());
  {
    pybind11::gil_scoped_release no_gil;
    dispatch(a, num_threads);
  }
  return {out_d, out_i};
}

std::vector<at::Tensor> pack_signs_min_abs(at::Tensor z);  // pack_cpu.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_xc Hamming top-k scan over an inverted file (CPU, OpenMP)";
  m.def("hamming_topk_ivf", &hamming_topk_ivf,
        "(q_codes, list_codes, list_ids, list_offsets, probes, k) -> (dist int32, ids int64)");
  m.def("pack_signs_min_abs", &pack_signs_min_abs,
        "(z (n, b) float32) -> (codes (n, b/8) uint8: bit = z > 0, LSB first; min_j |z| (n,))");
  m.def("simd", [] { return std::string(avx512_scan_enabled() ? "avx512" : "scalar"); },
        "the scan path in use: avx512 (AVX-512 VPOPCNTDQ, 256/512/1024-bit codes) or scalar");
}
