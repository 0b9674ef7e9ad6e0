// Host tensors for the cuda_sim tests. The simulated device's memory is host memory, so one
// buffer can be viewed as a CPU tensor (for the CPU kernel, the reference) or as a CUDA tensor
// (for the CUDA kernel run by the simulator): both ops then see the same public entry point.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fp8_e4m3.h"
#include "octavo/ops.h"
#include "octavo/status.h"
#include "octavo/tensor_view.h"

namespace sim_test {

using octavo::DeviceType;
using octavo::DType;
using octavo::TensorView;
using octavo::WeightFormat;

inline const DType kFloatDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::vector<int64_t> shape, DType dtype) : dtype_(dtype), shape_(std::move(shape)) {
    bytes_.assign(static_cast<size_t>(numel()) * octavo::dtype_size(dtype) / sizeof(uint64_t) + 1, 0);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    return n;
  }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  template <typename T>
  T* as() { return reinterpret_cast<T*>(bytes_.data()); }

  // Element i (row-major) as a float / set from a float, rounded to nearest even.
  float get(int64_t i) const {
    switch (dtype_) {
      case DType::kFloat32: return reinterpret_cast<const float*>(data())[i];
      case DType::kBFloat16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(data())[i]);
      case DType::kFloat16: return __half2float(reinterpret_cast<const __half*>(data())[i]);
      case DType::kInt32: return static_cast<float>(reinterpret_cast<const int32_t*>(data())[i]);
      case DType::kInt64: return static_cast<float>(reinterpret_cast<const int64_t*>(data())[i]);
      case DType::kFloat8E4M3: return octavo::fp8_e4m3_to_float(reinterpret_cast<const uint8_t*>(data())[i]);
      default: ADD_FAILURE() << "get: unsupported dtype"; return 0;
    }
  }
  void set(int64_t i, double v) {
    switch (dtype_) {
      case DType::kFloat32: as<float>()[i] = static_cast<float>(v); break;
      case DType::kBFloat16: as<__nv_bfloat16>()[i] = __float2bfloat16_rn(static_cast<float>(v)); break;
      case DType::kFloat16: as<__half>()[i] = __float2half_rn(static_cast<float>(v)); break;
      case DType::kInt32: as<int32_t>()[i] = static_cast<int32_t>(v); break;
      case DType::kInt64: as<int64_t>()[i] = static_cast<int64_t>(v); break;
      case DType::kFloat8E4M3: as<uint8_t>()[i] = octavo::fp8_e4m3_from_float(static_cast<float>(v)); break;
      default: ADD_FAILURE() << "set: unsupported dtype";
    }
  }
  std::vector<float> floats() const {
    std::vector<float> out(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) out[static_cast<size_t>(i)] = get(i);
    return out;
  }
  bool same_bytes(const Tensor& other) const {
    return dtype_ == other.dtype_ && shape_ == other.shape_ &&
           std::memcmp(data(), other.data(), static_cast<size_t>(numel()) * octavo::dtype_size(dtype_)) == 0;
  }

  // A contiguous view on `device` (the simulator's device memory is this host buffer).
  TensorView view(DeviceType device) const {
    TensorView t;
    t.data = const_cast<void*>(data());
    t.dtype = dtype_;
    t.device.type = device;
    t.ndim = static_cast<int>(shape_.size());
    int64_t stride = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      t.shape[d] = shape_[static_cast<size_t>(d)];
      t.strides[d] = stride;
      stride *= shape_[static_cast<size_t>(d)];
    }
    return t;
  }
  TensorView cpu() const { return view(DeviceType::kCPU); }
  // On the current simulated device (all of them share the host's memory).
  TensorView cuda() const {
    TensorView t = view(DeviceType::kCUDA);
    cudaGetDevice(&t.device.index);
    return t;
  }

 private:
  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> shape_;
  std::vector<uint64_t> bytes_;  // 8-byte aligned at least; operator new gives 16 (16-byte packs)
};

// Normal values times `scale`, rounded to the dtype.
inline Tensor randn(std::vector<int64_t> shape, DType dtype, std::mt19937& gen, double scale = 1.0) {
  Tensor t(std::move(shape), dtype);
  std::normal_distribution<double> normal;
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, normal(gen) * scale);
  return t;
}

// One rounding of the dtype, relative to each value and to the largest (test_cuda_ops.py's
// assert_matches_cpu): the kernels sum in different orders.
inline double ulp(DType dtype) {
  return dtype == DType::kFloat32 ? std::ldexp(1.0, -16) : dtype == DType::kBFloat16 ? std::ldexp(1.0, -7)
                                                                                       : std::ldexp(1.0, -10);
}
inline void expect_matches_cpu(const Tensor& gpu, const Tensor& cpu) {
  ASSERT_EQ(gpu.numel(), cpu.numel());
  const std::vector<float> g = gpu.floats(), c = cpu.floats();
  float largest = 0;
  for (float v : c) largest = std::max(largest, std::fabs(v));
  const double u = ulp(cpu.dtype());
  int failures = 0;
  for (size_t i = 0; i < c.size() && failures < 10; ++i) {
    const double tolerance = u * std::fabs(c[i]) + u * largest;
    if (!(std::fabs(static_cast<double>(g[i]) - c[i]) <= tolerance)) {
      ADD_FAILURE() << "element " << i << ": cuda " << g[i] << ", cpu " << c[i] << " (tolerance " << tolerance << ")";
      ++failures;
    }
  }
}

// Formats in blocks of 32 weights, then GGUF's K-quants (super-blocks of 256).
inline const WeightFormat kBlocksOf32[] = {WeightFormat::kQ8_0, WeightFormat::kQ4_0,  WeightFormat::kQ4_1,
                                           WeightFormat::kQ5_0, WeightFormat::kQ5_1,  WeightFormat::kIQ4_NL,
                                           WeightFormat::kInt8, WeightFormat::kInt4,  WeightFormat::kFp8};
inline const WeightFormat kQuantized[] = {WeightFormat::kQ8_0,   WeightFormat::kQ4_0, WeightFormat::kQ4_1,
                                          WeightFormat::kQ5_0,   WeightFormat::kQ5_1, WeightFormat::kIQ4_NL,
                                          WeightFormat::kQ3_K,   WeightFormat::kQ4_K, WeightFormat::kQ5_K,
                                          WeightFormat::kQ6_K,   WeightFormat::kInt8, WeightFormat::kInt4,
                                          WeightFormat::kFp8};

// k rounded up to whole blocks of format f (test shapes are written for blocks of 32).
inline int64_t whole_blocks(WeightFormat f, int64_t k) {
  const int64_t b = octavo::weight_block_weights(f);
  return (k + b - 1) / b * b;
}

// Byte offsets of the float16 fields (d, then a minimum) in a block of each GGUF format.
inline std::vector<int> gguf_halves(WeightFormat f) {
  switch (f) {
    case WeightFormat::kQ4_1:
    case WeightFormat::kQ5_1:
    case WeightFormat::kQ4_K:
    case WeightFormat::kQ5_K: return {0, 2};
    case WeightFormat::kQ3_K: return {108};
    case WeightFormat::kQ6_K: return {208};
    case WeightFormat::kInt8:
    case WeightFormat::kInt4:
    case WeightFormat::kInt4A8:
    case WeightFormat::kInt8A8:
    case WeightFormat::kFp8: return {};
    default: return {0};
  }
}

// A quantized weight of n rows standing for k inputs, with random quants and scales: GGUF blocks
// get float16 scales (and minimums) of either sign written into the bytes. fp8 weights take every
// E4M3 code but NaN (whose payload bits the CPU and CUDA decoders need not agree on).
struct Weight {
  WeightFormat format;
  Tensor data, scales, zeros;
  int64_t group_size = 0;

  Weight(WeightFormat f, int64_t n, int64_t k, std::mt19937& gen) : format(f) {
    const int64_t block_bytes = octavo::weight_block_bytes(f), blocks = k / octavo::weight_block_weights(f);
    const bool fp8 = f == WeightFormat::kFp8;
    data = Tensor({n, blocks * block_bytes}, f == WeightFormat::kInt8 ? DType::kInt8 : fp8 ? DType::kFloat8E4M3
                                                                                            : DType::kUInt8);
    uint8_t* bytes = data.as<uint8_t>();
    for (int64_t i = 0; i < data.numel(); ++i) {
      bytes[i] = static_cast<uint8_t>(gen());
      if (fp8 && (bytes[i] & 0x7f) == 0x7f) bytes[i] ^= 1;  // NaN -> +-448
    }
    std::normal_distribution<float> normal(0.0f, 0.05f);
    if (!gguf_halves(f).empty()) {
      for (int64_t b = 0; b < n * blocks; ++b)
        for (int at : gguf_halves(f)) {
          const __half v = __float2half_rn(normal(gen) / (block_bytes > 34 ? 32 : 1));  // K-quants: d * 6-bit scale
          std::memcpy(bytes + b * block_bytes + at, &v, 2);
        }
    } else if (f == WeightFormat::kInt8) {
      scales = Tensor({n}, DType::kFloat32);
      for (int64_t i = 0; i < n; ++i) scales.set(i, std::fabs(normal(gen)) / 16);
    } else {
      group_size = k % 64 == 0 ? 64 : 32;
      scales = Tensor({n, k / group_size}, DType::kFloat32);
      if (!fp8) zeros = Tensor({n, k / group_size}, DType::kUInt8);
      for (int64_t i = 0; i < scales.numel(); ++i) {
        scales.set(i, std::fabs(normal(gen)) / (fp8 ? 400 : 4));  // fp8 quants reach 448
        if (!fp8) zeros.as<uint8_t>()[i] = static_cast<uint8_t>(gen() % 16);
      }
    }
  }

  // The views of one device; quant() points into them, so they must outlive its use.
  struct Views {
    TensorView data, scales, zeros;
    int64_t group_size;
    octavo::WeightQuant quant() const {
      return {scales.data ? &scales : nullptr, zeros.data ? &zeros : nullptr, group_size};
    }
  };
  Views on(bool cuda) const {
    Views v{cuda ? data.cuda() : data.cpu(), TensorView{}, TensorView{}, group_size};
    if (!scales.shape().empty()) v.scales = cuda ? scales.cuda() : scales.cpu();
    if (format == WeightFormat::kInt4 || format == WeightFormat::kInt4A8) v.zeros = cuda ? zeros.cuda() : zeros.cpu();
    return v;
  }
};

// Calls op, which must throw an octavo::Error whose message contains `says`.
template <typename Op>
void expect_refusal(Op op, const std::string& says) {
  try {
    op();
    ADD_FAILURE() << "no error; expected one saying: " << says;
  } catch (const octavo::Error& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}

}  // namespace sim_test
