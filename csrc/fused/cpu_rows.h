// Helpers that give the CPU kernels a float view of one row whatever the storage type.
// For float tensors they return the tensor's own memory (no copy); for 16-bit types
// they convert through a per-thread scratch buffer.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

namespace megatron_fused {
namespace cpu {

// A per-thread conversion buffer of n floats for 16-bit types (empty for float,
// whose rows are used in place).
template <typename T>
std::vector<float> scratch(int64_t n) {
  return std::vector<float>(std::is_same_v<T, float> ? 0 : n);
}

// A float view of `src[0:n]`: src itself for float, else `buf` filled by conversion.
inline const float* load_row(const float* src, float* /*buf*/, int64_t /*n*/) { return src; }
template <typename T>
const float* load_row(const T* src, float* buf, int64_t n) {
  to_float(buf, src, n);
  return buf;
}

// Where a kernel writes its float results for row `dst`: dst itself for float, else `buf`.
inline float* result_row(float* dst, float* /*buf*/) { return dst; }
template <typename T>
float* result_row(T* /*dst*/, float* buf) {
  return buf;
}

// Moves results written at result_row(dst, buf) into dst (a no-op for float).
inline void store_row(float* /*dst*/, const float* /*buf*/, int64_t /*n*/) {}
template <typename T>
void store_row(T* dst, const float* buf, int64_t n) {
  from_float(dst, buf, n);
}

// Rows per task so that one task handles roughly `work` elements.
inline int64_t grain_rows(int64_t row_len, int64_t work = 32768) {
  int64_t g = row_len > 0 ? work / row_len : work;
  return g > 0 ? g : 1;
}

}  // namespace cpu
}  // namespace megatron_fused
