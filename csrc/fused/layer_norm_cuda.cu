// CUDA kernels for the fused layer norm (declared in fused_cuda.h).
//
// Forward: one block per row; the row is staged in shared memory as float, mean
// and variance come from two block reductions over it. Backward: one block per
// row for dx; the weight and bias gradients as in norm_cuda.cuh (deterministic).
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
__global__ void layer_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                          const T* __restrict__ b, T* __restrict__ y,
                                          float* __restrict__ mean, float* __restrict__ rstd,
                                          int cols, float eps) {
  extern __shared__ float row[];
  __shared__ float scratch[32];
  const long long r = blockIdx.x;
  const T* xr = x + r * cols;
  T* yr = y + r * cols;
  const float inv_n = 1.0f / static_cast<float>(cols);

  float local = 0.0f;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const float v = to_float(xr[j]);
    row[j] = v;
    local += v;
  }
  const float mu = block_reduce<false>(local, scratch) * inv_n;

  local = 0.0f;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const float d = row[j] - mu;
    local += d * d;
  }
  const float rs = rsqrtf(block_reduce<false>(local, scratch) * inv_n + eps);

  for (int j = threadIdx.x; j < cols; j += blockDim.x)
    yr[j] = from_float<T>((row[j] - mu) * rs * to_float(w[j]) + to_float(b[j]));
  if (threadIdx.x == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
}

template <typename T>
__global__ void layer_norm_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                     const float* __restrict__ mean,
                                     const float* __restrict__ rstd, const T* __restrict__ w,
                                     T* __restrict__ dx, int cols) {
  __shared__ float scratch[32];
  const long long r = blockIdx.x;
  const T* dyr = dy + r * cols;
  const T* xr = x + r * cols;
  T* dxr = dx + r * cols;
  const float mu = mean[r];
  const float rs = rstd[r];
  const float inv_n = 1.0f / static_cast<float>(cols);

  float s1 = 0.0f;
  float s2 = 0.0f;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const float g = to_float(dyr[j]) * to_float(w[j]);
    s1 += g;
    s2 += g * (to_float(xr[j]) - mu) * rs;
  }
  const float c1 = block_reduce<false>(s1, scratch) * inv_n;
  const float c2 = block_reduce<false>(s2, scratch) * inv_n;

  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const float g = to_float(dyr[j]) * to_float(w[j]);
    const float xhat = (to_float(xr[j]) - mu) * rs;
    dxr[j] = from_float<T>(rs * (g - c1 - xhat * c2));
  }
}

}  // namespace

cudaError_t layer_norm_forward(DType dtype, const void* x, const void* w, const void* b, void* y,
                               float* mean, float* rstd, long long rows, int cols, float eps,
                               cudaStream_t stream) {
  if (norm::bad_shape(rows, cols)) return cudaErrorInvalidValue;
  const int threads = threads_for_row(cols);
  const size_t smem = sizeof(float) * cols;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    layer_norm_forward_kernel<T><<<static_cast<unsigned>(rows), threads, smem, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(b),
        static_cast<T*>(y), mean, rstd, cols, eps);
  });
}

int norm_backward_splits(long long rows) {
  const long long splits = (rows + 63) / 64;
  return static_cast<int>(splits < 1 ? 1 : (splits > 128 ? 128 : splits));
}

cudaError_t layer_norm_backward(DType dtype, const void* dy, const void* x, const float* mean,
                                const float* rstd, const void* w, void* dx, void* dw, void* db,
                                float* workspace, long long rows, int cols,
                                cudaStream_t stream) {
  if (norm::bad_shape(rows, cols)) return cudaErrorInvalidValue;
  const int threads = threads_for_row(cols);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* dy_t = static_cast<const T*>(dy);
    const T* x_t = static_cast<const T*>(x);
    layer_norm_dx_kernel<T><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        dy_t, x_t, mean, rstd, static_cast<const T*>(w), static_cast<T*>(dx), cols);
    norm::launch_param_grads<T, true>(dy_t, x_t, mean, rstd, workspace, static_cast<T*>(dw),
                                      static_cast<T*>(db), rows, cols, stream);
  });
}

}  // namespace cuda
}  // namespace megatron_fused
