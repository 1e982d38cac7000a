// CPU kernels for the fused layer norm (see cpu_kernels.h).
//
// Forward: per row, mean and variance in two passes over the cached row (a bf16 row is
// converted to float in the first), then the affine output, rounded to bf16 as it is
// stored. Backward: per row, dx in two passes; the weight and bias gradients are summed by
// sum_rows_by_blocks (cpu_rows.h), independent of the number of threads.
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
      const float* xr;
      float mu;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {  // bf16: converted and summed at once
        mu = to_float_sum(buf.data(), x + r * cols, cols) * inv_n;
        xr = buf.data();
      } else {
        xr = load_row(x + r * cols, buf.data(), cols);
        mu = sum(xr, cols) * inv_n;
      }
      const float var = sum_sq_dev(xr, cols, mu) * inv_n;
      const float rs = 1.0f / std::sqrt(var + eps);
      if constexpr (std::is_same_v<T, c10::Half>) {
        layer_norm_affine(buf.data(), xr, wf, bf, cols, mu, rs);
        from_float(y + r * cols, buf.data(), cols);
      } else {  // float and bf16 rows are stored as they are computed
        layer_norm_affine(y + r * cols, xr, wf, bf, cols, mu, rs);
      }
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
  sum_rows_by_blocks(rows, cols, {dw, db}, [&](int64_t r_begin, int64_t r_end, float* part) {
    std::vector<float> xbuf = scratch<T>(cols);
    std::vector<float> gbuf = scratch<T>(cols);
    for (int64_t r = r_begin; r < r_end; ++r) {
      const float* xr = load_row(x + r * cols, xbuf.data(), cols);
      const float* gr = load_row(dy + r * cols, gbuf.data(), cols);
      float* dxr = result_row(dx + r * cols, gbuf.data());
      layer_norm_grad_row(dxr, part, part + cols, gr, xr, wf, cols, mean[r], rstd[r]);
      store_row(dx + r * cols, dxr, cols);
    }
  });
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
