// CUDA fused kernels on raw device pointers (launchers defined in the .cu files).
//
// This header and the .cu files include only CUDA headers, so they compile with a
// bare nvcc; bindings_cuda.cpp turns torch tensors into these calls. All arrays
// are contiguous and row-major; arithmetic is in float whatever the storage type.
// Each launcher enqueues on `stream` and returns the launch status.
#pragma once

#include <cuda_runtime.h>

namespace megatron_fused {
namespace cuda {

// Storage type of the float arrays (`void*` arguments).
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Rows are staged in shared memory as float: the softmax row (sk) and the
// layer-norm / RMSNorm row (cols) may be at most this long.
constexpr int kMaxRowLength = 8192;

// softmax(scale * x) of [batches, sq, sq] with j > i masked out (zeros there).
cudaError_t upper_triang_softmax_forward(DType dtype, const void* in, void* out,
                                         long long batches, int sq, float scale,
                                         cudaStream_t stream);
// dx = scale * y * (g - sum(g * y)) from the saved output y.
cudaError_t upper_triang_softmax_backward(DType dtype, const void* grad, const void* out,
                                          void* dx, long long batches, int sq, float scale,
                                          cudaStream_t stream);

// softmax over rows of x [b, np, sq, sk] where x*scale becomes -10000 wherever
// mask [mask_b, 1, sq, sk] (bytes, non-zero = masked) is set; mask_b is 1 or b.
cudaError_t masked_softmax_forward(DType dtype, const void* in, const unsigned char* mask,
                                   void* out, long long b, int np, int sq, int sk, int mask_b,
                                   float scale, cudaStream_t stream);
// Backward of the above; masked positions get zero gradient.
cudaError_t masked_softmax_backward(DType dtype, const void* grad, const void* out,
                                    const unsigned char* mask, void* dx, long long b, int np,
                                    int sq, int sk, int mask_b, float scale,
                                    cudaStream_t stream);

// y = (x - mean) * rstd * w + b per row of x [rows, cols]; mean, rstd: float [rows].
cudaError_t layer_norm_forward(DType dtype, const void* x, const void* w, const void* b, void* y,
                               float* mean, float* rstd, long long rows, int cols, float eps,
                               cudaStream_t stream);

// Number of row splits of the norms' weight/bias gradients; the caller passes a float
// workspace of 2 * norm_backward_splits(rows) * cols elements to layer_norm_backward,
// norm_backward_splits(rows) * cols to rms_norm_backward.
int norm_backward_splits(long long rows);

// dx [rows, cols], dw and db [cols] (storage dtype) from dy, x, mean, rstd and w.
cudaError_t layer_norm_backward(DType dtype, const void* dy, const void* x, const float* mean,
                                const float* rstd, const void* w, void* dx, void* dw, void* db,
                                float* workspace, long long rows, int cols,
                                cudaStream_t stream);

// y = w * (x * rstd) per row of x [rows, cols], rstd = 1/sqrt(mean(x^2) + eps) saved as
// float [rows]; for 16-bit storage x * rstd is rounded before the weight multiplies it.
cudaError_t rms_norm_forward(DType dtype, const void* x, const void* w, void* y, float* rstd,
                             long long rows, int cols, float eps, cudaStream_t stream);

// dx [rows, cols] and dw [cols] (storage dtype) from dy, x, rstd and w.
cudaError_t rms_norm_backward(DType dtype, const void* dy, const void* x, const float* rstd,
                              const void* w, void* dx, void* dw, float* workspace,
                              long long rows, int cols, cudaStream_t stream);

}  // namespace cuda
}  // namespace megatron_fused
