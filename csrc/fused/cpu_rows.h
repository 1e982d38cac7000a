// Helpers that give the CPU kernels a float view of one row whatever the storage type.
// For float tensors they return the tensor's own memory (no copy); for 16-bit types
// they convert through a per-thread scratch buffer.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>

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

// Parameter gradients of the norm backwards (summed over rows), independent of the
// thread count: the rows are cut into fixed blocks (at most 128, at least 8 rows each;
// a function of the shape only), block_fn(row_begin, row_end, partials) adds its rows'
// contributions to its own zeroed float partials [outs.size(), cols], and the blocks'
// partials are then added column-wise in block order and stored into `outs` ([cols] each).
template <typename T, typename BlockFn>
void sum_rows_by_blocks(int64_t rows, int64_t cols, std::initializer_list<T*> outs,
                        BlockFn&& block_fn) {
  const int64_t nout = static_cast<int64_t>(outs.size());
  const int64_t blocks = std::min<int64_t>((rows + 7) / 8, 128);
  const int64_t rows_per_block = blocks > 0 ? (rows + blocks - 1) / blocks : 0;
  std::vector<float> part(blocks * nout * cols, 0.0f);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk)
      block_fn(blk * rows_per_block, std::min(rows, (blk + 1) * rows_per_block),
               part.data() + blk * nout * cols);
  });
  at::parallel_for(0, cols, 256, [&](int64_t begin, int64_t end) {
    const int64_t n = end - begin;
    std::vector<float> acc(nout * n, 0.0f);
    for (int64_t blk = 0; blk < blocks; ++blk)
      for (int64_t k = 0; k < nout; ++k)
        add_inplace(acc.data() + k * n, part.data() + (blk * nout + k) * cols + begin, n);
    int64_t k = 0;
    for (T* out : outs) {
      for (int64_t j = 0; j < n; ++j) out[begin + j] = static_cast<T>(acc[k * n + j]);
      ++k;
    }
  });
}

}  // namespace cpu
}  // namespace megatron_fused
