// The DLPack ABI (v0.8, unversioned "dltensor" capsules) — just the structs this library exports.
// https://github.com/dmlc/dlpack (Apache-2.0). Torch reads these through torch.from_dlpack.
#pragma once

#include <cstdint>

extern "C" {

typedef struct {
  int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2
  int32_t device_id;
} DLDevice;

typedef struct {
  uint8_t code;  // kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

typedef struct {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements
  uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensor* self);
} DLManagedTensor;

}  // extern "C"
