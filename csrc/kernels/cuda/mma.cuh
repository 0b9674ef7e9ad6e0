// Warp-level tensor-core building blocks (sm_80 and up): ldmatrix loads from shared memory and
// the m16n8k16 mma with float accumulators, for bfloat16 and float16. The fragment layouts are
// the PTX ISA's ("Matrix Fragments for mma.m16n8k16 with floating point type"): with
// g = lane / 4 and t = lane % 4,
//   A (16x16, 4 registers of 2 elements): rows g, g + 8, g, g + 8; columns 2t, 2t + 1 (+8 for
//     registers 2 and 3);
//   B (16x8, 2 registers): rows 2t, 2t + 1 (+8 for register 1); column g;
//   C (16x8, 4 floats): rows g, g, g + 8, g + 8; columns 2t, 2t + 1.
#pragma once

#include <cstring>
#include <type_traits>

#include "common.cuh"

namespace octavo::cuda {

// Four 8x8 matrices of 16-bit elements: lanes 8i..8i+7 give the row addresses of matrix i, and
// register i receives matrix i's elements (row g, columns 2t, 2t + 1); with Trans, the elements
// (rows 2t, 2t + 1, column g) instead.
template <bool Trans>
__device__ __forceinline__ void load_matrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
  }
#elif defined(OCTAVO_CUDA_SIM)
  cuda_sim::load_matrix_x4(r, row, Trans);
#else
  __trap();  // the kernels using tensor cores are built for sm_80 and up only
#endif
}

// d += a·b for a 16x16 A fragment and a 16x8 B fragment (b0, b1) of T, float accumulators.
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#elif defined(OCTAVO_CUDA_SIM)
  cuda_sim::mma_16x8x16(d, a, b0, b1, std::is_same_v<T, bf16>);
#else
  __trap();
#endif
}

// Two floats rounded to T (nearest even) in one register, `lo` in the low half: an A fragment
// register, or two adjacent output elements.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, bf16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&bits, &v, sizeof(bits));
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&bits, &v, sizeof(bits));
  }
  return bits;
}

}  // namespace octavo::cuda
