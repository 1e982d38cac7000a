// The SwiGLU experts of one MoE layer on CPUs (megatron/model/moe/experts.py's grouped path):
// for each local expert e and its block of rows x_e (rows sorted by expert),
//   pre_e = x_e w1[e]^T,  a_e = silu(gate) * up  ([gate | up] = pre_e),  y_e = a_e w2[e]^T,
// and the backward, which adds the weight gradients into given buffers (the data-parallel
// reducer's main_grad) and returns the input gradient.
//
// Each expert's whole chain runs on one thread, with single-threaded matmuls, while the
// other threads run other experts: at these sizes (an expert sees ~100-500 rows) a matmul
// split over threads synchronises per call and streams its weights through every core's
// cache, and the activation and its gradient then cost one more pass over memory each.
// Here an expert's activation rows stay in the cache of the thread that made them.
// Experts are taken largest first, each thread taking the next one when it is free; with
// fewer than two non-empty experts per thread (expert parallelism leaves few per rank) the
// experts run one after another, each matmul on all threads.
#include <algorithm>
#include <atomic>
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

inline LaneVec load_n(const float* p, int64_t m) { return m == kLanes ? load(p) : load_part(p, m, 0.0f); }
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

// Calls fn(e, start, rows) for every expert with rows: largest first over threads, or in
// order with each call's matmuls threaded (see the top of the file).
template <typename Fn>
void for_each_expert(const std::vector<int64_t>& counts, Fn&& fn) {
  const int64_t experts = static_cast<int64_t>(counts.size());
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) start[e + 1] = start[e] + counts[e];
  std::vector<int64_t> order;
  for (int64_t e = 0; e < experts; ++e)
    if (counts[e] > 0) order.push_back(e);
  const int64_t threads = at::get_num_threads();
  if (threads < 2 || static_cast<int64_t>(order.size()) < 2 * threads) {
    for (int64_t e : order) fn(e, start[e], counts[e]);
    return;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    at::AutoGradMode no_grad(false);  // grad mode is per thread: the caller's is off
    for (int64_t i = next++; i < static_cast<int64_t>(order.size()); i = next++)
      fn(order[i], start[order[i]], counts[order[i]]);
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
  for_each_expert(counts, [&](int64_t e, int64_t start, int64_t rows) {
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
    if (dw1_into.has_value()) dw1 = *dw1_into; else dw1 = ret1 = at::zeros(w1.sizes(), w1.options());
    if (dw2_into.has_value()) dw2 = *dw2_into; else dw2 = ret2 = at::zeros(w2.sizes(), w2.options());
    TORCH_CHECK(dw1.sizes() == w1.sizes() && dw2.sizes() == w2.sizes() &&
                    dw1.scalar_type() == at::kFloat && dw2.scalar_type() == at::kFloat,
                "swiglu experts backward: gradient buffers must be float32 of the weights' "
                "shapes");
  }
  for_each_expert(counts, [&](int64_t e, int64_t start, int64_t rows) {
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
    if (need_dw) {
      dw2[e].addmm_(dy_e.t(), a);
      dw1[e].addmm_(dpre.t(), x_e);
    }
  });
  return {dx, ret1, ret2};
}

}  // namespace cpu
}  // namespace megatron_fused
