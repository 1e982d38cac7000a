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

#include "attention_rows.h"

namespace megatron_fused {
namespace cpu {

using namespace lanes;

namespace {

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
// Its p v on AVX2 takes blocks of 4 rows x 2 vectors (6 loads per 8 FMAs, where 8 x 1 takes
// 9): on Zen 3 (one thread, head size 64, medians of 11 interleaved) the forward 1.22-1.27x
// as fast at s1024-8192 (s4096: 36.3 ms against 45.3 ms; 6 x 2: 40.7 ms; 3 x 4 and 2 x 4
// no faster than 8 x 1). The backward's 6 x 2 stays: at s2048-4096, 4 x 3 products ran
// 0.88-0.89x as fast, dq in 4 x 2, 3 x 4 or 2 x 4 0.91-1.02x, dk / dv sums 0.58-0.98x.
constexpr int kCombineRows = kRegisters >= 32 ? kRows : 4;

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

// One (batch, head) in float32: its q, k, v rows at their strides.
struct Head : HeadShape {
  const float* q;
  const float* k;
  const float* v;
  int64_t qs, ks, vs;  // row (sequence) strides
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
  float keep[R], scale[R];
  online_softmax<R>(h, i0, j0, end, s, sld, n16, m, l, lse, drop, keep, scale);
  block_combine<R, kCombineRows>(o + i0 * os, os, s, sld, h.v + j0 * h.vs, h.vs, n, h.hn,
                                 h.first_block(i0, j0) ? nullptr : keep, scale);
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
  softmax_backward_rows<R>(h, i0, j0, end, p, ds, sld, n16, lse, delta, drop);
  float keep[R], scale[R];
  for (int r = 0; r < R; ++r) {
    keep[r] = 1.0f;
    scale[r] = h.scale;
  }
  block_combine<R, kBackwardRows>(dq + i0 * dqs, dqs, ds, sld, h.k + j0 * h.ks, h.ks, n, h.hn,
                                  h.first_block(i0, j0) ? nullptr : keep, scale);
  block_accumulate<R, kBackwardRows>(dv, h.hn, p, sld, dout + i0 * dos, dos, n, h.hn, 1.0f);
  block_accumulate<R, kBackwardRows>(dk, h.hn, ds, sld, h.q + i0 * h.qs, h.qs, n, h.hn,
                                     h.scale);
}

MF_INLINE int64_t fit_keys(int64_t floats, int64_t sq) {
  const int64_t fit = std::max<int64_t>(kKeyAlign, floats / kKeyAlign * kKeyAlign);
  return std::min(fit, (sq + kKeyAlign - 1) / kKeyAlign * kKeyAlign);
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
  Head h{{sq, hn, scale, causal, window}, q, k, vc, qs, ks, hn};
  h.set_sink(sink);
  forward_blocks(
      h, t,
      [&](int64_t q0, int64_t j0, int64_t end, int64_t i0, int64_t rows) {
        const float* ktb = kt + j0 / t.forward_keys * panel;
#define MF_FORWARD(R) \
  forward_group<R>(h, i0, j0, end, ktb, ld, s, sld, o, os, m + (i0 - q0), l + (i0 - q0), lse, drop)
        MF_ROWS_DISPATCH(rows, MF_FORWARD)
#undef MF_FORWARD
      },
      [](int64_t, int64_t) {});
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
  const Head h{{sq, hn, scale, causal, window}, qc, kc, v, hn, hn, vs};
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
