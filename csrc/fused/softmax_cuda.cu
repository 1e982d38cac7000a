// CUDA kernels for the fused attention softmax (declared in fused_cuda.h).
//
// One block per row. The row is read once into shared memory as float (scaled
// and masked), reduced for its max, exponentiated and summed in place, then
// written normalised. The causal kernel reads only the unmasked prefix j <= i.
// The backward reads g and y twice (the second time mostly from L2/L1).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_common.cuh"
#include "fused_cuda.h"

namespace megatron_fused {
namespace cuda {
namespace {

constexpr float kMaskedValue = -10000.0f;

// Where row `r` of the scores starts its mask row, and how much of it is unmasked.
struct RowInfo {
  const unsigned char* mask;  // nullptr for the causal kernel
  int valid;                  // number of leading columns that may be non-zero
};

template <bool kCausal>
__device__ RowInfo row_info(long long r, const unsigned char* mask, long long per_batch, int sq,
                            int sk, int mask_b) {
  RowInfo info;
  if (kCausal) {
    info.mask = nullptr;
    info.valid = static_cast<int>(r % sq) + 1;
  } else {
    const long long mb = mask_b == 1 ? 0 : r / per_batch;
    info.mask = mask + (mb * sq + r % sq) * static_cast<long long>(sk);
    info.valid = sk;
  }
  return info;
}

template <typename T, bool kCausal>
__global__ void softmax_forward_kernel(const T* __restrict__ in,
                                       const unsigned char* __restrict__ mask,
                                       T* __restrict__ out, long long per_batch, int sq, int sk,
                                       int mask_b, float scale) {
  extern __shared__ float row[];
  __shared__ float scratch[32];
  const long long r = blockIdx.x;
  const RowInfo info = row_info<kCausal>(r, mask, per_batch, sq, sk, mask_b);
  const T* x = in + r * sk;
  T* y = out + r * sk;

  float local_max = __int_as_float(0xff800000);  // -inf
  for (int j = threadIdx.x; j < info.valid; j += blockDim.x) {
    float v = to_float(x[j]) * scale;
    if (!kCausal && info.mask[j]) v = kMaskedValue;
    row[j] = v;
    local_max = fmaxf(local_max, v);
  }
  const float row_max = block_reduce<true>(local_max, scratch);

  float local_sum = 0.0f;
  for (int j = threadIdx.x; j < info.valid; j += blockDim.x) {
    const float e = expf(row[j] - row_max);
    row[j] = e;
    local_sum += e;
  }
  const float inv_sum = 1.0f / block_reduce<false>(local_sum, scratch);

  for (int j = threadIdx.x; j < sk; j += blockDim.x)
    y[j] = from_float<T>(j < info.valid ? row[j] * inv_sum : 0.0f);
}

template <typename T, bool kCausal>
__global__ void softmax_backward_kernel(const T* __restrict__ grad, const T* __restrict__ out,
                                        const unsigned char* __restrict__ mask,
                                        T* __restrict__ dx, long long per_batch, int sq, int sk,
                                        int mask_b, float scale) {
  __shared__ float scratch[32];
  const long long r = blockIdx.x;
  const RowInfo info = row_info<kCausal>(r, mask, per_batch, sq, sk, mask_b);
  const T* g = grad + r * sk;
  const T* y = out + r * sk;
  T* d = dx + r * sk;

  float local_dot = 0.0f;
  for (int j = threadIdx.x; j < info.valid; j += blockDim.x)
    local_dot += to_float(g[j]) * to_float(y[j]);
  const float gy = block_reduce<false>(local_dot, scratch);

  for (int j = threadIdx.x; j < sk; j += blockDim.x) {
    float v = 0.0f;
    if (j < info.valid && (kCausal || !info.mask[j]))
      v = to_float(y[j]) * (to_float(g[j]) - gy) * scale;
    d[j] = from_float<T>(v);
  }
}

bool bad_row_shape(long long rows, int sk) {
  return rows <= 0 || rows > 0x7fffffffLL || sk <= 0 || sk > kMaxRowLength;
}

}  // namespace

cudaError_t upper_triang_softmax_forward(DType dtype, const void* in, void* out,
                                         long long batches, int sq, float scale,
                                         cudaStream_t stream) {
  const long long rows = batches * sq;
  if (bad_row_shape(rows, sq)) return cudaErrorInvalidValue;
  const int threads = threads_for_row(sq);
  const size_t smem = sizeof(float) * sq;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_forward_kernel<T, true><<<static_cast<unsigned>(rows), threads, smem, stream>>>(
        static_cast<const T*>(in), nullptr, static_cast<T*>(out), 0, sq, sq, 1, scale);
  });
}

cudaError_t upper_triang_softmax_backward(DType dtype, const void* grad, const void* out,
                                          void* dx, long long batches, int sq, float scale,
                                          cudaStream_t stream) {
  const long long rows = batches * sq;
  if (bad_row_shape(rows, sq)) return cudaErrorInvalidValue;
  const int threads = threads_for_row(sq);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_backward_kernel<T, true><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        static_cast<const T*>(grad), static_cast<const T*>(out), nullptr, static_cast<T*>(dx),
        0, sq, sq, 1, scale);
  });
}

cudaError_t masked_softmax_forward(DType dtype, const void* in, const unsigned char* mask,
                                   void* out, long long b, int np, int sq, int sk, int mask_b,
                                   float scale, cudaStream_t stream) {
  const long long per_batch = static_cast<long long>(np) * sq;
  const long long rows = b * per_batch;
  if (bad_row_shape(rows, sk) || (mask_b != 1 && mask_b != b)) return cudaErrorInvalidValue;
  const int threads = threads_for_row(sk);
  const size_t smem = sizeof(float) * sk;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_forward_kernel<T, false><<<static_cast<unsigned>(rows), threads, smem, stream>>>(
        static_cast<const T*>(in), mask, static_cast<T*>(out), per_batch, sq, sk, mask_b,
        scale);
  });
}

cudaError_t masked_softmax_backward(DType dtype, const void* grad, const void* out,
                                    const unsigned char* mask, void* dx, long long b, int np,
                                    int sq, int sk, int mask_b, float scale,
                                    cudaStream_t stream) {
  const long long per_batch = static_cast<long long>(np) * sq;
  const long long rows = b * per_batch;
  if (bad_row_shape(rows, sk) || (mask_b != 1 && mask_b != b)) return cudaErrorInvalidValue;
  const int threads = threads_for_row(sk);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_backward_kernel<T, false><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        static_cast<const T*>(grad), static_cast<const T*>(out), mask, static_cast<T*>(dx),
        per_batch, sq, sk, mask_b, scale);
  });
}

}  // namespace cuda
}  // namespace megatron_fused
