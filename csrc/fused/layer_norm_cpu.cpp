// CPU kernels for the fused layer norm (see cpu_kernels.h).
//
// Forward: per row, mean and variance in two passes over the cached row, then the
// affine output. Backward: per row, dx in two passes; the weight and bias
// gradients are summed per fixed block of rows into float partials, which are
// then added up column-wise. The fixed blocks make the result independent of the
// number of threads.
#include <cmath>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu_kernels.h"
#include "cpu_math.h"
#include "cpu_rows.h"

namespace megatron_fused {
namespace cpu {
namespace {

// Number of row blocks for the weight/bias gradient partials: at most 128, at least
// 8 rows each. Depends only on the shape.
inline int64_t num_row_blocks(int64_t rows) {
  const int64_t blocks = (rows + 7) / 8;
  return blocks < 128 ? blocks : 128;
}

// Sums partials [blocks, 2, cols] over blocks into dw and db.
template <typename T>
void reduce_partials(const std::vector<float>& part, int64_t blocks, int64_t cols, T* dw,
                     T* db) {
  at::parallel_for(0, cols, 256, [&](int64_t begin, int64_t end) {
    const int64_t n = end - begin;
    std::vector<float> acc(2 * n, 0.0f);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const float* p = part.data() + blk * 2 * cols;
      add_inplace(acc.data(), p + begin, n);
      add_inplace(acc.data() + n, p + cols + begin, n);
    }
    for (int64_t j = 0; j < n; ++j) {
      dw[begin + j] = static_cast<T>(acc[j]);
      db[begin + j] = static_cast<T>(acc[n + j]);
    }
  });
}

}  // namespace

template <typename T>
void layer_norm_forward(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd,
                        int64_t rows, int64_t cols, float eps) {
  std::vector<float> wbuf = scratch<T>(cols);
  std::vector<float> bbuf = scratch<T>(cols);
  const float* wf = load_row(w, wbuf.data(), cols);
  const float* bf = load_row(b, bbuf.data(), cols);
  const float inv_n = 1.0f / static_cast<float>(cols);
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> buf = scratch<T>(cols);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = load_row(x + r * cols, buf.data(), cols);
      const float mu = sum(xr, cols) * inv_n;
      const float var = sum_sq_dev(xr, cols, mu) * inv_n;
      const float rs = 1.0f / std::sqrt(var + eps);
      float* yr = result_row(y + r * cols, buf.data());
      layer_norm_affine(yr, xr, wf, bf, cols, mu, rs);
      store_row(y + r * cols, yr, cols);
      mean[r] = mu;
      rstd[r] = rs;
    }
  });
}

template <typename T>
void layer_norm_backward(const T* dy, const T* x, const float* mean, const float* rstd,
                         const T* w, T* dx, T* dw, T* db, int64_t rows, int64_t cols) {
  std::vector<float> wbuf = scratch<T>(cols);
  const float* wf = load_row(w, wbuf.data(), cols);
  const int64_t blocks = num_row_blocks(rows);
  const int64_t rows_per_block = blocks > 0 ? (rows + blocks - 1) / blocks : 0;
  std::vector<float> part(blocks * 2 * cols, 0.0f);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xbuf = scratch<T>(cols);
    std::vector<float> gbuf = scratch<T>(cols);
    for (int64_t blk = begin; blk < end; ++blk) {
      float* dgamma = part.data() + blk * 2 * cols;
      const int64_t r_end = std::min(rows, (blk + 1) * rows_per_block);
      for (int64_t r = blk * rows_per_block; r < r_end; ++r) {
        const float* xr = load_row(x + r * cols, xbuf.data(), cols);
        const float* gr = load_row(dy + r * cols, gbuf.data(), cols);
        float* dxr = result_row(dx + r * cols, gbuf.data());
        layer_norm_grad_row(dxr, dgamma, dgamma + cols, gr, xr, wf, cols, mean[r], rstd[r]);
        store_row(dx + r * cols, dxr, cols);
      }
    }
  });
  reduce_partials(part, blocks, cols, dw, db);
}

#define MF_INSTANTIATE_LAYER_NORM(T)                                                        \
  template void layer_norm_forward<T>(const T*, const T*, const T*, T*, float*, float*,     \
                                      int64_t, int64_t, float);                             \
  template void layer_norm_backward<T>(const T*, const T*, const float*, const float*,      \
                                       const T*, T*, T*, T*, int64_t, int64_t);

MF_INSTANTIATE_LAYER_NORM(float)
MF_INSTANTIATE_LAYER_NORM(c10::BFloat16)
MF_INSTANTIATE_LAYER_NORM(c10::Half)
#undef MF_INSTANTIATE_LAYER_NORM

}  // namespace cpu
}  // namespace megatron_fused
