// Torch binding of the MXFP8 grouped GEMM kernels (mxfp8_grouped.cuh): argument checks,
// launch on the current stream, and the Python module. The Python side
// (grouped_gemm.backends.hip_mxfp8) lays the operands out; these checks only guard the
// kernels' memory assumptions.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cstring>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#if !defined(__HIP_PLATFORM_AMD__)
#include <cudaTypedefs.h>
#endif

#include "mxfp8_grouped.cuh"

namespace {

using gg_mxfp8::Operand;

// data holds E4M3 codes contraction-major (..., rows, L) or k-outer (..., L, rows); scale its
// E8M0 bytes (..., rows, L/32) or (..., L/32, rows). Checked, then handed over as the
// kernels' Operand with its contraction length L.
struct CheckedOperand {
  Operand op;
  int64_t len;
  int64_t lines;  // lines of op.ld bytes in the whole tensor (its TMA view's outer extent)
};

CheckedOperand operand(const torch::Tensor& data, const torch::Tensor& scale, bool k_outer, const char* name) {
  TORCH_CHECK(data.is_cuda() && scale.is_cuda(), name, ": data and scale must be GPU tensors");
  TORCH_CHECK(data.element_size() == 1 && scale.scalar_type() == torch::kUInt8, name,
              ": data must be 1-byte E4M3 codes and scale uint8 E8M0 bytes");
  TORCH_CHECK(data.is_contiguous() && scale.is_contiguous(), name, ": data and scale must be contiguous");
  TORCH_CHECK(data.dim() >= 2 && scale.dim() == data.dim(), name, ": data and scale must have the same rank (>= 2)");
  const int64_t len = k_outer ? data.size(-2) : data.size(-1);
  const int64_t rows = k_outer ? data.size(-1) : data.size(-2);
  TORCH_CHECK(len % gg_mxfp8::MX_BLOCK == 0, name, ": contraction length ", len, " is not a multiple of 32");
  const int64_t blocks = len / gg_mxfp8::MX_BLOCK;
  const int64_t srows = k_outer ? scale.size(-1) : scale.size(-2);
  const int64_t sblocks = k_outer ? scale.size(-2) : scale.size(-1);
  TORCH_CHECK(srows == rows && sblocks == blocks && scale.numel() * gg_mxfp8::MX_BLOCK == data.numel(), name,
              ": scale shape does not match data");
  // k-outer lines are copied 16 bytes at a time: every line start and every row count whole chunks.
  TORCH_CHECK(!k_outer || rows % 16 == 0, name, ": a k-outer operand needs a multiple of 16 rows, got ", rows);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(data.data_ptr()) % 16 == 0, name, ": data must be 16-byte aligned");
  const Operand op{static_cast<const uint8_t*>(data.data_ptr()),
                   static_cast<const uint8_t*>(scale.data_ptr()),
                   k_outer ? rows : len,
                   k_outer ? 1 : blocks,
                   k_outer ? rows : 1,
                   rows * len,
                   rows * blocks,
                   nullptr,
                   0};
  return {op, len, data.numel() / op.ld};
}

void check_out(const torch::Tensor& out) {
  TORCH_CHECK(out.is_cuda() && out.is_contiguous(), "out must be a contiguous GPU tensor");
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 || out.scalar_type() == torch::kFloat32,
              "out must be bfloat16 or float32");
}

void check_ends(const torch::Tensor& ends, int64_t groups, const char* name) {
  TORCH_CHECK(ends.is_cuda() && ends.scalar_type() == torch::kInt32 && ends.is_contiguous() && ends.dim() == 1 &&
                  ends.numel() == groups,
              name, " must be a contiguous int32 GPU tensor of ", groups, " group ends");
}

// Whether launches on the current device take the wgmma path (and so read TensorMaps).
bool wgmma_launch() { return gg_mxfp8::WGMMA_BUILD && at::cuda::getCurrentDeviceProperties()->major == 9; }

// Dynamic shared memory of a launch on the current device: sm_90 runs the prescaled path on
// wgmma (built for sm_90a), which needs its f16 buffers; tiles of `Halves` column halves,
// `PerSM` blocks a SM.
template <int Halves, int PerSM>
int launch_smem(int kouter_operands) {
  return gg_mxfp8::SmemPlan<Halves, PerSM>::bytes(kouter_operands, wgmma_launch());
}

// The wgmma path's TMA view of an operand's codes: lines of op.ld bytes, boxes of BK bytes x
// `box_lines` lines, 128-byte swizzle, zeros outside the tensor. Zeros elsewhere (no wgmma).
gg_mxfp8::TensorMap tensor_map(const CheckedOperand& operand, int box_lines) {
  gg_mxfp8::TensorMap map{};
#if !defined(__HIP_PLATFORM_AMD__)
  if (!wgmma_launch()) return map;
  static_assert(sizeof(map) == sizeof(CUtensorMap) && alignof(gg_mxfp8::TensorMap) >= alignof(CUtensorMap));
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
#else
    C10_CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found));
#endif
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr, "cuTensorMapEncodeTiled is not available");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  const Operand& op = operand.op;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(op.ld), static_cast<cuuint64_t>(operand.lines)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(op.ld)};
  const cuuint32_t box[2] = {gg_mxfp8::BK, static_cast<cuuint32_t>(box_lines)};
  const cuuint32_t steps[2] = {1, 1};
  CUtensorMap encoded;
  const CUresult result = encode(&encoded, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(op.data), dims,
                                 strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (", static_cast<int>(result), ") for ",
              operand.lines, " lines of ", op.ld, " bytes");
  std::memcpy(&map, &encoded, sizeof map);
#endif
  return map;
}

// Raise the kernel's dynamic shared-memory limit to what this launch asks (above the 48 KiB
// default), once per kernel and device.
template <typename Kernel>
void allow_smem(Kernel kernel, int bytes) {
  static std::mutex lock;
  static std::map<std::pair<const void*, int>, int> allowed;  // (kernel, device) -> bytes
  const std::lock_guard<std::mutex> hold(lock);
  int& done = allowed[{reinterpret_cast<const void*>(kernel), c10::cuda::current_device()}];
  if (done == bytes) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done = bytes;
}

// Every row's scale range (gg_mxfp8::row_ranges_kernel) of `groups` x `rows` rows of `op`,
// into `ranges` from element `first`; a pointer to them.
const uint16_t* row_ranges(const Operand& op, int groups, int rows, int64_t kblocks, const int32_t* token_ends,
                           const torch::Tensor& ranges, int64_t first, cudaStream_t stream) {
  auto* dst = reinterpret_cast<uint16_t*>(ranges.data_ptr<int16_t>()) + first;
  const int64_t count = static_cast<int64_t>(groups) * rows;
  constexpr int threads = 256;
  TORCH_CHECK((count + threads - 1) / threads < (int64_t{1} << 31), "problem too large for one launch");
  gg_mxfp8::row_ranges_kernel<<<static_cast<unsigned>((count + threads - 1) / threads), threads, 0, stream>>>(
      op, groups, rows, kblocks, token_ends, dst);
  return dst;
}

template <typename OutT, bool BKOuter>
void launch_rows(dim3 grid, cudaStream_t stream, const Operand& a, const Operand& b, const torch::Tensor& row_ends,
                 const torch::Tensor& tile_ends, int groups, int ncols, int64_t kblocks, const uint16_t* a_ranges,
                 const uint16_t* b_ranges, OutT* out, const gg_mxfp8::TensorMap& map_a,
                 const gg_mxfp8::TensorMap& map_b) {
  const auto kernel = gg_mxfp8::rows_kernel<OutT, BKOuter>;
  const int smem = launch_smem<gg_mxfp8::ROWS_HALVES, gg_mxfp8::ROWS_PER_SM>(BKOuter ? 1 : 0);
  allow_smem(kernel, smem);
  kernel<<<grid, gg_mxfp8::THREADS, smem, stream>>>(a, b, row_ends.data_ptr<int32_t>(), tile_ends.data_ptr<int32_t>(),
                                                    groups, ncols, kblocks, a_ranges, b_ranges, out, map_a, map_b);
}

template <typename OutT, bool KOuter>
void launch_wgrad(dim3 grid, cudaStream_t stream, const Operand& a, const Operand& b, const torch::Tensor& pad_ends,
                  int nrows, int ncols, const uint16_t* a_ranges, const uint16_t* b_ranges, OutT* out,
                  bool accumulate, const gg_mxfp8::TensorMap& map_a, const gg_mxfp8::TensorMap& map_b) {
  const auto kernel = gg_mxfp8::wgrad_kernel<OutT, KOuter>;
  const int smem = launch_smem<gg_mxfp8::WGRAD_HALVES, gg_mxfp8::WGRAD_PER_SM>(KOuter ? 2 : 0);
  allow_smem(kernel, smem);
  kernel<<<grid, gg_mxfp8::THREADS, smem, stream>>>(a, b, pad_ends.data_ptr<int32_t>(), nrows, ncols, a_ranges,
                                                    b_ranges, out, accumulate, map_a, map_b);
}

// f(out's data pointer as float* or uint16_t* (bf16 bits), std::bool_constant<k_outer>): one
// call per kernel instantiation.
template <typename F>
void with_out_and_layout(const torch::Tensor& out, bool k_outer, F f) {
  if (out.scalar_type() == torch::kFloat32) {
    if (k_outer) f(out.data_ptr<float>(), std::true_type{});
    else f(out.data_ptr<float>(), std::false_type{});
  } else {
    auto* o = static_cast<uint16_t*>(out.data_ptr());
    if (k_outer) f(o, std::true_type{});
    else f(o, std::false_type{});
  }
}

}  // namespace

// b_k_outer: b is (G, L, C) with scales (G, L/32, C) (a weight blocked along the contraction
// for dgrad, read as quantized); else (G, C, L) with scales (G, C, L/32).
void rows_gemm(const torch::Tensor& a_data, const torch::Tensor& a_scale, const torch::Tensor& b_data,
               const torch::Tensor& b_scale, const torch::Tensor& row_ends, const torch::Tensor& tile_ends,
               int64_t max_tiles, const torch::Tensor& out, bool b_k_outer) {
  const CheckedOperand a = operand(a_data, a_scale, false, "a");
  TORCH_CHECK(a_data.dim() == 2 && b_data.dim() == 3, "a must be (M, L) and b (G, C, L) or (G, L, C)");
  const CheckedOperand b = operand(b_data, b_scale, b_k_outer, "b");
  TORCH_CHECK(b.len == a.len, "a and b must have the same contraction length");
  check_out(out);
  const int64_t groups = b_data.size(0);
  const int64_t ncols = b_k_outer ? b_data.size(2) : b_data.size(1);
  TORCH_CHECK(groups >= 1 && out.dim() == 2 && out.size(0) == a_data.size(0) && out.size(1) == ncols,
              "out must be (M, C)");
  check_ends(row_ends, groups, "row_ends");
  check_ends(tile_ends, groups, "tile_ends");
  if (a_data.size(0) == 0 || ncols == 0 || max_tiles <= 0) return;
  constexpr int tile_cols = gg_mxfp8::ROWS_HALVES * gg_mxfp8::BN;
  const int64_t blocks = max_tiles * ((ncols + tile_cols - 1) / tile_cols);
  TORCH_CHECK(blocks < (int64_t{1} << 31), "problem too large for one launch: ", blocks, " tiles");
  const c10::cuda::CUDAGuard guard(a_data.device());
  const dim3 grid(static_cast<unsigned>(blocks));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t kblocks = a.len / gg_mxfp8::MX_BLOCK;
  const int g = static_cast<int>(groups), c = static_cast<int>(ncols);
  const int m = static_cast<int>(a_data.size(0));
  TORCH_CHECK(a_data.size(0) < (int64_t{1} << 31) && groups * ncols < (int64_t{1} << 31), "problem too large");
  // The prescaled path's per-row scale ranges, found once here instead of by every tile.
  const uint16_t* a_ranges = nullptr;
  const uint16_t* b_ranges = nullptr;
  if (gg_mxfp8::PRESCALE) {
    const auto ranges = torch::empty({m + groups * ncols}, a_data.options().dtype(torch::kInt16));
    a_ranges = row_ranges(a.op, 1, m, kblocks, nullptr, ranges, 0, stream);
    b_ranges = row_ranges(b.op, g, c, kblocks, nullptr, ranges, m, stream);
  }
  // TMA boxes: BM rows of a; a stage's columns of b (or one plane of BK contraction steps).
  const auto map_a = tensor_map(a, gg_mxfp8::BM);
  const auto map_b = tensor_map(b, b_k_outer ? gg_mxfp8::BK : tile_cols);
  with_out_and_layout(out, b_k_outer, [&](auto* o, auto k_outer) {
    launch_rows<std::remove_pointer_t<decltype(o)>, decltype(k_outer)::value>(
        grid, stream, a.op, b.op, row_ends, tile_ends, g, c, kblocks, a_ranges, b_ranges, o, map_a, map_b);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// k_outer: a is (T, R) and b (T, C), token-major as quantized along the tokens, scales
// (T/32, R) and (T/32, C); else a (R, T), b (C, T), scales (R, T/32) and (C, T/32).
void wgrad_gemm(const torch::Tensor& a_data, const torch::Tensor& a_scale, const torch::Tensor& b_data,
                const torch::Tensor& b_scale, const torch::Tensor& pad_ends, const torch::Tensor& out, bool accumulate,
                bool k_outer) {
  TORCH_CHECK(a_data.dim() == 2 && b_data.dim() == 2, "a and b must be 2-D");
  const CheckedOperand a = operand(a_data, a_scale, k_outer, "a");
  const CheckedOperand b = operand(b_data, b_scale, k_outer, "b");
  TORCH_CHECK(b.len == a.len, "a and b must have the same token count");
  check_out(out);
  const int64_t nrows = k_outer ? a_data.size(1) : a_data.size(0);
  const int64_t ncols = k_outer ? b_data.size(1) : b_data.size(0);
  TORCH_CHECK(out.dim() == 3 && out.size(1) == nrows && out.size(2) == ncols, "out must be (G, R, C)");
  const int64_t groups = out.size(0);
  check_ends(pad_ends, groups, "pad_ends");
  if (groups == 0 || nrows == 0 || ncols == 0) return;
  TORCH_CHECK(groups <= 65535, "at most 65535 groups");
  const c10::cuda::CUDAGuard guard(a_data.device());
  constexpr int tile_cols = gg_mxfp8::WGRAD_HALVES * gg_mxfp8::BN;
  const dim3 grid(static_cast<unsigned>((ncols + tile_cols - 1) / tile_cols),
                  static_cast<unsigned>((nrows + gg_mxfp8::BM - 1) / gg_mxfp8::BM), static_cast<unsigned>(groups));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int r = static_cast<int>(nrows), c = static_cast<int>(ncols), g = static_cast<int>(groups);
  // The prescaled path's scale ranges of each group's rows over its tokens, found once here.
  const uint16_t* a_ranges = nullptr;
  const uint16_t* b_ranges = nullptr;
  if (gg_mxfp8::PRESCALE) {
    const auto ranges = torch::empty({groups * (nrows + ncols)}, a_data.options().dtype(torch::kInt16));
    const int32_t* ends = pad_ends.data_ptr<int32_t>();
    a_ranges = row_ranges(a.op, g, r, 0, ends, ranges, 0, stream);
    b_ranges = row_ranges(b.op, g, c, 0, ends, ranges, groups * nrows, stream);
  }
  // TMA boxes: BM rows of a and tile_cols of b, or one plane of BK tokens.
  const auto map_a = tensor_map(a, k_outer ? gg_mxfp8::BK : gg_mxfp8::BM);
  const auto map_b = tensor_map(b, k_outer ? gg_mxfp8::BK : tile_cols);
  with_out_and_layout(out, k_outer, [&](auto* o, auto k_outer_) {
    launch_wgrad<std::remove_pointer_t<decltype(o)>, decltype(k_outer_)::value>(
        grid, stream, a.op, b.op, pad_ends, r, c, a_ranges, b_ranges, o, accumulate, map_a, map_b);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "grouped_gemm hip_mxfp8 kernels (MXFP8 grouped GEMM)";
  m.def("rows_gemm", &rows_gemm, "fwd / dgrad: out (M, C) = a (M, L) x b[g] (C, L)^T per row group");
  m.def("wgrad_gemm", &wgrad_gemm, "wgrad: out[g] (+)= a[:, tokens g] x b[:, tokens g]^T");
}
