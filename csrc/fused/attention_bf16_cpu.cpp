// CPU self-attention of bfloat16 q, k, v with the AVX512-BF16 dot products: vdpbf16ps adds
// two bfloat16 products into each float32 lane, twice the multiply-adds of a float32 FMA of
// the same width. The tiling, the online softmax, dropout, sinks and windows are those of
// the float32 kernel (attention_cpu.cpp, attention_rows.h); only the five products differ,
// and they take their operands in pairs along the summed dimension:
//   scores q k^T and dout v^T sum over the head size: q's rows are read as words of two
//   bfloat16 values (d, d + 1) and k^T / v^T are kept as panels of such words, one per
//   key block ([hn / 2, row_pitch(block)] words);
//   p v, ds k (sums over keys) and p^T dout, ds^T q (sums over query rows) take the rows of
//   v, k, dout and q in pairs, word (t, c) = (x[2t][c], x[2t + 1][c]), and the probabilities
//   p and their gradients ds rounded to bfloat16, in rows (p v, ds k) or in pairs of rows
//   (p^T dout, ds^T q).
// The scores, the softmax, the log-sum-exp and every sum are float32; p and ds are rounded to
// bfloat16 before they are multiplied (as flash attention does on GPUs), and the outputs
// (o, dq, dk, dv) are rounded once, at the end. Compiled with AVX512-BF16 in the avx512
// build only (the pragma below), and called only where the CPU has it
// (attention_bf16_supported); the other builds have stubs. The second half of the file is the
// same kernel with oneDNN's microkernels for the products (attention_head_forward_brgemm).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include <ATen/native/CPUBlas.h>

#include "cpu_kernels.h"

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512bf16")
#include "attention_rows.h"

namespace megatron_fused {
namespace cpu {
namespace {

using Bf16 = uint16_t;
using Word = uint32_t;  // two bfloat16 values, the first in the low half

static_assert(kLanes == 16, "the bfloat16 kernel is written for 16 float32 lanes");
constexpr int kGroup = kRows;  // query rows per group of the backward (kGroup / 2 row pairs)

MF_INLINE Word load_word(const Bf16* p) {
  Word w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// acc[l] += a.lo * b[l].lo + a.hi * b[l].hi (bfloat16 products, float32 sums).
MF_INLINE __m512 dot(__m512 acc, Word a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(a)), (__m512bh)b);
}

MF_INLINE __m512i load_words(const Word* p) { return _mm512_loadu_si512(p); }
MF_INLINE void store_words(Word* p, __m512i w) { _mm512_storeu_si512(p, w); }

// 16 bfloat16 values of p in the low halves of 32-bit lanes.
MF_INLINE __m512i halves(const Bf16* p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 floats rounded to bfloat16 (nearest even), in the low halves of 32-bit lanes.
MF_INLINE __m512i rounded_halves(__m512 x) {
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
}

MF_INLINE __m512i pair(__m512i lo, __m512i hi) {
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// 16 bfloat16 values of p widened to float32 (exact: bfloat16 is float32's upper half).
MF_INLINE __m512 widen(const Bf16* p) { return _mm512_castsi512_ps(_mm512_slli_epi32(halves(p), 16)); }

MF_INLINE void store_rounded(Bf16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}

// dst[r * ds + c] = bf16(scale * src[r * ss + c]) for r < rows, c < hn.
MF_INLINE void round_rows(Bf16* dst, int64_t ds, const float* src, int64_t ss, int64_t rows,
                          int64_t hn, float scale) {
  const __m512 f = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < hn; c += kLanes)
      store_rounded(dst + r * ds + c, _mm512_mul_ps(_mm512_loadu_ps(src + r * ss + c), f));
}

constexpr int64_t row_pairs(int64_t rows) { return (rows + 1) / 2; }
MF_INLINE int64_t panel_words(int64_t hn, int64_t block) { return hn / 2 * row_pitch(block); }
MF_INLINE int64_t panels_words(int64_t sq, int64_t hn, int64_t block) {
  return (sq + block - 1) / block * panel_words(hn, block);
}

// r[0..15] <- their transpose as a 16 x 16 matrix of 32-bit lanes (r[i] lane j <- r[j] lane i).
MF_INLINE void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3)
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4q + k], 128-bit lane L: column 4L + k of rows 4q .. 4q + 3
  for (int q = 0; q < 4; ++q) {
    const __m512i *a = t + 4 * q;
    u[4 * q] = _mm512_unpacklo_epi64(a[0], a[2]);
    u[4 * q + 1] = _mm512_unpackhi_epi64(a[0], a[2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(a[1], a[3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(a[1], a[3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);    // lanes 0, 2 of each
    const __m512i w0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);    // lanes 1, 3
    const __m512i v1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
    r[k] = _mm512_shuffle_i32x4(v0, v1, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(w0, w1, 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(v0, v1, 0xDD);
    r[12 + k] = _mm512_shuffle_i32x4(w0, w1, 0xDD);
  }
}

// Rows i0 .. i0 + 15 of x (pitch `stride` bfloat16) as words w0 .. w0 + 15 (pairs of
// columns; those past `words` and rows past n zero), transposed: r[w] lane i = word w0 + w
// of row i0 + i.
MF_INLINE void load_word_tile(__m512i r[16], const Bf16* x, int64_t stride, int64_t i0,
                              int64_t n, int64_t w0, int64_t words) {
  const __mmask16 cols = w0 + 16 <= words ? 0xFFFF : static_cast<__mmask16>((1u << (words - w0)) - 1);
  for (int i = 0; i < 16; ++i)
    r[i] = i0 + i < n ? _mm512_maskz_loadu_epi32(cols, x + (i0 + i) * stride + 2 * w0)
                      : _mm512_setzero_si512();
  transpose16(r);
}

// The key blocks' panels of x^T in words: panel b holds word (d / 2, j) = (x[j][d],
// x[j][d + 1]) of keys j in [b block, (b + 1) block), at pitch row_pitch(block), zero past
// the last key. Tiles of 16 rows x 16 words through registers, each row of x (a view of the
// fused QKV projection) read once.
MF_INLINE void word_panels(Word* xt, const Bf16* x, int64_t sq, int64_t stride, int64_t hn,
                           int64_t block) {
  const int64_t ld = row_pitch(block), words = hn / 2;
  for (int64_t b0 = 0; b0 < sq; b0 += block) {
    Word* panel = xt + b0 / block * panel_words(hn, block);
    const int64_t n = std::min(block, sq - b0);
    __m512i r[16];
    for (int64_t j0 = 0; j0 < n; j0 += kLanes)
      for (int64_t w0 = 0; w0 < words; w0 += 16) {
        load_word_tile(r, x + b0 * stride, stride, j0, n, w0, words);
        for (int64_t w = 0; w < std::min<int64_t>(16, words - w0); ++w)
          store_words(panel + (w0 + w) * ld + j0, r[w]);
      }
    for (int64_t d = 0; d < words; ++d)  // the tiles wrote zeros up to round_lanes(n)
      for (int64_t j = round_lanes(n); j < ld; ++j) panel[d * ld + j] = 0;
  }
}

// x2[t * hn + c] = (x[2t][c], x[2t + 1][c]) for t < row_pairs(n): x's rows in pairs, the row
// after the last (n odd) zero.
MF_INLINE void pair_rows(Word* x2, const Bf16* x, int64_t stride, int64_t n, int64_t hn) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t = 0; t < row_pairs(n); ++t)
    for (int64_t c = 0; c < hn; c += kLanes) {
      const __m512i hi = 2 * t + 1 < n ? halves(x + (2 * t + 1) * stride + c) : zero;
      store_words(x2 + t * hn + c, pair(halves(x + 2 * t * stride + c), hi));
    }
}

// w2[t * ld + j] = (bf16(x[2t][j]), bf16(x[2t + 1][j])) for t < row_pairs(R), j < n16: the
// group's float rows (pitch ld) rounded and taken in pairs of rows, row R (R odd) zero.
template <int R>
MF_INLINE void pair_columns(Word* w2, const float* x, int64_t ld, int64_t n16) {
  for (int t = 0; t < row_pairs(R); ++t)
    for (int64_t j = 0; j < n16; j += kLanes) {
      const __m512i lo = rounded_halves(_mm512_loadu_ps(x + 2 * t * ld + j));
      const __m512i hi = 2 * t + 1 < R ? rounded_halves(_mm512_loadu_ps(x + (2 * t + 1) * ld + j))
                                       : _mm512_setzero_si512();
      store_words(w2 + t * ld + j, pair(lo, hi));
    }
}

// s[r * sld + j + c] = scale * sum_{d < hn} a[r * as + d] xt[d][j + c] for r < R, c < 16 V:
// a's rows read as words, xt a panel of words (pitch ld).
template <int R, int V>
MF_INLINE void scores_chunk(float* s, int64_t sld, const Bf16* a, int64_t as, const Word* xt,
                            int64_t ld, int64_t j, int64_t hn, float scale) {
  __m512 acc[V][R];
  for (int v = 0; v < V; ++v)
    for (int r = 0; r < R; ++r) acc[v][r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hn; d += 2) {
    __m512i b[V];
    for (int v = 0; v < V; ++v) b[v] = load_words(xt + d / 2 * ld + j + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Word w = load_word(a + r * as + d);
      for (int v = 0; v < V; ++v) acc[v][r] = dot(acc[v][r], w, b[v]);
    }
  }
  const __m512 f = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(s + r * sld + j + v * kLanes, _mm512_mul_ps(acc[v][r], f));
}

// The scores above for j < n16 (a multiple of 16).
template <int R>
MF_INLINE void block_scores(float* s, int64_t sld, const Bf16* a, int64_t as, const Word* xt,
                            int64_t ld, int64_t n16, int64_t hn, float scale) {
  int64_t j = 0;
  for (; j + 2 * kLanes <= n16; j += 2 * kLanes) scores_chunk<R, 2>(s, sld, a, as, xt, ld, j, hn, scale);
  if (j < n16) scores_chunk<R, 1>(s, sld, a, as, xt, ld, j, hn, scale);
}

// out[r * os + c + i] = keep[r] * out[...] + row_scale[r] * sum_{j < 2 pairs} p[r * pld + j]
// x[j][c + i] for r < R, i < 16 V (keep null: out's old values are not read): p's bfloat16
// rows read as words, x2 the rows of x in pairs (pair_rows).
template <int R, int V>
MF_INLINE void combine_chunk(float* out, int64_t os, const Bf16* p, int64_t pld, const Word* x2,
                             int64_t hn, int64_t pairs, int64_t c, const float* keep,
                             const float* row_scale) {
  __m512 acc[V][R];
  for (int v = 0; v < V; ++v)
    for (int r = 0; r < R; ++r) acc[v][r] = _mm512_setzero_ps();
  for (int64_t t = 0; t < pairs; ++t) {
    __m512i x[V];
    for (int v = 0; v < V; ++v) x[v] = load_words(x2 + t * hn + c + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Word w = load_word(p + r * pld + 2 * t);
      for (int v = 0; v < V; ++v) acc[v][r] = dot(acc[v][r], w, x[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      float* dst = out + r * os + c + v * kLanes;
      const __m512 sum = _mm512_mul_ps(acc[v][r], _mm512_set1_ps(row_scale[r]));
      _mm512_storeu_ps(dst, keep ? _mm512_fmadd_ps(_mm512_loadu_ps(dst), _mm512_set1_ps(keep[r]), sum)
                                 : sum);
    }
}

template <int R>
MF_INLINE void block_combine(float* out, int64_t os, const Bf16* p, int64_t pld, const Word* x2,
                             int64_t hn, int64_t pairs, const float* keep, const float* row_scale) {
  int64_t c = 0;
  for (; c + 2 * kLanes <= hn; c += 2 * kLanes)
    combine_chunk<R, 2>(out, os, p, pld, x2, hn, pairs, c, keep, row_scale);
  if (c < hn) combine_chunk<R, 1>(out, os, p, pld, x2, hn, pairs, c, keep, row_scale);
}

// y[j * hn + c + i] += sum_{t < P} w2[t * ld + j] . a2[t * hn + c + i] for j < n, i < 16 V:
// the transposed products p^T dout and ds^T q over a group's P pairs of rows.
template <int P, int V>
MF_INLINE void accumulate_chunk(float* y, int64_t hn, const Word* w2, int64_t ld, const Word* a2,
                                int64_t n, int64_t c) {
  __m512i a[V][P];
  for (int v = 0; v < V; ++v)
    for (int t = 0; t < P; ++t) a[v][t] = load_words(a2 + t * hn + c + v * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    __m512 acc[V];
    for (int v = 0; v < V; ++v) acc[v] = _mm512_loadu_ps(y + j * hn + c + v * kLanes);
    for (int t = 0; t < P; ++t) {
      const Word w = w2[t * ld + j];
      for (int v = 0; v < V; ++v) acc[v] = dot(acc[v], w, a[v][t]);
    }
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + j * hn + c + v * kLanes, acc[v]);
  }
}

template <int P>
MF_INLINE void block_accumulate(float* y, int64_t hn, const Word* w2, int64_t ld, const Word* a2,
                                int64_t n) {
  int64_t c = 0;
  for (; c + 2 * kLanes <= hn; c += 2 * kLanes) accumulate_chunk<P, 2>(y, hn, w2, ld, a2, n, c);
  if (c < hn) accumulate_chunk<P, 1>(y, hn, w2, ld, a2, n, c);
}

// The group of rows i0 .. i0 + R - 1 against the key block [j0, end): its scores s from
// q's rows and the block's panel of k^T (kt, pitch ld), the online softmax, p rounded to
// bfloat16 (p16, pitch sld) and o = o * keep + scale * p v (o: the group's float rows, pitch
// hn; v2: v's rows in pairs, from j0).
template <int R>
MF_INLINE void forward_group(const HeadShape& h, const Bf16* q, int64_t qs, int64_t i0,
                             int64_t j0, int64_t end, const Word* kt, int64_t ld, const Word* v2,
                             float* s, Bf16* p16, int64_t sld, float* o, float* m, float* l,
                             float* lse, const Dropout& drop) {
  const int64_t n = h.group_keys(i0, R, j0, end), n16 = round_lanes(n);
  block_scores<R>(s, sld, q + i0 * qs, qs, kt, ld, n16, h.hn, h.scale);
  float keep[R], scale[R];
  online_softmax<R>(h, i0, j0, end, s, sld, n16, m, l, lse, drop, keep, scale);
  round_rows(p16, sld, s, sld, R, n16, 1.0f);
  block_combine<R>(o, h.hn, p16, sld, v2, h.hn, row_pairs(n), h.first_block(i0, j0) ? nullptr : keep,
                   scale);
}

// The backward's float32 and bfloat16 rows, and the head's rows as the products take them.
struct Backward {
  const Bf16* q;     // q's rows, contiguous
  const Bf16* dout;  // dout's rows, contiguous
  const Word *q2, *dout2, *k2;  // the rows of q, dout and k in pairs
  const float *lse, *delta;
  float *p, *ds;       // the group's probabilities and their gradients (pitch sld)
  Bf16* ds16;          // ds rounded (pitch sld)
  Word *p2, *ds2;      // p and ds rounded, in pairs of rows (pitch sld)
  int64_t sld;
  float *dq, *dk, *dv;  // float32 sums: dq [sq, hn], dk and dv of the key block [block, hn]
};

// The group of rows i0 .. i0 + R - 1 (i0 even) against the key block [j0, end): p and ds
// recomputed (kt, vt: the block's panels of k^T and v^T), dq += scale ds k, and the block's
// sums dv += p^T dout, dk += ds^T q (the scale applied when they are written).
template <int R>
MF_INLINE void backward_group(const HeadShape& h, const Backward& b, int64_t i0, int64_t j0,
                              int64_t end, const Word* kt, const Word* vt, int64_t ld,
                              const Dropout& drop) {
  const int64_t n = h.group_keys(i0, R, j0, end), n16 = round_lanes(n), hn = h.hn;
  block_scores<R>(b.p, b.sld, b.q + i0 * hn, hn, kt, ld, n16, hn, h.scale);
  block_scores<R>(b.ds, b.sld, b.dout + i0 * hn, hn, vt, ld, n16, hn, 1.0f);
  softmax_backward_rows<R>(h, i0, j0, end, b.p, b.ds, b.sld, n16, b.lse, b.delta, drop);
  round_rows(b.ds16, b.sld, b.ds, b.sld, R, n16, 1.0f);
  pair_columns<R>(b.p2, b.p, b.sld, n16);
  pair_columns<R>(b.ds2, b.ds, b.sld, n16);
  float keep[R], scale[R];
  for (int r = 0; r < R; ++r) {
    keep[r] = 1.0f;
    scale[r] = h.scale;
  }
  block_combine<R>(b.dq + i0 * hn, hn, b.ds16, b.sld, b.k2 + j0 / 2 * hn, hn, row_pairs(n), keep,
                   scale);
  block_accumulate<row_pairs(R)>(b.dv, hn, b.p2, b.sld, b.dout2 + i0 / 2 * hn, n);
  block_accumulate<row_pairs(R)>(b.dk, hn, b.ds2, b.sld, b.q2 + i0 / 2 * hn, n);
}

// delta[i] = sum_j p_ij dp_ij = dout_i . o_i for i < sq, with or without dropout (o is the
// dropped p v): float32 sums of the bfloat16 rows.
MF_INLINE void row_dots(float* delta, const Bf16* dout, int64_t dos, const Bf16* o, int64_t os,
                        int64_t sq, int64_t hn) {
  for (int64_t i = 0; i < sq; ++i) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < hn; c += kLanes)
      acc = _mm512_fmadd_ps(widen(dout + i * dos + c), widen(o + i * os + c), acc);
    delta[i] = _mm512_reduce_add_ps(acc);
  }
}

// dst[r * hn + c] = src[r * stride + c] for r < rows, c < hn.
MF_INLINE void copy_rows(Bf16* dst, const Bf16* src, int64_t stride, int64_t rows, int64_t hn) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * hn, src + r * stride, sizeof(Bf16) * hn);
}

MF_INLINE int64_t forward_words(int64_t sq, int64_t hn, const AttentionTiles& t) {
  const int64_t sld = row_pitch(t.forward_keys);
  return panels_words(sq, hn, t.forward_keys) + row_pairs(sq) * hn + kRows * sld +
         kRows * sld / 2 + t.rows * hn + 2 * t.rows;
}

MF_INLINE int64_t backward_words(int64_t sq, int64_t hn, const AttentionTiles& t) {
  const int64_t sld = row_pitch(t.backward_keys);
  return 2 * panels_words(sq, hn, t.backward_keys) + 3 * row_pairs(sq) * hn + sq * hn +
         2 * kGroup * sld + kGroup * sld / 2 + 2 * row_pairs(kGroup) * sld + sq +
         2 * t.backward_keys * hn + sq * hn;
}


// ---- The same attention with oneDNN's batch-reduce GEMM microkernels for the products
// (at::native::cpublas::brgemm, bfloat16 x bfloat16 -> float32): AMX tiles where the CPU has
// AMX-BF16, else AVX512-BF16 dot products, as oneDNN picks at run time. The operands are
// those of the kernel above: B of each product in the VNNI layout, [K / 2][N] words of two
// bfloat16 values along K (the k^T / v^T panels, the pairs of rows of k and v), and the
// transposed products dk^T += q^T ds, dv^T += dout^T p, whose B (ds, p in pairs of rows) is
// built per group as above. A group has kBrgemmRows query rows in the forward (the products'
// M), kBrgemmBackRows in the backward; the online softmax and the softmax backward run row by
// row (attention_rows.h).

constexpr int64_t kBrgemmRows = 32;
// The backward's groups: its transposed sums dk^T, dv^T (hn x block floats each) are read and
// written once per group, so it takes twice the forward's rows (Zen 4, s1024-8192: dot / brgemm
// 0.90-1.01 with 64, 0.84-0.93 with 32).
constexpr int64_t kBrgemmBackRows = 64;

using BF = at::BFloat16;

// c[r * ldc + j] (+)= sum_k a[r * lda + k] b[k][j] for r < m, j < n, k < kk: b in words
// (k / 2, j) at pitch ldb words.
MF_INLINE void brgemm(int64_t m, int64_t n, int64_t kk, const Bf16* a, int64_t lda,
                      const Word* b, int64_t ldb, float* c, int64_t ldc, bool add) {
  at::native::cpublas::brgemm(m, n, kk, lda, ldb, ldc, add, reinterpret_cast<const BF*>(a),
                              reinterpret_cast<const BF*>(b), c, true);
}

MF_INLINE int64_t round_even(int64_t n) { return (n + 1) / 2 * 2; }

MF_INLINE void scale_rows(float* s, int64_t sld, int64_t rows, int64_t n16, float scale) {
  const __m512 f = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n16; j += kLanes)
      _mm512_storeu_ps(s + r * sld + j, _mm512_mul_ps(_mm512_loadu_ps(s + r * sld + j), f));
}

// w2[t * ld + j] = (bf16(x[2t][j]), bf16(x[2t + 1][j])) for t < row_pairs(rows), j < n16
// (row `rows` zero when rows is odd): pair_columns for any number of rows.
MF_INLINE void pair_float_rows(Word* w2, const float* x, int64_t ld, int64_t rows, int64_t n16) {
  for (int64_t t = 0; t < row_pairs(rows); ++t)
    for (int64_t j = 0; j < n16; j += kLanes) {
      const __m512i lo = rounded_halves(_mm512_loadu_ps(x + 2 * t * ld + j));
      const __m512i hi = 2 * t + 1 < rows
                             ? rounded_halves(_mm512_loadu_ps(x + (2 * t + 1) * ld + j))
                             : _mm512_setzero_si512();
      store_words(w2 + t * ld + j, pair(lo, hi));
    }
}

// xt[c * tp + i] = x[i * stride + c] for i < sq, c < hn, and 0 for sq <= i < tp
// (tp = round_lanes(sq)): tiles of 16 rows x 16 words, each word's halves to two rows.
MF_INLINE void transpose_rows(Bf16* xt, int64_t tp, const Bf16* x, int64_t stride, int64_t sq,
                              int64_t hn) {
  const int64_t words = hn / 2;
  __m512i r[16];
  for (int64_t i0 = 0; i0 < tp; i0 += kLanes)
    for (int64_t w0 = 0; w0 < words; w0 += 16) {
      load_word_tile(r, x, stride, i0, sq, w0, words);
      for (int64_t w = 0; w < std::min<int64_t>(16, words - w0); ++w) {
        const int64_t c = 2 * (w0 + w);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xt + c * tp + i0),
                            _mm512_cvtepi32_epi16(r[w]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xt + (c + 1) * tp + i0),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(r[w], 16)));
      }
    }
}

// dst[j * ds + c] = bf16(scale * src[c * ld + j]) for j < rows, c < hn: a block's sums,
// kept transposed, written as rows (tiles of 16 x 16 through registers; ld >= rows + 16,
// a multiple of 16).
MF_INLINE void round_transposed(Bf16* dst, int64_t ds, const float* src, int64_t ld,
                                int64_t rows, int64_t hn, float scale) {
  const __m512 f = _mm512_set1_ps(scale);
  __m512i r[16];
  for (int64_t j0 = 0; j0 < rows; j0 += kLanes)
    for (int64_t c0 = 0; c0 < hn; c0 += kLanes) {
      for (int k = 0; k < 16; ++k)
        r[k] = _mm512_loadu_si512(src + (c0 + k) * ld + j0);
      transpose16(r);
      for (int64_t j = 0; j < std::min<int64_t>(16, rows - j0); ++j)
        store_rounded(dst + (j0 + j) * ds + c0, _mm512_mul_ps(_mm512_castsi512_ps(r[j]), f));
    }
}

MF_INLINE int64_t brgemm_forward_words(int64_t sq, int64_t hn, const AttentionTiles& t) {
  const int64_t sld = row_pitch(t.forward_keys);
  return panels_words(sq, hn, t.forward_keys) + row_pairs(sq) * hn + kBrgemmRows * sld +
         kBrgemmRows * sld / 2 + kBrgemmRows * hn + t.rows * hn + 2 * t.rows;
}

MF_INLINE int64_t transposed_words(int64_t sq, int64_t hn) { return hn * round_lanes(sq) / 2; }

MF_INLINE int64_t brgemm_backward_words(int64_t sq, int64_t hn, const AttentionTiles& t) {
  const int64_t sld = row_pitch(t.backward_keys);
  return 2 * panels_words(sq, hn, t.backward_keys) + row_pairs(sq) * hn +
         2 * transposed_words(sq, hn) + 2 * kBrgemmBackRows * sld +
         kBrgemmBackRows * sld / 2 + 2 * row_pairs(kBrgemmBackRows) * sld + sq + 2 * hn * sld +
         sq * hn;
}

}  // namespace

bool attention_bf16_supported() { return __builtin_cpu_supports("avx512bf16"); }

int64_t attention_bf16_work_floats(int64_t sq, int64_t hn) {
  const AttentionTiles t = attention_tiles(sq, hn);
  return std::max(forward_words(sq, hn, t), backward_words(sq, hn, t));
}

void attention_head_forward(const uint16_t* q, int64_t qs, const uint16_t* k, int64_t ks,
                            const uint16_t* v, int64_t vs, uint16_t* o, int64_t os,
                            float* lse, int64_t sq, int64_t hn, float scale, bool causal,
                            const Dropout& drop, float* work, const float* sink,
                            int64_t window) {
  const AttentionTiles t = attention_tiles(sq, hn);
  const int64_t ld = row_pitch(t.forward_keys), sld = ld, panel = panel_words(hn, t.forward_keys);
  Word* kt = reinterpret_cast<Word*>(work);
  Word* v2 = kt + panels_words(sq, hn, t.forward_keys);
  float* s = reinterpret_cast<float*>(v2 + row_pairs(sq) * hn);
  Bf16* p16 = reinterpret_cast<Bf16*>(s + kRows * sld);
  float* oq = reinterpret_cast<float*>(p16 + kRows * sld);  // a query block's float rows
  float* m = oq + t.rows * hn;  // the running max and sum of its rows
  float* l = m + t.rows;
  word_panels(kt, k, sq, ks, hn, t.forward_keys);
  pair_rows(v2, v, vs, sq, hn);
  HeadShape h{sq, hn, scale, causal, window};
  h.set_sink(sink);
  forward_blocks(
      h, t,
      [&](int64_t q0, int64_t j0, int64_t end, int64_t i0, int64_t rows) {
        const Word* ktb = kt + j0 / t.forward_keys * panel;
#define MF_FORWARD(R)                                                                        \
  forward_group<R>(h, q, qs, i0, j0, end, ktb, ld, v2 + j0 / 2 * hn, s, p16, sld,            \
                   oq + (i0 - q0) * hn, m + (i0 - q0), l + (i0 - q0), lse, drop)
        MF_ROWS_DISPATCH(rows, MF_FORWARD)
#undef MF_FORWARD
      },
      [&](int64_t q0, int64_t q1) { round_rows(o + q0 * os, os, oq, hn, q1 - q0, hn, 1.0f); });
}

void attention_head_backward(const uint16_t* q, int64_t qs, const uint16_t* k, int64_t ks,
                             const uint16_t* v, int64_t vs, const uint16_t* o, int64_t os,
                             const uint16_t* dout, int64_t dos, const float* lse,
                             uint16_t* dq, int64_t dqs, uint16_t* dk, int64_t dks,
                             uint16_t* dv, int64_t dvs, int64_t sq, int64_t hn, float scale,
                             bool causal, const Dropout& drop, float* work, int64_t window) {
  const AttentionTiles t = attention_tiles(sq, hn);
  const int64_t block = t.backward_keys, ld = row_pitch(block), sld = ld;
  const int64_t panel = panel_words(hn, block), pairs = row_pairs(sq) * hn;
  Word* kt = reinterpret_cast<Word*>(work);
  Word* vt = kt + panels_words(sq, hn, block);
  Word* k2 = vt + panels_words(sq, hn, block);
  Word* q2 = k2 + pairs;
  Word* dout2 = q2 + pairs;
  Bf16* qc = reinterpret_cast<Bf16*>(dout2 + pairs);
  Bf16* doutc = qc + sq * hn;
  float* p = reinterpret_cast<float*>(doutc + sq * hn);
  float* ds = p + kGroup * sld;
  Bf16* ds16 = reinterpret_cast<Bf16*>(ds + kGroup * sld);
  Word* p2 = reinterpret_cast<Word*>(ds16 + kGroup * sld);
  Word* ds2 = p2 + row_pairs(kGroup) * sld;
  float* delta = reinterpret_cast<float*>(ds2 + row_pairs(kGroup) * sld);
  float* dkb = delta + sq;
  float* dvb = dkb + block * hn;
  float* dqf = dvb + block * hn;
  word_panels(kt, k, sq, ks, hn, block);
  word_panels(vt, v, sq, vs, hn, block);
  pair_rows(k2, k, ks, sq, hn);
  pair_rows(q2, q, qs, sq, hn);
  pair_rows(dout2, dout, dos, sq, hn);
  copy_rows(qc, q, qs, sq, hn);
  copy_rows(doutc, dout, dos, sq, hn);
  row_dots(delta, doutc, hn, o, os, sq, hn);
  fill_zero(dqf, sq * hn);
  const HeadShape h{sq, hn, scale, causal, window};
  const Backward b{qc, doutc, q2, dout2, k2, lse, delta, p, ds, ds16, p2, ds2, sld, dqf, dkb, dvb};
  for (int64_t j0 = 0; j0 < sq; j0 += block) {
    const int64_t end = std::min(sq, j0 + block);
    const Word *ktb = kt + j0 / block * panel, *vtb = vt + j0 / block * panel;
    fill_zero(dkb, 2 * block * hn);
    // groups start at multiples of kGroup (even: the rows pair up as in q2 and dout2)
    for (int64_t i0 = causal ? j0 / kGroup * kGroup : 0; i0 < sq; i0 += kGroup) {
      if (end <= h.first_key(i0)) break;  // the later rows' windows start after the block
      const int64_t rows = std::min<int64_t>(kGroup, sq - i0);
#define MF_BACKWARD(R) backward_group<R>(h, b, i0, j0, end, ktb, vtb, ld, drop)
      MF_ROWS_DISPATCH(rows, MF_BACKWARD)
#undef MF_BACKWARD
    }
    round_rows(dk + j0 * dks, dks, dkb, hn, end - j0, hn, scale);
    round_rows(dv + j0 * dvs, dvs, dvb, hn, end - j0, hn, 1.0f);
  }
  round_rows(dq, dqs, dqf, hn, sq, hn, 1.0f);
}


namespace {

// Whether oneDNN's microkernels give exact products in the layouts the kernel passes them:
// M = kBrgemmRows rows, N with a tail (not a multiple of 16) at a row pitch of B and C wider
// than N, K = 64, and the accumulating form; small integers, whose sums are exact.
bool brgemm_self_test() {
  constexpr int64_t M = kBrgemmRows, N = 40, K = 64, ldb = 80, ldc = 72;
  std::vector<Bf16> a(M * K);
  std::vector<Word> b(K / 2 * ldb, 0);
  std::vector<float> c(M * ldc, 0.0f);
  auto bf16 = [](int x) {
    const BF v(static_cast<float>(x));
    Bf16 bits;
    std::memcpy(&bits, &v, sizeof(bits));
    return bits;
  };
  auto b_at = [](int64_t k, int64_t j) { return static_cast<int>((k * 3 + j * 5) % 7) - 3; };
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; ++k) a[r * K + k] = bf16(static_cast<int>((r + 2 * k) % 5) - 2);
  for (int64_t k = 0; k < K; k += 2)
    for (int64_t j = 0; j < N; ++j)
      b[k / 2 * ldb + j] = bf16(b_at(k, j)) | (static_cast<Word>(bf16(b_at(k + 1, j))) << 16);
  for (int pass = 0; pass < 2; ++pass)
    brgemm(M, N, K, a.data(), K, b.data(), ldb, c.data(), ldc, pass == 1);
  at::native::cpublas::brgemm_release(true);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j = 0; j < N; ++j) {
      float want = 0.0f;
      for (int64_t k = 0; k < K; ++k)
        want += static_cast<float>((static_cast<int>((r + 2 * k) % 5) - 2) * b_at(k, j));
      if (c[r * ldc + j] != 2.0f * want) return false;
    }
  return true;
}

}  // namespace

bool attention_brgemm_supported() {
  static const bool ok = [] {
    if (!attention_bf16_supported()) return false;
    try {  // oneDNN's bfloat16 microkernels in this torch (VNNI B), else an exception
      return brgemm_self_test();
    } catch (const std::exception&) {
      return false;
    }
  }();
  return ok;
}

bool attention_brgemm_amx() { return at::native::cpublas::could_pack(at::kBFloat16); }

int64_t attention_brgemm_work_floats(int64_t sq, int64_t hn) {
  const AttentionTiles t = attention_tiles(sq, hn);
  return std::max(brgemm_forward_words(sq, hn, t), brgemm_backward_words(sq, hn, t));
}

void attention_head_forward_brgemm(const uint16_t* q, int64_t qs, const uint16_t* k, int64_t ks,
                                   const uint16_t* v, int64_t vs, uint16_t* o, int64_t os,
                                   float* lse, int64_t sq, int64_t hn, float scale, bool causal,
                                   const Dropout& drop, float* work, const float* sink,
                                   int64_t window) {
  const AttentionTiles t = attention_tiles(sq, hn);
  const int64_t block = t.forward_keys, ld = row_pitch(block), sld = ld;
  const int64_t panel = panel_words(hn, block);
  Word* kt = reinterpret_cast<Word*>(work);
  Word* v2 = kt + panels_words(sq, hn, block);
  float* s = reinterpret_cast<float*>(v2 + row_pairs(sq) * hn);
  Bf16* p16 = reinterpret_cast<Bf16*>(s + kBrgemmRows * sld);
  float* pv = reinterpret_cast<float*>(p16 + kBrgemmRows * sld);  // a group's p v
  float* oq = pv + kBrgemmRows * hn;  // a query block's float rows
  float* m = oq + t.rows * hn;        // the running max and sum of its rows
  float* l = m + t.rows;
  word_panels(kt, k, sq, ks, hn, block);
  pair_rows(v2, v, vs, sq, hn);
  HeadShape h{sq, hn, scale, causal, window};
  h.set_sink(sink);
  for (int64_t q0 = 0; q0 < sq; q0 += t.rows) {
    const int64_t q1 = std::min(sq, q0 + t.rows);
    for (int64_t j0 = h.first_key(q0) / block * block; j0 < h.block_keys(q0, q1 - q0);
         j0 += block) {
      const int64_t end = std::min(sq, j0 + block);
      const Word* ktb = kt + j0 / block * panel;
      for (int64_t i0 = causal ? std::max(q0, j0) : q0; i0 < q1; i0 += kBrgemmRows) {
        // this group's windows and the later ones' start after the block
        if (end <= h.first_key(i0)) break;
        const int64_t rows = std::min(kBrgemmRows, q1 - i0);
        const int64_t n = h.group_keys(i0, rows, j0, end), n16 = round_lanes(n);
        brgemm(rows, n16, hn, q + i0 * qs, qs, ktb, ld, s, sld, false);
        scale_rows(s, sld, rows, n16, scale);
        float keep[kBrgemmRows], row_scale[kBrgemmRows];
        for (int64_t r = 0; r < rows; ++r)  // each row its own first and last block
          online_softmax<1>(h, i0 + r, j0, end, s + r * sld, sld, n16, m + (i0 - q0) + r,
                            l + (i0 - q0) + r, lse, drop, keep + r, row_scale + r);
        round_rows(p16, sld, s, sld, rows, n16, 1.0f);
        brgemm(rows, hn, round_even(n), p16, sld, v2 + j0 / 2 * hn, hn, pv, hn, false);
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = oq + (i0 - q0 + r) * hn;
          const __m512 f = _mm512_set1_ps(row_scale[r]), g = _mm512_set1_ps(keep[r]);
          const bool first = h.first_block(i0 + r, j0);
          for (int64_t c = 0; c < hn; c += kLanes) {
            const __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(pv + r * hn + c), f);
            _mm512_storeu_ps(dst + c,
                             first ? sum : _mm512_fmadd_ps(_mm512_loadu_ps(dst + c), g, sum));
          }
        }
      }
    }
    round_rows(o + q0 * os, os, oq, hn, q1 - q0, hn, 1.0f);
  }
  at::native::cpublas::brgemm_release(true);
}

void attention_head_backward_brgemm(const uint16_t* q, int64_t qs, const uint16_t* k,
                                    int64_t ks, const uint16_t* v, int64_t vs,
                                    const uint16_t* o, int64_t os, const uint16_t* dout,
                                    int64_t dos, const float* lse, uint16_t* dq, int64_t dqs,
                                    uint16_t* dk, int64_t dks, uint16_t* dv, int64_t dvs,
                                    int64_t sq, int64_t hn, float scale, bool causal,
                                    const Dropout& drop, float* work, int64_t window) {
  const AttentionTiles t = attention_tiles(sq, hn);
  const int64_t block = t.backward_keys, ld = row_pitch(block), sld = ld;
  const int64_t panel = panel_words(hn, block), tp = round_lanes(sq);
  Word* kt = reinterpret_cast<Word*>(work);
  Word* vt = kt + panels_words(sq, hn, block);
  Word* k2 = vt + panels_words(sq, hn, block);
  Bf16* qT = reinterpret_cast<Bf16*>(k2 + row_pairs(sq) * hn);  // [hn, tp]
  Bf16* doutT = qT + hn * tp;
  float* p = reinterpret_cast<float*>(doutT + hn * tp);
  float* ds = p + kBrgemmBackRows * sld;
  Bf16* ds16 = reinterpret_cast<Bf16*>(ds + kBrgemmBackRows * sld);
  Word* p2 = reinterpret_cast<Word*>(ds16 + kBrgemmBackRows * sld);
  Word* ds2 = p2 + row_pairs(kBrgemmBackRows) * sld;
  float* delta = reinterpret_cast<float*>(ds2 + row_pairs(kBrgemmBackRows) * sld);
  float* dkT = delta + sq;  // the key block's sums, transposed: [hn, ld]
  float* dvT = dkT + hn * ld;
  float* dqf = dvT + hn * ld;
  word_panels(kt, k, sq, ks, hn, block);
  word_panels(vt, v, sq, vs, hn, block);
  pair_rows(k2, k, ks, sq, hn);
  transpose_rows(qT, tp, q, qs, sq, hn);
  transpose_rows(doutT, tp, dout, dos, sq, hn);
  row_dots(delta, dout, dos, o, os, sq, hn);
  fill_zero(dqf, sq * hn);
  const HeadShape h{sq, hn, scale, causal, window};
  for (int64_t j0 = 0; j0 < sq; j0 += block) {
    const int64_t end = std::min(sq, j0 + block);
    const Word *ktb = kt + j0 / block * panel, *vtb = vt + j0 / block * panel;
    fill_zero(dkT, 2 * hn * ld);
    // groups of kBrgemmBackRows rows from a multiple of it: under the causal mask the first
    // may hold rows before j0, which see none of the block's keys (their p and ds are 0)
    for (int64_t i0 = causal ? j0 / kBrgemmBackRows * kBrgemmBackRows : 0; i0 < sq;
         i0 += kBrgemmBackRows) {
      if (end <= h.first_key(i0)) break;  // the later rows' windows start after the block
      const int64_t rows = std::min(kBrgemmBackRows, sq - i0);
      const int64_t n = h.group_keys(i0, rows, j0, end), n16 = round_lanes(n);
      brgemm(rows, n16, hn, q + i0 * qs, qs, ktb, ld, p, sld, false);
      scale_rows(p, sld, rows, n16, scale);
      brgemm(rows, n16, hn, dout + i0 * dos, dos, vtb, ld, ds, sld, false);
      for (int64_t r = 0; r < rows; ++r)
        softmax_backward_rows<1>(h, i0 + r, j0, end, p + r * sld, ds + r * sld, sld, n16, lse,
                                 delta, drop);
      round_rows(ds16, sld, ds, sld, rows, n16, 1.0f);
      pair_float_rows(p2, p, sld, rows, n16);
      pair_float_rows(ds2, ds, sld, rows, n16);
      const int64_t pairs = round_even(rows);
      brgemm(rows, hn, round_even(n), ds16, sld, k2 + j0 / 2 * hn, hn, dqf + i0 * hn, hn, true);
      brgemm(hn, n16, pairs, doutT + i0, tp, p2, sld, dvT, ld, true);
      brgemm(hn, n16, pairs, qT + i0, tp, ds2, sld, dkT, ld, true);
    }
    round_transposed(dk + j0 * dks, dks, dkT, ld, end - j0, hn, scale);
    round_transposed(dv + j0 * dvs, dvs, dvT, ld, end - j0, hn, 1.0f);
  }
  round_rows(dq, dqs, dqf, hn, sq, hn, scale);
  at::native::cpublas::brgemm_release(true);
}

}  // namespace cpu
}  // namespace megatron_fused
#pragma GCC pop_options

#else  // not the avx512 build: no bfloat16 dot products (callers check first)

namespace megatron_fused {
namespace cpu {

bool attention_bf16_supported() { return false; }
int64_t attention_bf16_work_floats(int64_t, int64_t) { return 0; }
bool attention_brgemm_supported() { return false; }
bool attention_brgemm_amx() { return false; }
int64_t attention_brgemm_work_floats(int64_t, int64_t) { return 0; }
void attention_head_forward_brgemm(const uint16_t*, int64_t, const uint16_t*, int64_t,
                                   const uint16_t*, int64_t, uint16_t*, int64_t, float*,
                                   int64_t, int64_t, float, bool, const Dropout&, float*,
                                   const float*, int64_t) {}
void attention_head_backward_brgemm(const uint16_t*, int64_t, const uint16_t*, int64_t,
                                    const uint16_t*, int64_t, const uint16_t*, int64_t,
                                    const uint16_t*, int64_t, const float*, uint16_t*,
                                    int64_t, uint16_t*, int64_t, uint16_t*, int64_t, int64_t,
                                    int64_t, float, bool, const Dropout&, float*, int64_t) {}
void attention_head_forward(const uint16_t*, int64_t, const uint16_t*, int64_t,
                            const uint16_t*, int64_t, uint16_t*, int64_t, float*, int64_t,
                            int64_t, float, bool, const Dropout&, float*, const float*,
                            int64_t) {}
void attention_head_backward(const uint16_t*, int64_t, const uint16_t*, int64_t,
                             const uint16_t*, int64_t, const uint16_t*, int64_t,
                             const uint16_t*, int64_t, const float*, uint16_t*, int64_t,
                             uint16_t*, int64_t, uint16_t*, int64_t, int64_t, int64_t, float,
                             bool, const Dropout&, float*, int64_t) {}

}  // namespace cpu
}  // namespace megatron_fused
#endif
