// MXFP8 grouped GEMM kernels: E4M3 operands with E8M0 scales per 32-element block of the
// contraction, fp32 accumulation, bf16 or fp32 output. Pure CUDA dialect (hipify-able), no
// torch headers, so it compiles on its own with nvcc (see tests/test_hip_mxfp8_build.py).
//
// Both operands are "contraction-major": row r of an operand holds its contraction bytes
// contiguously (row stride `ld` bytes) and its scale bytes contiguously (stride `lds`).
//   rows_kernel  (fwd, dgrad): out[m, c] = sum_k A[m, k] * B[g(m) * ncols + c, k]
//                               over ragged row groups, tile schedule from device offsets.
//   wgrad_kernel             : out[g, n, c] = sum_{t in group g} A[n, t] * B[c, t]
//                               contraction range per group from device offsets.
// Per MX block of 32: partial = block dot product of the codes (exact products, fp32 sums),
// then acc += partial * 2^(sa-127) * 2^(sb-127): the reference's dequantize-then-multiply.
// Scale byte 255 is NaN; byte 0 is 2^-127.
//
// Inner product per target:
//   sm_89 and newer (not GG_MXFP8_PORTABLE): mma.sync m16n8k32 e4m3 x e4m3 -> f32, one MX block
//   of K per instruction, promoted into fp32 accumulators with the two block scales.
//   everything else (ROCm, or GG_MXFP8_PORTABLE on CUDA): the same fragments computed by each
//   thread with exact software E4M3 decoding and fp32 FMAs (slow, portable).
#pragma once

#include <stdint.h>

#if defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#endif

#if !defined(GG_MXFP8_PORTABLE) && !defined(__HIP_PLATFORM_AMD__) && \
    (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890)
#define GG_MXFP8_MMA_SYNC 1
#else
#define GG_MXFP8_MMA_SYNC 0
#endif

namespace gg_mxfp8 {

constexpr int BM = 128;            // output rows per block
constexpr int BN = 128;            // output columns per block
constexpr int BK = 64;             // contraction bytes per pipeline stage (two MX blocks)
constexpr int MX_BLOCK = 32;       // MX block: one m16n8k32 instruction
constexpr int KB_PER_TILE = BK / MX_BLOCK;
constexpr int THREADS = 256;       // 8 warps: 2 along rows x 4 along columns
constexpr int WARP_M = 64;         // rows per warp: 4 fragments of 16
constexpr int WARP_N = 32;         // columns per warp: 4 fragments of 8
constexpr int FRAG_M = WARP_M / 16;
constexpr int FRAG_N = WARP_N / 8;
// Shared-memory row pitch: 80 bytes = 20 words, so the 8 rows x 4 words a fragment load
// touches fall in 32 distinct banks; a multiple of 16 keeps 16-byte stores aligned.
constexpr int PITCH = BK + 16;
constexpr int CHUNKS = BM * BK / 16;            // 16-byte chunks per operand tile
constexpr int CHUNKS_PER_THREAD = CHUNKS / THREADS;

static_assert(BM == BN, "the loader handles both operands with one chunk map");
static_assert(CHUNKS % THREADS == 0, "whole chunks per thread");
static_assert(BM * KB_PER_TILE == THREADS, "one scale per thread per operand");

// One operand: `rows` rows of contraction-major E4M3 codes and their E8M0 scale bytes.
struct Operand {
  const uint8_t* data;
  const uint8_t* scale;
  int64_t ld;   // bytes between rows of data
  int64_t lds;  // bytes between rows of scale
};

__device__ __forceinline__ float e8m0_value(uint32_t byte) {
  const uint32_t bits = byte == 0 ? 0x00400000u : (byte == 255 ? 0x7fc00000u : (byte << 23));
  return __uint_as_float(bits);
}

// Round-to-nearest-even fp32 -> bf16 bits (NaN stays a quiet NaN).
__device__ __forceinline__ uint16_t bf16_bits(float v) {
  const uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename OutT>
struct OutStore;

template <>
struct OutStore<float> {
  __device__ __forceinline__ static float load(const float* p) { return *p; }
  __device__ __forceinline__ static void store(float* p, float v) { *p = v; }
};

// bf16 output stored as raw bits (uint16_t), so this header needs no bf16 type header.
template <>
struct OutStore<uint16_t> {
  __device__ __forceinline__ static float load(const uint16_t* p) {
    return __uint_as_float(static_cast<uint32_t>(*p) << 16);
  }
  __device__ __forceinline__ static void store(uint16_t* p, float v) { *p = bf16_bits(v); }
};

struct Stage {
  uint8_t a[BM * PITCH];
  uint8_t b[BN * PITCH];
  float sa[BM * KB_PER_TILE];
  float sb[BN * KB_PER_TILE];
};

// Global loads of one stage held in registers (issued before the math of the current stage).
struct Prefetch {
  uint4 a[CHUNKS_PER_THREAD];
  uint4 b[CHUNKS_PER_THREAD];
  float sa;
  float sb;
};

// Load contraction blocks [kb0, kb0 + KB_PER_TILE) of `rows` valid rows starting at `row0`.
// Rows past `rows` and blocks at or past `kb_end` read as zeros with scale 1.
__device__ __forceinline__ void load_operand(const Operand& op, int64_t row0, int rows, int64_t kb0, int64_t kb_end,
                                             uint4 (&chunks)[CHUNKS_PER_THREAD], float& scale) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < CHUNKS_PER_THREAD; ++i) {
    const int c = tid + i * THREADS;
    const int r = c / (BK / 16);
    const int col = (c % (BK / 16)) * 16;
    const int64_t kbyte = kb0 * MX_BLOCK + col;
    if (r < rows && kbyte < kb_end * MX_BLOCK) {
      chunks[i] = *reinterpret_cast<const uint4*>(op.data + (row0 + r) * op.ld + kbyte);
    } else {
      chunks[i] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  const int r = tid / KB_PER_TILE;
  const int64_t kb = kb0 + tid % KB_PER_TILE;
  scale = (r < rows && kb < kb_end) ? e8m0_value(op.scale[(row0 + r) * op.lds + kb]) : 1.0f;
}

__device__ __forceinline__ void store_stage(Stage& s, const Prefetch& p) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < CHUNKS_PER_THREAD; ++i) {
    const int c = tid + i * THREADS;
    const int off = (c / (BK / 16)) * PITCH + (c % (BK / 16)) * 16;
    *reinterpret_cast<uint4*>(s.a + off) = p.a[i];
    *reinterpret_cast<uint4*>(s.b + off) = p.b[i];
  }
  s.sa[tid] = p.sa;
  s.sb[tid] = p.sb;
}

#if !GG_MXFP8_MMA_SYNC
// Exact E4M3 (OCP "fn": no infinities, S.1111.111 is NaN) -> fp32.
__device__ __forceinline__ float e4m3_value(uint32_t code) {
  const uint32_t e = (code >> 3) & 0xf;
  const uint32_t m = code & 0x7;
  float mag;
  if (e == 0) {
    mag = static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  } else if (e == 15 && m == 7) {
    mag = __uint_as_float(0x7fc00000u);
  } else {
    mag = __uint_as_float(((e + 120u) << 23) | (m << 20));  // (1 + m/8) * 2^(e-7)
  }
  return (code & 0x80) ? -mag : mag;
}

// Dot product of two 32-byte MX blocks of codes in shared memory, in fp32.
__device__ __forceinline__ float block_dot(const uint8_t* a, const uint8_t* b) {
  float s = 0.0f;
#pragma unroll 8
  for (int i = 0; i < MX_BLOCK; ++i) s = fmaf(e4m3_value(a[i]), e4m3_value(b[i]), s);
  return s;
}
#endif

// The math of one stage for this thread's fragments: for each MX block, the 16x8 block
// products of every (row fragment, column fragment) pair in the m16n8k32 accumulator layout
// (rows g and g+8, columns 2t and 2t+1 of the fragment), promoted into `acc` with the scales.
__device__ __forceinline__ void stage_math(const Stage& s, float (&acc)[FRAG_M][FRAG_N][4]) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int wrow = (warp / (BN / WARP_N)) * WARP_M;
  const int wcol = (warp % (BN / WARP_N)) * WARP_N;
#pragma unroll
  for (int kb = 0; kb < KB_PER_TILE; ++kb) {
    float sa[FRAG_M][2];
    float sb[FRAG_N][2];
#pragma unroll
    for (int mi = 0; mi < FRAG_M; ++mi) {
      sa[mi][0] = s.sa[(wrow + mi * 16 + g) * KB_PER_TILE + kb];
      sa[mi][1] = s.sa[(wrow + mi * 16 + g + 8) * KB_PER_TILE + kb];
    }
#pragma unroll
    for (int ni = 0; ni < FRAG_N; ++ni) {
      sb[ni][0] = s.sb[(wcol + ni * 8 + 2 * t) * KB_PER_TILE + kb];
      sb[ni][1] = s.sb[(wcol + ni * 8 + 2 * t + 1) * KB_PER_TILE + kb];
    }
#if GG_MXFP8_MMA_SYNC
    uint32_t af[FRAG_M][4];
    uint32_t bf[FRAG_N][2];
#pragma unroll
    for (int mi = 0; mi < FRAG_M; ++mi) {
      const uint8_t* top = s.a + (wrow + mi * 16 + g) * PITCH + kb * MX_BLOCK + 4 * t;
      af[mi][0] = *reinterpret_cast<const uint32_t*>(top);
      af[mi][1] = *reinterpret_cast<const uint32_t*>(top + 8 * PITCH);
      af[mi][2] = *reinterpret_cast<const uint32_t*>(top + 16);
      af[mi][3] = *reinterpret_cast<const uint32_t*>(top + 8 * PITCH + 16);
    }
#pragma unroll
    for (int ni = 0; ni < FRAG_N; ++ni) {
      const uint8_t* col = s.b + (wcol + ni * 8 + g) * PITCH + kb * MX_BLOCK + 4 * t;
      bf[ni][0] = *reinterpret_cast<const uint32_t*>(col);
      bf[ni][1] = *reinterpret_cast<const uint32_t*>(col + 16);
    }
#endif
#pragma unroll
    for (int mi = 0; mi < FRAG_M; ++mi) {
#pragma unroll
      for (int ni = 0; ni < FRAG_N; ++ni) {
        float d[4];
#if GG_MXFP8_MMA_SYNC
        asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%10, %11, %12, %13};\n"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
            : "r"(af[mi][0]), "r"(af[mi][1]), "r"(af[mi][2]), "r"(af[mi][3]), "r"(bf[ni][0]), "r"(bf[ni][1]),
              "f"(0.0f), "f"(0.0f), "f"(0.0f), "f"(0.0f));
#else
        const uint8_t* top = s.a + (wrow + mi * 16 + g) * PITCH + kb * MX_BLOCK;
        const uint8_t* col = s.b + (wcol + ni * 8 + 2 * t) * PITCH + kb * MX_BLOCK;
        d[0] = block_dot(top, col);
        d[1] = block_dot(top, col + PITCH);
        d[2] = block_dot(top + 8 * PITCH, col);
        d[3] = block_dot(top + 8 * PITCH, col + PITCH);
#endif
        acc[mi][ni][0] = fmaf(d[0] * sa[mi][0], sb[ni][0], acc[mi][ni][0]);
        acc[mi][ni][1] = fmaf(d[1] * sa[mi][0], sb[ni][1], acc[mi][ni][1]);
        acc[mi][ni][2] = fmaf(d[2] * sa[mi][1], sb[ni][0], acc[mi][ni][2]);
        acc[mi][ni][3] = fmaf(d[3] * sa[mi][1], sb[ni][1], acc[mi][ni][3]);
      }
    }
  }
}

// acc = sum over MX blocks [kb_begin, kb_end) of A rows [a_row0, +a_rows) x B rows
// [b_row0, +b_rows): a two-stage shared-memory pipeline, the next stage's global loads
// in flight in registers while the current stage's math runs; one barrier per stage.
__device__ __forceinline__ void tile_product(Stage (&stages)[2], const Operand& a, int64_t a_row0, int a_rows,
                                             const Operand& b, int64_t b_row0, int b_rows, int64_t kb_begin,
                                             int64_t kb_end, float (&acc)[FRAG_M][FRAG_N][4]) {
#pragma unroll
  for (int mi = 0; mi < FRAG_M; ++mi)
#pragma unroll
    for (int ni = 0; ni < FRAG_N; ++ni)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mi][ni][j] = 0.0f;
  const int64_t tiles = (kb_end - kb_begin + KB_PER_TILE - 1) / KB_PER_TILE;
  if (tiles <= 0) return;
  Prefetch p;
  load_operand(a, a_row0, a_rows, kb_begin, kb_end, p.a, p.sa);
  load_operand(b, b_row0, b_rows, kb_begin, kb_end, p.b, p.sb);
  store_stage(stages[0], p);
  __syncthreads();
  for (int64_t i = 0; i < tiles; ++i) {
    const bool more = i + 1 < tiles;
    if (more) {
      const int64_t kb = kb_begin + (i + 1) * KB_PER_TILE;
      load_operand(a, a_row0, a_rows, kb, kb_end, p.a, p.sa);
      load_operand(b, b_row0, b_rows, kb, kb_end, p.b, p.sb);
    }
    stage_math(stages[i & 1], acc);
    if (more) store_stage(stages[(i + 1) & 1], p);
    __syncthreads();
  }
}

// Write (or add into, when `accumulate`) the valid part of the block's tile: rows < rows,
// columns < cols, at out[r * ldo + c].
template <typename OutT>
__device__ __forceinline__ void store_tile(const float (&acc)[FRAG_M][FRAG_N][4], OutT* out, int64_t ldo, int rows,
                                           int cols, bool accumulate) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wrow = (warp / (BN / WARP_N)) * WARP_M + lane / 4;
  const int wcol = (warp % (BN / WARP_N)) * WARP_N + 2 * (lane % 4);
#pragma unroll
  for (int mi = 0; mi < FRAG_M; ++mi)
#pragma unroll
    for (int ni = 0; ni < FRAG_N; ++ni)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = wrow + mi * 16 + (j / 2) * 8;
        const int c = wcol + ni * 8 + (j % 2);
        if (r < rows && c < cols) {
          OutT* dst = out + static_cast<int64_t>(r) * ldo + c;
          float v = acc[mi][ni][j];
          if (accumulate) v += OutStore<OutT>::load(dst);
          OutStore<OutT>::store(dst, v);
        }
      }
}

// fwd / dgrad. Group g owns rows [row_ends[g-1], row_ends[g]) of A and out, and rows
// [g * ncols, (g + 1) * ncols) of B. tile_ends[g] is the cumulative count of BM-row tiles
// through group g; blockIdx.x is a tile index (blocks past the last tile exit), blockIdx.y
// a column tile. Everything is read on the device: no host sync, graph-capturable.
template <typename OutT>
__global__ void __launch_bounds__(THREADS, 1)
    rows_kernel(Operand a, Operand b, const int32_t* __restrict__ row_ends, const int32_t* __restrict__ tile_ends,
                int groups, int ncols, int64_t kblocks, OutT* __restrict__ out) {
  __shared__ Stage stages[2];
  const int tile = blockIdx.x;
  if (tile >= tile_ends[groups - 1]) return;
  int lo = 0, hi = groups - 1;  // first group whose tile_ends exceeds `tile`
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (tile_ends[mid] > tile) hi = mid; else lo = mid + 1;
  }
  const int g = lo;
  const int first_tile = g ? tile_ends[g - 1] : 0;
  const int64_t group_start = g ? row_ends[g - 1] : 0;
  const int64_t row0 = group_start + static_cast<int64_t>(tile - first_tile) * BM;
  const int rows = static_cast<int>(min(static_cast<int64_t>(BM), row_ends[g] - row0));
  const int col0 = blockIdx.y * BN;
  const int cols = min(BN, ncols - col0);
  float acc[FRAG_M][FRAG_N][4];
  tile_product(stages, a, row0, rows, b, static_cast<int64_t>(g) * ncols + col0, cols, 0, kblocks, acc);
  store_tile(acc, out + row0 * ncols + col0, ncols, rows, cols, false);
}

// wgrad. out[g] (nrows x ncols) = A[:, tokens of g] . B[:, tokens of g]^T, where group g's
// (padded, 32-aligned) tokens are [pad_ends[g-1], pad_ends[g]). blockIdx = (column tile,
// row tile, group). A group without tokens writes zeros (or leaves out untouched).
template <typename OutT>
__global__ void __launch_bounds__(THREADS, 1)
    wgrad_kernel(Operand a, Operand b, const int32_t* __restrict__ pad_ends, int nrows, int ncols,
                 OutT* __restrict__ out, bool accumulate) {
  __shared__ Stage stages[2];
  const int g = blockIdx.z;
  const int64_t t0 = g ? pad_ends[g - 1] : 0;
  const int64_t t1 = pad_ends[g];
  const int row0 = blockIdx.y * BM;
  const int col0 = blockIdx.x * BN;
  const int rows = min(BM, nrows - row0);
  const int cols = min(BN, ncols - col0);
  float acc[FRAG_M][FRAG_N][4];
  tile_product(stages, a, row0, rows, b, col0, cols, t0 / MX_BLOCK, t1 / MX_BLOCK, acc);
  OutT* dst = out + (static_cast<int64_t>(g) * nrows + row0) * ncols + col0;
  store_tile(acc, dst, ncols, rows, cols, accumulate);
}

}  // namespace gg_mxfp8
