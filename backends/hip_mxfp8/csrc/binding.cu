// Torch binding of the MXFP8 grouped GEMM kernels (mxfp8_grouped.cuh): argument checks,
// launch on the current stream, and the Python module. The Python side
// (grouped_gemm.backends.hip_mxfp8) lays the operands out; these checks only guard the
// kernels' memory assumptions.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "mxfp8_grouped.cuh"

namespace {

using gg_mxfp8::Operand;

void check_operand(const torch::Tensor& data, const torch::Tensor& scale, const char* name) {
  TORCH_CHECK(data.is_cuda() && scale.is_cuda(), name, ": data and scale must be GPU tensors");
  TORCH_CHECK(data.element_size() == 1 && scale.scalar_type() == torch::kUInt8, name,
              ": data must be 1-byte E4M3 codes and scale uint8 E8M0 bytes");
  TORCH_CHECK(data.is_contiguous() && scale.is_contiguous(), name, ": data and scale must be contiguous");
  const int64_t len = data.size(-1);
  TORCH_CHECK(len % gg_mxfp8::MX_BLOCK == 0, name, ": contraction length ", len, " is not a multiple of 32");
  TORCH_CHECK(scale.size(-1) == len / gg_mxfp8::MX_BLOCK && scale.numel() * gg_mxfp8::MX_BLOCK == data.numel(),
              name, ": scale shape does not match data");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(data.data_ptr()) % 16 == 0, name, ": data must be 16-byte aligned");
}

Operand operand(const torch::Tensor& data, const torch::Tensor& scale) {
  const int64_t len = data.size(-1);
  return Operand{static_cast<const uint8_t*>(data.data_ptr()), static_cast<const uint8_t*>(scale.data_ptr()), len,
                 len / gg_mxfp8::MX_BLOCK};
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

}  // namespace

// fwd / dgrad: out (M, C) = a (M, L) x b (G, C, L)^T per row group; L is the contraction.
void rows_gemm(const torch::Tensor& a_data, const torch::Tensor& a_scale, const torch::Tensor& b_data,
               const torch::Tensor& b_scale, const torch::Tensor& row_ends, const torch::Tensor& tile_ends,
               int64_t max_tiles, const torch::Tensor& out) {
  check_operand(a_data, a_scale, "a");
  check_operand(b_data, b_scale, "b");
  check_out(out);
  TORCH_CHECK(a_data.dim() == 2 && b_data.dim() == 3 && a_data.size(1) == b_data.size(2), "a (M, L), b (G, C, L)");
  const int64_t groups = b_data.size(0);
  const int64_t ncols = b_data.size(1);
  TORCH_CHECK(groups >= 1 && out.dim() == 2 && out.size(0) == a_data.size(0) && out.size(1) == ncols,
              "out must be (M, C)");
  check_ends(row_ends, groups, "row_ends");
  check_ends(tile_ends, groups, "tile_ends");
  if (a_data.size(0) == 0 || ncols == 0 || max_tiles <= 0) return;
  TORCH_CHECK(max_tiles < (int64_t{1} << 31) && ncols < (int64_t{1} << 31), "problem too large for one launch");
  const c10::cuda::CUDAGuard guard(a_data.device());
  const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((ncols + gg_mxfp8::BN - 1) / gg_mxfp8::BN));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const Operand a = operand(a_data, a_scale);
  const Operand b = operand(b_data, b_scale);
  const int64_t kblocks = a_data.size(1) / gg_mxfp8::MX_BLOCK;
  if (out.scalar_type() == torch::kFloat32) {
    gg_mxfp8::rows_kernel<float><<<grid, gg_mxfp8::THREADS, 0, stream>>>(
        a, b, row_ends.data_ptr<int32_t>(), tile_ends.data_ptr<int32_t>(), static_cast<int>(groups),
        static_cast<int>(ncols), kblocks, out.data_ptr<float>());
  } else {
    gg_mxfp8::rows_kernel<uint16_t><<<grid, gg_mxfp8::THREADS, 0, stream>>>(
        a, b, row_ends.data_ptr<int32_t>(), tile_ends.data_ptr<int32_t>(), static_cast<int>(groups),
        static_cast<int>(ncols), kblocks, static_cast<uint16_t*>(out.data_ptr()));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// wgrad: out[g] (R, C) (+)= a (R, T) x b (C, T)^T over group g's tokens [pad_ends[g-1], pad_ends[g]).
void wgrad_gemm(const torch::Tensor& a_data, const torch::Tensor& a_scale, const torch::Tensor& b_data,
                const torch::Tensor& b_scale, const torch::Tensor& pad_ends, const torch::Tensor& out, bool accumulate) {
  check_operand(a_data, a_scale, "a");
  check_operand(b_data, b_scale, "b");
  check_out(out);
  TORCH_CHECK(a_data.dim() == 2 && b_data.dim() == 2 && a_data.size(1) == b_data.size(1), "a (R, T), b (C, T)");
  TORCH_CHECK(out.dim() == 3 && out.size(1) == a_data.size(0) && out.size(2) == b_data.size(0),
              "out must be (G, R, C)");
  const int64_t groups = out.size(0);
  check_ends(pad_ends, groups, "pad_ends");
  const int64_t nrows = a_data.size(0);
  const int64_t ncols = b_data.size(0);
  if (groups == 0 || nrows == 0 || ncols == 0) return;
  TORCH_CHECK(groups <= 65535, "at most 65535 groups");
  const c10::cuda::CUDAGuard guard(a_data.device());
  const dim3 grid(static_cast<unsigned>((ncols + gg_mxfp8::BN - 1) / gg_mxfp8::BN),
                  static_cast<unsigned>((nrows + gg_mxfp8::BM - 1) / gg_mxfp8::BM), static_cast<unsigned>(groups));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const Operand a = operand(a_data, a_scale);
  const Operand b = operand(b_data, b_scale);
  if (out.scalar_type() == torch::kFloat32) {
    gg_mxfp8::wgrad_kernel<float><<<grid, gg_mxfp8::THREADS, 0, stream>>>(
        a, b, pad_ends.data_ptr<int32_t>(), static_cast<int>(nrows), static_cast<int>(ncols), out.data_ptr<float>(),
        accumulate);
  } else {
    gg_mxfp8::wgrad_kernel<uint16_t><<<grid, gg_mxfp8::THREADS, 0, stream>>>(
        a, b, pad_ends.data_ptr<int32_t>(), static_cast<int>(nrows), static_cast<int>(ncols),
        static_cast<uint16_t*>(out.data_ptr()), accumulate);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "grouped_gemm hip_mxfp8 kernels (MXFP8 grouped GEMM)";
  m.def("rows_gemm", &rows_gemm, "fwd / dgrad: out (M, C) = a (M, L) x b (G, C, L)^T per row group");
  m.def("wgrad_gemm", &wgrad_gemm, "wgrad: out[g] (+)= a[:, tokens g] x b[:, tokens g]^T");
}
