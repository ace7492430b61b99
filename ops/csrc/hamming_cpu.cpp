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
// code_bits % 64 != 0) with a bounded selection: a buffer of at most
// `cap` = max(2k, k + 64) (distance, id) pairs receives every candidate at distance
// <= bound; when it is full, nth_element keeps its k smallest pairs and bound becomes
// the largest distance kept (a candidate at that distance can still enter with a smaller
// id). Candidates above the bound cost one compare, so after the first few lists the scan
// is a popcount per row. At the end the k smallest pairs are sorted. Memory per thread:
// O(block * k + block * nprobe).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
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

// Keeps the k smallest pairs of buf (unordered) and returns the largest distance kept.
inline int32_t shrink(std::vector<Pair>& buf, int k) {
  std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end());
  buf.resize(k);
  return buf[k - 1].first;  // nth_element puts the k-th smallest at k - 1, smaller before
}

// The candidates of one query inside one list [begin, end) go through the bounded selection.
template <typename Word, int NW>
inline void scan_rows(const Args& a, const Hamming<Word, NW>& ham, int64_t begin, int64_t end, size_t cap,
                      std::vector<Pair>& buf, int32_t& bound) {
  const uint8_t* row = a.codes + begin * a.nbytes;
  for (int64_t r = begin; r < end; ++r, row += a.nbytes) {
    const int32_t d = ham(row);
    if (d > bound) continue;
    buf.emplace_back(d, a.ids[r]);
    if (buf.size() == cap) bound = shrink(buf, a.k);
  }
}

void finish_query(const Args& a, int64_t i, std::vector<Pair>& buf) {
  const int bits = a.nbytes * 8;
  if (buf.size() > static_cast<size_t>(a.k)) shrink(buf, a.k);
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
// again). Each query keeps its own buffer and bound across lists; the result, the k
// smallest (distance, id) pairs, does not depend on the order of the candidates.
template <typename Word, int NW>
void scan_block(const Args& a, int64_t q0, int64_t q1, size_t cap, std::vector<std::vector<Pair>>& bufs,
                std::vector<int32_t>& bounds, std::vector<std::pair<int64_t, int64_t>>& pairs) {
  const int bits = a.nbytes * 8;
  pairs.clear();
  for (int64_t i = q0; i < q1; ++i) {
    const int64_t* pr = a.probes + i * a.nprobe;
    for (int64_t j = 0; j < a.nprobe; ++j)
      if (pr[j] >= 0) pairs.emplace_back(pr[j], i);
    bufs[i - q0].clear();
    bounds[i - q0] = bits;  // no candidate is excluded until k are known
  }
  std::sort(pairs.begin(), pairs.end());  // by list, then query
  for (const auto& lq : pairs) {
    const int64_t i = lq.second;
    const Hamming<Word, NW> ham(a.q + i * a.nbytes, a.nbytes);
    scan_rows<Word, NW>(a, ham, a.offsets[lq.first], a.offsets[lq.first + 1], cap, bufs[i - q0],
                        bounds[i - q0]);
  }
  for (int64_t i = q0; i < q1; ++i) finish_query(a, i, bufs[i - q0]);
}

template <typename Word, int NW>
void scan_all(const Args& a, int num_threads) {
  const size_t cap = std::max<size_t>(2 * static_cast<size_t>(a.k), a.k + 64);
  // Block size: the queries of one thread share their lists, bounded so that the
  // selection buffers of a block stay within ~8 MiB.
  const int64_t per_thread = (a.n + num_threads - 1) / num_threads;
  const int64_t by_memory = std::max<int64_t>(1, (8 << 20) / static_cast<int64_t>(cap * sizeof(Pair)));
  const int64_t block = std::max<int64_t>(1, std::min(per_thread, by_memory));
  const int64_t nblocks = (a.n + block - 1) / block;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<std::vector<Pair>> bufs(block);
    for (auto& b : bufs) b.reserve(cap);
    std::vector<int32_t> bounds(block);
    std::vector<std::pair<int64_t, int64_t>> pairs;
    pairs.reserve(block * a.nprobe);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < nblocks; ++b)
      scan_block<Word, NW>(a, b * block, std::min(a.n, (b + 1) * block), cap, bufs, bounds, pairs);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_xc Hamming top-k scan over an inverted file (CPU, OpenMP)";
  m.def("hamming_topk_ivf", &hamming_topk_ivf,
        "(q_codes, list_codes, list_ids, list_offsets, probes, k) -> (dist int32, ids int64)");
}
