// MXFP8 grouped GEMM kernels: E4M3 operands with E8M0 scales per 32-element block of the
// contraction, fp32 accumulation, bf16 or fp32 output. Pure CUDA dialect (hipify-able), no
// torch headers, so it compiles on its own with nvcc (see tests/test_hip_mxfp8_build.py).
//
// An operand is read in one of two layouts (template flag `KOuter`):
//   contraction-major: row r holds its contraction bytes contiguously (row stride `ld`);
//   k-outer: contraction step k holds the operand's rows contiguously (step stride `ld`):
//     the layout of a weight blocked along N for dgrad, and of wgrad's token-major dy and x,
//     read as they are (no transposing copy per call) and transposed on chip.
// Scale bytes are addressed by two strides, per row and per MX block.
//   rows_kernel  (fwd, dgrad): out[m, c] = sum_k A[m, k] * B_g(m)[c, k]
//                               over ragged row groups, tile schedule from device offsets.
//   wgrad_kernel             : out[g, n, c] = sum_{t in group g} A[n, t] * B[c, t]
//                               contraction range per group from device offsets.
// The value: sum over MX blocks of 32 of (block dot product of the codes) * 2^(sa-127) *
// 2^(sb-127), the reference's dequantize-then-multiply, in fp32 (the paths below differ only
// in rounding order). Scale byte 255 is NaN; byte 0 is 2^-127.
//
// Inner product per target:
//   sm_89 and newer (not GG_MXFP8_PORTABLE), two paths chosen per output tile:
//   - prescaled (when every row of the tile's two operands has block scales within 15 binades
//     of its largest over the whole contraction, found per call by row_ranges_kernel): codes
//     are converted to f16 and multiplied by 2^(scale - row's largest scale), which is exact
//     (an E4M3 value times 2^-15 or more is still an f16 value); f16 MMAs then accumulate
//     every MX block into one fp32 accumulator, and the two rows' largest scales are applied
//     once at the end. sm_90a: each stage converted into swizzled f16 tiles in shared memory
//     that two warpgroups multiply by wgmma (wgmma_pipeline; fwd / dgrad blocks 128 x 256,
//     wgrad 128 x 128); elsewhere converted fragments
//     and mma.sync m16n8k16. Per-block promotion (an FADD, FMUL and FFMA per accumulator per
//     block) was most of the instructions issued by the kernel, which was issue- and
//     latency-bound (Nsight Compute, docs/performance.md).
//   - exact per block (wider spreads, NaN scales): mma.sync m16n8k32 e4m3 x e4m3 -> f32, one
//     MX block of K per instruction, promoted into fp32 accumulators with the two block scales.
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

// Tuning knobs for A/B builds: pipeline depth (4 was no faster than 3 on the H200,
// 2026-12-05, docs/performance.md), and MX blocks of a stage whose fragment loads are
// scheduled together (2 and 4 spill at 255 registers with nvcc 13.0).
#ifndef GG_MXFP8_STAGES
#define GG_MXFP8_STAGES 3
#endif
#ifndef GG_MXFP8_KB_UNROLL
#define GG_MXFP8_KB_UNROLL 1
#endif
// 0 turns the prescaled path off (A/B builds against the per-block path).
#ifndef GG_MXFP8_PRESCALE
#define GG_MXFP8_PRESCALE 1
#endif
// 0 keeps the prescaled path on mma.sync on sm_90a (A/B builds against wgmma).
#ifndef GG_MXFP8_WGMMA
#define GG_MXFP8_WGMMA 1
#endif
// 1 gives fwd / dgrad's A operand to wgmma in registers, converted from the code stage in the
// fragment's order (a_fragments); 0 passes it through an f16 tile in shared memory like B. On an
// H100, 1 took 0.83-0.96x the time of 0 on the nine compute-bound cases, bit for bit the same
// results (2026-12-06, docs/performance.md, the twenty-third session).
#ifndef GG_MXFP8_REG_A
#define GG_MXFP8_REG_A 1
#endif
// Whether this compilation's device code runs the prescaled path on wgmma (sm_90a only; the
// host pass sizes shared memory from the device's compute capability instead).
#if GG_MXFP8_MMA_SYNC && GG_MXFP8_PRESCALE && GG_MXFP8_WGMMA && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GG_MXFP8_WGMMA_HERE 1
#else
#define GG_MXFP8_WGMMA_HERE 0
#endif

namespace gg_mxfp8 {

constexpr int BM = 128;            // output rows per block
constexpr int BN = 128;            // output columns of the per-block path's pass
constexpr int BK = 128;            // contraction bytes per pipeline stage (four MX blocks)
constexpr int MX_BLOCK = 32;       // MX block: one m16n8k32 instruction
constexpr int KB_UNROLL = GG_MXFP8_KB_UNROLL;
constexpr int KB_PER_TILE = BK / MX_BLOCK;
constexpr int STAGES = GG_MXFP8_STAGES;  // stages in flight: loads of STAGES - 1 run under the math of one
constexpr int THREADS = 256;       // 8 warps: 2 along rows x 4 along columns
constexpr int WARP_M = 64;         // rows per warp: 4 fragments of 16
constexpr int WARP_N = 32;         // columns per warp: 4 fragments of 8
constexpr int FRAG_M = WARP_M / 16;
constexpr int FRAG_N = WARP_N / 8;
using Acc = float[FRAG_M][FRAG_N][4];  // a thread's accumulators of BM x BN outputs
template <int Halves>
using TileAcc = Acc[Halves];  // of a block's BM x Halves BN outputs, by column half
// Shared-memory row pitch: 144 bytes, so the eight 16-byte rows one ldmatrix reads fall in
// eight distinct 16-byte bank groups, and every row start stays 16-byte aligned.
constexpr int PITCH = BK + 16;
constexpr int TILE_BYTES = BM * PITCH;              // one operand's codes in one stage
constexpr int BLOCKS4_PER_THREAD = BM * BK / 16 / THREADS;  // 4x4-byte blocks transposed a stage
constexpr bool PRESCALE = GG_MXFP8_MMA_SYNC && GG_MXFP8_PRESCALE;
constexpr int MAX_SPREAD = 15;       // binades below a row's largest scale the prescaled path takes
constexpr uint32_t NO_SCALE = 0x100; // a scale slot outside the operand (its codes are zeros)

// wgmma (sm_90a) reads the prescaled f16 operands from shared memory, half a stage at a time:
// 64 contraction steps = one 128-byte row of the 128-byte swizzle (double-buffered at one block
// a SM; SmemPlan).
constexpr bool WGMMA_BUILD = PRESCALE && GG_MXFP8_WGMMA;
constexpr int HALF_K = BK / 2;
constexpr int SWIZZLE_ROW = HALF_K * 2;                 // bytes: 64 f16
constexpr int SWIZZLE_ATOM = 8 * SWIZZLE_ROW;           // 8 rows: the swizzle's period, and its alignment
constexpr int F16_A = BM * SWIZZLE_ROW;                 // A's f16 half-stage (B's: Halves times that)
// Column halves of a block's tile: fwd / dgrad on wgmma take 256 columns, one m64n256 wgmma per
// warpgroup, so a stage's conversions, copies and barriers serve twice the MMAs (their tiles
// were issue-bound on that work: H100 profile, tensor pipe a quarter busy). wgrad keeps 128:
// its tiles are short along the contraction (one group's tokens), and at 256 columns it was
// slower on most cases and spilled registers (docs/performance.md, sixteenth session).
constexpr int ROWS_HALVES = WGMMA_BUILD ? 2 : 1;
constexpr int WGRAD_HALVES = 1;
// Blocks a SM of a wgrad launch. A wgrad tile is short (a group's tokens: one stage for 128),
// so a block spends most of its time waiting in turn on its scale ranges, its copies and its
// stores; with one block a SM nothing ran under those waits (H100 profile: tensor pipe 8.5 %
// busy, 0.5 eligible warps a scheduler). Two blocks take at most 128 registers a thread and
// half the shared memory each (SmemPlan).
constexpr int WGRAD_PER_SM = 2;
// Blocks a SM of a fwd / dgrad launch: its tiles are long along the contraction and take
// every register and most of the shared memory (SmemPlan).
constexpr int ROWS_PER_SM = 1;

static_assert(BM == BN && BK == BM, "one square transpose serves both operands");
static_assert(BM * BK / 16 % THREADS == 0 && BM * KB_PER_TILE % THREADS == 0, "whole work items per thread");

// One operand: E4M3 codes and their E8M0 scale bytes (see the layouts above). `gdata` and
// `gscale` step from one group's operand to the next (rows_kernel's weights).
struct Operand {
  const uint8_t* data;
  const uint8_t* scale;
  int64_t ld;      // contraction-major: bytes between rows; k-outer: between contraction steps
  int64_t srow;    // scale bytes between rows
  int64_t skb;     // scale bytes between MX blocks
  int64_t gdata;
  int64_t gscale;
  // The wgmma path's TMA view of the codes (set by the kernel; null elsewhere): a 2-D tensor of
  // lines of ld bytes (rows, or contraction steps if k-outer), data's first line at first_line.
  const void* map;
  int64_t first_line;
};

// CUtensorMap's size and (CUDA 13's, the larger) alignment, so that the kernels' signatures do not depend on the
// CUDA driver header (ROCm builds pass zeros they never read). Filled on the host by
// cuTensorMapEncodeTiled: uint8 codes, 2-D, 128-byte swizzle.
struct alignas(128) TensorMap {
  uint64_t opaque[16];
};
#if defined(__HIP_PLATFORM_AMD__)
#define GG_GRID_CONSTANT
#else
#define GG_GRID_CONSTANT __grid_constant__
#endif

__device__ __forceinline__ Operand group_operand(const Operand& op, int g) {
  Operand o = op;
  o.data += static_cast<int64_t>(g) * op.gdata;
  o.scale += static_cast<int64_t>(g) * op.gscale;
  o.first_line += static_cast<int64_t>(g) * (op.gdata / op.ld);
  return o;
}

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
  // Two adjacent elements, 8-byte aligned.
  __device__ __forceinline__ static float2 load2(const float* p) { return *reinterpret_cast<const float2*>(p); }
  __device__ __forceinline__ static void store2(float* p, float v0, float v1) {
    *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
  }
};

// bf16 output stored as raw bits (uint16_t), so this header needs no bf16 type header.
template <>
struct OutStore<uint16_t> {
  __device__ __forceinline__ static float load(const uint16_t* p) {
    return __uint_as_float(static_cast<uint32_t>(*p) << 16);
  }
  __device__ __forceinline__ static void store(uint16_t* p, float v) {
#if GG_MXFP8_MMA_SYNC
    uint16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(v));
    *p = h;
#else
    *p = bf16_bits(v);
#endif
  }
  // Two adjacent elements, 4-byte aligned.
  __device__ __forceinline__ static float2 load2(const uint16_t* p) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  // The pair rounds in one cvt.rn.bf16x2.f32 where mma.sync builds run (sm_89+): bf16_bits'
  // integer rounding, about ten instructions a value, was most of a wgrad tile's epilogue by
  // its SASS (a NaN comes out as the hardware's canonical NaN instead of 0x7fc0).
  __device__ __forceinline__ static uint32_t pack2(float v0, float v1) {
#if GG_MXFP8_MMA_SYNC
    uint32_t w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(w) : "f"(v1), "f"(v0));  // v1 -> the upper half
    return w;
#else
    return static_cast<uint32_t>(bf16_bits(v0)) | static_cast<uint32_t>(bf16_bits(v1)) << 16;
#endif
  }
  __device__ __forceinline__ static void store2(uint16_t* p, float v0, float v1) {
    *reinterpret_cast<uint32_t*>(p) = pack2(v0, v1);
  }
};

// One pipeline stage in shared memory: both operands' codes as [row][contraction byte]
// (a k-outer operand lands here as [contraction byte][row], in planes of BK rows one under the
// other, and is transposed on chip), and the block scales, [MX block][row]: fp32 bits on the
// per-block path, an f16x2 pair of 2^(scale - row's largest) on the prescaled path.
// `BRows` rows of B: BN on the per-block path (a column half of the tile), the tile's width on
// wgmma's.
template <int BRows>
struct StageOf {
  static constexpr int B_ROWS = BRows;
  uint8_t a[TILE_BYTES];
  uint8_t b[BRows * PITCH];
  uint32_t sa[KB_PER_TILE][BM];
  uint32_t sb[KB_PER_TILE][BRows];
};
using Stage = StageOf<BN>;
// A stage of the wgmma path as TMA writes it: codes in 128-byte lines (a row, or a
// contraction step if k-outer, in planes of BK lines), line l's 16-byte chunk c at
// l BK + (c ^ l % 8) 16 (the 128-byte swizzle: eight lines' same chunk in eight bank groups),
// then the scale words as in StageOf. Every part is a multiple of 1024 bytes (the swizzle's
// period and the copies' alignment).
template <int Halves>
struct WgStage {
  static constexpr int B_ROWS = Halves * BN;
  uint8_t a[BM * BK];
  uint8_t b[B_ROWS * BK];
  uint32_t sa[KB_PER_TILE][BM];
  uint32_t sb[KB_PER_TILE][B_ROWS];
};
static_assert(sizeof(WgStage<1>) % 1024 == 0 && sizeof(WgStage<2>) % 1024 == 0, "stages keep the 1024-byte alignment");

// Byte offset of line l's byte `byte` in a swizzled stage.
__device__ __forceinline__ int swizzled(int l, int byte) { return l * BK + (((byte >> 4) ^ (l & 7)) << 4) + (byte & 15); }

// The dynamic shared memory of a block of `Halves` column halves, `PerSM` blocks a SM, which its
// two paths share: the per-block path's code stages, then a transpose buffer per k-outer
// operand; or the wgmma path's (`wgmma`: the device is sm_90 and the build has that path) code
// stages and f16 buffers (each a half-stage of A and of B), aligned to the swizzle's 1024
// bytes. Two blocks a SM keep two code stages on either path, one f16 buffer, and one
// transpose buffer (B's tile is transposed into the stage's A codes once those have left).
template <int Halves, int PerSM>
struct SmemPlan {
  static constexpr int PB_STAGES = PerSM == 1 ? STAGES : 2;
  // The wider tile keeps two: its B stages are twice the size.
  static constexpr int WG_STAGES = PerSM == 1 && Halves == 1 ? STAGES : 2;
  static constexpr int F16_BUFS = PerSM == 1 ? 2 : 1;
  static constexpr bool ONE_WORK = PerSM > 1;
  static constexpr int bytes(int kouter_operands, bool wgmma) {
    const int work = ONE_WORK && kouter_operands > 1 ? 1 : kouter_operands;
    const int per_block = PB_STAGES * static_cast<int>(sizeof(Stage)) + work * TILE_BYTES;
    const int wg = WG_STAGES * static_cast<int>(sizeof(WgStage<Halves>)) + SWIZZLE_ATOM + F16_BUFS * (1 + Halves) * F16_A;
    return wgmma && wg > per_block ? wg : per_block;
  }
};
// sm_90: 228 KB a SM, less 1 KB reserved a block and the blocks' static buffers (under 2 KB).
static_assert(WGRAD_PER_SM * (SmemPlan<WGRAD_HALVES, WGRAD_PER_SM>::bytes(2, true) + 3 * 1024) <= 228 * 1024,
              "WGRAD_PER_SM wgrad blocks fit a SM");

// 16 bytes global -> shared, zeros where `valid` is false (`src` is then never read, and may
// point outside the operand). Asynchronous (cp.async, zero fill by source size 0, which
// reads nothing) where mma.sync runs; a plain copy elsewhere.
__device__ __forceinline__ void copy16(uint8_t* dst, const uint8_t* src, bool valid) {
#if GG_MXFP8_MMA_SYNC
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
#else
  *reinterpret_cast<uint4*>(dst) = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#endif
}

// The wgmma path's stage copies (sm_90a): one TMA copy per operand and stage (two for a
// k-outer B of two planes), issued by one thread and completing on the stage's shared-memory
// barrier, where 16-byte cp.async took twelve instructions a thread with their addresses (the
// H100 source counters had a fifth of the stall samples on those). No operation on other
// targets, which never call them.
#if GG_MXFP8_WGMMA_HERE
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// `v`, which the compiler cannot recompute from its inputs: it stays in a register.
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
  asm volatile("mov.b32 %0, %0;\n" : "+r"(v));
  return v;
}
#endif

// The box at (x: byte along the line, y: line) of `map` into `dst` (1024-byte aligned).
__device__ __forceinline__ void tma_load(uint8_t* dst, const void* map, int64_t x, int64_t y, uint64_t* bar) {
#if GG_MXFP8_WGMMA_HERE
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(smem_addr(dst)),
      "l"(map), "r"(static_cast<int32_t>(x)), "r"(static_cast<int32_t>(y)), "r"(smem_addr(bar))
      : "memory");
#endif
}

// The calling thread's arrival on `bar`, announcing `bytes` to land in the current phase.
__device__ __forceinline__ void arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
#if GG_MXFP8_WGMMA_HERE
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}

// Until the phase with this parity of the barrier at shared address `bar` has completed (the
// address from the caller: converting it here, in the main loop, read the CTA's id each stage).
__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
#if GG_MXFP8_WGMMA_HERE
  asm volatile(
      "{\n .reg .pred done;\n gg_wait:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra gg_wait;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}

// `count` barriers, each completing a phase on one arrival and its bytes; the caller
// synchronizes the block after.
__device__ __forceinline__ void bars_init(uint64_t* bars, int count) {
#if GG_MXFP8_WGMMA_HERE
  if (threadIdx.x == 0) {
    for (int i = 0; i < count; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bars + i)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
#endif
}

__device__ __forceinline__ void copy_commit() {
#if GG_MXFP8_MMA_SYNC
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most `pending` committed copy groups of this thread are still in flight.
template <int pending>
__device__ __forceinline__ void copy_wait() {
#if GG_MXFP8_MMA_SYNC
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
#endif
}

// f16x2 bits of the pair (2^e, 2^e), e in [-MAX_SPREAD, 0]: normal down to 2^-14, 2^-15 subnormal.
__device__ __forceinline__ uint32_t pow2_f16x2(int e) {
  const uint32_t h = e >= -14 ? static_cast<uint32_t>(e + 15) << 10 : 0x0200u;
  return h | (h << 16);
}

// The calling thread's share of one operand's pipeline stages, addressed once per tile (64-bit
// addresses recomputed for every copy and scale byte were a third of the wgmma path's main
// loop, by its SASS). Codes: the thread's chunk i of 16 bytes is line tid / 8 + 32 i of the
// stage (a row, or if KOuter a contraction step of plane i / 4: rows 128 (i / 4) + [0, 128)),
// at byte (tid % 8) * 16 of the line. Scales:
// slot i is (row r0 + i dr, MX block kb0 + i dkb) of the stage, one map for loading and
// storing, so neighbouring threads read neighbouring bytes in either scale layout.
template <bool KOuter, int Rows>
struct StageLoader {
  static constexpr int LINES_APART = THREADS / (BK / 16);
  static constexpr int CHUNKS = Rows * BK / 16 / THREADS;
  static constexpr int SCALES = Rows * KB_PER_TILE / THREADS;
  static constexpr int PLANE_CHUNKS = BK / LINES_APART;  // k-outer: chunks per plane of BK rows
  static_assert(KOuter ? Rows % BK == 0 : Rows % LINES_APART == 0, "whole planes, whole lines");
  const uint8_t* code;   // chunk 0 at MX block 0
  int64_t code_kb;       // bytes per MX block along the contraction
  int64_t code_chunk;    // bytes between the thread's chunks
  int64_t kb_end;
  uint32_t inside;       // bit i: chunk i's rows lie inside the operand
  int k0;                // chunk 0's contraction step within a stage
  int rows;
  const uint8_t* scale;  // slot 0 at MX block 0
  int64_t scale_kb, scale_slot;
  int r0, dr, kb0, dkb;
  int32_t ref[SCALES];  // the slots' rows' largest scales (prescaled path)
  const void* map;      // the wgmma path's TMA view, and the stage's box at MX block 0
  int64_t tma_x0, tma_y0;

  __device__ __forceinline__ StageLoader(const Operand& op, int64_t row0, int rows_, int64_t kb_end_)
      : kb_end(kb_end_), inside(0), rows(rows_) {
    const int tid = threadIdx.x;
    const int line = tid / (BK / 16);
    const int byte = (tid % (BK / 16)) * 16;
    code_chunk = LINES_APART * op.ld;
    code = KOuter ? op.data + line * op.ld + row0 + byte : op.data + (row0 + line) * op.ld + byte;
    code_kb = KOuter ? MX_BLOCK * op.ld : MX_BLOCK;
    k0 = KOuter ? line : byte;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i)
      inside |= static_cast<uint32_t>(KOuter ? i / PLANE_CHUNKS * BK + byte < rows : line + i * LINES_APART < rows) << i;
    const bool by_row = op.srow == 1;  // scale bytes of neighbouring rows adjacent
    r0 = by_row ? tid % Rows : tid / KB_PER_TILE;
    dr = by_row ? 0 : THREADS / KB_PER_TILE;
    kb0 = by_row ? tid / Rows : tid % KB_PER_TILE;
    dkb = by_row ? THREADS / Rows : 0;
    scale = op.scale + (row0 + r0) * op.srow + kb0 * op.skb;
    scale_kb = op.skb;
    scale_slot = dr * op.srow + dkb * op.skb;
    map = op.map;
    tma_x0 = KOuter ? row0 : 0;
    tma_y0 = KOuter ? op.first_line : op.first_line + row0;
  }

  // The wgmma path's copy of MX blocks [kb, kb + KB_PER_TILE) into the swizzled `dst` (see
  // WgStage), by the one calling thread: a box of BK bytes x Rows rows, or with KOuter one of
  // BK rows x BK contraction steps per plane. The box reads zeros past the operand's tensor
  // and whatever lies beyond the tile inside it (the caller zeroes contraction steps past
  // kb_end; other rows only reach outputs that are never stored).
  __device__ __forceinline__ void tma_codes(int64_t kb, uint8_t* dst, uint64_t* bar) const {
    if constexpr (KOuter) {
#pragma unroll
      for (int p = 0; p < Rows / BK; ++p) tma_load(dst + p * BK * BK, map, tma_x0 + p * BK, tma_y0 + kb * MX_BLOCK, bar);
    } else {
      tma_load(dst, map, tma_x0 + kb * MX_BLOCK, tma_y0, bar);
    }
  }

  // Issue the copies of MX blocks [kb, kb + KB_PER_TILE) into `dst`. Rows outside the operand
  // and blocks at or past kb_end land as zeros.
  __device__ __forceinline__ void copy_codes(int64_t kb, uint8_t* dst) const {
    const int tid = threadIdx.x;
    const uint8_t* src = code + kb * code_kb;
    uint8_t* d = dst + (tid / (BK / 16)) * PITCH + (tid % (BK / 16)) * 16;
    const int64_t k = kb * MX_BLOCK + k0;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const int line = KOuter ? i % PLANE_CHUNKS : i;  // the chunk's line, in steps of LINES_APART
      const bool valid = (inside >> i & 1u) && (KOuter ? k + line * LINES_APART : k) < kb_end * MX_BLOCK;
      const uint8_t* from = src + line * code_chunk + (KOuter ? i / PLANE_CHUNKS * BK : 0);
      copy16(d + i * LINES_APART * PITCH, from, valid);
    }
  }

  // The stage's scale bytes, loaded into registers (E8M0 bytes need no 4-byte alignment, which
  // cp.async would); NO_SCALE outside the operand.
  __device__ __forceinline__ void load_scales(int64_t kb, uint32_t (&s)[SCALES]) const {
    const uint8_t* p = scale + kb * scale_kb;
#pragma unroll
    for (int i = 0; i < SCALES; ++i)
      s[i] = r0 + i * dr < rows && kb + kb0 + i * dkb < kb_end ? p[i * scale_slot] : NO_SCALE;
  }

  // The slots' rows' largest scales, from the operand's `rows_ref` (once per tile, so that
  // every stage's store_scales does without a shared-memory load).
  __device__ __forceinline__ void bind(const int32_t* rows_ref) {
#pragma unroll
    for (int i = 0; i < SCALES; ++i) ref[i] = rows_ref[r0 + i * dr] >> 23;  // the byte (see scale_ranges)
  }

  // Scale bytes -> the stage's scale words: fp32 2^(s-127) (per-block path, 1.0 outside the
  // operand), or 2^(s - the row's largest scale) as f16x2 (prescaled path, after bind).
  __device__ __forceinline__ void store_scales(uint32_t (&dst)[KB_PER_TILE][Rows], const uint32_t (&s)[SCALES],
                                               bool prescaled) const {
#pragma unroll
    for (int i = 0; i < SCALES; ++i) {
      const int r = r0 + i * dr;
      const int kb = kb0 + i * dkb;
      if (prescaled)
        dst[kb][r] = s[i] == NO_SCALE ? pow2_f16x2(0) : pow2_f16x2(static_cast<int>(s[i]) - ref[i]);
      else
        dst[kb][r] = s[i] == NO_SCALE ? __float_as_uint(1.0f) : __float_as_uint(e8m0_value(s[i]));
    }
  }
};

// Both operands' loaders of one tile (B: `StageT::B_ROWS` rows), and the scale bytes in flight
// between a stage's load (issued with its copies) and its store into shared memory (after the
// math of another stage).
template <bool AKOuter, bool BKOuter, typename StageT>
struct TileLoader {
  StageLoader<AKOuter, BM> a;
  StageLoader<BKOuter, StageT::B_ROWS> b;
  uint32_t scale_a[decltype(a)::SCALES], scale_b[decltype(b)::SCALES];

  __device__ __forceinline__ TileLoader(const Operand& op_a, int64_t a_row0, int a_rows, const Operand& op_b,
                                        int64_t b_row0, int b_rows, int64_t kb_end)
      : a(op_a, a_row0, a_rows, kb_end), b(op_b, b_row0, b_rows, kb_end) {}

  // Copies and scale loads of the stage starting at MX block kb: cp.async, or with `bar` (the
  // wgmma path, `Tma`) TMA copies issued by thread 0 that complete on it.
  template <bool Tma = false>
  __device__ __forceinline__ void issue(int64_t kb, StageT& stage, uint64_t* bar = nullptr) {
    if constexpr (Tma) {
      if (threadIdx.x == 0) {
        arrive_expect_bytes(bar, sizeof(stage.a) + sizeof(stage.b));
        a.tma_codes(kb, stage.a, bar);
        b.tma_codes(kb, stage.b, bar);
      }
    } else {
      a.copy_codes(kb, stage.a);
      b.copy_codes(kb, stage.b);
    }
    a.load_scales(kb, scale_a);
    b.load_scales(kb, scale_b);
  }

  // The scale words of the last issued stage.
  __device__ __forceinline__ void store_scales(StageT& stage, bool prescaled) const {
    a.store_scales(stage.sa, scale_a, prescaled);
    b.store_scales(stage.sb, scale_b, prescaled);
  }

  // The first `stages_ahead` stages of [kb_begin, kb_begin + tiles stages), one commit group
  // each (or completing on bars[s]); `ref_a`, `ref_b`: the rows' largest scales (prescaled path).
  template <int stages_ahead, bool Tma = false>
  __device__ __forceinline__ void prologue(StageT* stages, int64_t kb_begin, int64_t tiles, const int32_t* ref_a,
                                           const int32_t* ref_b, bool prescaled, uint64_t* bars = nullptr) {
    if (prescaled) {
      a.bind(ref_a);
      b.bind(ref_b);
    }
#pragma unroll
    for (int s = 0; s < stages_ahead; ++s) {
      if (s < tiles) {
        issue<Tma>(kb_begin + s * KB_PER_TILE, stages[s], bars + s);
        store_scales(stages[s], prescaled);
      }
      copy_commit();
    }
  }
};

// The (smallest, largest) scale byte of every row of the tile's two operands, packed lo << 8 |
// hi (row_ranges_kernel) and indexed from the tile's first row (`a`, `b`); null in builds
// without the prescaled path, which never read them.
struct RowRanges {
  const uint16_t* a;
  const uint16_t* b;
};

// Each operand row's largest scale byte into ref[] (A's BM rows, then B's `b_tile`; 0 for rows
// outside the operands), and whether every row's scales lie within MAX_SPREAD binades of it:
// the condition of the prescaled path, decided for the whole tile. ref holds the byte as the
// fp32 bits of its value (e8m0_value), which bits >> 23 turn back into the byte (0 and 255
// too): converted once here, not by every thread at each of its columns in the epilogue.
// Entry t of ref[] (see scale_ranges) from its row's packed range, or from NO_RANGE for a row
// outside the operands; whether the row's scales span more than MAX_SPREAD binades.
constexpr uint32_t NO_RANGE = 0xff00u;  // smallest 255, largest 0: never wide, ref 2^-127
__device__ __forceinline__ bool put_range(uint32_t range, int32_t* slot) {
  const int lo = static_cast<int>(range >> 8), hi = static_cast<int>(range & 0xffu);
  *slot = static_cast<int32_t>(__float_as_uint(e8m0_value(hi)));
  return hi - lo > MAX_SPREAD;
}

__device__ __forceinline__ bool scale_ranges(int a_rows, int b_rows, int b_tile, RowRanges ranges, int32_t* ref) {
  bool wide = false;
  for (int t = threadIdx.x; t < BM + b_tile; t += THREADS) {
    const bool is_a = t < BM;
    const int r = is_a ? t : t - BM;
    const uint32_t range = r < (is_a ? a_rows : b_rows) ? (is_a ? ranges.a : ranges.b)[r] : NO_RANGE;
    wide = put_range(range, ref + t) || wide;
  }
  return !__syncthreads_or(wide);
}

// Every row's (smallest, largest) scale byte, for `groups` groups of `rows` rows, packed lo << 8 |
// hi into ranges[g * rows + r]: once per call (each tile used to scan its rows again, and wait
// on that before its first stage). The MX blocks of group g: [0, kblocks) of op's group
// g (rows_kernel's weights), or with `token_ends` (wgrad), [token_ends[g-1], token_ends[g]) / 32
// of op itself.
__global__ void row_ranges_kernel(Operand op, int groups, int rows, int64_t kblocks,
                                  const int32_t* __restrict__ token_ends, uint16_t* __restrict__ ranges) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(groups) * rows) return;
  const int64_t g = i / rows, r = i % rows;
  const uint8_t* p = op.scale + r * op.srow + (token_ends ? 0 : g * op.gscale);
  const int64_t kb_begin = token_ends && g ? token_ends[g - 1] / MX_BLOCK : 0;
  const int64_t kb_end = token_ends ? token_ends[g] / MX_BLOCK : kblocks;
  int lo = 255, hi = 0;
#pragma unroll 16
  for (int64_t kb = kb_begin; kb < kb_end; ++kb) {
    const int s = p[kb * op.skb];
    lo = min(lo, s);
    hi = max(hi, s);
  }
  ranges[i] = static_cast<uint16_t>(lo << 8 | hi);
}

// Four words of four bytes (word j: byte i of line j) -> byte j of word i: a 4x4 byte transpose.
__device__ __forceinline__ void transpose4x4(const uint32_t* w, uint32_t (&t)[4]) {
  const uint32_t lo01 = __byte_perm(w[0], w[1], 0x5140), hi01 = __byte_perm(w[0], w[1], 0x7362);
  const uint32_t lo23 = __byte_perm(w[2], w[3], 0x5140), hi23 = __byte_perm(w[2], w[3], 0x7362);
  t[0] = __byte_perm(lo01, lo23, 0x5410);
  t[1] = __byte_perm(lo01, lo23, 0x7632);
  t[2] = __byte_perm(hi01, hi23, 0x5410);
  t[3] = __byte_perm(hi01, hi23, 0x7632);
}

// [contraction byte][row] -> [row][contraction byte], 4x4-byte blocks through registers.
__device__ __forceinline__ void transpose_tile(const uint8_t* src, uint8_t* dst) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < BLOCKS4_PER_THREAD; ++i) {
    const int q = tid + i * THREADS;
    const int row4 = (q % (BM / 4)) * 4;  // neighbouring threads: neighbouring words of a line
    const int k4 = (q / (BM / 4)) * 4;
    uint32_t w[4], t[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = *reinterpret_cast<const uint32_t*>(src + (k4 + j) * PITCH + row4);
    transpose4x4(w, t);
#pragma unroll
    for (int j = 0; j < 4; ++j) *reinterpret_cast<uint32_t*>(dst + (row4 + j) * PITCH + k4) = t[j];
  }
}

#if GG_MXFP8_MMA_SYNC
// Four 8x8 matrices of 16-bit pairs (here: 8 rows x 16 bytes each) from shared memory;
// thread l gives the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldmatrix_x4(const uint8_t* row, uint32_t (&r)[4]) {
  const uint32_t p = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(p));
}

// Four E4M3 codes -> f16x2 of codes (0, 1) and of codes (2, 3), each pair times `mul` (f16x2):
// the conversion is exact and so is the multiply by a power of two down to 2^-15.
__device__ __forceinline__ void e4m3x4_to_f16_scaled(uint32_t codes, uint32_t mul, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n .reg .b32 fl, fh;\n mov.b32 {l, h}, %2;\n"
      " cvt.rn.f16x2.e4m3x2 fl, l;\n cvt.rn.f16x2.e4m3x2 fh, h;\n"
      " mul.rn.f16x2 %0, fl, %3;\n mul.rn.f16x2 %1, fh, %3;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(codes), "r"(mul));
}

// Two E4M3 codes (the low 16 bits) -> f16x2 times `mul` (f16x2), exactly as above.
__device__ __forceinline__ uint32_t e4m3x2_to_f16_scaled(uint32_t codes, uint32_t mul) {
  uint32_t out;
  asm("{\n .reg .b16 l, h;\n .reg .b32 f;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 f, l;\n"
      " mul.rn.f16x2 %0, f, %2;\n}\n"
      : "=r"(out)
      : "r"(codes), "r"(mul));
  return out;
}

// acc += A (16x16, f16) . B (16x8, f16), fp32 accumulation.
__device__ __forceinline__ void mma_f16(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#if GG_MXFP8_WGMMA_HERE
// Shared-memory matrix descriptor of a K-major tile in the 128-byte swizzle (row r's 16-byte
// chunk c at r * 128 + (c ^ r % 8) * 16, 1024-byte aligned atoms of 8 rows) at shared address
// `addr`: start address, leading offset 1 (unused by this layout), stride 1024 bytes between
// 8-row atoms, mode 1.
__device__ __forceinline__ uint64_t swizzled_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) | (uint64_t{1} << 16) |
         (static_cast<uint64_t>(SWIZZLE_ATOM >> 4) << 32) | (uint64_t{1} << 62);
}

// Keeps the compiler from moving accumulator accesses across the asynchronous MMAs.
template <int Halves>
__device__ __forceinline__ void pin_acc(TileAcc<Halves>& acc) {
#pragma unroll
  for (int h = 0; h < Halves; ++h)
#pragma unroll
    for (int mi = 0; mi < FRAG_M; ++mi)
#pragma unroll
      for (int ni = 0; ni < FRAG_N; ++ni)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(acc[h][mi][ni][j])::"memory");
}

#define GG_ACC4(h, mi, ni) \
  "+f"(acc[h][mi][ni][0]), "+f"(acc[h][mi][ni][1]), "+f"(acc[h][mi][ni][2]), "+f"(acc[h][mi][ni][3])
#define GG_ACC16(h, mi) GG_ACC4(h, mi, 0), GG_ACC4(h, mi, 1), GG_ACC4(h, mi, 2), GG_ACC4(h, mi, 3)
// acc (this warpgroup's 64 x 128 Halves, fp32) += A (64 x 16, f16) . B (128 Halves x 16, f16)^T,
// both K-major in shared memory. Register 4j + e of the m64n(128 Halves) accumulator is
// acc[j / 16][j / 4 % 4][j % 4][e].
__device__ __forceinline__ void wgmma_f16(TileAcc<1>& acc, uint64_t a, uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : GG_ACC16(0, 0), GG_ACC16(0, 1), GG_ACC16(0, 2), GG_ACC16(0, 3)
      : "l"(a), "l"(b), "r"(1));
}

// The m64n256 accumulator's 128 registers, operands %0-%127 of the asm statements below.
#define GG_D128 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
  " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
  " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
  " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," \
  " %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
  " %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," \
  " %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
  " %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
#define GG_ACC128 \
  GG_ACC16(0, 0), GG_ACC16(0, 1), GG_ACC16(0, 2), GG_ACC16(0, 3), GG_ACC16(1, 0), GG_ACC16(1, 1), GG_ACC16(1, 2), GG_ACC16(1, 3)
__device__ __forceinline__ void wgmma_f16(TileAcc<2>& acc, uint64_t a, uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      GG_D128
      "%128, %129, p, 1, 1, 0, 0;\n}\n"
      : GG_ACC128
      : "l"(a), "l"(b), "r"(1));
}
// The same with A (this warp's 16 rows of the warpgroup's 64 x 16) in registers, in the
// m16n8k16 A fragment's layout (a_fragments).
__device__ __forceinline__ void wgmma_f16(TileAcc<2>& acc, const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      GG_D128
      "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
      : GG_ACC128
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
#undef GG_ACC128
#undef GG_D128
#undef GG_ACC16
#undef GG_ACC4

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}
// Orders this thread's shared-memory stores before the MMAs' (asynchronous proxy) reads.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif  // GG_MXFP8_WGMMA_HERE
#else
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

// The math of one stage for this thread's fragments, for each MX block, over every (row
// fragment, column fragment) pair in the m16n8k32 accumulator layout (rows g and g+8, columns
// 2t and 2t+1 of the fragment). Prescaled: the codes, converted to f16 and multiplied by their
// relative scales, accumulate straight into `acc` (see the header). Otherwise the block's
// 16x8 products are promoted into `acc` with the two scales.
template <bool Prescaled>
__device__ __forceinline__ void stage_math(const uint8_t* sa_codes, const uint8_t* sb_codes,
                                           const uint32_t (&sa_all)[KB_PER_TILE][BM],
                                           const uint32_t (&sb_all)[KB_PER_TILE][BN],
                                           float (&acc)[FRAG_M][FRAG_N][4]) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int wrow = (warp / (BN / WARP_N)) * WARP_M;
  const int wcol = (warp % (BN / WARP_N)) * WARP_N;
#pragma unroll KB_UNROLL
  for (int kb = 0; kb < KB_PER_TILE; ++kb) {
#if GG_MXFP8_MMA_SYNC
    // A: matrices (rows 0-7 | 8-15) x (bytes 0-15 | 16-31) = a0, a1, a2, a3 of m16n8k32.
    // B: two column fragments per load, (bytes 0-15, 16-31) of columns 0-7, then of 8-15.
    uint32_t af[FRAG_M][4];
    uint32_t bf[FRAG_N][2];
#pragma unroll
    for (int mi = 0; mi < FRAG_M; ++mi) {
      const int row = wrow + mi * 16 + lane % 8 + ((lane / 8) % 2) * 8;
      ldmatrix_x4(sa_codes + row * PITCH + kb * MX_BLOCK + (lane / 16) * 16, af[mi]);
    }
#pragma unroll
    for (int ni = 0; ni < FRAG_N; ni += 2) {
      const int col = wcol + ni * 8 + (lane / 16) * 8 + lane % 8;
      uint32_t r[4];
      ldmatrix_x4(sb_codes + col * PITCH + kb * MX_BLOCK + ((lane / 8) % 2) * 16, r);
      bf[ni][0] = r[0];
      bf[ni][1] = r[1];
      bf[ni + 1][0] = r[2];
      bf[ni + 1][1] = r[3];
    }
    if constexpr (Prescaled) {
      // m16n8k32 register j holds 4 codes: A row g (j even) or g+8 (j odd), contraction bytes
      // 4t..4t+3 (+16 for j >= 2); B column g, bytes 4t..4t+3 (+16 for j = 1). Split into
      // f16 pairs (bytes 4t, 4t+1 | 4t+2, 4t+3), they are two m16n8k16 fragments whose k
      // order is permuted alike in A and B, so the two f16 MMAs sum the same 32 products.
      uint32_t bh[FRAG_N][4];
#pragma unroll
      for (int ni = 0; ni < FRAG_N; ++ni) {
        const uint32_t mul = sb_all[kb][wcol + ni * 8 + g];
        e4m3x4_to_f16_scaled(bf[ni][0], mul, bh[ni][0], bh[ni][1]);
        e4m3x4_to_f16_scaled(bf[ni][1], mul, bh[ni][2], bh[ni][3]);
      }
#pragma unroll
      for (int mi = 0; mi < FRAG_M; ++mi) {
        const uint32_t mul_top = sa_all[kb][wrow + mi * 16 + g];
        const uint32_t mul_bottom = sa_all[kb][wrow + mi * 16 + g + 8];
        uint32_t ah[8];  // (lo, hi) pairs of registers 0..3
#pragma unroll
        for (int j = 0; j < 4; ++j)
          e4m3x4_to_f16_scaled(af[mi][j], j % 2 ? mul_bottom : mul_top, ah[2 * j], ah[2 * j + 1]);
#pragma unroll
        for (int ni = 0; ni < FRAG_N; ++ni) {
          mma_f16(acc[mi][ni], ah[0], ah[2], ah[1], ah[3], bh[ni][0], bh[ni][1]);
          mma_f16(acc[mi][ni], ah[4], ah[6], ah[5], ah[7], bh[ni][2], bh[ni][3]);
        }
      }
    }
#endif
    if constexpr (!Prescaled) {
      float sa[FRAG_M][2];
      float sb[FRAG_N][2];
#pragma unroll
      for (int mi = 0; mi < FRAG_M; ++mi) {
        sa[mi][0] = __uint_as_float(sa_all[kb][wrow + mi * 16 + g]);
        sa[mi][1] = __uint_as_float(sa_all[kb][wrow + mi * 16 + g + 8]);
      }
#pragma unroll
      for (int ni = 0; ni < FRAG_N; ++ni) {
        sb[ni][0] = __uint_as_float(sb_all[kb][wcol + ni * 8 + 2 * t]);
        sb[ni][1] = __uint_as_float(sb_all[kb][wcol + ni * 8 + 2 * t + 1]);
      }
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
          const uint8_t* top = sa_codes + (wrow + mi * 16 + g) * PITCH + kb * MX_BLOCK;
          const uint8_t* col = sb_codes + (wcol + ni * 8 + 2 * t) * PITCH + kb * MX_BLOCK;
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
}

// f(element, element, tile row, tile column) for each pair of this thread's accumulators
// at columns (c, c + 1), c even. Both layouts repeat the m16n8 accumulator fragment (rows g
// and g+8, columns 2t and 2t+1):
//   mma.sync: warp w owns rows 64 (w / 4) + [0, 64) in four fragments, columns 32 (w % 4) + [0, 32);
//   wgmma (`Wg`): warpgroup w / 4 owns rows 64 (w / 4) + [0, 64), warp w % 4 rows 16 (w % 4) + [0, 16)
//   of them, and every column: acc[mi][ni] of column half h is the m64n(128 Halves)
//   accumulator's fragment 16 h + 4 mi + ni (columns here relative to the half).
// The first row of warp `warp`'s fragments in the wgmma layout (its rows g and g + 8 add
// lane / 4): warpgroup warp / 4's rows 64 (warp / 4) + [0, 64), 16 of them per warp.
// for_each_acc_pair's accumulators and a_fragments' A rows, which must be the same.
__device__ __forceinline__ int wg_warp_row(int warp) { return (warp / 4) * WARP_M + (warp % 4) * 16; }

template <bool Wg, typename A, typename F>
__device__ __forceinline__ void for_each_acc_pair(A& acc, F f) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wrow = (Wg ? wg_warp_row(warp) : (warp / (BN / WARP_N)) * WARP_M) + lane / 4;
  const int wcol = (Wg ? 0 : (warp % (BN / WARP_N)) * WARP_N) + 2 * (lane % 4);
#pragma unroll
  for (int mi = 0; mi < FRAG_M; ++mi)
#pragma unroll
    for (int ni = 0; ni < FRAG_N; ++ni)
#pragma unroll
      for (int j = 0; j < 4; j += 2) {
        const int row = wrow + (Wg ? 0 : mi * 16) + (j / 2) * 8;
        const int col = wcol + (Wg ? (mi * FRAG_N + ni) * 8 : ni * 8);
        f(acc[mi][ni][j], acc[mi][ni][j + 1], row, col);
      }
}

// f(element, tile row, tile column) for each of this thread's accumulators (see above).
template <bool Wg, typename A, typename F>
__device__ __forceinline__ void for_each_acc(A& acc, F f) {
  for_each_acc_pair<Wg>(acc, [&](auto& v0, auto& v1, int r, int c) {
    f(v0, r, c);
    f(v1, r, c + 1);
  });
}

// acc *= 2^(ref_a[row] - 127) * 2^(ref_b[column] - 127) (ref: scale_ranges' fp32 bits): the
// prescaled path's rows' largest scales, applied once at the end (in the per-block path's
// order), in either layout.
template <bool Wg>
__device__ __forceinline__ void apply_row_scales(Acc& acc, const int32_t* ref_a, const int32_t* ref_b) {
  for_each_acc<Wg>(acc, [&](float& v, int r, int c) { v = v * __int_as_float(ref_a[r]) * __int_as_float(ref_b[c]); });
}

// acc += the MX blocks [kb_begin, kb_end) of A rows [a_row0, +a_rows) x B rows [b_row0,
// +b_rows) (at most BN), on one path (see the header; `ref_a`, `ref_b`: the rows' largest
// scales): a pipeline of SmemPlan's PB_STAGES asynchronous copies, one barrier a stage (two with a
// k-outer operand, whose tile is transposed before the math).
template <bool AKOuter, bool BKOuter, bool Prescaled, int PerSM>
__device__ __forceinline__ void tile_pipeline(uint8_t* smem, const Operand& a, int64_t a_row0, int a_rows,
                                              const Operand& b, int64_t b_row0, int b_rows, int64_t kb_begin,
                                              int64_t kb_end, const int32_t* ref_a, const int32_t* ref_b,
                                              float (&acc)[FRAG_M][FRAG_N][4]) {
  using Plan = SmemPlan<1, PerSM>;
  constexpr int PB_STAGES = Plan::PB_STAGES;
  Stage* stages = reinterpret_cast<Stage*>(smem);
  uint8_t* work = smem + PB_STAGES * sizeof(Stage);  // transposed k-outer tiles: A's, then B's
  const int64_t tiles = (kb_end - kb_begin + KB_PER_TILE - 1) / KB_PER_TILE;
  TileLoader<AKOuter, BKOuter, Stage> loader(a, a_row0, a_rows, b, b_row0, b_rows, kb_end);
  loader.template prologue<PB_STAGES - 1>(stages, kb_begin, tiles, ref_a, ref_b, Prescaled);
  for (int64_t i = 0; i < tiles; ++i) {
    copy_wait<PB_STAGES - 2>();
    __syncthreads();  // stage i has landed for every thread; stage i - 1 is no longer read
    const int64_t next = i + PB_STAGES - 1;
    Stage& upcoming = stages[next % PB_STAGES];
    if (next < tiles) loader.issue(kb_begin + next * KB_PER_TILE, upcoming);
    copy_commit();
    Stage& current = stages[i % PB_STAGES];
    uint8_t* work_b = !AKOuter ? work : Plan::ONE_WORK ? current.a : work + TILE_BYTES;
    if (AKOuter || BKOuter) {
      if (AKOuter) transpose_tile(current.a, work);
      if (AKOuter && BKOuter && Plan::ONE_WORK) __syncthreads();  // A's codes have left current.a
      if (BKOuter) transpose_tile(current.b, work_b);
      __syncthreads();
    }
    stage_math<Prescaled>(AKOuter ? work : current.a, BKOuter ? work_b : current.b, current.sa, current.sb, acc);
    if (next < tiles) loader.store_scales(upcoming, Prescaled);  // the loads had the math to arrive
  }
  copy_wait<0>();
  if constexpr (Prescaled) apply_row_scales<false>(acc, ref_a, ref_b);
  __syncthreads();  // the caller may reuse shared memory
}

#if GG_MXFP8_WGMMA_HERE
// 8 f16 (16 bytes) as chunk c of row r of a 128-byte-swizzled f16 tile (see swizzled_desc).
__device__ __forceinline__ void store_f16_chunk(uint8_t* tile, int r, int c, uint4 v) {
  *reinterpret_cast<uint4*>(tile + r * SWIZZLE_ROW + ((c ^ (r % 8)) * 16)) = v;
}

// The calling thread's share of half `h` of a swizzled stage (WgStage; contraction steps
// [64 h, 64 h + 64)) of one operand of `Rows` rows: its words of codes and their relative scales (`mul`, f16x2
// words from store_scales). Contraction-major: 16-code runs of one row. k-outer: blocks of
// four rows by eight steps, byte-transposed in registers. All of a half's shared-memory loads
// are issued before any conversion: the compiler cannot move them above the f16 stores (it
// cannot tell the two apart), and waiting on each load in turn was the largest stall of the
// loop (ncu).
//   `Parts` splits the work into that many load-then-store rounds (fewer live registers).
//   `Permuted` (contraction-major only) writes each 16-step group in a_fragments' order:
// steps (4t, 4t+1) at 2t and (4t+2, 4t+3) at 2t + 8, so that A taken that way from registers
// meets B's steps in the same order (the mma.sync prescaled path pairs them alike).
template <bool KOuter, int Rows, int Parts = 1, bool Permuted = false>
struct HalfCodes {
  static_assert(!(KOuter && Permuted), "k-outer B keeps the natural order (a_fragments reads A to match)");
  static_assert(THREADS % Rows == 0 || Rows % THREADS == 0, "whole rows per thread");
  static constexpr int RUNS = Rows * HALF_K / 16 / THREADS / Parts;         // contraction-major
  static constexpr int BLOCKS = Rows / 4 * (HALF_K / 8) / THREADS / Parts;  // k-outer
  uint32_t w[KOuter ? 8 * BLOCKS : 4 * RUNS];
  uint32_t mul[KOuter ? 4 * BLOCKS : RUNS];
  int row;  // contraction-major: the row; k-outer: the first of four
  int rot;  // k-outer: w holds rows in an order rotated by rot (see store)

  __device__ __forceinline__ void load(const uint8_t* codes, const uint32_t (&scale)[KB_PER_TILE][Rows], int h,
                                       int part = 0) {
    const int tid = threadIdx.x + part * (KOuter ? BLOCKS : RUNS) * THREADS;  // the part's first item
    if constexpr (!KOuter) {
      row = tid % Rows;  // a quarter warp: eight rows, whose same chunk the swizzle puts in eight bank groups
#pragma unroll
      for (int i = 0; i < RUNS; ++i) {
        const int k = h * HALF_K + ((tid + i * THREADS) / Rows) * 16;
        const uint4 v = *reinterpret_cast<const uint4*>(codes + swizzled(row, k));
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        mul[i] = scale[k / MX_BLOCK][row];
      }
    } else {
      row = (tid % (Rows / 4)) * 4;  // neighbouring threads: neighbouring words of a line
      // Rows are stored in an order rotated by `rot`, so that the eight 16-byte stores of a
      // quarter warp fall in eight distinct chunks (rows 4q + i alone share two swizzle phases).
      rot = (tid / 2) % 4;
#pragma unroll
      for (int b = 0; b < BLOCKS; ++b) {
        const int k = h * HALF_K + ((tid + b * THREADS) / (Rows / 4)) * 8;
        const uint8_t* plane = codes + row / BK * (BK * BK);
#pragma unroll
        for (int j = 0; j < 8; ++j) w[8 * b + j] = *reinterpret_cast<const uint32_t*>(plane + swizzled(k + j, row % BK));
#pragma unroll
        for (int i = 0; i < 4; ++i) mul[4 * b + i] = scale[k / MX_BLOCK][row + ((i + rot) & 3)];
      }
    }
  }

  // Convert to f16 times `mul` into the swizzled tile `dst`.
  __device__ __forceinline__ void store(uint8_t* dst, int part = 0) {
    const int tid = threadIdx.x + part * (KOuter ? BLOCKS : RUNS) * THREADS;
    if constexpr (!KOuter) {
#pragma unroll
      for (int i = 0; i < RUNS; ++i) {
        const int run = (tid + i * THREADS) / Rows;
        uint4 lo, hi;
        if constexpr (Permuted) {
          e4m3x4_to_f16_scaled(w[4 * i], mul[i], lo.x, hi.x);
          e4m3x4_to_f16_scaled(w[4 * i + 1], mul[i], lo.y, hi.y);
          e4m3x4_to_f16_scaled(w[4 * i + 2], mul[i], lo.z, hi.z);
          e4m3x4_to_f16_scaled(w[4 * i + 3], mul[i], lo.w, hi.w);
        } else {
          e4m3x4_to_f16_scaled(w[4 * i], mul[i], lo.x, lo.y);
          e4m3x4_to_f16_scaled(w[4 * i + 1], mul[i], lo.z, lo.w);
          e4m3x4_to_f16_scaled(w[4 * i + 2], mul[i], hi.x, hi.y);
          e4m3x4_to_f16_scaled(w[4 * i + 3], mul[i], hi.z, hi.w);
        }
        store_f16_chunk(dst, row, 2 * run, lo);
        store_f16_chunk(dst, row, 2 * run + 1, hi);
      }
    } else {
#pragma unroll
      for (int b = 0; b < BLOCKS; ++b) {
        const int step8 = (tid + b * THREADS) / (Rows / 4);
        uint32_t lo[4], hi[4];
        uint32_t* v8 = w + 8 * b;
#pragma unroll
        for (int j = 0; j < 8; ++j) v8[j] = __funnelshift_r(v8[j], v8[j], 8 * rot);  // byte i: row + (i + rot) % 4
        transpose4x4(v8, lo);  // lo[i]: row + (i + rot) % 4, steps 0..3 of the eight
        transpose4x4(v8 + 4, hi);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint4 v;
          e4m3x4_to_f16_scaled(lo[i], mul[4 * b + i], v.x, v.y);
          e4m3x4_to_f16_scaled(hi[i], mul[4 * b + i], v.z, v.w);
          store_f16_chunk(dst, row + ((i + rot) & 3), step8, v);
        }
      }
    }
  }
};

// This thread's A fragments of half `h` of a contraction-major code stage (GG_MXFP8_REG_A): for
// each k16 step s, the m16n8k16 A fragment of its warp's 16 rows of its warpgroup's 64 (rows
// g and g + 8, g = lane / 4), converted to f16 times the rows' relative scales. `Permuted`:
// registers 0 / 2 (row g) and 1 / 3 (row g + 8) take the f16 pairs of one 4-code word, steps
// 4t..4t+3 (t = lane % 4; B written alike: HalfCodes); else the natural steps (2t, 2t+1) and
// (2t + 8, 2t + 9), two codes a load (a k-outer B is not rewritten). The stage's swizzle puts
// the eight rows g of a load in eight 16-byte bank groups: no bank conflicts either way.
template <bool Permuted>
__device__ __forceinline__ void a_fragments(const uint8_t* codes, const uint32_t (&scale)[KB_PER_TILE][BM], int h,
                                            uint32_t (&a)[HALF_K / 16][4]) {
  const int lane = threadIdx.x % 32;
  const int row = wg_warp_row(threadIdx.x / 32) + lane / 4;
  const int t = lane % 4;
#pragma unroll
  for (int s = 0; s < HALF_K / 16; ++s) {
    const int k = h * HALF_K + 16 * s;
    const uint32_t top = scale[k / MX_BLOCK][row], bottom = scale[k / MX_BLOCK][row + 8];
    if constexpr (Permuted) {
      const uint32_t w0 = *reinterpret_cast<const uint32_t*>(codes + swizzled(row, k + 4 * t));
      const uint32_t w1 = *reinterpret_cast<const uint32_t*>(codes + swizzled(row + 8, k + 4 * t));
      e4m3x4_to_f16_scaled(w0, top, a[s][0], a[s][2]);
      e4m3x4_to_f16_scaled(w1, bottom, a[s][1], a[s][3]);
    } else {
      const auto pair = [&](int r, int step) -> uint32_t {
        return *reinterpret_cast<const uint16_t*>(codes + swizzled(r, k + step));
      };
      a[s][0] = e4m3x2_to_f16_scaled(pair(row, 2 * t), top);
      a[s][1] = e4m3x2_to_f16_scaled(pair(row + 8, 2 * t), bottom);
      a[s][2] = e4m3x2_to_f16_scaled(pair(row, 2 * t + 8), top);
      a[s][3] = e4m3x2_to_f16_scaled(pair(row + 8, 2 * t + 8), bottom);
    }
  }
}

// Zeros in the contraction steps [steps, BK) of a swizzled stage of `Rows` rows (past the
// tile's contraction: TMA copied whatever lies there, another group's rows or tokens).
template <bool KOuter, int Rows>
__device__ __forceinline__ void zero_past(uint8_t* codes, int steps) {
  static_assert(Rows * 8 % THREADS == 0, "whole 16-byte chunks per thread");
#pragma unroll
  for (int i = 0; i < Rows * 8 / THREADS; ++i) {
    const int t = threadIdx.x + i * THREADS;  // line t / 8 (of planes of BK when k-outer), chunk t % 8
    const int line = t / 8;
    if ((KOuter ? line % BK : t % 8 * 16) >= steps)
      *reinterpret_cast<uint4*>(codes + (KOuter ? t * 16 : swizzled(line, t % 8 * 16))) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// The prescaled path on wgmma: a pipeline of code stages like tile_pipeline's (SmemPlan's
// WG_STAGES deep, B's Halves BN rows), each stage converted, half by half, into f16 tiles in
// shared memory that two warpgroups multiply asynchronously (m64n128k16 or m64n256k16;
// warpgroup w: rows 64 w + [0, 64), every column): with two f16 buffers (one block a SM) while
// the threads convert the next half, with one (two blocks a SM) before they do.
// acc[h] holds columns h BN + [0, BN) in for_each_acc's wgmma layout.
// The wgmma path's code stages, at the first swizzle-aligned byte of the dynamic shared memory.
template <int Halves>
__device__ __forceinline__ WgStage<Halves>* wg_stages(uint8_t* smem) {
  const uint32_t offset = smem_addr(smem) % SWIZZLE_ATOM;
  return reinterpret_cast<WgStage<Halves>*>(smem + (offset ? SWIZZLE_ATOM - offset : 0));
}

// The stage loop of a tile: its stages [0, tiles), stage i in stages[i % WG_STAGES] landing on
// barrier i % WG_STAGES (at shared address `bars_at`, freshly initialized), the first
// WG_STAGES - 1 issued and their scale words stored by the caller.
template <bool AKOuter, bool BKOuter, int Halves, int PerSM>
__device__ __forceinline__ void wgmma_stages(WgStage<Halves>* stages, uint32_t bars_at,
                                             TileLoader<AKOuter, BKOuter, WgStage<Halves>>& loader, int64_t kb_begin,
                                             int64_t kb_end, const int32_t* ref, TileAcc<Halves>& acc) {
  using StageT = WgStage<Halves>;
  using Plan = SmemPlan<Halves, PerSM>;
  constexpr int WG_STAGES = Plan::WG_STAGES;
  constexpr int F16_B = Halves * F16_A;
  uint8_t* f16 = reinterpret_cast<uint8_t*>(stages + WG_STAGES);  // buffer h (of F16_BUFS): A, then B
  const int32_t* ref_a = ref;
  const int32_t* ref_b = ref + BM;
  // A from registers (GG_MXFP8_REG_A): fwd / dgrad, whose A is contraction-major; B's f16 then
  // in a_fragments' order where B is contraction-major too (fwd).
  constexpr bool REG_A = GG_MXFP8_REG_A && !AKOuter && Halves == 2;
  constexpr bool PERMUTED = REG_A && !BKOuter;
  const int warpgroup = threadIdx.x / 128;
  const int64_t tiles = (kb_end - kb_begin + KB_PER_TILE - 1) / KB_PER_TILE;
  uint64_t* bars = reinterpret_cast<uint64_t*>(__cvta_shared_to_generic(bars_at));
  pin_acc(acc);
  const uint32_t f16_at = smem_addr(f16);
  // Bit s: the parity of bars[s]'s next phase, flipped at each wait (no division by the stage
  // count at every stage).
  uint32_t phases = 0;
  for (int64_t i = 0; i < tiles; ++i) {
    StageT& current = stages[i % WG_STAGES];
    const uint32_t s = static_cast<uint32_t>(i % WG_STAGES);
    bar_wait(bars_at + s * static_cast<uint32_t>(sizeof(uint64_t)), (phases >> s) & 1u);
    phases ^= 1u << s;
    const int64_t steps_left = (kb_end - kb_begin - i * KB_PER_TILE) * MX_BLOCK;
    if (steps_left < BK) {  // the tile's last stage reaches past its contraction
      zero_past<AKOuter, BM>(current.a, static_cast<int>(steps_left));
      zero_past<BKOuter, StageT::B_ROWS>(current.b, static_cast<int>(steps_left));
      fence_async_shared();  // before a later TMA copy into this stage
    }
    // Stage i has landed (and its zeros are written) for every thread, stage i - 1 is no
    // longer read, and every warpgroup has retired the MMAs that read f16 buffer 0 (waited
    // below).
    __syncthreads();
    const int64_t next = i + WG_STAGES - 1;
    StageT& upcoming = stages[next % WG_STAGES];
    if (next < tiles) loader.template issue<true>(kb_begin + next * KB_PER_TILE, upcoming, bars + next % WG_STAGES);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int buf = Plan::F16_BUFS == 2 ? h : 0;
      uint8_t* fa = f16 + buf * (F16_A + F16_B);
      uint8_t* fb = fa + F16_A;
      const uint32_t fa_at = f16_at + buf * (F16_A + F16_B), fb_at = fa_at + F16_A;
      HalfCodes<AKOuter, BM> ca;
      HalfCodes<BKOuter, Halves * BN, Halves, PERMUTED> cb;  // B's rows in Halves rounds: fewer live registers
      uint32_t af[HALF_K / 16][4];                              // REG_A: this half's A fragments
      if constexpr (Plan::F16_BUFS == 1) {
        // One buffer: every MMA has retired (waited below), so nothing is left to overlap the
        // loads with, and converting one operand at a time holds fewer registers.
        if (h == 1) __syncthreads();  // every warpgroup has retired the MMAs that read the buffer
        if constexpr (REG_A) {
          a_fragments<PERMUTED>(current.a, current.sa, h, af);
        } else {
          ca.load(current.a, current.sa, h);
          ca.store(fa);
        }
        cb.load(current.b, current.sb, h, 0);
        cb.store(fb, 0);
      } else {
        if constexpr (REG_A)
          a_fragments<PERMUTED>(current.a, current.sa, h, af);
        else
          ca.load(current.a, current.sa, h);
        cb.load(current.b, current.sb, h, 0);
        if (h == 1) __syncthreads();  // every warpgroup has retired the MMAs that read buffer 1
        if constexpr (!REG_A) ca.store(fa);
        cb.store(fb, 0);
      }
#pragma unroll
      for (int part = 1; part < Halves; ++part) {
        cb.load(current.b, current.sb, h, part);
        cb.store(fb, part);
      }
      fence_async_shared();
      __syncthreads();
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < HALF_K / 16; ++s) {
        if constexpr (REG_A)
          wgmma_f16(acc, af[s], swizzled_desc(fb_at + s * 32));
        else
          wgmma_f16(acc, swizzled_desc(fa_at + warpgroup * WARP_M * SWIZZLE_ROW + s * 32), swizzled_desc(fb_at + s * 32));
      }
      wgmma_commit();
      wgmma_wait<Plan::F16_BUFS - 1>();  // the other buffer's MMAs are done (with one, all are)
    }
    if (next < tiles) loader.store_scales(upcoming, true);
  }
  wgmma_wait<0>();
  pin_acc(acc);
#pragma unroll
  for (int h = 0; h < Halves; ++h) apply_row_scales<true>(acc[h], ref_a, ref_b + h * BN);
  __syncthreads();  // the caller may reuse shared memory
}

// One tile on the wgmma path from scratch: barriers, loader, prologue, stage loop.
template <bool AKOuter, bool BKOuter, int Halves, int PerSM>
__device__ __forceinline__ void wgmma_pipeline(uint8_t* smem, const Operand& a, int64_t a_row0, int a_rows,
                                               const Operand& b, int64_t b_row0, int b_rows, int64_t kb_begin,
                                               int64_t kb_end, const int32_t* ref, TileAcc<Halves>& acc) {
  using StageT = WgStage<Halves>;
  constexpr int WG_STAGES = SmemPlan<Halves, PerSM>::WG_STAGES;
  StageT* stages = wg_stages<Halves>(smem);
  const int64_t tiles = (kb_end - kb_begin + KB_PER_TILE - 1) / KB_PER_TILE;
  __shared__ uint64_t bars[WG_STAGES];  // stage s has landed: a phase of bars[s]
  bars_init(bars, WG_STAGES);
  __syncthreads();
  TileLoader<AKOuter, BKOuter, StageT> loader(a, a_row0, a_rows, b, b_row0, b_rows, kb_end);
  loader.template prologue<WG_STAGES - 1, true>(stages, kb_begin, tiles, ref, ref + BM, true, bars);
  // The barriers' shared address kept in a register (opaque to ptxas, which otherwise
  // re-derived it from the CTA's id at every stage: with the LEA after it, 7 % of the stall
  // samples, by ncu).
  wgmma_stages<AKOuter, BKOuter, Halves, PerSM>(stages, opaque(smem_addr(bars)), loader, kb_begin, kb_end, ref, acc);
}
#endif  // GG_MXFP8_WGMMA_HERE

// Pass h of the per-block (or mma.sync prescaled) path over B rows b_row0 + h BN + [0, rows)
// (see tile_product), into `acc`, then handed to store.
template <bool AKOuter, bool BKOuter, int PerSM, typename Store>
__device__ __forceinline__ void column_pass(uint8_t* smem, const Operand& a, int64_t a_row0, int a_rows,
                                            const Operand& b, int64_t b_row0, int h, int rows, int64_t kb_begin,
                                            int64_t kb_end, bool prescaled, const int32_t* ref, Acc& acc,
                                            Store& store) {
  for_each_acc<false>(acc, [](float& v, int, int) { v = 0.0f; });
  if (kb_end > kb_begin) {
    const int32_t* ref_b = ref + BM + h * BN;
    constexpr bool MMA_PRESCALED = PRESCALE && !GG_MXFP8_WGMMA_HERE;  // the prescaled path on mma.sync
    if (MMA_PRESCALED && prescaled)
      tile_pipeline<AKOuter, BKOuter, MMA_PRESCALED, PerSM>(smem, a, a_row0, a_rows, b, b_row0 + h * BN, rows,
                                                            kb_begin, kb_end, ref, ref_b, acc);
    else
      tile_pipeline<AKOuter, BKOuter, false, PerSM>(smem, a, a_row0, a_rows, b, b_row0 + h * BN, rows, kb_begin,
                                                    kb_end, ref, ref_b, acc);
  }
  store(acc, false, h * BN);
}

// column_pass as a call of its own, with accumulators of its own: inlined at two blocks a SM
// (128 registers), the per-block path made ptxas spill the wgmma path's state too (388 bytes
// spilled against 80).
template <bool AKOuter, bool BKOuter, int PerSM, typename Store>
__device__ __noinline__ void column_pass_call(uint8_t* smem, const Operand& a, int64_t a_row0, int a_rows,
                                              const Operand& b, int64_t b_row0, int h, int rows, int64_t kb_begin,
                                              int64_t kb_end, bool prescaled, const int32_t* ref, Store store) {
  Acc acc;
  column_pass<AKOuter, BKOuter, PerSM>(smem, a, a_row0, a_rows, b, b_row0, h, rows, kb_begin, kb_end, prescaled, ref,
                                       acc, store);
}

// The product of the block's tile (A rows [a_row0, +a_rows) x B rows [b_row0, +b_rows), at most
// Halves BN) over MX blocks [kb_begin, kb_end), handed to store(acc, wg_layout, c0) as
// accumulators of the columns from c0: on the wgmma path where the tile's scale ranges allow
// it (every half at once, a TileAcc), else in column passes, one per column half (an Acc).
template <bool AKOuter, bool BKOuter, int Halves, int PerSM, typename Store>
__device__ __forceinline__ void tile_product(uint8_t* smem, const Operand& a, int64_t a_row0, int a_rows,
                                             const Operand& b, int64_t b_row0, int b_rows, int64_t kb_begin,
                                             int64_t kb_end, RowRanges ranges, Store store) {
  __shared__ int32_t ref[BM + Halves * BN];
  TileAcc<Halves> acc;
  const bool prescaled = PRESCALE && kb_end > kb_begin && scale_ranges(a_rows, b_rows, Halves * BN, ranges, ref);
#if GG_MXFP8_WGMMA_HERE
  if (prescaled) {
#pragma unroll
    for (int h = 0; h < Halves; ++h) for_each_acc<false>(acc[h], [](float& v, int, int) { v = 0.0f; });
    wgmma_pipeline<AKOuter, BKOuter, Halves, PerSM>(smem, a, a_row0, a_rows, b, b_row0, b_rows, kb_begin, kb_end, ref, acc);
    store(acc, true, 0);
    return;
  }
#endif
#pragma unroll 1
  for (int h = 0; h < Halves; ++h) {
    const int rows = min(BN, b_rows - h * BN);
    if (h > 0 && rows <= 0) break;
    if constexpr (PerSM > 1)
      column_pass_call<AKOuter, BKOuter, PerSM>(smem, a, a_row0, a_rows, b, b_row0, h, rows, kb_begin, kb_end,
                                                prescaled, ref, store);
    else
      column_pass<AKOuter, BKOuter, PerSM>(smem, a, a_row0, a_rows, b, b_row0, h, rows, kb_begin, kb_end, prescaled,
                                           ref, acc[0], store);
  }
}

// The epilogue's staging tile in shared memory: BM rows of H BN values of S (the output's type,
// or fp32 where the output is bf16 and is added into, which must round once, after the sum).
// Each 16-byte unit row r holds four accumulator pairs of a fragment row (a 32-byte unit for
// fp32); units are XOR-swizzled by row so that the fragments' eight rows, and a row's
// consecutive 16-byte chunks read back, fall in distinct banks.
template <typename S, int H>
struct Staging {
  static constexpr int ROW = H * BN * static_cast<int>(sizeof(S));  // bytes a row
  static constexpr int UNIT = 8 * static_cast<int>(sizeof(S));  // four pairs of one fragment row
  static constexpr int PERIOD = 128 / UNIT;                     // rows one 128-byte wavefront spans
  static constexpr int BYTES = BM * ROW;
  __device__ __forceinline__ static int offset(int r, int byte) {
    return r * ROW + ((byte / UNIT) ^ (r % PERIOD)) * UNIT + byte % UNIT;
  }
};

// Every SmemPlan's dynamic shared memory holds the larger (fp32) staging tile of its column
// halves: one on the per-block path, every half on wgmma's.
static_assert(Staging<float, 1>::BYTES <= SmemPlan<1, 1>::bytes(0, false) &&
                  Staging<float, 1>::BYTES <= SmemPlan<1, WGRAD_PER_SM>::bytes(0, false) &&
                  Staging<float, ROWS_HALVES>::BYTES <= SmemPlan<ROWS_HALVES, ROWS_PER_SM>::bytes(0, WGMMA_BUILD),
              "the staging tile fits every plan");

// Out's value of S written into the staging tile: a pair of bf16 is rounded here (the same
// conversion OutStore's pair store makes), anything else is kept.
template <typename S>
__device__ __forceinline__ void stage_pair(uint8_t* at, float v0, float v1);
template <>
__device__ __forceinline__ void stage_pair<float>(uint8_t* at, float v0, float v1) {
  *reinterpret_cast<float2*>(at) = make_float2(v0, v1);
}
template <>
__device__ __forceinline__ void stage_pair<uint16_t>(uint8_t* at, float v0, float v1) {
  *reinterpret_cast<uint32_t*>(at) = OutStore<uint16_t>::pack2(v0, v1);
}

// A staged run of columns [c, c + E) (E: one 16-byte store of OutT), whose bytes start at
// `src` (one swizzle unit holds them), to dst, or added into it. Whole runs inside out go out
// as one 16-byte access where out's rows keep them aligned (`vec`), others element by
// element, bounded by `cols`.
template <typename OutT, typename S>
__device__ __forceinline__ void write_run(const uint8_t* src, int c, OutT* dst, int cols, bool vec, bool accumulate) {
  constexpr int E = 16 / static_cast<int>(sizeof(OutT));
  constexpr int WORDS = E * static_cast<int>(sizeof(S)) / 16;  // 16-byte loads of the staged run
  uint4 staged[WORDS];
#pragma unroll
  for (int w = 0; w < WORDS; ++w) staged[w] = *reinterpret_cast<const uint4*>(src + 16 * w);
  const S* v = reinterpret_cast<const S*>(staged);
  if constexpr (sizeof(S) == sizeof(OutT)) {  // staged as out's values: bits copied, or added in fp32
    if (!accumulate && vec && c + E <= cols) {
      *reinterpret_cast<uint4*>(dst) = staged[0];
      return;
    }
  }
  const auto value = [&](int e) -> float {
    if constexpr (sizeof(S) == sizeof(OutT) && sizeof(S) == 2) return OutStore<uint16_t>::load(reinterpret_cast<const uint16_t*>(v) + e);
    else return static_cast<float>(v[e]);
  };
  if (vec && c + E <= cols) {  // one 16-byte store (after one 16-byte load when added into)
    alignas(16) OutT old[E];  // 16-byte accesses below
    alignas(16) OutT res[E];
    if (accumulate) *reinterpret_cast<uint4*>(old) = *reinterpret_cast<const uint4*>(dst);
#pragma unroll
    for (int e = 0; e < E; e += 2) {
      float v0 = value(e), v1 = value(e + 1);
      if (accumulate) {
        const float2 o = OutStore<OutT>::load2(old + e);
        v0 += o.x;
        v1 += o.y;
      }
      OutStore<OutT>::store2(res + e, v0, v1);
    }
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(res);
    return;
  }
#pragma unroll
  for (int e = 0; e < E; ++e) {
    if (c + e >= cols) break;
    if constexpr (sizeof(S) == sizeof(OutT) && sizeof(S) == 2) {
      if (!accumulate) {
        dst[e] = reinterpret_cast<const uint16_t*>(v)[e];  // the staged bits, already rounded
        continue;
      }
    }
    OutStore<OutT>::store(dst + e, accumulate ? value(e) + OutStore<OutT>::load(dst + e) : value(e));
  }
}

// Write (or add into, when `accumulate`) the valid part of the block's tile of H column halves
// (acc[h]: columns h BN + [0, BN)): rows < rows, columns < cols, at out[r * ldo + c];
// `wg_layout` as tile_product returned. The accumulators
// go to a staging tile in shared memory first (free once the tile's math is done), then out
// row by row in 16-byte runs: written straight from the fragments, each warp store touched
// eight rows 16 bytes at a time, and a wgrad tile of one stage spent a third of its stall
// samples waiting on those stores (H100 source counters, docs/performance.md).
template <typename OutT, typename S, int H>
__device__ __forceinline__ void store_staged(uint8_t* staging, const TileAcc<H>& acc, OutT* out, int64_t ldo,
                                             int rows, int cols, bool accumulate, bool wg_layout) {
#pragma unroll
  for (int h = 0; h < H; ++h) {
    const auto put = [&](float v0, float v1, int r, int c) {
      stage_pair<S>(staging + Staging<S, H>::offset(r, (h * BN + c) * static_cast<int>(sizeof(S))), v0, v1);
    };
    if (GG_MXFP8_WGMMA_HERE && wg_layout)
      for_each_acc_pair<true>(acc[h], put);
    else
      for_each_acc_pair<false>(acc[h], put);
  }
  __syncthreads();
  // A thread keeps one run of columns and steps down the rows, PASS at a time: its staged run
  // moves by PASS rows of the staging tile (PASS is a multiple of the swizzle's period) and its
  // destination by PASS rows of out, so no index is divided again (the write-out loop was a
  // sixth of the one-stage wgrad tile's instructions with its 64-bit index math; H200 counters).
  using Tile = Staging<S, H>;
  constexpr int E = 16 / static_cast<int>(sizeof(OutT));
  constexpr int RUNS = H * BN / E;       // 16-byte runs a row
  constexpr int PASS = THREADS / RUNS;  // rows a pass of the block
  static_assert(THREADS % RUNS == 0 && PASS % Tile::PERIOD == 0, "a thread's run keeps its column and swizzle phase");
  static_assert(E * sizeof(S) <= Tile::UNIT, "a run lies in one swizzle unit");
  const bool vec = (ldo * static_cast<int64_t>(sizeof(OutT))) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int live = rows < BM ? rows : BM;
  const int r0 = threadIdx.x / RUNS, c = threadIdx.x % RUNS * E;
  if (c < cols) {
    const uint8_t* src = staging + Tile::offset(r0, c * static_cast<int>(sizeof(S)));
    OutT* dst = out + static_cast<int64_t>(r0) * ldo + c;
    const int64_t dst_pass = PASS * ldo;
#pragma unroll 1  // unrolled, the fp32 rows kernels spilled (255 registers)
    for (int r = r0; r < live; r += PASS, src += PASS * Tile::ROW, dst += dst_pass)
      write_run<OutT, S>(src, c, dst, cols, vec, accumulate);
  }
  __syncthreads();  // the staging tile is read: shared memory is the caller's again
}

// store_staged of out's values, or of fp32 where bf16 is added into (rounded once, after the sum).
template <typename OutT, int H>
__device__ __forceinline__ void store_tile(uint8_t* staging, const TileAcc<H>& acc, OutT* out, int64_t ldo, int rows,
                                           int cols, bool accumulate, bool wg_layout) {
  if (sizeof(OutT) == 2 && accumulate)
    store_staged<OutT, float, H>(staging, acc, out, ldo, rows, cols, true, wg_layout);
  else
    store_staged<OutT, OutT, H>(staging, acc, out, ldo, rows, cols, accumulate, wg_layout);
}
template <typename OutT>
__device__ __forceinline__ void store_tile(uint8_t* staging, const Acc& acc, OutT* out, int64_t ldo, int rows,
                                           int cols, bool accumulate, bool wg_layout) {
  store_tile<OutT, 1>(staging, reinterpret_cast<const TileAcc<1>&>(acc), out, ldo, rows, cols, accumulate, wg_layout);
}

// fwd / dgrad. Group g owns rows [row_ends[g-1], row_ends[g]) of A and out; B's group g is
// group_operand(b, g), whose rows are out's columns. tile_ends[g] is the cumulative count of
// BM-row tiles through group g. blockIdx.x enumerates (row tile, TILE_N-column tile) with the column
// tiles of a row tile adjacent, so blocks running together share their A rows and their
// group's B in L2 (blocks past the last row tile exit). Everything is read on the device: no
// host sync, graph-capturable.
template <typename OutT, bool BKOuter>
__global__ void __launch_bounds__(THREADS, ROWS_PER_SM)
    rows_kernel(Operand a, Operand b, const int32_t* __restrict__ row_ends, const int32_t* __restrict__ tile_ends,
                int groups, int ncols, int64_t kblocks, const uint16_t* a_ranges, const uint16_t* b_ranges,
                OutT* __restrict__ out, const GG_GRID_CONSTANT TensorMap map_a,
                const GG_GRID_CONSTANT TensorMap map_b) {
  extern __shared__ __align__(16) uint8_t smem[];
  a.map = &map_a;
  b.map = &map_b;
  constexpr int TILE_N = ROWS_HALVES * BN;
  const int col_tiles = (ncols + TILE_N - 1) / TILE_N;
  const int tile = static_cast<int>(blockIdx.x / col_tiles);
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
  const int col0 = static_cast<int>(blockIdx.x % col_tiles) * TILE_N;
  const int cols = min(TILE_N, ncols - col0);
  // a_ranges: A's rows (row_ranges_kernel over A); b_ranges: every group's B rows; or null.
  const RowRanges ranges{a_ranges ? a_ranges + row0 : nullptr,
                         b_ranges ? b_ranges + static_cast<int64_t>(g) * ncols + col0 : nullptr};
  tile_product<false, BKOuter, ROWS_HALVES, ROWS_PER_SM>(smem, a, row0, rows, group_operand(b, g), col0, cols, 0, kblocks, ranges,
                               [&](const auto& acc, bool wg, int c0) {
                                 store_tile(smem, acc, out + row0 * ncols + col0 + c0, ncols, rows, cols - c0, false, wg);
                               });
}

// wgrad. out[g] (nrows x ncols) = A[:, tokens of g] . B[:, tokens of g]^T, where group g's
// (padded, 32-aligned) tokens are [pad_ends[g-1], pad_ends[g]). blockIdx = (column tile,
// row tile, group); a column tile is TILE_N wide. A group without tokens writes zeros (or leaves
// out untouched).
template <typename OutT, bool KOuter>
__global__ void __launch_bounds__(THREADS, WGRAD_PER_SM)
    wgrad_kernel(Operand a, Operand b, const int32_t* __restrict__ pad_ends, int nrows, int ncols,
                 const uint16_t* a_ranges, const uint16_t* b_ranges, OutT* __restrict__ out, bool accumulate,
                 const GG_GRID_CONSTANT TensorMap map_a, const GG_GRID_CONSTANT TensorMap map_b) {
  extern __shared__ __align__(16) uint8_t smem[];
  a.map = &map_a;
  b.map = &map_b;
  const int g = blockIdx.z;
  const int64_t t0 = g ? pad_ends[g - 1] : 0;
  const int64_t t1 = pad_ends[g];
  const int row0 = blockIdx.y * BM;
  constexpr int TILE_N = WGRAD_HALVES * BN;
  const int col0 = blockIdx.x * TILE_N;
  const int rows = min(BM, nrows - row0);
  const int cols = min(TILE_N, ncols - col0);
  // Each group's rows' scale ranges over its tokens (row_ranges_kernel), or null.
  const RowRanges ranges{a_ranges ? a_ranges + static_cast<int64_t>(g) * nrows + row0 : nullptr,
                         b_ranges ? b_ranges + static_cast<int64_t>(g) * ncols + col0 : nullptr};
  OutT* dst = out + (static_cast<int64_t>(g) * nrows + row0) * ncols + col0;
  tile_product<KOuter, KOuter, WGRAD_HALVES, WGRAD_PER_SM>(smem, a, row0, rows, b, col0, cols, t0 / MX_BLOCK, t1 / MX_BLOCK, ranges,
                               [&](const auto& acc, bool wg, int c0) {
                                 store_tile(smem, acc, dst + c0, ncols, rows, cols - c0, accumulate, wg);
                               });
}

}  // namespace gg_mxfp8
