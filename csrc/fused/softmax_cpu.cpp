// CPU kernels for the fused attention softmax (see cpu_kernels.h).
//
// Each row is done in one go while it sits in cache: max, exp and sum, normalise.
// The causal kernel only touches the unmasked prefix of a row (j <= i) and writes
// zeros after it, which halves the work compared with masking a full row.
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

// softmax of x[0:valid] * scale into y[0:valid]; y[valid:len] = 0.
inline void causal_row_forward(const float* x, float* y, int64_t valid, int64_t len,
                               float scale) {
  const float m = scaled_max(x, valid, scale);
  const float s = scaled_exp_sum(y, x, valid, scale, m);
  scale_inplace(y, valid, 1.0f / s);
  fill_zero(y + valid, len - valid);
}

}  // namespace

template <typename T>
void upper_triang_softmax_forward(const T* in, T* out, int64_t batches, int64_t sq,
                                  float scale) {
  at::parallel_for(0, batches * sq, grain_rows(sq), [&](int64_t begin, int64_t end) {
    std::vector<float> buf = scratch<T>(sq);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t valid = r % sq + 1;
      const float* x = load_row(in + r * sq, buf.data(), valid);
      float* y = result_row(out + r * sq, buf.data());
      causal_row_forward(x, y, valid, sq, scale);
      store_row(out + r * sq, y, sq);
    }
  });
}

template <typename T>
void upper_triang_softmax_backward(const T* grad, const T* out, T* dx, int64_t batches,
                                   int64_t sq, float scale) {
  at::parallel_for(0, batches * sq, grain_rows(sq), [&](int64_t begin, int64_t end) {
    std::vector<float> gbuf = scratch<T>(sq);
    std::vector<float> ybuf = scratch<T>(sq);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t valid = r % sq + 1;
      const float* g = load_row(grad + r * sq, gbuf.data(), valid);
      const float* y = load_row(out + r * sq, ybuf.data(), valid);
      float* d = result_row(dx + r * sq, gbuf.data());
      softmax_grad(d, g, y, valid, dot(g, y, valid), scale);
      fill_zero(d + valid, sq - valid);
      store_row(dx + r * sq, d, sq);
    }
  });
}

template <typename T>
void masked_softmax_forward(const T* in, const uint8_t* mask, T* out, int64_t b, int64_t np,
                            int64_t sq, int64_t sk, int64_t mask_b, float scale) {
  const int64_t per_batch = np * sq;
  at::parallel_for(0, b * per_batch, grain_rows(sk), [&](int64_t begin, int64_t end) {
    std::vector<float> buf = scratch<T>(sk);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t mb = mask_b == 1 ? 0 : r / per_batch;
      const uint8_t* mrow = mask + (mb * sq + r % sq) * sk;
      const float* x = load_row(in + r * sk, buf.data(), sk);
      float* y = result_row(out + r * sk, buf.data());
      const float m = masked_scaled_max(x, mrow, sk, scale);
      const float s = masked_scaled_exp_sum(y, x, mrow, sk, scale, m);
      scale_inplace(y, sk, 1.0f / s);
      store_row(out + r * sk, y, sk);
    }
  });
}

template <typename T>
void masked_softmax_backward(const T* grad, const T* out, const uint8_t* mask, T* dx, int64_t b,
                             int64_t np, int64_t sq, int64_t sk, int64_t mask_b, float scale) {
  const int64_t per_batch = np * sq;
  at::parallel_for(0, b * per_batch, grain_rows(sk), [&](int64_t begin, int64_t end) {
    std::vector<float> gbuf = scratch<T>(sk);
    std::vector<float> ybuf = scratch<T>(sk);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t mb = mask_b == 1 ? 0 : r / per_batch;
      const uint8_t* mrow = mask + (mb * sq + r % sq) * sk;
      const float* g = load_row(grad + r * sk, gbuf.data(), sk);
      const float* y = load_row(out + r * sk, ybuf.data(), sk);
      float* d = result_row(dx + r * sk, gbuf.data());
      masked_softmax_grad(d, g, y, mrow, sk, dot(g, y, sk), scale);
      store_row(dx + r * sk, d, sk);
    }
  });
}

#define MF_INSTANTIATE_SOFTMAX(T)                                                              \
  template void upper_triang_softmax_forward<T>(const T*, T*, int64_t, int64_t, float);        \
  template void upper_triang_softmax_backward<T>(const T*, const T*, T*, int64_t, int64_t,     \
                                                 float);                                       \
  template void masked_softmax_forward<T>(const T*, const uint8_t*, T*, int64_t, int64_t,      \
                                          int64_t, int64_t, int64_t, float);                   \
  template void masked_softmax_backward<T>(const T*, const T*, const uint8_t*, T*, int64_t,    \
                                           int64_t, int64_t, int64_t, int64_t, float);

MF_INSTANTIATE_SOFTMAX(float)
MF_INSTANTIATE_SOFTMAX(c10::BFloat16)
MF_INSTANTIATE_SOFTMAX(c10::Half)
#undef MF_INSTANTIATE_SOFTMAX

}  // namespace cpu
}  // namespace megatron_fused
