// A non-owning view of a tensor's memory: what crosses from Python (torch, numpy via DLPack)
// or from another native caller into Octavo's ops. It never owns or frees the data; the caller
// keeps the producer alive for the duration of the call.
#pragma once

#include <cstddef>
#include <cstdint>

namespace octavo {

// kFloat8E4M3: torch.float8_e4m3fn (4 exponent bits, 3 mantissa bits, no infinities; only a KV cache holds it).
enum class DType : uint8_t {
  kFloat32, kFloat16, kBFloat16, kFloat64, kInt8, kUInt8, kInt32, kInt64, kBool, kFloat8E4M3
};
enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;  // where the memory lives
  int index = 0;                       // CUDA ordinal; 0 for CPU
};

const char* dtype_name(DType dtype);   // "float32", "bfloat16", ... as torch spells them
size_t dtype_size(DType dtype);        // bytes per element
const char* device_name(DeviceType type);  // "cpu" or "cuda"

struct TensorView {
  static constexpr int kMaxDims = 8;

  void* data = nullptr;         // first element (byte offset already applied)
  DType dtype = DType::kFloat32;
  Device device;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements, not bytes

  int64_t numel() const;
  bool is_contiguous() const;  // row-major, no gaps (size-1 dims may have any stride)
  template <typename T>
  T* data_as() const { return static_cast<T*>(data); }
};

// Argument checks for ops. Each throws octavo::Error naming `arg` and what was expected:
// wrong dtype -> kType; wrong rank, size, device or layout -> kValue.
void check_dtype(const TensorView& t, const char* arg, DType expected);
void check_ndim(const TensorView& t, const char* arg, int expected);
void check_size(const TensorView& t, const char* arg, int dim, int64_t expected);
void check_device(const TensorView& t, const char* arg, DeviceType expected);
void check_contiguous(const TensorView& t, const char* arg);

}  // namespace octavo
