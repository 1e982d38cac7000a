// CPU kernels for the fused RMSNorm (see cpu_kernels.h).
//
// Forward: per row, the sum of squares of the cached row, then the scaled output.
// Backward: per row, dx in two passes; the weight gradient is summed by
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
namespace {

// Row r of y from its float input xr (xr is `buf` for 16-bit types).
template <typename T>
void rms_norm_row(T* yr, const float* xr, const float* wf, float* buf, int64_t cols, float rs) {
  if constexpr (std::is_same_v<T, float>) {
    scaled_product(yr, xr, wf, cols, rs);
  } else {
    // x * rstd rounded to T, then times the weight: the plain path's two roundings.
    scale_inplace(buf, cols, rs);
    from_float(yr, buf, cols);
    to_float(buf, yr, cols);
    scaled_product(buf, buf, wf, cols, 1.0f);
    from_float(yr, buf, cols);
  }
}

}  // namespace

template <typename T>
void rms_norm_forward(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t cols,
                      float eps) {
  std::vector<float> wbuf = scratch<T>(cols);
  const float* wf = load_row(w, wbuf.data(), cols);
  const float inv_n = 1.0f / static_cast<float>(cols);
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> buf = scratch<T>(cols);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = load_row(x + r * cols, buf.data(), cols);
      const float rs = 1.0f / std::sqrt(sum_sq_dev(xr, cols, 0.0f) * inv_n + eps);
      rms_norm_row(y + r * cols, xr, wf, buf.data(), cols, rs);
      rstd[r] = rs;
    }
  });
}

template <typename T>
void rms_norm_backward(const T* dy, const T* x, const float* rstd, const T* w, T* dx, T* dw,
                       int64_t rows, int64_t cols) {
  std::vector<float> wbuf = scratch<T>(cols);
  const float* wf = load_row(w, wbuf.data(), cols);
  sum_rows_by_blocks(rows, cols, {dw}, [&](int64_t r_begin, int64_t r_end, float* part) {
    std::vector<float> xbuf = scratch<T>(cols);
    std::vector<float> gbuf = scratch<T>(cols);
    for (int64_t r = r_begin; r < r_end; ++r) {
      const float* xr = load_row(x + r * cols, xbuf.data(), cols);
      const float* gr = load_row(dy + r * cols, gbuf.data(), cols);
      float* dxr = result_row(dx + r * cols, gbuf.data());
      rms_norm_grad_row(dxr, part, gr, xr, wf, cols, rstd[r]);
      store_row(dx + r * cols, dxr, cols);
    }
  });
}

#define MF_INSTANTIATE_RMS_NORM(T)                                                          \
  template void rms_norm_forward<T>(const T*, const T*, T*, float*, int64_t, int64_t,       \
                                    float);                                                 \
  template void rms_norm_backward<T>(const T*, const T*, const float*, const T*, T*, T*,    \
                                     int64_t, int64_t);

MF_INSTANTIATE_RMS_NORM(float)
MF_INSTANTIATE_RMS_NORM(c10::BFloat16)
MF_INSTANTIATE_RMS_NORM(c10::Half)
#undef MF_INSTANTIATE_RMS_NORM

}  // namespace cpu
}  // namespace megatron_fused
