// SPDX-License-Identifier: GPL-3.0-or-later
// Shared helpers: fp32 conversion for the three element types, and an aligned vector type for
// 16-byte loads and stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/util/Exception.h>

#include <cstdio>

// CNA_CHECK(cond, "printf format", args...): a TORCH_CHECK whose message is formatted here into
// one C string. TORCH_CHECK with several message arguments builds a std::string in this
// translation unit and hands it to libc10; in this extension that hand-over crashed the process
// (segmentation fault) instead of raising, while a single C-string message raises a Python
// RuntimeError as it should. So every check here passes exactly one const char*.
#define CNA_CHECK(cond, ...)                                      \
  do {                                                            \
    if (!(cond)) {                                                \
      char cna_check_msg_[320];                                   \
      std::snprintf(cna_check_msg_, sizeof(cna_check_msg_), __VA_ARGS__); \
      TORCH_CHECK(false, static_cast<const char*>(cna_check_msg_)); \
    }                                                             \
  } while (0)

namespace cna {

// Multiprocessors of the current device (sizes grids). Read through the runtime, not ATen's
// CUDAContext, whose header pulls in cuBLAS/cuSPARSE headers the build does not need.
inline int sm_count() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms > 0 ? sms : 1;
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename T, int N>
struct alignas(16) AlignedVec {
  T v[N];
};

// N int8 values stored together (the int8 side of a 16-byte vector of fp16/bf16/fp32).
template <int N>
struct alignas(N) I8Vec {
  int8_t v[N];
};

inline bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace cna
