// CUDA kernels for the fused RMSNorm (declared in fused_cuda.h).
//
// Forward: one block per row; the row is staged in shared memory as float and its
// mean square comes from one block reduction. Backward: one block per row for dx;
// the weight gradient as in norm_cuda.cuh (deterministic).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_common.cuh"
#include "fused_cuda.h"
#include "norm_cuda.cuh"

namespace megatron_fused {
namespace cuda {
namespace {

template <typename T>
__global__ void rms_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                        T* __restrict__ y, float* __restrict__ rstd, int cols,
                                        float eps) {
  extern __shared__ float row[];
  __shared__ float scratch[32];
  const long long r = blockIdx.x;
  const T* xr = x + r * cols;
  T* yr = y + r * cols;

  float local = 0.0f;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const float v = to_float(xr[j]);
    row[j] = v;
    local += v * v;
  }
  const float rs =
      rsqrtf(block_reduce<false>(local, scratch) / static_cast<float>(cols) + eps);

  // x * rstd rounded to the storage type, then times the weight (as the plain path).
  for (int j = threadIdx.x; j < cols; j += blockDim.x)
    yr[j] = from_float<T>(to_float(from_float<T>(row[j] * rs)) * to_float(w[j]));
  if (threadIdx.x == 0) rstd[r] = rs;
}

template <typename T>
__global__ void rms_norm_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                   const float* __restrict__ rstd, const T* __restrict__ w,
                                   T* __restrict__ dx, int cols) {
  __shared__ float scratch[32];
  const long long r = blockIdx.x;
  const T* dyr = dy + r * cols;
  const T* xr = x + r * cols;
  T* dxr = dx + r * cols;
  const float rs = rstd[r];

  float s = 0.0f;
  for (int j = threadIdx.x; j < cols; j += blockDim.x)
    s += to_float(dyr[j]) * to_float(w[j]) * to_float(xr[j]) * rs;
  const float c = block_reduce<false>(s, scratch) / static_cast<float>(cols);

  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const float g = to_float(dyr[j]) * to_float(w[j]);
    dxr[j] = from_float<T>(rs * (g - to_float(xr[j]) * rs * c));
  }
}

}  // namespace

cudaError_t rms_norm_forward(DType dtype, const void* x, const void* w, void* y, float* rstd,
                             long long rows, int cols, float eps, cudaStream_t stream) {
  if (norm::bad_shape(rows, cols)) return cudaErrorInvalidValue;
  const int threads = threads_for_row(cols);
  const size_t smem = sizeof(float) * cols;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    rms_norm_forward_kernel<T><<<static_cast<unsigned>(rows), threads, smem, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), rstd, cols, eps);
  });
}

cudaError_t rms_norm_backward(DType dtype, const void* dy, const void* x, const float* rstd,
                              const void* w, void* dx, void* dw, float* workspace,
                              long long rows, int cols, cudaStream_t stream) {
  if (norm::bad_shape(rows, cols)) return cudaErrorInvalidValue;
  const int threads = threads_for_row(cols);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* dy_t = static_cast<const T*>(dy);
    const T* x_t = static_cast<const T*>(x);
    rms_norm_dx_kernel<T><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        dy_t, x_t, rstd, static_cast<const T*>(w), static_cast<T*>(dx), cols);
    norm::launch_param_grads<T, false>(dy_t, x_t, nullptr, rstd, workspace,
                                       static_cast<T*>(dw), nullptr, rows, cols, stream);
  });
}

}  // namespace cuda
}  // namespace megatron_fused
