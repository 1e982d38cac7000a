// CPU kernel for self-attention, softmax(scale * q k^T) v over keys j <= query i (causal)
// or over all keys (the full blocks of context-parallel ring attention), in the manner of
// flash attention: one (batch, head) per task, tiled so that the working set stays in
// the core's L2 at any sequence length. The forward takes blocks of query rows and streams
// blocks of keys past them with an online softmax (each row's running max and sum; the
// output is rescaled when the max grows); the scores of a group of kRows rows and one key
// block are computed, turned into probabilities and multiplied by v while they sit in L1,
// and only each row's log-sum-exp is kept. The backward takes one key block at a time,
// keeps its dk / dv sums in cache and streams the query rows past it, recomputing the
// probabilities from the log-sum-exp. The block sizes come from the cache sizes read at
// start-up (cpu_caches). Causal: key blocks beyond a row group's last query are never
// touched, which halves the work. q, k, v rows may be strided (views of the fused QKV
// projection); the head size is a multiple of 16. A sliding window (causal only) of W keys:
// row i sees keys i - W < j <= i; key blocks wholly before a row group's window are never
// touched either, so the work is O(s W), and the keys of a block before a row's window are
// masked like those after it.
//
// Attention dropout: probability (i, j) is kept with probability 1 - p and scaled by
// 1 / (1 - p). Whether it is kept is a hash of (seed, task, i * sq + j) (dropout_keep
// below), so the backward regenerates the forward's mask from the seed alone; the
// log-sum-exp is that of the probabilities before dropout.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>

#include "cpu_kernels.h"
#include "cpu_lanes.h"
#include "cpu_math.h"

namespace megatron_fused {
namespace cpu {

using namespace lanes;

namespace {

constexpr int kRows = 8;  // query rows per group of the forward (the registers' rows)

// The products below keep R rows x V lane vectors of accumulators in registers, a group's
// rows taken in blocks of at most BR rows, with V = kVecsFor<BR> so that nothing spills:
// 8 x 2 where there are 32 vector registers (AVX-512), 8 x 1, 6 x 2 or 4 x 2 where there
// are 16 (AVX2 and baseline). The forward takes blocks of 8 rows. The backward takes groups
// of kBackwardGroup rows in blocks of kBackwardRows: on AVX2 groups of 12 in blocks of 6 x 2
// (12 accumulators, and the dk / dv sums chain 6 FMAs per output vector, loaded and stored
// twice per group). Measured on AVX2 (one thread, head size 64): the backward at s4096
// 80-86 ms with groups of 12 in 6 x 2, 95 ms with groups of 8 in 4 x 2 (18 or 24 rows in
// 6 x 2: 86 ms); at s8192 322 ms against 357 ms. Before the panels below, 8 x 1 took 217 ms
// of process time where 4 x 2 took 182 ms.
constexpr int kBackwardRows = kRegisters >= 32 ? kRows : 6;
constexpr int kBackwardGroup = kRegisters >= 32 ? kRows : 12;
template <int BR> constexpr int kVecsFor = (kRegisters >= 32 || BR < 8) ? 2 : 1;
// The forward's scores q k^T on AVX2 take blocks of 4 rows x 3 vectors (12 accumulators,
// 7 loads per 12 FMAs): one thread, s4096, 37.7 ms against 39.2 ms with 8 x 1.
constexpr int kScoreRows = kRegisters >= 32 ? kRows : 4;
constexpr int kScoreVecs = kRegisters >= 32 ? 2 : 3;

#define MF_INLINE inline __attribute__((always_inline))

MF_INLINE int64_t round_lanes(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// Floats between the rows of the transposed k / v and of the score block: one vector more
// than the rounded length, so that rows of a power-of-two length do not all fall into
// the same cache sets (the products read down the columns of k^T and v^T).
MF_INLINE int64_t row_pitch(int64_t sq) { return round_lanes(sq) + kLanes; }

// k^T and v^T are kept in panels, one per key block: the block of keys [j0, j0 + block)
// transposed, [hn, row_pitch(block)], the panels one after the other. A panel is
// contiguous, so that the products read a few pages: read down the columns of a whole
// transposed sequence (rows sq floats apart), each of the hn rows lay on its own page, and
// the misses of the TLB cost 7-11 % (one thread, s4096 / s8192: 39.2 / 154.8 ms forward
// and 93.0 / 374.2 ms backward in panels, against 41.1 / 166.0 and 100.1 / 417.3 ms).
MF_INLINE int64_t panel_floats(int64_t hn, int64_t block) { return hn * row_pitch(block); }
MF_INLINE int64_t panels_floats(int64_t sq, int64_t hn, int64_t block) {
  return (sq + block - 1) / block * panel_floats(hn, block);
}

// dst[j * dst_stride + d] = src[j * src_stride + d] for j < n, d < hn.
MF_INLINE void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride,
                         int64_t n, int64_t hn) {
  for (int64_t j = 0; j < n; ++j) std::memcpy(dst + j * dst_stride, src + j * src_stride,
                                              sizeof(float) * hn);
}

// xt[d * ld + j] = x[j * stride + d] for j < n, zero for n <= j < ld. Tiles of kTile rows,
// so that each row of x is read from memory once and stays in L1 while its values are
// written out: x is a view of the fused QKV projection, its rows kilobytes apart, and a
// column at a time read s cache lines per column (at s4096 a 24 MiB span, larger than L3).
MF_INLINE void transpose_rows(float* xt, const float* x, int64_t n, int64_t stride, int64_t hn,
                           int64_t ld) {
  constexpr int64_t kTile = 16;
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int64_t j1 = std::min(n, j0 + kTile);
    for (int64_t d = 0; d < hn; ++d) {
      float* row = xt + d * ld;
      for (int64_t j = j0; j < j1; ++j) row[j] = x[j * stride + d];
    }
  }
  for (int64_t d = 0; d < hn; ++d)
    for (int64_t j = n; j < ld; ++j) xt[d * ld + j] = 0.0f;
}

// The panels of x's n rows (above) in blocks of `block` keys.
MF_INLINE void transpose_panels(float* xt, const float* x, int64_t n, int64_t stride, int64_t hn,
                                int64_t block) {
  for (int64_t j0 = 0; j0 < n; j0 += block)
    transpose_rows(xt + j0 / block * panel_floats(hn, block), x + j0 * stride,
                   std::min(block, n - j0), stride, hn, row_pitch(block));
}

// The three products below work on chunks of V lane vectors (kVecsFor<BR> where not
// given) and, for the last vectors, of V = 1.

// s[r * sld + j + c] = scale * sum_d a[r * a_stride + d] * bt[d * ld + j + c] for r < R,
// c < kLanes V.
template <int R, int V>
MF_INLINE void products_chunk(float* s, int64_t sld, const float* a, int64_t a_stride,
                              const float* bt, int64_t ld, int64_t j, int64_t hn, float scale) {
  LaneVec acc[V][R];
  for (int v = 0; v < V; ++v)
    for (int r = 0; r < R; ++r) acc[v][r] = splat(0.0f);
  for (int64_t d = 0; d < hn; ++d) {
    LaneVec b[V];
    for (int v = 0; v < V; ++v) b[v] = load(bt + d * ld + j + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float x = a[r * a_stride + d];
      for (int v = 0; v < V; ++v) acc[v][r] += x * b[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store(s + r * sld + j + v * kLanes, acc[v][r] * scale);
}

// The products above for j < n (a multiple of kLanes), in blocks of BR rows.
template <int R, int BR, int V = kVecsFor<BR>>
MF_INLINE void block_products(float* s, int64_t sld, const float* a, int64_t a_stride,
                              const float* bt, int64_t ld, int64_t n, int64_t hn, float scale) {
  if constexpr (R > BR) {
    block_products<BR, BR, V>(s, sld, a, a_stride, bt, ld, n, hn, scale);
    block_products<R - BR, BR, V>(s + BR * sld, sld, a + BR * a_stride, a_stride, bt, ld, n,
                                  hn, scale);
    return;
  }
  int64_t j = 0;
  for (; j + V * kLanes <= n; j += V * kLanes)
    products_chunk<R, V>(s, sld, a, a_stride, bt, ld, j, hn, scale);
  for (; j < n; j += kLanes) products_chunk<R, 1>(s, sld, a, a_stride, bt, ld, j, hn, scale);
}

// out[r * out_stride + c + i] = keep[r] * out[...] + row_scale[r] * sum_{j < n}
// p[r * ld + j] * x[j * x_stride + c + i] for r < R, i < kLanes V (keep null: out's
// old values are not read): the blocks of keys accumulate into out.
template <int R, int V>
MF_INLINE void combine_chunk(float* out, int64_t out_stride, const float* p, int64_t ld,
                             const float* x, int64_t x_stride, int64_t n, int64_t c,
                             const float* keep, const float* row_scale) {
  LaneVec acc[V][R];
  for (int v = 0; v < V; ++v)
    for (int r = 0; r < R; ++r) acc[v][r] = splat(0.0f);
  for (int64_t j = 0; j < n; ++j) {
    LaneVec xv[V];
    for (int v = 0; v < V; ++v) xv[v] = load(x + j * x_stride + c + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float w = p[r * ld + j];
      for (int v = 0; v < V; ++v) acc[v][r] += w * xv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      float* dst = out + r * out_stride + c + v * kLanes;
      const LaneVec sum = acc[v][r] * row_scale[r];
      store(dst, keep ? load(dst) * keep[r] + sum : sum);
    }
}

// The combination above for all c < hn (a multiple of kLanes), in blocks of BR rows.
template <int R, int BR>
MF_INLINE void block_combine(float* out, int64_t out_stride, const float* p, int64_t ld,
                             const float* x, int64_t x_stride, int64_t n, int64_t hn,
                             const float* keep, const float* row_scale) {
  if constexpr (R > BR) {
    block_combine<BR, BR>(out, out_stride, p, ld, x, x_stride, n, hn, keep, row_scale);
    block_combine<R - BR, BR>(out + BR * out_stride, out_stride, p + BR * ld, ld, x, x_stride,
                              n, hn, keep ? keep + BR : nullptr, row_scale + BR);
    return;
  }
  constexpr int V = kVecsFor<BR>;
  int64_t c = 0;
  for (; c + V * kLanes <= hn; c += V * kLanes)
    combine_chunk<R, V>(out, out_stride, p, ld, x, x_stride, n, c, keep, row_scale);
  if (c < hn) combine_chunk<R, 1>(out, out_stride, p, ld, x, x_stride, n, c, keep, row_scale);
}

// y[j * y_stride + c + i] += scale * sum_{r < R} w[r * ld + j] * a[r * a_stride + c + i] for
// j < n, i < kLanes V: the transposed product, accumulated over the blocks of query rows.
template <int R, int V>
MF_INLINE void accumulate_chunk(float* y, int64_t y_stride, const float* w, int64_t ld,
                                const float* a, int64_t a_stride, int64_t n, int64_t c,
                                float scale) {
  LaneVec av[V][R];
  for (int v = 0; v < V; ++v)
    for (int r = 0; r < R; ++r) av[v][r] = load(a + r * a_stride + c + v * kLanes) * scale;
  for (int64_t j = 0; j < n; ++j) {
    LaneVec yv[V];
    for (int v = 0; v < V; ++v) yv[v] = load(y + j * y_stride + c + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float wr = w[r * ld + j];
      for (int v = 0; v < V; ++v) yv[v] += wr * av[v][r];
    }
    for (int v = 0; v < V; ++v) store(y + j * y_stride + c + v * kLanes, yv[v]);
  }
}

// The accumulation above for all c < hn (a multiple of kLanes), in blocks of BR rows.
template <int R, int BR>
MF_INLINE void block_accumulate(float* y, int64_t y_stride, const float* w, int64_t ld,
                                const float* a, int64_t a_stride, int64_t n, int64_t hn,
                                float scale) {
  if constexpr (R > BR) {
    block_accumulate<BR, BR>(y, y_stride, w, ld, a, a_stride, n, hn, scale);
    block_accumulate<R - BR, BR>(y, y_stride, w + BR * ld, ld, a + BR * a_stride, a_stride, n,
                                 hn, scale);
    return;
  }
  constexpr int V = kVecsFor<BR>;
  int64_t c = 0;
  for (; c + V * kLanes <= hn; c += V * kLanes)
    accumulate_chunk<R, V>(y, y_stride, w, ld, a, a_stride, n, c, scale);
  if (c < hn) accumulate_chunk<R, 1>(y, y_stride, w, ld, a, a_stride, n, c, scale);
}

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

struct Head {
  const float* q;
  const float* k;
  const float* v;
  int64_t qs, ks, vs;  // row (sequence) strides
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
};

// The group of rows i0 .. i0 + R - 1 against the key block [j0, end): its scores s (pitch
// sld) from the block's panel of k^T (kt, pitch ld), the online softmax (m, l: the rows'
// running max and sum over the blocks before, or over the sink alone at the first block),
// o = o * exp(m_old - m) + p v; the block that holds the group's last keys divides o by
// the sum and writes the log-sum-exp.
template <int R>
MF_INLINE void forward_group(const Head& h, int64_t i0, int64_t j0, int64_t end,
                             const float* kt, int64_t ld, float* s, int64_t sld, float* o,
                             int64_t os, float* m, float* l, float* lse, const Dropout& drop) {
  const int64_t n = h.group_keys(i0, R, j0, end), n16 = round_lanes(n);
  block_products<R, kScoreRows, kScoreVecs>(s, sld, h.q + i0 * h.qs, h.qs, kt, ld, n16, h.hn,
                                            h.scale);
  const bool first = j0 <= h.first_key(i0), last = end >= h.block_keys(i0, R);
  float keep[R], scale[R];
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
  block_combine<R, kRows>(o + i0 * os, os, s, sld, h.v + j0 * h.vs, h.vs, n, h.hn,
                          first ? nullptr : keep, scale);
}

// The group of rows i0 .. i0 + R - 1 against the key block [j0, end): the probabilities p
// and their gradients ds (pitch sld) recomputed from lse (kt, vt: the block's panels of
// k^T and v^T, pitch ld), dq += scale ds k (written by
// the first block), and the block's sums dv += p^T dout, dk += scale ds^T q (rows from j0,
// pitch hn).
template <int R>
MF_INLINE void backward_group(const Head& h, int64_t i0, int64_t j0, int64_t end,
                              const float* kt, const float* vt, int64_t ld, float* p, float* ds,
                              int64_t sld, const float* dout, int64_t dos, const float* lse,
                              const float* delta, float* dq, int64_t dqs, float* dk, float* dv,
                              const Dropout& drop) {
  const int64_t n = h.group_keys(i0, R, j0, end), n16 = round_lanes(n);
  block_products<R, kBackwardRows>(p, sld, h.q + i0 * h.qs, h.qs, kt, ld, n16, h.hn, h.scale);
  block_products<R, kBackwardRows>(ds, sld, dout + i0 * dos, dos, vt, ld, n16, h.hn, 1.0f);
  float keep[R], scale[R];
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
    keep[r] = 1.0f;
    scale[r] = h.scale;
  }
  block_combine<R, kBackwardRows>(dq + i0 * dqs, dqs, ds, sld, h.k + j0 * h.ks, h.ks, n, h.hn,
                                  j0 <= h.first_key(i0) ? nullptr : keep, scale);
  block_accumulate<R, kBackwardRows>(dv, h.hn, p, sld, dout + i0 * dos, dos, n, h.hn, 1.0f);
  block_accumulate<R, kBackwardRows>(dk, h.hn, ds, sld, h.q + i0 * h.qs, h.qs, n, h.hn,
                                     h.scale);
}

// Key blocks are a multiple of this many keys (of kRows and of the products' chunks), so
// that a group of rows sees a block whole or not at all.
constexpr int64_t kKeyAlign = 32;

MF_INLINE int64_t fit_keys(int64_t floats, int64_t sq) {
  const int64_t fit = std::max<int64_t>(kKeyAlign, floats / kKeyAlign * kKeyAlign);
  return std::min(fit, (sq + kKeyAlign - 1) / kKeyAlign * kKeyAlign);
}

// Calls call(R) for R = rows (at most kRows in the forward, kBackwardGroup in the backward).
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

Dropout attention_dropout(double p, uint64_t seed, int64_t task, int64_t keys) {
  Dropout drop;
  drop.keys = static_cast<uint32_t>(keys);
  const double threshold = std::round(p * 4294967296.0);
  if (!(threshold >= 1.0)) return drop;
  drop.threshold = static_cast<uint32_t>(std::min(threshold, 4294967295.0));
  drop.scale = static_cast<float>(1.0 / (1.0 - p));
  // splitmix64 of the seed and the task: independent keys for every (batch, head)
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(task + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  drop.k0 = static_cast<uint32_t>(z);
  drop.k1 = static_cast<uint32_t>(z >> 32);
  return drop;
}

void attention_dropout_keep(uint8_t* keep, int64_t rows, const Dropout& drop) {
  const int64_t keys = drop.keys;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < keys; j += kLanes) {
      const LaneVec z = drop.active() ? dropout_factor(drop, i, j) : splat(1.0f);
      for (int l = 0; l < kLanes && j + l < keys; ++l) keep[i * keys + j + l] = z[l] != 0.0f;
    }
}

AttentionTiles attention_tiles(int64_t sq, int64_t hn) {
  const CpuCaches caches = cpu_caches();
  const int64_t l1 = caches.l1d / int64_t(sizeof(float)), half_l2 = caches.l2 / 8;
  AttentionTiles t;
  // forward: a query block's q and o rows in a quarter of the L2, its key block's k^T and
  // v rows in another quarter, one group's scores in half of the L1
  t.rows = std::max<int64_t>(kRows, half_l2 / (4 * hn) / kRows * kRows);
  int64_t forward = std::min(half_l2 / (4 * hn), l1 / (2 * kRows));
  // backward: a key block's k^T, v^T, k, dk and dv in half of the L2, one group's
  // probabilities and their gradients in half of the L1
  int64_t backward = std::min(half_l2 / (5 * hn), l1 / (4 * kBackwardGroup));
  if (kRegisters < 32) {
    // With 16 registers, a key block's panel of k^T (and of v^T) within three quarters of
    // the L1, which the products read once per row group: on AVX2 (one thread, s4096, head
    // size 64, 32 KiB L1d) the forward 33.4 ms with blocks of 96 keys against 35.0 ms with
    // 256 (64: 36.8 ms), the backward 74-75 ms with 48-96 keys against 80-81 ms with
    // 120-144 and 86 ms with 160. Not measured on AVX-512, whose blocks stay as above.
    forward = std::min(forward, 3 * l1 / (4 * hn));
    backward = std::min(backward, 3 * l1 / (4 * hn));
  }
  t.forward_keys = fit_keys(forward, sq);
  t.backward_keys = fit_keys(backward, sq);
  return t;
}

void attention_head_forward(const float* q, int64_t qs, const float* k, int64_t ks,
                            const float* v, int64_t vs, float* o, int64_t os, float* lse,
                            int64_t sq, int64_t hn, float scale, bool causal,
                            const Dropout& drop, float* work, const float* sink,
                            int64_t window) {
  const AttentionTiles t = attention_tiles(sq, hn);
  const int64_t ld = row_pitch(t.forward_keys), sld = ld, panel = panel_floats(hn, t.forward_keys);
  float* kt = work;
  float* vc = kt + panels_floats(sq, hn, t.forward_keys);  // v's rows, contiguous
  float* s = vc + sq * hn;
  float* m = s + kRows * sld;  // the running max and sum of a query block's rows
  float* l = m + t.rows;
  transpose_panels(kt, k, sq, ks, hn, t.forward_keys);
  copy_rows(vc, hn, v, vs, sq, hn);
  Head h{q, k, vc, qs, ks, hn, sq, hn, scale, causal, window};
  if (sink) {
    h.sink = *sink;
    h.sink_weight = 1.0f;
  }
  for (int64_t q0 = 0; q0 < sq; q0 += t.rows) {
    const int64_t q1 = std::min(sq, q0 + t.rows);
    const int64_t start = h.first_key(q0) / t.forward_keys * t.forward_keys;
    for (int64_t j0 = start; j0 < h.block_keys(q0, q1 - q0); j0 += t.forward_keys) {
      const int64_t end = std::min(sq, j0 + t.forward_keys);
      const float* ktb = kt + j0 / t.forward_keys * panel;
      for (int64_t i0 = causal ? std::max(q0, j0) : q0; i0 < q1; i0 += kRows) {
        if (end <= h.first_key(i0)) break;  // this group's window and the later ones' start after the block
        const int64_t rows = std::min<int64_t>(kRows, q1 - i0);
#define MF_FORWARD(R) \
  forward_group<R>(h, i0, j0, end, ktb, ld, s, sld, o, os, m + (i0 - q0), l + (i0 - q0), lse, drop)
        MF_ROWS_DISPATCH(rows, MF_FORWARD)
#undef MF_FORWARD
      }
    }
  }
}

void attention_head_backward(const float* q, int64_t qs, const float* k, int64_t ks,
                             const float* v, int64_t vs, const float* o, int64_t os,
                             const float* dout, int64_t dos, const float* lse, float* dq,
                             int64_t dqs, float* dk, int64_t dks, float* dv, int64_t dvs,
                             int64_t sq, int64_t hn, float scale, bool causal,
                             const Dropout& drop, float* work, int64_t window) {
  const AttentionTiles t = attention_tiles(sq, hn);
  const int64_t ld = row_pitch(t.backward_keys), sld = ld;
  const int64_t panel = panel_floats(hn, t.backward_keys);
  float* kt = work;
  float* vt = kt + panels_floats(sq, hn, t.backward_keys);
  float* kc = vt + panels_floats(sq, hn, t.backward_keys);  // k's rows, contiguous
  float* p = kc + sq * hn;
  float* ds = p + kBackwardGroup * sld;
  float* delta = ds + kBackwardGroup * sld;
  float* dkb = delta + sq;  // the key block's dk and dv sums
  float* dvb = dkb + t.backward_keys * hn;
  // q, dout and dq in contiguous rows, read (and dq written) once per key block: rows of
  // the fused QKV view and of the outputs lie heads * head size apart, each on its own
  // page with many heads (one thread, s4096, head size 64, 16 heads: 70 ms against 79 ms)
  float* qc = dvb + t.backward_keys * hn;
  float* doutc = qc + sq * hn;
  float* dqc = doutc + sq * hn;
  transpose_panels(kt, k, sq, ks, hn, t.backward_keys);
  transpose_panels(vt, v, sq, vs, hn, t.backward_keys);
  copy_rows(kc, hn, k, ks, sq, hn);
  copy_rows(qc, hn, q, qs, sq, hn);
  copy_rows(doutc, hn, dout, dos, sq, hn);
  // delta_i = sum_j p_ij dp_ij = dout_i . o_i, with or without dropout (o = dropped p v)
  for (int64_t i = 0; i < sq; ++i) delta[i] = dot(doutc + i * hn, o + i * os, hn);
  const Head h{qc, kc, v, hn, hn, vs, sq, hn, scale, causal, window};
  for (int64_t j0 = 0; j0 < sq; j0 += t.backward_keys) {
    const int64_t end = std::min(sq, j0 + t.backward_keys);
    const float *ktb = kt + j0 / t.backward_keys * panel, *vtb = vt + j0 / t.backward_keys * panel;
    fill_zero(dkb, 2 * t.backward_keys * hn);
    // The groups start at multiples of kBackwardGroup in every key block (the first may
    // hold rows before j0, which see none of its keys), so that a row's dq is first written,
    // then accumulated, as the blocks go by (key blocks are a multiple of kKeyAlign keys,
    // not of kBackwardGroup).
    for (int64_t i0 = causal ? j0 / kBackwardGroup * kBackwardGroup : 0; i0 < sq;
         i0 += kBackwardGroup) {
      if (end <= h.first_key(i0)) break;  // the later rows' windows start after the block
      const int64_t rows = std::min<int64_t>(kBackwardGroup, sq - i0);
#define MF_BACKWARD(R)                                                                     \
  backward_group<R>(h, i0, j0, end, ktb, vtb, ld, p, ds, sld, doutc, hn, lse, delta, dqc, hn, \
                    dkb, dvb, drop)
      MF_ROWS_DISPATCH(rows, MF_BACKWARD)
#undef MF_BACKWARD
    }
    copy_rows(dk + j0 * dks, dks, dkb, hn, end - j0, hn);
    copy_rows(dv + j0 * dvs, dvs, dvb, hn, end - j0, hn);
  }
  copy_rows(dq, dqs, dqc, hn, sq, hn);
}

int64_t attention_work_floats(int64_t sq, int64_t hn) {
  const AttentionTiles t = attention_tiles(sq, hn);
  const int64_t forward = panels_floats(sq, hn, t.forward_keys) + sq * hn +
                          kRows * row_pitch(t.forward_keys) + 2 * t.rows;
  const int64_t backward = 2 * panels_floats(sq, hn, t.backward_keys) + 4 * sq * hn +
                           2 * kBackwardGroup * row_pitch(t.backward_keys) + sq +
                           2 * t.backward_keys * hn;
  return std::max(forward, backward);
}

}  // namespace cpu
}  // namespace megatron_fused
