// Row primitives for the CPU kernels: plain loops over contiguous float rows.
//
// Every function works on one row of `n` elements, in vectors of the instruction set
// the library is built for (AVX-512, AVX2 or baseline: megatron/fused/kernels.py).
#pragma once

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace megatron_fused {
namespace cpu {

// Value given to masked-out attention scores before the softmax (Megatron's convention).
constexpr float kMaskedValue = -10000.0f;

// max_j (x[j] * scale).
float scaled_max(const float* x, int64_t n, float scale);
// Same, where mask[j] != 0 counts as kMaskedValue instead of x[j] * scale.
float masked_scaled_max(const float* x, const uint8_t* mask, int64_t n, float scale);

// y[j] = exp(x[j] * scale - m); returns sum_j y[j]. y may alias x.
float scaled_exp_sum(float* y, const float* x, int64_t n, float scale, float m);
// Same with masked entries taking kMaskedValue. y may alias x.
float masked_scaled_exp_sum(float* y, const float* x, const uint8_t* mask, int64_t n,
                            float scale, float m);

// y[j] *= factor.
void scale_inplace(float* y, int64_t n, float factor);
// y[j] = 0.
void fill_zero(float* y, int64_t n);

// sum_j a[j] * b[j].
float dot(const float* a, const float* b, int64_t n);
// dx[j] = y[j] * (g[j] - gy) * scale (softmax backward). dx may alias g or y.
void softmax_grad(float* dx, const float* g, const float* y, int64_t n, float gy, float scale);
// Same, with dx[j] = 0 where mask[j] != 0.
void masked_softmax_grad(float* dx, const float* g, const float* y, const uint8_t* mask,
                         int64_t n, float gy, float scale);

// sum_j x[j] and sum_j (x[j] - mean)^2.
float sum(const float* x, int64_t n);
float sum_sq_dev(const float* x, int64_t n, float mean);
// y[j] = (x[j] - mean) * rstd * w[j] + b[j]. y may alias x.
void layer_norm_affine(float* y, const float* x, const float* w, const float* b, int64_t n,
                       float mean, float rstd);
// One row of the layer-norm backward. Computes s1 = sum(dy*w), s2 = sum(dy*w*xhat),
// then dx = rstd * (dy*w - s1/n - xhat*s2/n), and accumulates dgamma += dy*xhat,
// dbeta += dy. dx may alias dy.
void layer_norm_grad_row(float* dx, float* dgamma, float* dbeta, const float* dy,
                         const float* x, const float* w, int64_t n, float mean, float rstd);
// y[j] = x[j] * s * w[j] (RMSNorm forward). y may alias x.
void scaled_product(float* y, const float* x, const float* w, int64_t n, float s);
// One row of the RMSNorm backward. With xhat = x*rstd computes c = sum(dy*w*xhat)/n,
// then dx = rstd * (dy*w - xhat*c), and accumulates dgamma += dy*xhat. dx may alias dy.
void rms_norm_grad_row(float* dx, float* dgamma, const float* dy, const float* x,
                       const float* w, int64_t n, float rstd);
// y[j] = gelu_tanh(x[j] + b[j]) (GPT-2's tanh-approximated GeLU); b may be null. y may alias x.
void bias_gelu_row(float* y, const float* x, const float* b, int64_t n);
// dx[j] = g[j] * gelu_tanh'(x[j] + b[j]); b may be null; db (may be null) += dx.
// dx may alias g.
void bias_gelu_grad_row(float* dx, float* db, const float* g, const float* x, const float* b,
                        int64_t n);
// acc[j] += x[j].
void add_inplace(float* acc, const float* x, int64_t n);
// acc[j] += float(x[j]) (a bfloat16 gradient into its float32 accumulator).
void add_inplace(float* acc, const c10::BFloat16* x, int64_t n);

// Conversions between float rows and 16-bit storage (round to nearest even).
void to_float(float* dst, const c10::BFloat16* src, int64_t n);
void to_float(float* dst, const c10::Half* src, int64_t n);
void from_float(c10::BFloat16* dst, const float* src, int64_t n);
void from_float(c10::Half* dst, const float* src, int64_t n);
// to_float that also returns sum_j dst[j] (the layer norm's first pass over a bf16 row).
float to_float_sum(float* dst, const c10::BFloat16* src, int64_t n);
// layer_norm_affine with y rounded to bfloat16 as it is stored.
void layer_norm_affine(c10::BFloat16* y, const float* x, const float* w, const float* b,
                       int64_t n, float mean, float rstd);

}  // namespace cpu
}  // namespace megatron_fused
