// LaneVec: one register of floats handled as one value through the GCC/Clang vector
// extension, and the helpers the CPU kernels write their arithmetic with.
//
// The library is built for one instruction set (-march flags, chosen by
// megatron/fused/kernels.py from this CPU or MEGATRON_CPU_ISA), and LaneVec is exactly one
// register of it: 16 floats with AVX-512, 8 with AVX2, 4 otherwise. A vector wider than
// the target's registers has no machine mode: GCC keeps every such value in stack memory
// and builds it element by element, which made the AVX2 code 5-20x slower than SDPA
// (the previous build had one 16-float type for AVX-512, AVX2 and baseline clones).
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace megatron_fused {
namespace cpu {
namespace lanes {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRegisters = 32;  // vector registers of the target
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr int kRegisters = 16;
constexpr const char* kIsa = "avx2";
#else
constexpr int kLanes = 4;
constexpr int kRegisters = 16;
constexpr const char* kIsa = "baseline";
#endif
typedef float LaneVec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t LaneInt __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t LaneU32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t LaneU16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint8_t LaneU8 __attribute__((vector_size(kLanes * sizeof(uint8_t))));

constexpr float kInf = std::numeric_limits<float>::infinity();

inline LaneVec splat(float v) {
  LaneVec out;
  for (int k = 0; k < kLanes; ++k) out[k] = v;
  return out;
}

inline LaneVec load(const float* p) {
  LaneVec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The first m (< kLanes) floats of p, the other lanes set to `fill`.
inline LaneVec load_part(const float* p, int64_t m, float fill) {
  LaneVec v = splat(fill);
  std::memcpy(&v, p, sizeof(float) * m);
  return v;
}

inline void store(float* p, const LaneVec& v) { std::memcpy(p, &v, sizeof(v)); }
inline void store_part(float* p, const LaneVec& v, int64_t m) {
  std::memcpy(p, &v, sizeof(float) * m);
}

// -1 in the lanes whose mask byte is non-zero, 0 elsewhere; m bytes (m <= kLanes).
inline LaneInt load_mask(const uint8_t* p, int64_t m = kLanes) {
  LaneU8 bytes = {};
  std::memcpy(&bytes, p, m);
  return __builtin_convertvector(bytes, LaneInt) != 0;
}

// -1 in lanes [0, m), 0 elsewhere.
inline LaneInt first_lanes(int64_t m) {
  LaneInt index;
  for (int k = 0; k < kLanes; ++k) index[k] = k;
  return index < static_cast<int32_t>(m);
}

inline LaneVec select(const LaneInt& cond, const LaneVec& a, const LaneVec& b) {
  return cond ? a : b;
}

inline LaneVec vmax(const LaneVec& a, const LaneVec& b) { return select(b > a, b, a); }

// 1 / d for finite d >= 1 to within an ulp or two: the hardware estimate (AVX-512 14 bits,
// AVX2 12) and one Newton step, r (2 - d r). A division has a fraction of its rate and was
// the GeLU's bottleneck (by perf annotate on a Xeon with AVX-512: the instruction after
// vdivps took 43 % of the forward's samples).
inline LaneVec reciprocal(const LaneVec& d) {
#if defined(__AVX512F__)
  const LaneVec r = (LaneVec)_mm512_rcp14_ps((__m512)d);
#elif defined(__AVX2__)
  const LaneVec r = (LaneVec)_mm256_rcp_ps((__m256)d);
#else
  return 1.0f / d;
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
  return r * (2.0f - d * r);
#endif
}

// The sum of the lanes as a tree (lane k plus lane k + kLanes/2, and so on): log2(kLanes)
// dependent additions instead of kLanes - 1.
inline float hsum(const LaneVec& v) {
  float t[kLanes];
  std::memcpy(t, &v, sizeof(t));
  for (int half = kLanes / 2; half > 0; half /= 2)
    for (int k = 0; k < half; ++k) t[k] += t[k + half];
  return t[0];
}

inline float hmax(const LaneVec& v) {
  float m = v[0];
  for (int k = 1; k < kLanes; ++k) m = v[k] > m ? v[k] : m;
  return m;
}

// Reductions over a row keep P partial sums, vector j of the row adding into part j % P,
// so that successive additions do not wait on each other. With one accumulator the sums of
// a short row are bound by the latency of the add: a 256-float row is 32 dependent
// additions on AVX2, and the layer norm at [2048, 256] only tied F.layer_norm there.
constexpr int kParts = 4;

// Adds term(i, acc) for the full vectors of [0, n), i = 0, kLanes, ..., where acc is part
// i / kLanes % P's M accumulators; leaves i at the first element not covered and sets out
// to the M sums of the parts. P * M accumulators must fit in the registers with the term's
// temporaries (kRegisters): a loop of 4 x 2 spilled on AVX2.
template <int P, int M, typename Term>
inline void sum_parts(int64_t n, int64_t& i, LaneVec (&out)[M], Term&& term) {
  static_assert(P == 1 || P == 2 || P == 4, "P parts are added as a tree");
  LaneVec acc[P][M];
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m) acc[p][m] = splat(0.0f);
  for (i = 0; i + P * kLanes <= n; i += P * kLanes) {
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) term(i + p * kLanes, acc[p]);
  }
  // The last full vectors (fewer than P), each into its own part. The loop is unrolled so that
  // the accumulators stay in registers: with a part index known only at run time they lived
  // on the stack, and clearing it took a fifth of a [*, 256] row's sum.
#pragma GCC unroll 4
  for (int p = 0; p + 1 < P; ++p) {
    if (i + kLanes > n) break;
    term(i, acc[p]);
    i += kLanes;
  }
  for (int m = 0; m < M; ++m) {
    if constexpr (P == 4) out[m] = (acc[0][m] + acc[1][m]) + (acc[2][m] + acc[3][m]);
    else if constexpr (P == 2) out[m] = acc[0][m] + acc[1][m];
    else out[m] = acc[0][m];
  }
}

// exp(x): round x / ln2 to n, reduce to r = x - n ln2 (in two parts so that
// n * kLn2Hi is exact), a degree-7 Taylor polynomial for exp(r), then scale by 2^n
// through the exponent bits. 0 below the normal range; NaN stays NaN.
inline LaneVec exp_lanes(const LaneVec& x) {
  constexpr float kMin = -87.33f;  // exp(kMin) is just above the smallest normal float
  constexpr float kMax = 88.37f;   // exp(kMax) is just below the largest float
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // 9 significant bits
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  LaneVec c = select(x < kMin, splat(kMin), x);
  c = select(c > kMax, splat(kMax), c);
  const LaneVec n = (c * kLog2e + kRound) - kRound;
  const LaneVec r = (c - n * kLn2Hi) - n * kLn2Lo;
  LaneVec p = splat(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const LaneInt bits = (__builtin_convertvector(n, LaneInt) + 127) << 23;
  LaneVec pow2n;
  std::memcpy(&pow2n, &bits, sizeof(pow2n));
  return select(x < kMin, splat(0.0f), p * pow2n);
}

}  // namespace lanes
}  // namespace cpu
}  // namespace megatron_fused
