// Python binding of the CUDA Hamming top-k scan (ops/csrc/hamming_cuda.cu).
//
// Checks the tensors, allocates the outputs on their device and launches the kernel on
// the stream given by Python (torch.cuda.current_stream().cuda_stream), so this file
// needs no CUDA header and compiles with a CPU build of torch too.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <vector>

extern "C" int ds_xc_hamming_cuda_max_k();
extern "C" const char* ds_xc_hamming_cuda_error_string(int err);
extern "C" int ds_xc_hamming_topk_ivf_cuda(const uint8_t* q, const uint8_t* codes, const int64_t* ids,
                                           const int64_t* offsets, const int64_t* probes, int64_t n,
                                           int64_t nprobe, int64_t nlist, int nbytes, int k,
                                           int32_t* out_d, int64_t* out_i, void* stream);

namespace {

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int dim,
                  const at::Device& device) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must be ", dim, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// Returns (dist (N, k) int32, ids (N, k) int64). Probes out of range are skipped by the
// kernel (the Python wrapper rejects them when check=True); ids must be >= 0.
std::vector<at::Tensor> hamming_topk_ivf(at::Tensor q_codes, at::Tensor list_codes, at::Tensor list_ids,
                                         at::Tensor list_offsets, at::Tensor probes, int64_t k,
                                         int64_t stream) {
  const at::Device device = q_codes.device();
  TORCH_CHECK(device.is_cuda(), "q_codes must be a CUDA tensor, got ", device);
  check_tensor(q_codes, "q_codes", at::kByte, 2, device);
  check_tensor(list_codes, "list_codes", at::kByte, 2, device);
  check_tensor(list_ids, "list_ids", at::kLong, 1, device);
  check_tensor(list_offsets, "list_offsets", at::kLong, 1, device);
  check_tensor(probes, "probes", at::kLong, 2, device);
  const int64_t n = q_codes.size(0), nbytes = q_codes.size(1);
  TORCH_CHECK(nbytes % 4 == 0 && nbytes >= 4 && nbytes <= 128,
              "code_bits = ", nbytes * 8, " must be a multiple of 32 in [32, 1024]");
  TORCH_CHECK(list_codes.size(1) == nbytes, "list_codes has ", list_codes.size(1),
              " bytes per code, q_codes ", nbytes);
  TORCH_CHECK(list_ids.size(0) == list_codes.size(0), "list_ids and list_codes disagree in rows");
  TORCH_CHECK(list_codes.size(0) < (int64_t(1) << 31), "rows = ", list_codes.size(0), " must be < 2^31");
  TORCH_CHECK(probes.size(0) == n, "probes has ", probes.size(0), " rows, q_codes ", n);
  TORCH_CHECK(list_offsets.size(0) >= 1, "list_offsets must have nlist + 1 >= 1 entries");
  TORCH_CHECK(k >= 0 && k <= ds_xc_hamming_cuda_max_k(), "k = ", k, " must be in [0, ",
              ds_xc_hamming_cuda_max_k(), "] for the CUDA kernel");
  TORCH_CHECK(n < (int64_t(1) << 31), "N = ", n, " queries must be < 2^31");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(q_codes.data_ptr()) % 4 == 0 &&
              reinterpret_cast<uintptr_t>(list_codes.data_ptr()) % 4 == 0,
              "q_codes and list_codes must be 4-byte aligned (use .contiguous() on a fresh tensor)");

  auto out_d = at::empty({n, k}, q_codes.options().dtype(at::kInt));
  auto out_i = at::empty({n, k}, q_codes.options().dtype(at::kLong));
  const int err = ds_xc_hamming_topk_ivf_cuda(
      q_codes.data_ptr<uint8_t>(), list_codes.data_ptr<uint8_t>(), list_ids.data_ptr<int64_t>(),
      list_offsets.data_ptr<int64_t>(), probes.data_ptr<int64_t>(), n, probes.size(1),
      list_offsets.size(0) - 1, static_cast<int>(nbytes), static_cast<int>(k),
      out_d.data_ptr<int32_t>(), out_i.data_ptr<int64_t>(), reinterpret_cast<void*>(stream));
  TORCH_CHECK(err == 0, "ds_xc Hamming CUDA kernel failed: ", ds_xc_hamming_cuda_error_string(err));
  return {out_d, out_i};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_xc Hamming top-k scan over an inverted file (CUDA)";
  m.def("hamming_topk_ivf", &hamming_topk_ivf,
        "(q_codes, list_codes, list_ids, list_offsets, probes, k, stream) -> (dist int32, ids int64)");
  m.def("max_k", &ds_xc_hamming_cuda_max_k, "the largest k the kernel accepts");
}
