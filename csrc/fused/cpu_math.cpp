// Row primitives for the CPU kernels (see cpu_math.h).
//
// The arithmetic is written on LaneVec, one vector register of floats handled as one
// value through the GCC/Clang vector extension (cpu_lanes.h; the library is built for one
// instruction set). Reductions keep kLanes partial results and add them at the end, so no
// -ffast-math is needed. exp() is a short polynomial accurate to about 2 ulp.
// Row tails shorter than kLanes go through a padded LaneVec, so every element sees
// the same arithmetic.
#include "cpu_math.h"

#include <cstring>
#include <limits>

#include "cpu_lanes.h"

namespace megatron_fused {
namespace cpu {

using namespace lanes;

namespace {

inline LaneVec masked_scores(const LaneVec& x, const LaneInt& masked, float scale) {
  return select(masked, splat(kMaskedValue), x * scale);
}

}  // namespace

float scaled_max(const float* x, int64_t n, float scale) {
  LaneVec acc = splat(-kInf);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = vmax(acc, load(x + i) * scale);
  if (i < n) {
    const LaneVec v = load_part(x + i, n - i, 0.0f) * scale;
    acc = vmax(acc, select(first_lanes(n - i), v, splat(-kInf)));
  }
  return hmax(acc);
}

float masked_scaled_max(const float* x, const uint8_t* mask, int64_t n, float scale) {
  LaneVec acc = splat(-kInf);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    acc = vmax(acc, masked_scores(load(x + i), load_mask(mask + i), scale));
  if (i < n) {
    const LaneVec v = masked_scores(load_part(x + i, n - i, 0.0f), load_mask(mask + i, n - i),
                                    scale);
    acc = vmax(acc, select(first_lanes(n - i), v, splat(-kInf)));
  }
  return hmax(acc);
}

float scaled_exp_sum(float* y, const float* x, int64_t n, float scale, float m) {
  LaneVec acc = splat(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const LaneVec e = exp_lanes(load(x + i) * scale - m);
    store(y + i, e);
    acc += e;
  }
  if (i < n) {
    const LaneVec e = exp_lanes(load_part(x + i, n - i, 0.0f) * scale - m);
    store_part(y + i, e, n - i);
    acc += select(first_lanes(n - i), e, splat(0.0f));
  }
  return hsum(acc);
}

float masked_scaled_exp_sum(float* y, const float* x, const uint8_t* mask, int64_t n,
                                      float scale, float m) {
  LaneVec acc = splat(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const LaneVec e = exp_lanes(masked_scores(load(x + i), load_mask(mask + i), scale) - m);
    store(y + i, e);
    acc += e;
  }
  if (i < n) {
    const LaneVec s =
        masked_scores(load_part(x + i, n - i, 0.0f), load_mask(mask + i, n - i), scale);
    const LaneVec e = exp_lanes(s - m);
    store_part(y + i, e, n - i);
    acc += select(first_lanes(n - i), e, splat(0.0f));
  }
  return hsum(acc);
}

void scale_inplace(float* y, int64_t n, float factor) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, load(y + i) * factor);
  for (; i < n; ++i) y[i] *= factor;
}

void fill_zero(float* y, int64_t n) {
  if (n > 0) std::memset(y, 0, sizeof(float) * n);
}

float dot(const float* a, const float* b, int64_t n) {
  LaneVec acc[1];
  int64_t i;
  sum_parts<kParts>(n, i, acc, [&](int64_t j, LaneVec* s) { s[0] += load(a + j) * load(b + j); });
  if (i < n) acc[0] += load_part(a + i, n - i, 0.0f) * load_part(b + i, n - i, 0.0f);
  return hsum(acc[0]);
}

void softmax_grad(float* dx, const float* g, const float* y, int64_t n, float gy,
                            float scale) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(dx + i, load(y + i) * (load(g + i) - gy) * scale);
  for (; i < n; ++i) dx[i] = y[i] * (g[i] - gy) * scale;
}

void masked_softmax_grad(float* dx, const float* g, const float* y,
                                   const uint8_t* mask, int64_t n, float gy, float scale) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const LaneVec v = load(y + i) * (load(g + i) - gy) * scale;
    store(dx + i, select(load_mask(mask + i), splat(0.0f), v));
  }
  for (; i < n; ++i) dx[i] = mask[i] ? 0.0f : y[i] * (g[i] - gy) * scale;
}

float sum(const float* x, int64_t n) {
  LaneVec acc[1];
  int64_t i;
  sum_parts<kParts>(n, i, acc, [&](int64_t j, LaneVec* s) { s[0] += load(x + j); });
  if (i < n) acc[0] += load_part(x + i, n - i, 0.0f);
  return hsum(acc[0]);
}

float sum_sq_dev(const float* x, int64_t n, float mean) {
  LaneVec acc[1];
  int64_t i;
  sum_parts<kParts>(n, i, acc, [&](int64_t j, LaneVec* s) {
    const LaneVec d = load(x + j) - mean;
    s[0] += d * d;
  });
  if (i < n) {
    const LaneVec d = load_part(x + i, n - i, mean) - mean;  // padding contributes 0
    acc[0] += d * d;
  }
  return hsum(acc[0]);
}

void layer_norm_affine(float* y, const float* x, const float* w, const float* b,
                                 int64_t n, float mean, float rstd) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    store(y + i, (load(x + i) - mean) * rstd * load(w + i) + load(b + i));
  for (; i < n; ++i) y[i] = (x[i] - mean) * rstd * w[i] + b[i];
}

void layer_norm_grad_row(float* dx, float* dgamma, float* dbeta, const float* dy,
                                   const float* x, const float* w, int64_t n, float mean,
                                   float rstd) {
  LaneVec acc[2];
  int64_t i;
  sum_parts<2>(n, i, acc, [&](int64_t j, LaneVec* s) {
    const LaneVec d = load(dy + j);
    const LaneVec xhat = (load(x + j) - mean) * rstd;
    const LaneVec g = d * load(w + j);
    s[0] += g;
    s[1] += g * xhat;
    store(dgamma + j, load(dgamma + j) + d * xhat);
    store(dbeta + j, load(dbeta + j) + d);
  });
  float s1 = hsum(acc[0]);
  float s2 = hsum(acc[1]);
  for (int64_t j = i; j < n; ++j) {
    const float xhat = (x[j] - mean) * rstd;
    const float g = dy[j] * w[j];
    s1 += g;
    s2 += g * xhat;
    dgamma[j] += dy[j] * xhat;
    dbeta[j] += dy[j];
  }
  const float inv_n = 1.0f / static_cast<float>(n);
  const float c1 = s1 * inv_n;
  const float c2 = s2 * inv_n;
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const LaneVec xhat = (load(x + i) - mean) * rstd;
    store(dx + i, rstd * (load(dy + i) * load(w + i) - c1 - xhat * c2));
  }
  for (; i < n; ++i) dx[i] = rstd * (dy[i] * w[i] - c1 - (x[i] - mean) * rstd * c2);
}

void scaled_product(float* y, const float* x, const float* w, int64_t n, float s) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, load(x + i) * s * load(w + i));
  for (; i < n; ++i) y[i] = x[i] * s * w[i];
}

void rms_norm_grad_row(float* dx, float* dgamma, const float* dy, const float* x,
                                 const float* w, int64_t n, float rstd) {
  LaneVec acc[1];
  int64_t i;
  sum_parts<kParts>(n, i, acc, [&](int64_t j, LaneVec* s) {
    const LaneVec d = load(dy + j);
    const LaneVec xhat = load(x + j) * rstd;
    s[0] += d * load(w + j) * xhat;
    store(dgamma + j, load(dgamma + j) + d * xhat);
  });
  float s = hsum(acc[0]);
  for (int64_t j = i; j < n; ++j) {
    const float xhat = x[j] * rstd;
    s += dy[j] * w[j] * xhat;
    dgamma[j] += dy[j] * xhat;
  }
  const float c = s / static_cast<float>(n);
  for (i = 0; i + kLanes <= n; i += kLanes)
    store(dx + i, rstd * (load(dy + i) * load(w + i) - load(x + i) * rstd * c));
  for (; i < n; ++i) dx[i] = rstd * (dy[i] * w[i] - x[i] * rstd * c);
}

// gelu_tanh(u) = 0.5 u (1 + tanh(z)), z = sqrt(2/pi) (u + 0.044715 u^3), written as
// u * sigmoid(2z): the same function without cancellation near z = 0.
constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

inline LaneVec gelu_sigmoid(const LaneVec& u) {
  const LaneVec z = kGeluBeta * (u + kGeluKappa * u * u * u);
  return reciprocal(1.0f + exp_lanes(-2.0f * z));
}

inline LaneVec bias_lanes(const float* b, int64_t i, int64_t m) {
  if (b == nullptr) return splat(0.0f);
  return m == kLanes ? load(b + i) : load_part(b + i, m, 0.0f);
}

void bias_gelu_row(float* y, const float* x, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t m = n - i < kLanes ? n - i : kLanes;
    const LaneVec u = (m == kLanes ? load(x + i) : load_part(x + i, m, 0.0f)) + bias_lanes(b, i, m);
    const LaneVec out = u * gelu_sigmoid(u);
    if (m == kLanes) store(y + i, out); else store_part(y + i, out, m);
  }
}

// d/du [u s] with s = sigmoid(2z): s + 2 u s (1 - s) dz/du.
void bias_gelu_grad_row(float* dx, float* db, const float* g, const float* x,
                                  const float* b, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t m = n - i < kLanes ? n - i : kLanes;
    const LaneVec u = (m == kLanes ? load(x + i) : load_part(x + i, m, 0.0f)) + bias_lanes(b, i, m);
    const LaneVec gv = m == kLanes ? load(g + i) : load_part(g + i, m, 0.0f);
    const LaneVec s = gelu_sigmoid(u);
    const LaneVec dz = kGeluBeta * (1.0f + 3.0f * kGeluKappa * u * u);
    const LaneVec d = gv * (s + 2.0f * u * s * (1.0f - s) * dz);
    if (m == kLanes) {
      store(dx + i, d);
      if (db != nullptr) store(db + i, load(db + i) + d);
    } else {
      store_part(dx + i, d, m);
      if (db != nullptr) store_part(db + i, load_part(db + i, m, 0.0f) + d, m);
    }
  }
}

void add_inplace(float* acc, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(acc + i, load(acc + i) + load(x + i));
  for (; i < n; ++i) acc[i] += x[i];
}

// bfloat16 is the top half of a float: widen by shifting; narrow with round to
// nearest even, NaN kept as a quiet NaN (the same results as c10::BFloat16).
namespace {

inline LaneVec load_bf16(const c10::BFloat16* src) {
  LaneU16 h;
  std::memcpy(&h, src, sizeof(h));
  const LaneU32 bits = __builtin_convertvector(h, LaneU32) << 16;
  LaneVec f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline void store_bf16(c10::BFloat16* dst, const LaneVec& f) {
  LaneU32 bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const LaneU32 rounded = (bits + (0x7fffu + ((bits >> 16) & 1u))) >> 16;
  const LaneU32 out = (f != f) ? LaneU32{} + 0x7fc0u : rounded;
  const LaneU16 h = __builtin_convertvector(out, LaneU16);
  std::memcpy(dst, &h, sizeof(h));
}

}  // namespace

void add_inplace(float* acc, const c10::BFloat16* x, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(acc + i, load(acc + i) + load_bf16(x + i));
  for (; i < n; ++i) acc[i] += static_cast<float>(x[i]);
}

void to_float(float* dst, const c10::BFloat16* src, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(dst + i, load_bf16(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

float to_float_sum(float* dst, const c10::BFloat16* src, int64_t n) {
  LaneVec acc[1];
  int64_t i;
  sum_parts<kParts>(n, i, acc, [&](int64_t j, LaneVec* s) {
    const LaneVec f = load_bf16(src + j);
    store(dst + j, f);
    s[0] += f;
  });
  for (int64_t j = i; j < n; ++j) dst[j] = static_cast<float>(src[j]);
  if (i < n) acc[0] += load_part(dst + i, n - i, 0.0f);
  return hsum(acc[0]);
}

void from_float(c10::BFloat16* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store_bf16(dst + i, load(src + i));
  for (; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(src[i]);
}

void layer_norm_affine(c10::BFloat16* y, const float* x, const float* w, const float* b,
                       int64_t n, float mean, float rstd) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    store_bf16(y + i, (load(x + i) - mean) * rstd * load(w + i) + load(b + i));
  for (; i < n; ++i)
    y[i] = static_cast<c10::BFloat16>((x[i] - mean) * rstd * w[i] + b[i]);
}

void to_float(float* dst, const c10::Half* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

void from_float(c10::Half* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

}  // namespace cpu
}  // namespace megatron_fused
