// CPU fused kernels on raw pointers. All tensors are contiguous, row-major.
// T is float, c10::BFloat16 or c10::Half; arithmetic is always in float.
// Rows are spread over threads with at::parallel_for.
#pragma once

#include <cstdint>

#include <c10/util/BFloat16.h>

namespace megatron_fused {
namespace cpu {

// softmax(scale * x) over the last dim of [batches, sq, sq] with j > i masked out.
template <typename T>
void upper_triang_softmax_forward(const T* in, T* out, int64_t batches, int64_t sq, float scale);

// dx = scale * y * (g - sum(g * y)) for the kernel above; y is its saved output.
template <typename T>
void upper_triang_softmax_backward(const T* grad, const T* out, T* dx, int64_t batches,
                                   int64_t sq, float scale);

// softmax over the last dim of x [b, np, sq, sk] where x*scale is replaced by -10000
// wherever mask [mask_b, 1, sq, sk] is non-zero; mask_b is 1 or b.
template <typename T>
void masked_softmax_forward(const T* in, const uint8_t* mask, T* out, int64_t b, int64_t np,
                            int64_t sq, int64_t sk, int64_t mask_b, float scale);

// Backward of the kernel above; masked positions get a zero gradient.
template <typename T>
void masked_softmax_backward(const T* grad, const T* out, const uint8_t* mask, T* dx, int64_t b,
                             int64_t np, int64_t sq, int64_t sk, int64_t mask_b, float scale);

// y = (x - mean) * rstd * w + b per row of x [rows, cols]; mean and rstd are float [rows].
template <typename T>
void layer_norm_forward(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd,
                        int64_t rows, int64_t cols, float eps);

// Gradients of layer_norm_forward: dx [rows, cols], dw and db [cols]. The weight and bias
// gradients are summed in a fixed order, so results do not depend on the thread count.
template <typename T>
void layer_norm_backward(const T* dy, const T* x, const float* mean, const float* rstd,
                         const T* w, T* dx, T* dw, T* db, int64_t rows, int64_t cols);

// y = w * (x * rstd) per row of x [rows, cols], rstd = 1/sqrt(mean(x^2) + eps) saved as
// float [rows]. For 16-bit T, x * rstd is rounded to T before the weight multiplies it
// (as Hugging Face's LlamaRMSNorm does).
template <typename T>
void rms_norm_forward(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t cols,
                      float eps);

// Gradients of rms_norm_forward: dx [rows, cols] and dw [cols], dw summed in a fixed order.
template <typename T>
void rms_norm_backward(const T* dy, const T* x, const float* rstd, const T* w, T* dx, T* dw,
                       int64_t rows, int64_t cols);

// y = gelu_tanh(x + b) over x [rows, cols], b [cols] or null.
template <typename T>
void bias_gelu_forward(const T* x, const T* b, T* y, int64_t rows, int64_t cols);

// dx = g * gelu_tanh'(x + b); db [cols] (when b is given) is the column sum of dx,
// summed in a fixed order.
template <typename T>
void bias_gelu_backward(const T* g, const T* x, const T* b, T* dx, T* db, int64_t rows,
                        int64_t cols);

// acc[j] += float(x[j]) for j < n, over threads: a bfloat16 gradient added into its float32
// accumulator in one pass (torch's mixed-dtype add_ first makes a float32 copy of x).
void add_to_float(float* acc, const c10::BFloat16* x, int64_t n);

// The softmax numerator of the cross entropy, in place: x [rows, cols] <- exp(x - max),
// sums [rows] = row sums of the result (float). With given_max the float row_max [rows]
// is read (the max over all TP shards), else each row's own max is written there.
template <typename T>
void exp_sum_rows(T* x, float* row_max, float* sums, int64_t rows, int64_t cols, bool given_max);

// The cross entropy of 16-bit logits, whose float32 softmax is not kept: row_max [rows] and
// sums [rows] of exp(x - row_max) in float32, x unchanged (a row that is -inf throughout:
// max -inf, sum 0).
template <typename T>
void max_exp_sum_rows(const T* x, float* row_max, float* sums, int64_t rows, int64_t cols);

// In place, x [rows, cols] <- exp(x - row_max) / sums - [j == target]: d loss / d logits up
// to each row's loss gradient, computed in float32 and rounded once. given: row_max and sums
// are read (the max and sum over every shard's columns, from max_exp_sum_rows), else each
// row's own are written there (one pass). target [rows]: the column on this shard, < 0 where
// none.
template <typename T>
void softmax_minus_target_rows(T* x, float* row_max, float* sums, const int64_t* target,
                               int64_t rows, int64_t cols, bool given);

// Attention dropout of one (batch, head): probability (i, j) is kept where
// hash(key, i * keys + j) >= threshold (probability 1 - p) and then scaled by 1 / (1 - p).
// The key comes from the seed and the task (b * heads + head), so the mask is a function
// of (seed, task, i, j) alone and the backward regenerates it.
struct Dropout {
  uint32_t threshold = 0;  // 0: no dropout
  float scale = 1.0f;      // 1 / (1 - p)
  uint32_t k0 = 0, k1 = 0;
  uint32_t keys = 0;       // keys per row (the counter's row stride)
  bool active() const { return threshold != 0; }
};
// Dropout with probability p (0 <= p < 1; p = 0 or below 2^-32: none) of task `task` for
// rows of `keys` keys (keys^2 < 2^32).
Dropout attention_dropout(double p, uint64_t seed, int64_t task, int64_t keys);
// keep[i * keys + j] = 1 where the kernels keep probability (i, j), else 0, for i < rows.
void attention_dropout_keep(uint8_t* keep, int64_t rows, const Dropout& drop);

// Self-attention of one (batch, head), float32 (attention_cpu.cpp): q, k, v, o, dout rows
// [sq, hn] at the given row strides (hn contiguous, a multiple of 16); causal: keys
// j <= i, else all sq keys; lse [sq] the log-sum-exp of each row of scale * q k^T over
// the visible keys (before dropout). `work` holds attention_work_floats floats. The
// backward writes dq, dk, dv. sink (null: none): the head's attention-sink logit, which
// joins each row's softmax denominator (and its lse) with no value; the backward takes
// the lse that includes it. window (causal only; 0: none): row i sees keys
// i - window < j <= i.
void attention_head_forward(const float* q, int64_t qs, const float* k, int64_t ks,
                            const float* v, int64_t vs, float* o, int64_t os, float* lse,
                            int64_t sq, int64_t hn, float scale, bool causal,
                            const Dropout& drop, float* work, const float* sink = nullptr,
                            int64_t window = 0);
void attention_head_backward(const float* q, int64_t qs, const float* k, int64_t ks,
                             const float* v, int64_t vs, const float* o, int64_t os,
                             const float* dout, int64_t dos, const float* lse, float* dq,
                             int64_t dqs, float* dk, int64_t dks, float* dv, int64_t dvs,
                             int64_t sq, int64_t hn, float scale, bool causal,
                             const Dropout& drop, float* work, int64_t window = 0);
int64_t attention_work_floats(int64_t sq, int64_t hn);

// The same in bfloat16 with the AVX512-BF16 dot products (attention_bf16_cpu.cpp): q, k, v,
// o, dout, dq, dk, dv bfloat16 (as uint16_t), lse and the sums float32; p and ds rounded to
// bfloat16 before their products. Only where attention_bf16_supported() (the avx512 build
// on a CPU with AVX512-BF16); `work` holds attention_bf16_work_floats floats.
bool attention_bf16_supported();
void attention_head_forward(const uint16_t* q, int64_t qs, const uint16_t* k, int64_t ks,
                            const uint16_t* v, int64_t vs, uint16_t* o, int64_t os,
                            float* lse, int64_t sq, int64_t hn, float scale, bool causal,
                            const Dropout& drop, float* work, const float* sink,
                            int64_t window);
void attention_head_backward(const uint16_t* q, int64_t qs, const uint16_t* k, int64_t ks,
                             const uint16_t* v, int64_t vs, const uint16_t* o, int64_t os,
                             const uint16_t* dout, int64_t dos, const float* lse,
                             uint16_t* dq, int64_t dqs, uint16_t* dk, int64_t dks,
                             uint16_t* dv, int64_t dvs, int64_t sq, int64_t hn, float scale,
                             bool causal, const Dropout& drop, float* work, int64_t window);
int64_t attention_bf16_work_floats(int64_t sq, int64_t hn);

// The same bfloat16 attention with oneDNN's microkernels for its products
// (at::native::cpublas::brgemm: AMX tiles on a CPU with AMX-BF16, else AVX512-BF16), chosen
// by the measured auto against the dot products above (megatron/fused/attention.py). Only
// where attention_brgemm_supported() (attention_bf16_supported() and a torch whose oneDNN
// has the bfloat16 microkernels); attention_brgemm_amx(): whether oneDNN uses AMX for them.
bool attention_brgemm_supported();
bool attention_brgemm_amx();
void attention_head_forward_brgemm(const uint16_t* q, int64_t qs, const uint16_t* k, int64_t ks,
                                   const uint16_t* v, int64_t vs, uint16_t* o, int64_t os,
                                   float* lse, int64_t sq, int64_t hn, float scale, bool causal,
                                   const Dropout& drop, float* work, const float* sink,
                                   int64_t window);
void attention_head_backward_brgemm(const uint16_t* q, int64_t qs, const uint16_t* k,
                                    int64_t ks, const uint16_t* v, int64_t vs,
                                    const uint16_t* o, int64_t os, const uint16_t* dout,
                                    int64_t dos, const float* lse, uint16_t* dq, int64_t dqs,
                                    uint16_t* dk, int64_t dks, uint16_t* dv, int64_t dvs,
                                    int64_t sq, int64_t hn, float scale, bool causal,
                                    const Dropout& drop, float* work, int64_t window);
int64_t attention_brgemm_work_floats(int64_t sq, int64_t hn);

// The per-core data caches, in bytes (cpu_caches.cpp): read once at start-up from
// /sys/devices/system/cpu/cpu0/cache, else sysconf; set_cpu_caches overrides them
// (tests; 0, 0: back to those read).
struct CpuCaches {
  int64_t l1d, l2;
};
CpuCaches cpu_caches();
void set_cpu_caches(int64_t l1d, int64_t l2);

// The attention kernels' blocks for sq keys of head size hn, from cpu_caches(): rows per
// query block and keys per key block of the forward, keys per key block of the backward.
struct AttentionTiles {
  int64_t rows, forward_keys, backward_keys;
};
AttentionTiles attention_tiles(int64_t sq, int64_t hn);

}  // namespace cpu
}  // namespace megatron_fused
