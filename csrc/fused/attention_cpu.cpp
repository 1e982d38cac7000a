// CPU kernel for self-attention, softmax(scale * q k^T) v over keys j <= query i (causal)
// or over all keys (the full blocks of context-parallel ring attention), in the manner of
// flash attention: one (batch, head) per task; the scores of a block of query rows are
// computed, turned into probabilities and multiplied by v while they sit in cache, and
// only each row's log-sum-exp is kept. The backward recomputes the probabilities from
// it. Causal: keys beyond a block's last query are never touched, which halves the work.
// q, k, v rows may be strided (views of the fused QKV projection); the head size is a
// multiple of 16.
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

constexpr int kRows = 8;  // query rows per block

// The products below keep R rows x V lane vectors of accumulators in registers: V = 2
// where there are 32 vector registers (AVX-512: 16 accumulators of 8 x 2), 1 where there
// are 16 (AVX2 and baseline: 8 accumulators), so that nothing spills.
constexpr int kChunkVecs = kRegisters >= 32 ? 2 : 1;

#define MF_INLINE inline __attribute__((always_inline))

MF_INLINE int64_t round_lanes(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// Floats between the rows of the transposed k / v and of the score block: one vector more
// than the rounded length, so that rows of a power-of-two length do not all fall into
// the same cache sets (the products read down the columns of k^T and v^T).
MF_INLINE int64_t row_pitch(int64_t sq) { return round_lanes(sq) + kLanes; }

// dst[j * dst_stride + d] = src[j * src_stride + d] for j < n, d < hn.
MF_INLINE void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride,
                         int64_t n, int64_t hn) {
  for (int64_t j = 0; j < n; ++j) std::memcpy(dst + j * dst_stride, src + j * src_stride,
                                              sizeof(float) * hn);
}

// xt[d * ld + j] = x[j * stride + d] for j < n, zero for n <= j < ld.
MF_INLINE void transpose_rows(float* xt, const float* x, int64_t n, int64_t stride, int64_t hn,
                           int64_t ld) {
  for (int64_t d = 0; d < hn; ++d) {
    float* row = xt + d * ld;
    for (int64_t j = 0; j < n; ++j) row[j] = x[j * stride + d];
    for (int64_t j = n; j < ld; ++j) row[j] = 0.0f;
  }
}

// The three products below work on chunks of V = kChunkVecs lane vectors and, for a
// last vector, of V = 1.

// s[r * ld + j + c] = scale * sum_d a[r * a_stride + d] * bt[d * ld + j + c] for r < R,
// c < kLanes V.
template <int R, int V>
MF_INLINE void products_chunk(float* s, int64_t ld, const float* a, int64_t a_stride,
                              const float* bt, int64_t j, int64_t hn, float scale) {
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
    for (int v = 0; v < V; ++v) store(s + r * ld + j + v * kLanes, acc[v][r] * scale);
}

// The products above for j < n (a multiple of kLanes).
template <int R>
MF_INLINE void block_products(float* s, int64_t ld, const float* a, int64_t a_stride,
                              const float* bt, int64_t n, int64_t hn, float scale) {
  int64_t j = 0;
  for (; j + kChunkVecs * kLanes <= n; j += kChunkVecs * kLanes)
    products_chunk<R, kChunkVecs>(s, ld, a, a_stride, bt, j, hn, scale);
  if (j < n) products_chunk<R, 1>(s, ld, a, a_stride, bt, j, hn, scale);
}

// out[r * out_stride + c + i] = row_scale[r] * sum_{j < n} p[r * ld + j] *
// x[j * x_stride + c + i] for r < R, i < kLanes V.
template <int R, int V>
MF_INLINE void combine_chunk(float* out, int64_t out_stride, const float* p, int64_t ld,
                             const float* x, int64_t x_stride, int64_t n, int64_t c,
                             const float* row_scale) {
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
    for (int v = 0; v < V; ++v)
      store(out + r * out_stride + c + v * kLanes, acc[v][r] * row_scale[r]);
}

// The combination above for all c < hn (a multiple of kLanes).
template <int R>
MF_INLINE void block_combine(float* out, int64_t out_stride, const float* p, int64_t ld,
                             const float* x, int64_t x_stride, int64_t n, int64_t hn,
                             const float* row_scale) {
  int64_t c = 0;
  for (; c + kChunkVecs * kLanes <= hn; c += kChunkVecs * kLanes)
    combine_chunk<R, kChunkVecs>(out, out_stride, p, ld, x, x_stride, n, c, row_scale);
  if (c < hn) combine_chunk<R, 1>(out, out_stride, p, ld, x, x_stride, n, c, row_scale);
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

// The accumulation above for all c < hn (a multiple of kLanes).
template <int R>
MF_INLINE void block_accumulate(float* y, int64_t y_stride, const float* w, int64_t ld,
                                const float* a, int64_t a_stride, int64_t n, int64_t hn,
                                float scale) {
  int64_t c = 0;
  for (; c + kChunkVecs * kLanes <= hn; c += kChunkVecs * kLanes)
    accumulate_chunk<R, kChunkVecs>(y, y_stride, w, ld, a, a_stride, n, c, scale);
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

// row[j] = exp(row[j] - m) for j < valid, 0 for valid <= j < n16 (a multiple of kLanes);
// returns the sum.
MF_INLINE float exp_row(float* row, int64_t valid, int64_t n16, float m) {
  LaneVec acc = splat(0.0f);
  int64_t j = 0;
  for (; j + kLanes <= valid; j += kLanes) {
    const LaneVec e = exp_lanes(load(row + j) - m);
    store(row + j, e);
    acc += e;
  }
  if (j < valid) {
    const LaneVec e = select(first_lanes(valid - j), exp_lanes(load(row + j) - m), splat(0.0f));
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

// The dropout factors (0 or 1 / (1 - p)) of keys j .. j + kLanes - 1 of row `row`.
MF_INLINE LaneVec dropout_factor(const Dropout& drop, int64_t row, int64_t j) {
  const LaneU32 h = dropout_hash(drop, static_cast<uint32_t>(row * drop.keys + j));
  return select(h >= drop.threshold, splat(drop.scale), splat(0.0f));
}

// ds[j] = p[j] * (z[j] * ds[j] - delta), then p[j] *= z[j], with z[j] the dropout factor
// of key j in row `row` (0 or 1 / (1 - p)): the softmax backward through dropout, and p
// becomes the dropped probabilities that the value gradient takes.
MF_INLINE void dropout_softmax_grad_row(float* ds, float* p, int64_t n16, float delta,
                                        const Dropout& drop, int64_t row) {
  for (int64_t j = 0; j < n16; j += kLanes) {
    const LaneVec z = dropout_factor(drop, row, j);
    const LaneVec pj = load(p + j);
    store(ds + j, pj * (z * load(ds + j) - delta));
    store(p + j, pj * z);
  }
}

// row[j] *= the dropout factor of key j, for j < n16.
MF_INLINE void dropout_row(float* row, int64_t n16, const Dropout& drop, int64_t r) {
  for (int64_t j = 0; j < n16; j += kLanes)
    store(row + j, load(row + j) * dropout_factor(drop, r, j));
}

struct Head {
  const float* q;
  const float* k;
  const float* v;
  int64_t qs, ks, vs;  // row (sequence) strides
  int64_t sq, hn;
  float scale;
  bool causal;
  // Keys seen by some row of the block of rows i0 .. i0 + R - 1 / by row i.
  MF_INLINE int64_t block_keys(int64_t i0, int R) const { return causal ? i0 + R : sq; }
  MF_INLINE int64_t row_keys(int64_t i) const { return causal ? i + 1 : sq; }
};

template <int R>
MF_INLINE void forward_block(const Head& h, int64_t i0, const float* kt, float* s, int64_t ld,
                             float* o, int64_t os, float* lse, const Dropout& drop) {
  const int64_t n = h.block_keys(i0, R);  // keys 0 .. n-1 are visible to some row
  block_products<R>(s, ld, h.q + i0 * h.qs, h.qs, kt, round_lanes(n), h.hn, h.scale);
  float inv[R];
  for (int r = 0; r < R; ++r) {
    const int64_t valid = h.row_keys(i0 + r);
    float* row = s + r * ld;
    const float m = row_max(row, valid);
    const float l = exp_row(row, valid, round_lanes(n), m);
    lse[i0 + r] = m + std::log(l);
    inv[r] = 1.0f / l;
    if (drop.active()) dropout_row(row, round_lanes(n), drop, i0 + r);
  }
  block_combine<R>(o + i0 * os, os, s, ld, h.v, h.vs, n, h.hn, inv);
}

template <int R>
MF_INLINE void backward_block(const Head& h, int64_t i0, const float* kt, const float* vt, float* p,
                    float* ds, int64_t ld, const float* dout, int64_t dos, const float* lse,
                    const float* delta, float* dq, int64_t dqs, float* dk, int64_t dks,
                    float* dv, int64_t dvs, const Dropout& drop) {
  const int64_t n = h.block_keys(i0, R);
  const int64_t n16 = round_lanes(n);
  block_products<R>(p, ld, h.q + i0 * h.qs, h.qs, kt, n16, h.hn, h.scale);
  block_products<R>(ds, ld, dout + i0 * dos, dos, vt, n16, h.hn, 1.0f);
  for (int r = 0; r < R; ++r) {
    const int64_t i = i0 + r;
    float* prow = p + r * ld;
    exp_row(prow, h.row_keys(i), n16, lse[i]);  // the probabilities of row i
    if (drop.active())
      dropout_softmax_grad_row(ds + r * ld, prow, n16, delta[i], drop, i);
    else
      softmax_grad_row(ds + r * ld, prow, n16, delta[i]);
  }
  float scale[R];
  for (int r = 0; r < R; ++r) scale[r] = h.scale;
  block_combine<R>(dq + i0 * dqs, dqs, ds, ld, h.k, h.ks, n, h.hn, scale);
  block_accumulate<R>(dv, dvs, p, ld, dout + i0 * dos, dos, n, h.hn, 1.0f);
  block_accumulate<R>(dk, dks, ds, ld, h.q + i0 * h.qs, h.qs, n, h.hn, h.scale);
}

#define MF_ROWS_DISPATCH(rows, call) \
  switch (rows) {                    \
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

void attention_head_forward(const float* q, int64_t qs, const float* k, int64_t ks,
                            const float* v, int64_t vs, float* o, int64_t os, float* lse,
                            int64_t sq, int64_t hn, float scale, bool causal,
                            const Dropout& drop, float* work) {
  const int64_t ld = row_pitch(sq);
  float* kt = work;
  float* s = kt + hn * ld;
  float* vc = s + kRows * ld;  // v's rows, contiguous
  transpose_rows(kt, k, sq, ks, hn, ld);
  copy_rows(vc, hn, v, vs, sq, hn);
  const Head h{q, k, vc, qs, ks, hn, sq, hn, scale, causal};
  for (int64_t i0 = 0; i0 < sq; i0 += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, sq - i0);
#define MF_FORWARD(R) forward_block<R>(h, i0, kt, s, ld, o, os, lse, drop)
    MF_ROWS_DISPATCH(rows, MF_FORWARD)
#undef MF_FORWARD
  }
}

void attention_head_backward(const float* q, int64_t qs, const float* k, int64_t ks,
                             const float* v, int64_t vs, const float* o, int64_t os,
                             const float* dout, int64_t dos, const float* lse, float* dq,
                             int64_t dqs, float* dk, int64_t dks, float* dv, int64_t dvs,
                             int64_t sq, int64_t hn, float scale, bool causal,
                             const Dropout& drop, float* work) {
  const int64_t ld = row_pitch(sq);
  float* kt = work;
  float* vt = kt + hn * ld;
  float* p = vt + hn * ld;
  float* ds = p + kRows * ld;
  float* delta = ds + kRows * ld;
  // k's rows and the dk / dv sums, contiguous: every block reads or adds to all rows
  // before it, and the tensors' own rows lie a power of two apart (b * heads * hn floats)
  // in few cache sets.
  float* kc = delta + sq;
  float* dkc = kc + sq * hn;
  float* dvc = dkc + sq * hn;
  transpose_rows(kt, k, sq, ks, hn, ld);
  transpose_rows(vt, v, sq, vs, hn, ld);
  copy_rows(kc, hn, k, ks, sq, hn);
  fill_zero(dkc, 2 * sq * hn);
  // delta_i = sum_j p_ij dp_ij = dout_i . o_i, with or without dropout (o = dropped p v)
  for (int64_t i = 0; i < sq; ++i) delta[i] = dot(dout + i * dos, o + i * os, hn);
  const Head h{q, kc, v, qs, hn, vs, sq, hn, scale, causal};
  for (int64_t i0 = 0; i0 < sq; i0 += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, sq - i0);
#define MF_BACKWARD(R)                                                                       \
  backward_block<R>(h, i0, kt, vt, p, ds, ld, dout, dos, lse, delta, dq, dqs, dkc, hn, dvc, hn, \
                    drop)
    MF_ROWS_DISPATCH(rows, MF_BACKWARD)
#undef MF_BACKWARD
  }
  copy_rows(dk, dks, dkc, hn, sq, hn);
  copy_rows(dv, dvs, dvc, hn, sq, hn);
}

int64_t attention_work_floats(int64_t sq, int64_t hn) {
  const int64_t ld = row_pitch(sq);
  return 2 * hn * ld + 2 * kRows * ld + sq + 3 * sq * hn;
}

}  // namespace cpu
}  // namespace megatron_fused
