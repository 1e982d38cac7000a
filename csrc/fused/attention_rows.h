// The parts of the CPU attention kernels that do not depend on how the products are computed
// (attention_cpu.cpp in float32, attention_bf16_cpu.cpp with AVX512-BF16 dot products): which
// keys a row sees (causal, sliding window, sink), the online softmax of a group of rows
// against one key block, the recomputed probabilities and their gradients in the backward,
// and the dropout mask. Included by each of those files, whose instruction sets differ (the
// bfloat16 file is compiled for AVX512-BF16), so everything here has internal linkage.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_kernels.h"
#include "cpu_lanes.h"
#include "cpu_math.h"

namespace megatron_fused {
namespace cpu {
namespace {

using namespace lanes;

#define MF_INLINE inline __attribute__((always_inline))

constexpr int kRows = 8;  // query rows per group of the forward (the registers' rows)

MF_INLINE int64_t round_lanes(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// Floats between the rows of the transposed k / v and of the score block: one vector more
// than the rounded length, so that rows of a power-of-two length do not all fall into
// the same cache sets (the products read down the columns of k^T and v^T).
MF_INLINE int64_t row_pitch(int64_t sq) { return round_lanes(sq) + kLanes; }

// max of row[0:valid].
MF_INLINE float row_max(const float* row, int64_t valid) {
  LaneVec acc = splat(-kInf);
  int64_t j = 0;
  for (; j + kLanes <= valid; j += kLanes) acc = vmax(acc, load(row + j));
  if (j < valid) acc = vmax(acc, select(first_lanes(valid - j), load(row + j), splat(-kInf)));
  return hmax(acc);
}

// exp(x) for x <= 0 (a score less its row's max or log-sum-exp), 0 below -87.33 (where
// exp leaves the normal floats), with fewer operations than exp_lanes, which takes any x:
// x log2(e) = n + f with n an integer and |f| <= 1/2 (log2(e) in two parts, so that f
// keeps its accuracy at large |x|), 2^f from a degree-6 polynomial (a near-minimax fit on
// [-1/2, 1/2], 1.6 ulp), times 2^n from n's bits. One thread, s4096: the forward 35.7 ms
// against 37.7 ms with exp_lanes.
MF_INLINE LaneVec exp_nonpositive(const LaneVec& x) {
  constexpr float kLog2eHi = 1.44269502162933349609f;   // log2(e) rounded to float
  constexpr float kLog2eLo = 1.925963033500011079e-8f;  // log2(e) - kLog2eHi
  constexpr float kRound = 12582912.0f;                 // 1.5 * 2^23: adding it rounds
  const LaneVec n = (x * kLog2eHi + kRound) - kRound;
  const LaneVec f = (x * kLog2eHi - n) + x * kLog2eLo;
  LaneVec p = splat(1.5345810970757157e-4f);
  p = p * f + 1.3399930903688073e-3f;
  p = p * f + 9.618489071726799e-3f;
  p = p * f + 5.550328642129898e-2f;
  p = p * f + 2.4022646248340607e-1f;
  p = p * f + 6.931471824645996e-1f;
  p = p * f + 1.0f;
  const LaneInt bits = (__builtin_convertvector(n, LaneInt) + 127) << 23;
  LaneVec pow2n;
  std::memcpy(&pow2n, &bits, sizeof(pow2n));
  return select(x < -87.33f, splat(0.0f), p * pow2n);
}

// row[j] = exp(row[j] - m) for j < valid, 0 for valid <= j < n16 (a multiple of kLanes);
// returns the sum (m at least the row's max).
MF_INLINE float exp_row(float* row, int64_t valid, int64_t n16, float m) {
  LaneVec acc = splat(0.0f);
  int64_t j = 0;
  for (; j + kLanes <= valid; j += kLanes) {
    const LaneVec e = exp_nonpositive(load(row + j) - m);
    store(row + j, e);
    acc += e;
  }
  if (j < valid) {
    const LaneVec e =
        select(first_lanes(valid - j), exp_nonpositive(load(row + j) - m), splat(0.0f));
    store(row + j, e);
    acc += e;
    j += kLanes;
  }
  for (; j < n16; j += kLanes) store(row + j, splat(0.0f));
  return hsum(acc);
}

// ds[j] = p[j] * (ds[j] - delta) for j < n16: the softmax backward.
MF_INLINE void softmax_grad_row(float* ds, const float* p, int64_t n16, float delta) {
  for (int64_t j = 0; j < n16; j += kLanes) store(ds + j, load(p + j) * (load(ds + j) - delta));
}

// The dropout hash: a 32-bit integer mixer (xor-shift-multiply, the "lowbias32"
// constants), a bijection of the counter applied twice with the two key halves.
MF_INLINE LaneU32 mix32(LaneU32 x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

MF_INLINE LaneU32 dropout_hash(const Dropout& drop, uint32_t counter) {
  LaneU32 c;
  for (int l = 0; l < kLanes; ++l) c[l] = counter + static_cast<uint32_t>(l);
  return mix32(mix32(c ^ drop.k0) + drop.k1);
}

// The dropout factors (0 or 1 / (1 - p)) of keys j .. j + kLanes - 1 of row `row` (j
// counted from the first key of the sequence).
MF_INLINE LaneVec dropout_factor(const Dropout& drop, int64_t row, int64_t j) {
  const LaneU32 h = dropout_hash(drop, static_cast<uint32_t>(row * drop.keys + j));
  return select(h >= drop.threshold, splat(drop.scale), splat(0.0f));
}

// ds[j] = p[j] * (z[j] * ds[j] - delta), then p[j] *= z[j], with z[j] the dropout factor
// of key j0 + j in row `row` (0 or 1 / (1 - p)): the softmax backward through dropout,
// and p becomes the dropped probabilities that the value gradient takes.
MF_INLINE void dropout_softmax_grad_row(float* ds, float* p, int64_t n16, float delta,
                                        const Dropout& drop, int64_t row, int64_t j0) {
  for (int64_t j = 0; j < n16; j += kLanes) {
    const LaneVec z = dropout_factor(drop, row, j0 + j);
    const LaneVec pj = load(p + j);
    store(ds + j, pj * (z * load(ds + j) - delta));
    store(p + j, pj * z);
  }
}

// row[j] *= the dropout factor of key j0 + j, for j < n16.
MF_INLINE void dropout_row(float* row, int64_t n16, const Dropout& drop, int64_t r, int64_t j0) {
  for (int64_t j = 0; j < n16; j += kLanes)
    store(row + j, load(row + j) * dropout_factor(drop, r, j0 + j));
}


// Which keys the rows of one (batch, head) see, and its softmax scale and sink.
struct HeadShape {
  int64_t sq, hn;
  float scale;
  bool causal;
  int64_t window = 0;  // 0: none; else (causal) keys i - window < j <= i
  // The head's attention sink: a logit that joins every row's softmax denominator with no
  // value (-inf, weight 0: none; else weight exp(sink - sink) = 1 at the row's start).
  float sink = -kInf, sink_weight = 0.0f;
  // Keys seen by some row of the group of rows i0 .. i0 + R - 1 / by row i.
  MF_INLINE int64_t block_keys(int64_t i0, int64_t R) const { return causal ? i0 + R : sq; }
  MF_INLINE int64_t row_keys(int64_t i) const { return causal ? i + 1 : sq; }
  // The same, counted from j0, within the key block [j0, end) (at least 1 where j0 <= i0).
  MF_INLINE int64_t group_keys(int64_t i0, int64_t R, int64_t j0, int64_t end) const {
    return std::min(end, block_keys(i0, R)) - j0;
  }
  MF_INLINE int64_t visible_keys(int64_t i, int64_t j0, int64_t end) const {
    return std::min(end, row_keys(i)) - j0;
  }
  // The first key row i sees.
  MF_INLINE int64_t first_key(int64_t i) const {
    return window ? std::max<int64_t>(0, i - window + 1) : 0;
  }
  // Scores row[0 : hidden) of row i in the block from j0 lie before its window: set to -inf,
  // so that they take no part in the max and their exp is 0 (valid: the row's visible
  // keys counted from j0).
  MF_INLINE void hide_before_window(float* row, int64_t i, int64_t j0, int64_t valid) const {
    const int64_t hidden = std::min(valid, first_key(i) - j0);
    for (int64_t j = 0; j < hidden; ++j) row[j] = -kInf;
  }
  // The head's sink logit (null: none).
  MF_INLINE void set_sink(const float* logit) {
    if (logit) {
      sink = *logit;
      sink_weight = 1.0f;
    }
  }
  // Whether key block [j0, end) is the first / last that the group of rows from i0 sees.
  MF_INLINE bool first_block(int64_t i0, int64_t j0) const { return j0 <= first_key(i0); }
  MF_INLINE bool last_block(int64_t i0, int64_t R, int64_t end) const {
    return end >= block_keys(i0, R);
  }
};

// The online softmax of the scores s (R rows, pitch sld, n16 columns) of the rows i0 ..
// i0 + R - 1 against the key block [j0, end), in place: s becomes exp(s - m) (dropped, with
// dropout), m and l the rows' running max and sum (over the blocks before, or over the
// sink alone at the first block), keep[r] the factor of the output so far and scale[r]
// that of this block's p v; the last block divides by the sum and writes the log-sum-exp.
template <int R>
MF_INLINE void online_softmax(const HeadShape& h, int64_t i0, int64_t j0, int64_t end,
                              float* s, int64_t sld, int64_t n16, float* m, float* l,
                              float* lse, const Dropout& drop, float* keep, float* scale) {
  const bool first = h.first_block(i0, j0), last = h.last_block(i0, R, end);
  for (int r = 0; r < R; ++r) {
    float* row = s + r * sld;
    const int64_t valid = h.visible_keys(i0 + r, j0, end);
    h.hide_before_window(row, i0 + r, j0, valid);
    const float m_old = first ? h.sink : m[r], l_old = first ? h.sink_weight : l[r];
    const float mx = std::max(m_old, row_max(row, valid));
    if (mx == -kInf) {  // a windowed row that has seen no key yet (and has no sink)
      fill_zero(row, n16);
      keep[r] = scale[r] = 1.0f;
      m[r] = mx;
      l[r] = l_old;
      continue;
    }
    const float sum = exp_row(row, valid, n16, mx);
    keep[r] = std::exp(m_old - mx);  // 0 where m_old is -inf
    l[r] = keep[r] * l_old + sum;
    m[r] = mx;
    scale[r] = last ? 1.0f / l[r] : 1.0f;
    keep[r] *= scale[r];
    if (last) lse[i0 + r] = mx + std::log(l[r]);
    if (drop.active()) dropout_row(row, n16, drop, i0 + r, j0);
  }
}

// The backward's rows: p (the scores of rows i0 .. i0 + R - 1 against the key block
// [j0, end), pitch sld) becomes the probabilities exp(p - lse), dropped with dropout, and
// ds (dout v^T) their gradients p * (ds - delta) through the softmax (and the dropout).
template <int R>
MF_INLINE void softmax_backward_rows(const HeadShape& h, int64_t i0, int64_t j0, int64_t end,
                                     float* p, float* ds, int64_t sld, int64_t n16,
                                     const float* lse, const float* delta, const Dropout& drop) {
  for (int r = 0; r < R; ++r) {
    const int64_t i = i0 + r;
    float* prow = p + r * sld;
    const int64_t valid = h.visible_keys(i, j0, end);
    h.hide_before_window(prow, i, j0, valid);
    exp_row(prow, valid, n16, lse[i]);  // the probabilities of row i
    if (drop.active())
      dropout_softmax_grad_row(ds + r * sld, prow, n16, delta[i], drop, i, j0);
    else
      softmax_grad_row(ds + r * sld, prow, n16, delta[i]);
  }
}

// The forward's loops over one head: query blocks [q0, q1) of t.rows rows, the key blocks
// [j0, end) of t.forward_keys keys that some row of the block sees, and in each the groups of
// at most kRows rows from i0 that see it: group(q0, j0, end, i0, rows) for each group, then
// done(q0, q1) after each query block.
template <typename Group, typename Done>
MF_INLINE void forward_blocks(const HeadShape& h, const AttentionTiles& t, Group&& group,
                              Done&& done) {
  for (int64_t q0 = 0; q0 < h.sq; q0 += t.rows) {
    const int64_t q1 = std::min(h.sq, q0 + t.rows);
    const int64_t start = h.first_key(q0) / t.forward_keys * t.forward_keys;
    for (int64_t j0 = start; j0 < h.block_keys(q0, q1 - q0); j0 += t.forward_keys) {
      const int64_t end = std::min(h.sq, j0 + t.forward_keys);
      for (int64_t i0 = h.causal ? std::max(q0, j0) : q0; i0 < q1; i0 += kRows) {
        if (end <= h.first_key(i0)) break;  // this group's window and the later ones' start after the block
        group(q0, j0, end, i0, std::min<int64_t>(kRows, q1 - i0));
      }
    }
    done(q0, q1);
  }
}

// Key blocks are a multiple of this many keys (of kRows and of the products' chunks), so
// that a group of rows sees a block whole or not at all.
constexpr int64_t kKeyAlign = 32;

// Calls call(R) for R = rows (at most kRows in the forward, 12 in the backward).
#define MF_ROWS_DISPATCH(rows, call) \
  switch (rows) {                    \
    case 12: call(12); break;        \
    case 11: call(11); break;        \
    case 10: call(10); break;        \
    case 9: call(9); break;          \
    case 8: call(8); break;          \
    case 7: call(7); break;          \
    case 6: call(6); break;          \
    case 5: call(5); break;          \
    case 4: call(4); break;          \
    case 3: call(3); break;          \
    case 2: call(2); break;          \
    default: call(1); break;         \
  }

}  // namespace
}  // namespace cpu
}  // namespace megatron_fused
