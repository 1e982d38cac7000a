// CPU kernels for the bias-GeLU of the MLP and the softmax numerator of the cross
// entropy (see cpu_kernels.h). Rows are spread over threads; each row is done in one
// pass while it sits in cache.
#include <limits>
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
void bias_gelu_forward(const T* x, const T* b, T* y, int64_t rows, int64_t cols) {
  std::vector<float> bbuf = scratch<T>(cols);
  const float* bf = b == nullptr ? nullptr : load_row(b, bbuf.data(), cols);
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> buf = scratch<T>(cols);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = load_row(x + r * cols, buf.data(), cols);
      float* yr = result_row(y + r * cols, buf.data());
      bias_gelu_row(yr, xr, bf, cols);
      store_row(y + r * cols, yr, cols);
    }
  });
}

template <typename T>
void bias_gelu_backward(const T* g, const T* x, const T* b, T* dx, T* db, int64_t rows,
                        int64_t cols) {
  std::vector<float> bbuf = scratch<T>(cols);
  const float* bf = b == nullptr ? nullptr : load_row(b, bbuf.data(), cols);
  auto grad_rows = [&](int64_t begin, int64_t end, float* part) {
    std::vector<float> xbuf = scratch<T>(cols);
    std::vector<float> gbuf = scratch<T>(cols);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = load_row(x + r * cols, xbuf.data(), cols);
      const float* gr = load_row(g + r * cols, gbuf.data(), cols);
      float* dxr = result_row(dx + r * cols, gbuf.data());
      bias_gelu_grad_row(dxr, part, gr, xr, bf, cols);
      store_row(dx + r * cols, dxr, cols);
    }
  };
  if (db == nullptr) {
    at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
      grad_rows(begin, end, nullptr);
    });
  } else {
    sum_rows_by_blocks(rows, cols, {db}, grad_rows);
  }
}

void add_to_float(float* acc, const c10::BFloat16* x, int64_t n) {
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    add_inplace(acc + begin, x + begin, end - begin);
  });
}

template <typename T>
void exp_sum_rows(T* x, float* row_max, float* sums, int64_t rows, int64_t cols,
                  bool given_max) {
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> buf = scratch<T>(cols);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = load_row(x + r * cols, buf.data(), cols);
      float* yr = result_row(x + r * cols, buf.data());  // in place: xr itself
      if (!given_max) row_max[r] = scaled_max(xr, cols, 1.0f);
      sums[r] = scaled_exp_sum(yr, xr, cols, 1.0f, row_max[r]);
      store_row(x + r * cols, yr, cols);
    }
  });
}

template <typename T>
void max_exp_sum_rows(const T* x, float* row_max, float* sums, int64_t rows, int64_t cols) {
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(cols), exps(cols);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = load_row(x + r * cols, buf.data(), cols);
      row_max[r] = scaled_max(xr, cols, 1.0f);
      // a row of -inf throughout (this shard's part of the vocabulary padding): no sum
      sums[r] = row_max[r] == -std::numeric_limits<float>::infinity()
                    ? 0.0f
                    : scaled_exp_sum(exps.data(), xr, cols, 1.0f, row_max[r]);
    }
  });
}

template <typename T>
void softmax_minus_target_rows(T* x, float* row_max, float* sums, const int64_t* target,
                               int64_t rows, int64_t cols, bool given) {
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> buf = scratch<T>(cols);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = load_row(x + r * cols, buf.data(), cols);
      float* yr = result_row(x + r * cols, buf.data());  // in place: xr itself
      if (!given) row_max[r] = scaled_max(xr, cols, 1.0f);
      const float sum = scaled_exp_sum(yr, xr, cols, 1.0f, row_max[r]);
      if (!given) sums[r] = sum;
      scale_inplace(yr, cols, 1.0f / sums[r]);
      if (target[r] >= 0) yr[target[r]] -= 1.0f;
      store_row(x + r * cols, yr, cols);
    }
  });
}

#define MF_INSTANTIATE_ELEMENTWISE(T)                                                       \
  template void bias_gelu_forward<T>(const T*, const T*, T*, int64_t, int64_t);             \
  template void bias_gelu_backward<T>(const T*, const T*, const T*, T*, T*, int64_t,        \
                                      int64_t);                                             \
  template void exp_sum_rows<T>(T*, float*, float*, int64_t, int64_t, bool);             \
  template void max_exp_sum_rows<T>(const T*, float*, float*, int64_t, int64_t);          \
  template void softmax_minus_target_rows<T>(T*, float*, float*, const int64_t*, int64_t,  \
                                             int64_t, bool);

MF_INSTANTIATE_ELEMENTWISE(float)
MF_INSTANTIATE_ELEMENTWISE(c10::BFloat16)
MF_INSTANTIATE_ELEMENTWISE(c10::Half)
#undef MF_INSTANTIATE_ELEMENTWISE

}  // namespace cpu
}  // namespace megatron_fused
