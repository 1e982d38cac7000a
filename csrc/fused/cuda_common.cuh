// Device helpers shared by the CUDA kernels: float conversion of the storage
// types and warp/block reductions. CUDA headers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fused_cuda.h"

namespace megatron_fused {
namespace cuda {

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

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Sum (or max) over the block; every thread gets the result. blockDim.x must be a
// multiple of 32 and at most 1024; `scratch` holds 32 floats in shared memory.
template <bool kMax>
__device__ float block_reduce(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = kMax ? warp_max(v) : warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const float identity = kMax ? __int_as_float(0xff800000) : 0.0f;  // -inf or 0
  v = lane < warps ? scratch[lane] : identity;
  return kMax ? warp_max(v) : warp_sum(v);
}

// Threads per block for a row of `n` elements: about 4 elements per thread,
// a multiple of 32 between 32 and 256.
inline int threads_for_row(int n) {
  int t = ((n + 3) / 4 + 31) / 32 * 32;
  return t < 32 ? 32 : (t > 256 ? 256 : t);
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls launch(TypeTag<T>{}) with T the storage type of `dtype`, then returns the
// launch status.
template <typename Launch>
cudaError_t dispatch_dtype(DType dtype, Launch&& launch) {
  switch (dtype) {
    case DType::kFloat32: launch(TypeTag<float>{}); break;
    case DType::kFloat16: launch(TypeTag<__half>{}); break;
    case DType::kBFloat16: launch(TypeTag<__nv_bfloat16>{}); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace megatron_fused
