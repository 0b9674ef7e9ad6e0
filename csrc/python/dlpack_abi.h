// The C ABI of a legacy DLPack capsule ("dltensor"), declared here so Octavo reads torch and
// numpy tensors without linking either. Field order and widths follow the public DLPack spec.
#pragma once

#include <cstdint>

namespace octavo::dlpack {

// DLDeviceType values we accept; all others are rejected by name.
constexpr int32_t kDLCPU = 1;
constexpr int32_t kDLCUDA = 2;

// DLDataTypeCode values.
constexpr uint8_t kDLInt = 0;
constexpr uint8_t kDLUInt = 1;
constexpr uint8_t kDLFloat = 2;
constexpr uint8_t kDLBfloat = 4;
constexpr uint8_t kDLComplex = 5;
constexpr uint8_t kDLBool = 6;
constexpr uint8_t kDLFloat8_e4m3fn = 10;  // DLPack 1.1

struct DLDevice {
  int32_t device_type;  // DLDeviceType (a C enum, int-sized)
  int32_t device_id;    // ordinal within the device type
};

struct DLDataType {
  uint8_t code;    // DLDataTypeCode
  uint8_t bits;    // bits per lane
  uint16_t lanes;  // 1 for ordinary (non-vector) types
};

struct DLTensor {
  void* data;            // base pointer; add byte_offset for the first element
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;        // [ndim]
  int64_t* strides;      // [ndim] in elements; NULL means compact row-major
  uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;                         // owned by the producer
  void (*deleter)(DLManagedTensor* self);    // releases manager_ctx; called by the capsule's destructor
};

}  // namespace octavo::dlpack
