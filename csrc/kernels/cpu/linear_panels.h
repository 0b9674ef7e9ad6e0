// linear on weight panels: float32 out = input · weightᵀ (+ bias) from kFromRows input rows on,
// included by linear.cc in the vector ISA levels.
//
// linear.cc's row kernel takes dot products: each output is kW partial sums along K added up at
// the end, and each step loads an input vector and a weight vector per group of products. From 16
// rows on, arithmetic rather than memory bounds a float32 projection, and the outer-product form
// does more multiply-adds per load and no horizontal sums: a panel of kWidth weight rows is
// transposed into K-major order once per call (quantized rows decoded to floats first), and
// blocks of kGroup input rows pass over it a slice of at most kDepth inputs at a time (the slice
// stays in L2), each keeping kGroup x kVecs accumulator vectors in registers:
// acc[m][v] += input[m][k] * panel[k][v], the input broadcast. On the Intel Xeon of
// bench/RESULTS.md the default model's float32 shapes took 0.6-0.9x the row kernel's time at 32
// rows and 0.4-0.8x at 64-256, even with or ahead of torch's MKL GEMM there.
//
// Every output is one chain of multiply-adds over k in order (a slice resumes from the partial
// sum it stored), whatever the block, thread or M: rows are batch invariant among calls of
// kFromRows rows and more. (Below, the row kernel adds in its own order.)
#pragma once

#include <cstdlib>
#include <cstring>
#include <new>

#include "octavo/threading.h"
#include "parallel.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace panels {

constexpr int kVecs = kW == 16 ? 4 : 3;   // accumulator vectors per input row
constexpr int kGroup = kW == 16 ? 6 : 4;  // input rows per block: AVX-512 24 + 4 of 32 registers, AVX2 12 + 3 of 16
constexpr int kWidth = kVecs * kW;        // weight rows (output features) per panel
constexpr int64_t kDepth = 1024;          // the longest slice of K all row blocks pass over: 256 KiB on AVX-512
constexpr int64_t kFromRows = 16;

// float32 activations with weights in any format linear.cc decodes (the panel holds floats).
inline bool takes(const LinearParams& p) { return kW > 1 && p.dtype == DType::kFloat32 && p.rows >= kFromRows; }

// Per-thread heap buffers, kept for the thread's life and grown as needed (thread-local arrays
// this large could exhaust the static TLS block an extension module is loaded with). A failed
// allocation throws std::bad_alloc, which the pool hands to the caller (MemoryError in Python).
struct ThreadBuffer {
  float* data = nullptr;
  int64_t floats = 0;
  ~ThreadBuffer() { std::free(data); }
  float* get(int64_t wanted) {
    if (wanted > floats) {
      std::free(data);
      data = nullptr;
      floats = 0;
      const int64_t rounded = (wanted + 15) / 16 * 16;  // aligned_alloc wants a multiple of the alignment
      data = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * rounded));
      if (data == nullptr) throw std::bad_alloc();
      floats = rounded;
    }
    return data;
  }
};
inline float* panel_buffer(int64_t floats) {
  thread_local ThreadBuffer buffer;
  return buffer.get(floats);
}
// Weight rows decoded to float32 (a quantized panel's rows, or linear.cc's decode-once tiles).
inline float* row_buffer(int64_t floats) {
  thread_local ThreadBuffer buffer;
  return buffer.get(floats);
}

// panel[k * kWidth + j0 + j] = rows[j * stride + k] for j < nr (nr <= kW), k < K: kW rows of
// float32 transposed into columns [j0, j0 + nr) of a K-major panel.
inline void transpose_rows(const float* rows, int64_t stride, int nr, int64_t K, int j0, float* panel) {
  int64_t k = 0;
  if (nr == kW)
    for (; k + kW <= K; k += kW) transpose_square(rows + k, stride, panel + k * kWidth + j0, kWidth);
  for (; k < K; ++k)
    for (int j = 0; j < nr; ++j) panel[k * kWidth + j0 + j] = rows[j * stride + k];
}

// Columns [nr, kWidth) of a panel are zeros (the last panel of a weight whose N is not a multiple).
inline void zero_columns(int nr, int64_t K, float* panel) {
  if (nr < kWidth)
    for (int64_t k = 0; k < K; ++k) std::memset(panel + k * kWidth + nr, 0, sizeof(float) * (kWidth - nr));
}

// A float32 weight's rows [n, n + nr) into its panel.
struct DensePanel {
  const float* weight;
  int64_t K;
  void operator()(int64_t n, int nr, float* panel) const {
    for (int j = 0; j < nr; j += kW) transpose_rows(weight + (n + j) * K, K, nr - j < kW ? nr - j : kW, K, j, panel);
    zero_columns(nr, K, panel);
  }
};

// Columns [v kW, v kW + kW) of a panel's row, of which the first nr exist (missing lanes are 0).
inline VecF load_columns(const float* row, int v, int nr) {
  const int have = nr - v * kW;
  if (have >= kW) return VecF::load(row + v * kW);
  return have > 0 ? load_partial(row + v * kW, have) : VecF::zero();
}
inline void store_columns(VecF x, float* row, int v, int nr) {
  const int have = nr - v * kW;
  if (have >= kW) return x.store(row + v * kW);
  if (have > 0) store_partial(x, row + v * kW, have);
}

// G input rows against one panel slice of `depth` inputs: the accumulators start from zero on
// the first slice and from the stored partial sums after it; the last slice adds the bias.
template <int G>
void block(const float* x, int64_t x_stride, const float* panel, int64_t depth, int nr, bool first,
           const float* bias, float* out, int64_t out_stride) {
  VecF acc[G][kVecs];
  for (int m = 0; m < G; ++m)
    for (int v = 0; v < kVecs; ++v) acc[m][v] = first ? VecF::zero() : load_columns(out + m * out_stride, v, nr);
  for (int64_t k = 0; k < depth; ++k) {
    VecF wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = VecF::load(panel + k * kWidth + v * kW);
    for (int m = 0; m < G; ++m) {
      const VecF xv = VecF::set1(x[m * x_stride + k]);
      for (int v = 0; v < kVecs; ++v) acc[m][v] = fma(xv, wv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < G; ++m)
    for (int v = 0; v < kVecs; ++v)
      store_columns(bias != nullptr ? acc[m][v] + load_columns(bias, v, nr) : acc[m][v], out + m * out_stride, v, nr);
}

template <int G = kGroup>
void block_of(int rows, const float* x, int64_t x_stride, const float* panel, int64_t depth, int nr, bool first,
              const float* bias, float* out, int64_t out_stride) {
  if constexpr (G > 1)
    if (rows < G) return block_of<G - 1>(rows, x, x_stride, panel, depth, nr, first, bias, out, out_stride);
  block<G>(x, x_stride, panel, depth, nr, first, bias, out, out_stride);
}

// Slices of K as even as kW-aligned lengths of at most kDepth allow.
inline int64_t slice_depth(int64_t K) {
  const int64_t slices = (K + kDepth - 1) / kDepth;
  const int64_t depth = (K + slices - 1) / slices;
  return (depth + kW - 1) / kW * kW;
}

// Panels split evenly over the threads, each thread streaming its own contiguous weight rows;
// fill(n, nr, panel) writes weight rows [n, n + nr) into a K-major panel (DensePanel, or
// linear.cc's decoder of quantized rows).
template <typename Fill>
void linear(const LinearParams& p, const Fill& fill) {
  const int64_t K = p.in_features, N = p.out_features;
  const float* input = static_cast<const float*>(p.input);
  const float* bias = static_cast<const float*>(p.bias);
  float* out = static_cast<float*>(p.out);
  const int64_t panels = (N + kWidth - 1) / kWidth, depth = slice_depth(K);
  const int threads = get_num_threads();
  parallel_for(panels, (panels + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    float* panel = panel_buffer(K * kWidth);
    for (int64_t q = begin; q < end; ++q) {
      const int64_t n = q * kWidth;
      const int nr = static_cast<int>(N - n < kWidth ? N - n : kWidth);
      fill(n, nr, panel);
      for (int64_t k0 = 0; k0 < K; k0 += depth) {
        const int64_t k1 = K - k0 < depth ? K : k0 + depth;
        const float* slice_bias = bias != nullptr && k1 == K ? bias + n : nullptr;
        for (int64_t m = 0; m < p.rows; m += kGroup) {
          const int rows = static_cast<int>(p.rows - m < kGroup ? p.rows - m : kGroup);
          block_of(rows, input + m * p.in_stride + k0, p.in_stride, panel + k0 * kWidth, k1 - k0, nr, k0 == 0,
                   slice_bias, out + m * p.out_stride + n, p.out_stride);
        }
      }
    }
  });
}

}  // namespace panels
}  // namespace octavo::cpu::OCTAVO_ISA
