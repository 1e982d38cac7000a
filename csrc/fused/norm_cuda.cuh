// Pieces shared by the CUDA layer norm and RMSNorm (layer_norm_cuda.cu,
// rms_norm_cuda.cu): the shape check and the weight (and bias) gradients. Those are
// summed per (column, row split) into a float workspace by 32x8 thread tiles
// (coalesced over columns), then over splits, in a fixed order (deterministic).
// CUDA headers only.
#pragma once

#include <cuda_runtime.h>

#include "cuda_common.cuh"
#include "fused_cuda.h"

namespace megatron_fused {
namespace cuda {
namespace norm {

constexpr int kTileCols = 32;
constexpr int kTileRows = 8;

inline bool bad_shape(long long rows, int cols) {
  return rows <= 0 || rows > 0x7fffffffLL || cols <= 0 || cols > kMaxRowLength;
}

// workspace [splits, kLayerNorm ? 2 : 1, cols]: per split, the sum of dy * xhat (and, for
// the layer norm, of dy) over its rows. xhat = (x - mean) * rstd, or x * rstd for RMSNorm
// (mean unused).
template <typename T, bool kLayerNorm>
__global__ void param_partials_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                      const float* __restrict__ mean,
                                      const float* __restrict__ rstd,
                                      float* __restrict__ workspace, long long rows, int cols,
                                      long long rows_per_split) {
  constexpr int kOut = kLayerNorm ? 2 : 1;
  __shared__ float tile[kOut][kTileRows][kTileCols + 1];
  const int col = blockIdx.x * kTileCols + threadIdx.x;
  const long long r0 = blockIdx.y * rows_per_split;
  const long long r1 = r0 + rows_per_split < rows ? r0 + rows_per_split : rows;
  float acc_w = 0.0f;
  float acc_b = 0.0f;
  if (col < cols) {
    for (long long r = r0 + threadIdx.y; r < r1; r += kTileRows) {
      const float g = to_float(dy[r * cols + col]);
      const float centred = kLayerNorm ? to_float(x[r * cols + col]) - mean[r]
                                       : to_float(x[r * cols + col]);
      acc_w += g * centred * rstd[r];
      acc_b += g;
    }
  }
  tile[0][threadIdx.y][threadIdx.x] = acc_w;
  if constexpr (kLayerNorm) tile[1][threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float* part = workspace + kOut * static_cast<long long>(blockIdx.y) * cols;
    for (int o = 0; o < kOut; ++o) {
      float s = 0.0f;
      for (int k = 0; k < kTileRows; ++k) s += tile[o][k][threadIdx.x];
      part[o * cols + col] = s;
    }
  }
}

// dw (and db) from the workspace above, summed over splits in order.
template <typename T, bool kLayerNorm>
__global__ void param_final_kernel(const float* __restrict__ workspace, int splits, int cols,
                                   T* __restrict__ dw, T* __restrict__ db) {
  constexpr int kOut = kLayerNorm ? 2 : 1;
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float sw = 0.0f;
  float sb = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float* part = workspace + kOut * static_cast<long long>(s) * cols;
    sw += part[col];
    if constexpr (kLayerNorm) sb += part[cols + col];
  }
  dw[col] = from_float<T>(sw);
  if constexpr (kLayerNorm) db[col] = from_float<T>(sb);
}

// Enqueues both kernels; workspace holds (kLayerNorm ? 2 : 1) * norm_backward_splits(rows)
// * cols floats; db is unused for RMSNorm.
template <typename T, bool kLayerNorm>
void launch_param_grads(const T* dy, const T* x, const float* mean, const float* rstd,
                        float* workspace, T* dw, T* db, long long rows, int cols,
                        cudaStream_t stream) {
  const int splits = norm_backward_splits(rows);
  const long long rows_per_split = (rows + splits - 1) / splits;
  const dim3 tile_grid((cols + kTileCols - 1) / kTileCols, splits);
  const dim3 tile_block(kTileCols, kTileRows);
  param_partials_kernel<T, kLayerNorm><<<tile_grid, tile_block, 0, stream>>>(
      dy, x, mean, rstd, workspace, rows, cols, rows_per_split);
  param_final_kernel<T, kLayerNorm><<<(cols + 255) / 256, 256, 0, stream>>>(
      workspace, splits, cols, dw, db);
}

}  // namespace norm
}  // namespace cuda
}  // namespace megatron_fused
