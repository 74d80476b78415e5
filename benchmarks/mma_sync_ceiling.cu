// The rate of Hopper's warp-level mma.sync, the instruction hip_mxfp8's sm_90 path is
// built on, with nothing else in the loop: no loads, no conversions of operands to
// registers, no scale promotion. Whatever hip_mxfp8 reaches on sm_90 is below this, so it
// says whether its goal (>= 0.6x torch._grouped_mm bf16, issue 11) is reachable at all.
//
//   nvcc -O3 -arch=sm_90 -o mma_sync_ceiling benchmarks/mma_sync_ceiling.cu && ./mma_sync_ceiling
//
// Prints TFLOP/s for bf16 m16n8k16 (fp32 accumulate) and e4m3 m16n8k32 (fp32 accumulate;
// on sm_90 ptxas lowers it to E4M3 -> fp16 conversions and fp16 MMAs), each with 4 and 8
// warps a block and 1 or 2 blocks a SM. Every warp keeps ACC independent accumulators so
// that the MMA pipe, not the dependency between MMAs, sets the rate.
#include <cstdio>
#include <cuda_runtime.h>

constexpr int ACC = 8;       // independent accumulators per warp
constexpr int ITERS = 4096;  // MMA rounds per warp (ACC MMAs each)

__global__ void bf16_mma(float* sink, unsigned seed) {
  unsigned a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = seed * (threadIdx.x + 7 * i) | 0x3f803f80u;
  for (int i = 0; i < 2; ++i) b[i] = seed * (threadIdx.x + 3 * i) | 0x3f803f80u;
  float d[ACC][4] = {};
  for (int it = 0; it < ITERS; ++it) {
#pragma unroll
    for (int j = 0; j < ACC; ++j) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  float s = 0.f;
  for (int j = 0; j < ACC; ++j) s += d[j][0] + d[j][1] + d[j][2] + d[j][3];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// On sm_90 ptxas lowers the E4M3 MMA to operand conversions, two fp16 MMAs from zero and
// four FADDs into the accumulator, so with fixed operands it would compute the product once
// and only add: every accumulator gets its own operands, changed every round (one integer
// op per operand register), so each MMA converts its operands as a kernel reading them from
// shared memory would.
__global__ void e4m3_mma(float* sink, unsigned seed) {
  unsigned a[ACC][4], b[ACC][2];
#pragma unroll
  for (int j = 0; j < ACC; ++j) {
    for (int i = 0; i < 4; ++i) a[j][i] = (seed * (threadIdx.x + 7 * i + 31 * j)) & 0x3a3a3a3au;
    for (int i = 0; i < 2; ++i) b[j][i] = (seed * (threadIdx.x + 3 * i + 17 * j)) & 0x3a3a3a3au;
  }
  float d[ACC][4] = {};
  for (int it = 0; it < ITERS; ++it) {
    const unsigned flip = (it & 1u) * 0x01010101u;  // stays inside the finite E4M3 codes
#pragma unroll
    for (int j = 0; j < ACC; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[j][i] ^= flip;
#pragma unroll
      for (int i = 0; i < 2; ++i) b[j][i] ^= flip;
      asm volatile(
          "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
          : "r"(a[j][0]), "r"(a[j][1]), "r"(a[j][2]), "r"(a[j][3]), "r"(b[j][0]), "r"(b[j][1]));
    }
  }
  float s = 0.f;
  for (int j = 0; j < ACC; ++j) s += d[j][0] + d[j][1] + d[j][2] + d[j][3];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <typename Kernel>
static double tflops(Kernel kernel, double flops_per_mma, int sms, int per_sm, int warps, float* sink) {
  const int blocks = sms * per_sm, threads = 32 * warps;
  kernel<<<blocks, threads>>>(sink, 1u);  // warm-up
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start);
  const int reps = 5;
  for (int r = 0; r < reps; ++r) kernel<<<blocks, threads>>>(sink, 3u + r);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, start, stop);
  const double mmas = double(reps) * blocks * warps * ITERS * ACC;
  return mmas * flops_per_mma / (ms * 1e-3) / 1e12;
}

int main() {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::printf("no CUDA device\n");
    return 1;
  }
  float* sink = nullptr;
  cudaMalloc(&sink, sizeof(float) * prop.multiProcessorCount * 2 * 256);
  std::printf("%s, %d SMs\n| mma.sync | warps a block | blocks a SM | TFLOP/s |\n|---|---|---|---|\n", prop.name,
              prop.multiProcessorCount);
  for (int warps : {4, 8}) {
    for (int per_sm : {1, 2}) {
      const double bf16 = tflops(bf16_mma, 2.0 * 16 * 8 * 16, prop.multiProcessorCount, per_sm, warps, sink);
      const double e4m3 = tflops(e4m3_mma, 2.0 * 16 * 8 * 32, prop.multiProcessorCount, per_sm, warps, sink);
      std::printf("| bf16 m16n8k16 | %d | %d | %.0f |\n| e4m3 m16n8k32 | %d | %d | %.0f |\n", warps, per_sm, bf16,
                  warps, per_sm, e4m3);
    }
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  cudaFree(sink);
  return 0;
}
