// The SwiGLU experts of one MoE layer on CPUs (megatron/model/moe/experts.py's grouped path):
// for each local expert e and its block of rows x_e (rows sorted by expert),
//   pre_e = x_e w1[e]^T,  a_e = silu(gate) * up  ([gate | up] = pre_e),  y_e = a_e w2[e]^T,
// and the backward, which adds the weight gradients into given buffers (the data-parallel
// reducer's main_grad) and returns the input gradient.
//
// The rows are split over threads in equal contiguous shares, and each thread runs the
// whole chain of every expert block in its share with single-threaded matmuls: at these
// sizes (an expert sees ~100-500 rows) a matmul split over threads synchronises per call
// and streams its weights through every core's cache, and the activation and its gradient
// then cost one more pass over memory each; here an expert's activation rows stay in the
// cache of the thread that made them. An expert whose rows straddle two shares has its
// weight gradient summed from the two parts (the later one through scratch, added after).
// Large experts (over 4M weights: that scratch would be large, and their matmuls thread
// well) run one after another, each matmul on all threads.
#include <algorithm>
#include <tuple>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "cpu_kernels.h"
#include "cpu_lanes.h"

namespace megatron_fused {
namespace cpu {
namespace {

using namespace lanes;

inline LaneVec sigmoid_lanes(const LaneVec& g) { return 1.0f / (1.0f + exp_lanes(-g)); }

inline LaneVec load_n(const float* p, int64_t m) {
  return m == kLanes ? load(p) : load_part(p, m, 0.0f);
}
inline void store_n(float* p, const LaneVec& v, int64_t m) {
  if (m == kLanes) store(p, v); else store_part(p, v, m);
}

// a[j] = silu(pre[j]) * pre[f + j] for j < f.
void swiglu_row(float* a, const float* pre, int64_t f) {
  for (int64_t j = 0; j < f; j += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, f - j);
    const LaneVec g = load_n(pre + j, m), u = load_n(pre + f + j, m);
    store_n(a + j, g * sigmoid_lanes(g) * u, m);
  }
}

// With s = sigmoid(gate): d_up = da * gate * s, d_gate = da * up * s * (1 + gate (1 - s)),
// written as [d_gate | d_up] into dpre; a[j] (may be null) gets silu(gate) * up.
void swiglu_grad_row(float* dpre, float* a, const float* da, const float* pre, int64_t f) {
  for (int64_t j = 0; j < f; j += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, f - j);
    const LaneVec g = load_n(pre + j, m), u = load_n(pre + f + j, m), d = load_n(da + j, m);
    const LaneVec s = sigmoid_lanes(g), silu = g * s;
    store_n(dpre + j, d * u * s * (1.0f + g * (1.0f - s)), m);
    store_n(dpre + f + j, d * silu, m);
    if (a != nullptr) store_n(a + j, silu * u, m);
  }
}

// Rows [0, rows) of f(row), over threads when called outside a parallel region.
template <typename Fn>
void rows_loop(int64_t rows, int64_t cols, Fn&& fn) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(i);
  });
}

// Rows [start, start + rows) of the input, all of expert e's or a part of them.
struct Piece {
  int64_t e, start, rows;
};

// Experts of at most this many weights (w1 and w2) are split over threads by rows: a thread
// that takes up an expert's rows after another one needs scratch of that size for its part
// of the weight gradients.
constexpr int64_t kSplitWeights = int64_t{1} << 22;

// Calls fn(piece, slot) for the rows of every expert. With T >= 2 threads and experts of
// at most kSplitWeights weights, thread t takes rows [N t / T, N (t + 1) / T), expert by
// expert: slot t for its first piece when that does not start the expert's rows (its weight
// gradients go to scratch slot t, which the caller adds afterwards), -1 for every other
// piece. Otherwise the experts run one after another, each call's matmuls threaded, slot -1.
template <typename Fn>
void for_each_piece(const std::vector<int64_t>& counts, int64_t expert_weights, Fn&& fn) {
  const int64_t experts = static_cast<int64_t>(counts.size());
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) start[e + 1] = start[e] + counts[e];
  const int64_t n = start[experts], threads = at::get_num_threads();
  if (threads < 2 || expert_weights > kSplitWeights || n < threads) {
    for (int64_t e = 0; e < experts; ++e)
      if (counts[e] > 0) fn(Piece{e, start[e], counts[e]}, -1);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    at::AutoGradMode no_grad(false);  // grad mode is per thread: the caller's is off
    for (int64_t t = begin; t < end; ++t) {
      const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
      for (int64_t e = 0; e < experts; ++e) {
        const int64_t first = std::max(lo, start[e]), last = std::min(hi, start[e + 1]);
        if (last > first) fn(Piece{e, first, last - first}, first == start[e] ? -1 : t);
      }
    }
  });
}

void check_experts(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                   const std::vector<int64_t>& counts) {
  for (const at::Tensor* t : {&x, &w1, &w2}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "swiglu experts: tensors must be contiguous float32 on the CPU");
  }
  TORCH_CHECK(x.dim() == 2 && w1.dim() == 3 && w2.dim() == 3, "swiglu experts: x [N, h], "
              "w1 [E, 2F, h], w2 [E, h, F] expected, got ", x.sizes(), w1.sizes(), w2.sizes());
  const int64_t e = w1.size(0), h = x.size(1), f = w2.size(2);
  TORCH_CHECK(w1.size(1) == 2 * f && w1.size(2) == h && w2.size(0) == e && w2.size(1) == h,
              "swiglu experts: shapes do not fit: x ", x.sizes(), ", w1 ", w1.sizes(), ", w2 ",
              w2.sizes());
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == e, "swiglu experts: ", counts.size(),
              " counts for ", e, " experts");
  int64_t total = 0;
  for (int64_t c : counts) {
    TORCH_CHECK(c >= 0, "swiglu experts: negative count ", c);
    total += c;
  }
  TORCH_CHECK(total == x.size(0), "swiglu experts: counts sum to ", total, ", x has ",
              x.size(0), " rows");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> swiglu_experts_forward(const at::Tensor& x,
                                                          const at::Tensor& w1,
                                                          const at::Tensor& w2,
                                                          const std::vector<int64_t>& counts) {
  check_experts(x, w1, w2, counts);
  const int64_t n = x.size(0), h = x.size(1), f = w2.size(2);
  at::Tensor pre = at::empty({n, 2 * f}, x.options());
  at::Tensor y = at::empty({n, h}, x.options());
  const int64_t weights = w1[0].numel() + w2[0].numel();
  for_each_piece(counts, weights, [&](const Piece& piece, int64_t) {
    const int64_t e = piece.e, start = piece.start, rows = piece.rows;
    at::Tensor pre_e = pre.narrow(0, start, rows);
    at::mm_out(pre_e, x.narrow(0, start, rows), w1[e].t());
    at::Tensor a = at::empty({rows, f}, x.options());
    float *ap = a.data_ptr<float>(), *pp = pre_e.data_ptr<float>();
    rows_loop(rows, f, [&](int64_t i) { swiglu_row(ap + i * f, pp + i * 2 * f, f); });
    at::Tensor y_e = y.narrow(0, start, rows);
    at::mm_out(y_e, a, w2[e].t());
  });
  return {y, pre};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_experts_backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& pre, const at::Tensor& w1,
    const at::Tensor& w2, const std::vector<int64_t>& counts, bool need_dx, bool need_dw,
    const c10::optional<at::Tensor>& dw1_into, const c10::optional<at::Tensor>& dw2_into) {
  check_experts(x, w1, w2, counts);
  const int64_t n = x.size(0), h = x.size(1), f = w2.size(2);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.is_contiguous() && dy.scalar_type() == at::kFloat,
              "swiglu experts backward: dy must be contiguous float32 ", x.sizes());
  TORCH_CHECK(pre.sizes() == at::IntArrayRef({n, 2 * f}) && pre.is_contiguous(),
              "swiglu experts backward: pre must be contiguous [", n, ", ", 2 * f, "]");
  at::Tensor dx = need_dx ? at::empty({n, h}, x.options()) : at::Tensor();
  at::Tensor dw1, dw2, ret1, ret2;
  if (need_dw) {
    // Added into the given buffers, else into zeros that are returned.
    dw1 = dw1_into.has_value() ? *dw1_into : (ret1 = at::zeros(w1.sizes(), w1.options()));
    dw2 = dw2_into.has_value() ? *dw2_into : (ret2 = at::zeros(w2.sizes(), w2.options()));
    TORCH_CHECK(dw1.sizes() == w1.sizes() && dw2.sizes() == w2.sizes() &&
                    dw1.scalar_type() == at::kFloat && dw2.scalar_type() == at::kFloat,
                "swiglu experts backward: gradient buffers must be float32 of the weights' "
                "shapes");
  }
  // Scratch weight gradients of the pieces that continue an expert another thread started.
  const int64_t threads = at::get_num_threads();
  std::vector<at::Tensor> part1(threads), part2(threads);
  std::vector<int64_t> part_expert(threads, -1);
  const int64_t weights = w1[0].numel() + w2[0].numel();
  for_each_piece(counts, weights, [&](const Piece& piece, int64_t slot) {
    const int64_t e = piece.e, start = piece.start, rows = piece.rows;
    const at::Tensor dy_e = dy.narrow(0, start, rows), x_e = x.narrow(0, start, rows);
    const float* pp = pre.data_ptr<float>() + start * 2 * f;
    at::Tensor da = at::mm(dy_e, w2[e]);  // [rows, f]
    at::Tensor dpre = at::empty({rows, 2 * f}, x.options());
    at::Tensor a = need_dw ? at::empty({rows, f}, x.options()) : at::Tensor();
    float *dap = da.data_ptr<float>(), *dp = dpre.data_ptr<float>();
    float* ap = need_dw ? a.data_ptr<float>() : nullptr;
    rows_loop(rows, 2 * f, [&](int64_t i) {
      swiglu_grad_row(dp + i * 2 * f, ap ? ap + i * f : nullptr, dap + i * f, pp + i * 2 * f, f);
    });
    if (need_dx) {
      at::Tensor dx_e = dx.narrow(0, start, rows);
      at::mm_out(dx_e, dpre, w1[e]);
    }
    if (need_dw && slot >= 0) {
      part_expert[slot] = e;
      part2[slot] = at::mm(dy_e.t(), a);
      part1[slot] = at::mm(dpre.t(), x_e);
    } else if (need_dw) {
      dw2[e].addmm_(dy_e.t(), a);
      dw1[e].addmm_(dpre.t(), x_e);
    }
  });
  for (int64_t t = 0; t < threads; ++t) {  // in thread order: the same sums every run
    if (part_expert[t] < 0) continue;
    dw1[part_expert[t]].add_(part1[t]);
    dw2[part_expert[t]].add_(part2[t]);
  }
  return {dx, ret1, ret2};
}

}  // namespace cpu
}  // namespace megatron_fused
