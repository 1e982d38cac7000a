// Python bindings of the CPU fused kernels (module built as megatron_fused_cpu).
#include <algorithm>
#include <atomic>
#include <tuple>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "bindings_common.h"
#include "cpu_kernels.h"
#include "cpu_lanes.h"

namespace megatron_fused {
namespace cpu {  // moe_cpu.cpp: the SwiGLU experts of an MoE layer
std::tuple<at::Tensor, at::Tensor> swiglu_experts_forward(const at::Tensor& x,
                                                          const at::Tensor& w1,
                                                          const at::Tensor& w2,
                                                          const std::vector<int64_t>& counts);
std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_experts_backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& pre, const at::Tensor& w1,
    const at::Tensor& w2, const std::vector<int64_t>& counts, bool need_dx, bool need_dw,
    const c10::optional<at::Tensor>& dw1_into, const c10::optional<at::Tensor>& dw2_into);
}  // namespace cpu
namespace {

constexpr auto kCPU = c10::DeviceType::CPU;

// Calls fn(T{}) with T the C++ type of `st` (float, BFloat16 or Half).
template <typename Fn>
void dispatch_float_types(at::ScalarType st, Fn&& fn) {
  switch (st) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", st);
  }
}

at::Tensor upper_triang_forward(const at::Tensor& input, double scale) {
  check_upper_triang_input(input, kCPU);
  at::Tensor out = new_output(input.sizes(), input.options());
  dispatch_float_types(input.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::upper_triang_softmax_forward<T>(input.data_ptr<T>(), out.data_ptr<T>(), input.size(0),
                                         input.size(1), static_cast<float>(scale));
  });
  return out;
}

at::Tensor upper_triang_backward(const at::Tensor& grad, const at::Tensor& out,
                                    double scale) {
  check_softmax_backward(grad, out, 3, "upper_triang backward", kCPU);
  at::Tensor dx = new_output(out.sizes(), out.options());
  dispatch_float_types(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::upper_triang_softmax_backward<T>(grad.data_ptr<T>(), out.data_ptr<T>(),
                                          dx.data_ptr<T>(), out.size(0), out.size(1),
                                          static_cast<float>(scale));
  });
  return dx;
}

at::Tensor masked_forward(const at::Tensor& input, const at::Tensor& mask,
                             double scale) {
  const int64_t mb = check_masked_input(input, mask, kCPU);
  at::Tensor out = new_output(input.sizes(), input.options());
  dispatch_float_types(input.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::masked_softmax_forward<T>(input.data_ptr<T>(), mask_data(mask), out.data_ptr<T>(),
                                   input.size(0), input.size(1), input.size(2), input.size(3),
                                   mb, static_cast<float>(scale));
  });
  return out;
}

at::Tensor masked_backward(const at::Tensor& grad, const at::Tensor& out,
                              const at::Tensor& mask, double scale) {
  check_softmax_backward(grad, out, 4, "masked softmax backward", kCPU);
  const int64_t mb = check_mask(mask, out, kCPU);
  at::Tensor dx = new_output(out.sizes(), out.options());
  dispatch_float_types(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::masked_softmax_backward<T>(grad.data_ptr<T>(), out.data_ptr<T>(), mask_data(mask),
                                    dx.data_ptr<T>(), out.size(0), out.size(1), out.size(2),
                                    out.size(3), mb, static_cast<float>(scale));
  });
  return dx;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(
    const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
  check_layer_norm_forward(x, w, b, kCPU);
  at::Tensor y = new_output(x.sizes(), x.options());
  at::Tensor mean = new_output({x.size(0)}, x.options().dtype(at::kFloat));
  at::Tensor rstd = new_output({x.size(0)}, x.options().dtype(at::kFloat));
  dispatch_float_types(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::layer_norm_forward<T>(x.data_ptr<T>(), w.data_ptr<T>(), b.data_ptr<T>(),
                               y.data_ptr<T>(), mean.data_ptr<float>(), rstd.data_ptr<float>(),
                               x.size(0), x.size(1), static_cast<float>(eps));
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& w) {
  check_layer_norm_backward(dy, x, mean, rstd, w, kCPU);
  at::Tensor dx = new_output(x.sizes(), x.options());
  at::Tensor dw = new_output(w.sizes(), w.options());
  at::Tensor db = new_output(w.sizes(), w.options());
  dispatch_float_types(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::layer_norm_backward<T>(dy.data_ptr<T>(), x.data_ptr<T>(), mean.data_ptr<float>(),
                                rstd.data_ptr<float>(), w.data_ptr<T>(), dx.data_ptr<T>(),
                                dw.data_ptr<T>(), db.data_ptr<T>(), x.size(0), x.size(1));
  });
  return {dx, dw, db};
}

// The layer norm as one autograd node in C++: x [..., hidden] -> y of x's shape, saving x,
// the weight and the per-row mean and rstd. A torch.autograd.Function in Python around the two
// kernels above cost ~30 us per forward+backward more than F.layer_norm's node (a [64, 64]
// step took 70 us against 39 us), 10% of a [2048, 256] step.
struct LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const at::Tensor& b, double eps) {
    TORCH_CHECK(x.dim() >= 1, "layer norm takes x [..., hidden], got a scalar");
    at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
    auto [y, mean, rstd] = layer_norm_forward(x2, w.contiguous(), b.contiguous(), eps);
    ctx->save_for_backward({x2, w, mean, rstd});
    ctx->saved_data["shape"] = x.sizes().vec();
    return y.view(x.sizes());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "the fused layer norm has no double backward");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x2 = saved[0];
    at::Tensor dy = grads[0].reshape(x2.sizes()).contiguous();
    auto [dx, dw, db] = layer_norm_backward(dy, x2, saved[2], saved[3], saved[1].contiguous());
    return {dx.view(ctx->saved_data["shape"].toIntVector()),
            ctx->needs_input_grad(1) ? dw : at::Tensor(),
            ctx->needs_input_grad(2) ? db : at::Tensor(), at::Tensor()};
  }
};

at::Tensor layer_norm_autograd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                               double eps) {
  return LayerNormFunction::apply(x, w, b, eps);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& w,
                                                    double eps) {
  check_layer_norm_params(x, w, kCPU);
  at::Tensor y = new_output(x.sizes(), x.options());
  at::Tensor rstd = new_output({x.size(0)}, x.options().dtype(at::kFloat));
  dispatch_float_types(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rms_norm_forward<T>(x.data_ptr<T>(), w.data_ptr<T>(), y.data_ptr<T>(),
                             rstd.data_ptr<float>(), x.size(0), x.size(1),
                             static_cast<float>(eps));
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& rstd,
                                                     const at::Tensor& w) {
  check_rms_norm_backward(dy, x, rstd, w, kCPU);
  at::Tensor dx = new_output(x.sizes(), x.options());
  at::Tensor dw = new_output(w.sizes(), w.options());
  dispatch_float_types(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rms_norm_backward<T>(dy.data_ptr<T>(), x.data_ptr<T>(), rstd.data_ptr<float>(),
                              w.data_ptr<T>(), dx.data_ptr<T>(), dw.data_ptr<T>(), x.size(0),
                              x.size(1));
  });
  return {dx, dw};
}

// x [rows, cols] and an optional bias [cols] of x's dtype.
void check_bias_input(const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  check_tensor(x, "input", 2, kCPU);
  check_float_type(x, "input");
  if (bias.has_value()) check_layer_norm_params(x, *bias, kCPU);
}

template <typename T>
const T* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

at::Tensor bias_gelu_forward(const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  check_bias_input(x, bias);
  at::Tensor y = new_output(x.sizes(), x.options());
  dispatch_float_types(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::bias_gelu_forward<T>(x.data_ptr<T>(), data_or_null<T>(bias), y.data_ptr<T>(),
                              x.size(0), x.size(1));
  });
  return y;
}

// Returns (dx, db); db is None without a bias.
std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad, const at::Tensor& x,
                                                      const c10::optional<at::Tensor>& bias) {
  check_bias_input(x, bias);
  check_tensor(grad, "grad", 2, kCPU);
  check_same(grad, x, "bias_gelu backward");
  at::Tensor dx = new_output(x.sizes(), x.options());
  at::Tensor db = bias.has_value() ? new_output(bias->sizes(), bias->options()) : at::Tensor();
  dispatch_float_types(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::bias_gelu_backward<T>(grad.data_ptr<T>(), x.data_ptr<T>(), data_or_null<T>(bias),
                               dx.data_ptr<T>(), db.defined() ? db.data_ptr<T>() : nullptr,
                               x.size(0), x.size(1));
  });
  return {dx, db};
}

// In place: acc (float32) += x (bfloat16), both contiguous with the same number of elements.
void add_to_float_(at::Tensor& acc, const at::Tensor& x) {
  TORCH_CHECK(acc.device().is_cpu() && x.device().is_cpu() && acc.scalar_type() == at::kFloat &&
                  x.scalar_type() == at::kBFloat16 && acc.is_contiguous() && x.is_contiguous() &&
                  acc.numel() == x.numel(),
              "add_to_float_ takes contiguous CPU tensors, float32 acc and bfloat16 x of one size "
              "(got ", acc.scalar_type(), " ", acc.sizes(), " and ", x.scalar_type(), " ",
              x.sizes(), "): use acc.add_(x)");
  cpu::add_to_float(acc.data_ptr<float>(), x.data_ptr<c10::BFloat16>(), acc.numel());
}

// In place: x <- exp(x - row_max); returns (row_max, row sums), float [rows]. Without
// row_max each row's own max is used (and returned).
std::tuple<at::Tensor, at::Tensor> exp_sum_(at::Tensor& x, const c10::optional<at::Tensor>& row_max) {
  check_tensor(x, "input", 2, kCPU);
  check_float_type(x, "input");
  at::Tensor m;
  if (row_max.has_value()) {
    check_row_stat(*row_max, x, "row_max", kCPU);
    m = *row_max;
  } else {
    m = new_output({x.size(0)}, x.options().dtype(at::kFloat));
  }
  at::Tensor sums = new_output({x.size(0)}, x.options().dtype(at::kFloat));
  dispatch_float_types(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::exp_sum_rows<T>(x.data_ptr<T>(), m.data_ptr<float>(), sums.data_ptr<float>(),
                         x.size(0), x.size(1), row_max.has_value());
  });
  return {m, sums};
}

// x [rows, cols] (unchanged) -> (row max, row sums of exp(x - row max)), float [rows].
std::tuple<at::Tensor, at::Tensor> max_exp_sum(const at::Tensor& x) {
  check_tensor(x, "input", 2, kCPU);
  check_float_type(x, "input");
  at::Tensor m = new_output({x.size(0)}, x.options().dtype(at::kFloat));
  at::Tensor sums = new_output({x.size(0)}, x.options().dtype(at::kFloat));
  dispatch_float_types(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::max_exp_sum_rows<T>(x.data_ptr<T>(), m.data_ptr<float>(), sums.data_ptr<float>(),
                             x.size(0), x.size(1));
  });
  return {m, sums};
}

// In place: x <- exp(x - row_max) / sums - one_hot(target) (target < 0: no column here), with
// the given row max and sums (float [rows], over every shard's columns) or each row's own;
// returns (row max, row sums).
std::tuple<at::Tensor, at::Tensor> softmax_minus_target_(
    at::Tensor& x, const at::Tensor& target, const c10::optional<at::Tensor>& row_max,
    const c10::optional<at::Tensor>& sums) {
  check_tensor(x, "input", 2, kCPU);
  check_float_type(x, "input");
  TORCH_CHECK(row_max.has_value() == sums.has_value(), "pass both row_max and sums or neither");
  at::Tensor m, s;
  if (row_max.has_value()) {
    check_row_stat(*row_max, x, "row_max", kCPU);
    check_row_stat(*sums, x, "sums", kCPU);
    m = *row_max;
    s = *sums;
  } else {
    m = new_output({x.size(0)}, x.options().dtype(at::kFloat));
    s = new_output({x.size(0)}, x.options().dtype(at::kFloat));
  }
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 &&
                  target.size(0) == x.size(0) && target.is_contiguous(),
              "target must be a contiguous int64 tensor [", x.size(0), "], got ",
              target.sizes(), " of ", target.scalar_type());
  const int64_t cols = x.size(1);
  const int64_t* t = target.data_ptr<int64_t>();
  for (int64_t r = 0; r < x.size(0); ++r)
    TORCH_CHECK(t[r] < cols, "target ", t[r], " of row ", r, " is past the ", cols, " columns");
  dispatch_float_types(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::softmax_minus_target_rows<T>(x.data_ptr<T>(), m.data_ptr<float>(), s.data_ptr<float>(),
                                      t, x.size(0), cols, row_max.has_value());
  });
  return {m, s};
}

// q, k, v: float32 or bfloat16 (all one dtype) [sq, b, heads, hn] (any strides, hn
// contiguous, hn % 16 == 0); bfloat16 only where the CPU and build have AVX512-BF16.
void check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().type() == kCPU && t->dim() == 4 &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) &&
                    t->scalar_type() == q.scalar_type(),
                "causal attention takes float32 or bfloat16 CPU tensors [sq, b, heads, "
                "head_dim] of one dtype, got ", t->sizes(), " of ", t->scalar_type(), " with q ",
                q.scalar_type());
    TORCH_CHECK(t->sizes() == q.sizes(), "q, k and v shapes differ: ", q.sizes(), " vs ",
                t->sizes());
    TORCH_CHECK(t->stride(3) == 1, "the head dimension must be contiguous");
  }
  TORCH_CHECK(q.size(3) % 16 == 0, "head_dim must be a multiple of 16, got ", q.size(3));
  TORCH_CHECK(q.scalar_type() == at::kFloat || cpu::attention_bf16_supported(),
              "bfloat16 causal attention needs AVX512-BF16, which this CPU or build lacks "
              "(attention_bf16_dot() is False): pass float32 tensors");
}

// The elements of a float32 (T = float) or bfloat16 (T = uint16_t) tensor.
template <typename T>
T* elements(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.data_ptr<float>();
  else return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

// Scratch floats per task of the float32 (T = float) or bfloat16 (uint16_t) kernel, the
// latter with the dot products or oneDNN's microkernels (brgemm).
template <typename T>
int64_t attention_work_floats(int64_t sq, int64_t hn, bool brgemm) {
  if constexpr (std::is_same_v<T, float>) return cpu::attention_work_floats(sq, hn);
  else if (brgemm) return cpu::attention_brgemm_work_floats(sq, hn);
  else return cpu::attention_bf16_work_floats(sq, hn);
}

// brgemm (bfloat16 only): oneDNN's microkernels for the products, where they exist.
void check_brgemm(const at::Tensor& q, bool brgemm) {
  TORCH_CHECK(!brgemm || (q.scalar_type() == at::kBFloat16 && cpu::attention_brgemm_supported()),
              "brgemm=True takes bfloat16 q, k, v where attention_brgemm() is True (got ",
              q.scalar_type(), ", attention_brgemm() ", cpu::attention_brgemm_supported(),
              "): pass brgemm=False");
}

// Calls fn(T{}) with T = float for float32 q, uint16_t for bfloat16.
template <typename Fn>
void dispatch_attention_dtype(const at::Tensor& q, Fn&& fn) {
  if (q.scalar_type() == at::kBFloat16) fn(uint16_t{});
  else fn(float{});
}

void check_window(int64_t window, bool causal) {
  TORCH_CHECK(window >= 0, "the attention window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(window == 0 || causal, "a sliding window needs causal attention");
}

// (b, head) task -> offset of its first row in a [sq, b, heads, hn] tensor.
inline int64_t head_offset(const at::Tensor& t, int64_t task) {
  return (task / t.size(2)) * t.stride(1) + (task % t.size(2)) * t.stride(2);
}

// The dropout of task t for rows of sq keys; p = 0: none.
cpu::Dropout task_dropout(double p, int64_t seed, int64_t task, int64_t sq) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "attention dropout must be in [0, 1), got ", p);
  TORCH_CHECK(p == 0.0 || sq < 65536, "attention dropout takes sequences below 65536, got ", sq);
  return cpu::attention_dropout(p, static_cast<uint64_t>(seed), task, sq);
}

// Runs fn(t, work) for every task t in [0, tasks) on torch's intra-op threads, each thread
// taking the next unclaimed task from a shared counter (work: that thread's scratch of
// `work_floats` floats). A static split (at::parallel_for hands each thread a fixed share)
// let a thread that lost its core hold back its whole share: under heavy load (load average
// ~11) the s256 step fell to 0.36x SDPA. Here the others take over its remaining tasks. Each
// task writes only its own rows, so the output does not depend on which thread ran it.
template <typename Fn>
void for_each_task(int64_t tasks, int64_t work_floats, Fn&& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> work(work_floats);
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) fn(t, work.data());
  });
}

// Returns (o [sq, b, heads, hn] contiguous, lse [b * heads, sq] float). causal: keys
// j <= i, else all keys; dropout_p with the mask of `seed` (see cpu_kernels.h); sinks:
// float32 [heads], each head's attention-sink logit (in the lse too); window (causal only;
// 0: none): keys i - window < j <= i.
std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, double scale,
                                                     bool causal, double dropout_p,
                                                     int64_t seed,
                                                     const c10::optional<at::Tensor>& sinks,
                                                     int64_t window, bool brgemm) {
  check_attention_inputs(q, k, v);
  check_brgemm(q, brgemm);
  const int64_t sq = q.size(0), hn = q.size(3), tasks = q.size(1) * q.size(2);
  task_dropout(dropout_p, seed, 0, sq);
  check_window(window, causal);
  const bool has_sinks = sinks.has_value() && sinks->defined();
  TORCH_CHECK(!has_sinks || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                             sinks->size(0) == q.size(2) && sinks->is_contiguous() &&
                             sinks->device().type() == kCPU),
              "sinks must be a contiguous float32 CPU tensor [heads] = [", q.size(2), "]");
  const float* sp = has_sinks ? sinks->data_ptr<float>() : nullptr;
  at::Tensor o = new_output(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = new_output({tasks, sq}, q.options().dtype(at::kFloat));
  float* lp = lse.data_ptr<float>();
  dispatch_attention_dtype(q, [&](auto tag) {
    using T = decltype(tag);
    const T *qp = elements<T>(q), *kp = elements<T>(k), *vp = elements<T>(v);
    T* op = elements<T>(o);
    for_each_task(tasks, attention_work_floats<T>(sq, hn, brgemm), [&](int64_t t, float* work) {
      auto head = [&](auto&& kernel) {
        kernel(qp + head_offset(q, t), q.stride(0), kp + head_offset(k, t), k.stride(0),
               vp + head_offset(v, t), v.stride(0), op + head_offset(o, t), o.stride(0),
               lp + t * sq, sq, hn, static_cast<float>(scale), causal,
               task_dropout(dropout_p, seed, t, sq), work, sp ? sp + t % q.size(2) : nullptr,
               window);
      };
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (brgemm) return head(cpu::attention_head_forward_brgemm);
      }
      head([](auto... args) { cpu::attention_head_forward(args...); });
    });
  });
  return {o, lse};
}

// Returns (dq, dk, dv), each [sq, b, heads, hn] contiguous.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& o, const at::Tensor& lse, double scale, bool causal, double dropout_p,
    int64_t seed, int64_t window, bool brgemm) {
  check_attention_inputs(q, k, v);
  check_brgemm(q, brgemm);
  check_window(window, causal);
  check_attention_inputs(q, o, dout);
  const int64_t sq = q.size(0), hn = q.size(3), tasks = q.size(1) * q.size(2);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == tasks * sq,
              "lse must be float32 [b * heads, sq]");
  task_dropout(dropout_p, seed, 0, sq);
  auto options = q.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor dq = new_output(q.sizes(), options);
  at::Tensor dk = new_output(q.sizes(), options);
  at::Tensor dv = new_output(q.sizes(), options);
  const float* lp = lse.data_ptr<float>();
  dispatch_attention_dtype(q, [&](auto tag) {
    using T = decltype(tag);
    const T *qp = elements<T>(q), *kp = elements<T>(k), *vp = elements<T>(v);
    const T *op = elements<T>(o), *gp = elements<T>(dout);
    T *dqp = elements<T>(dq), *dkp = elements<T>(dk), *dvp = elements<T>(dv);
    for_each_task(tasks, attention_work_floats<T>(sq, hn, brgemm), [&](int64_t t, float* work) {
      auto head = [&](auto&& kernel) {
        kernel(qp + head_offset(q, t), q.stride(0), kp + head_offset(k, t), k.stride(0),
               vp + head_offset(v, t), v.stride(0), op + head_offset(o, t), o.stride(0),
               gp + head_offset(dout, t), dout.stride(0), lp + t * sq,
               dqp + head_offset(dq, t), dq.stride(0), dkp + head_offset(dk, t), dk.stride(0),
               dvp + head_offset(dv, t), dv.stride(0), sq, hn, static_cast<float>(scale),
               causal, task_dropout(dropout_p, seed, t, sq), work, window);
      };
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (brgemm) return head(cpu::attention_head_backward_brgemm);
      }
      head([](auto... args) { cpu::attention_head_backward(args...); });
    });
  });
  return {dq, dk, dv};
}

// The keep mask [tasks, sq, sq] (uint8, 1 = kept) the kernels above apply for
// (dropout_p, seed): the same hash, for references and tests.
at::Tensor attention_dropout_keep(int64_t tasks, int64_t sq, double dropout_p, int64_t seed) {
  TORCH_CHECK(tasks >= 0 && sq >= 0, "tasks and sq must be >= 0");
  task_dropout(dropout_p, seed, 0, sq);
  at::Tensor keep = at::empty({tasks, sq, sq}, at::TensorOptions().dtype(at::kByte));
  uint8_t* kp = keep.data_ptr<uint8_t>();
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      cpu::attention_dropout_keep(kp + t * sq * sq, sq, task_dropout(dropout_p, seed, t, sq));
  });
  return keep;
}

}  // namespace
}  // namespace megatron_fused

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace mf = megatron_fused;
  m.doc() = "Megatron fused softmax, layer-norm, RMSNorm, bias-GeLU and cross-entropy kernels (CPU)";
  m.def("scaled_upper_triang_masked_softmax_forward", &mf::upper_triang_forward,
        "causal softmax(scale * x) of [batches, sq, sq]");
  m.def("scaled_upper_triang_masked_softmax_backward", &mf::upper_triang_backward,
        "gradient of the causal softmax from its output");
  m.def("scaled_masked_softmax_forward", &mf::masked_forward,
        "masked softmax(scale * x) of [b, np, sq, sk] with mask [1 or b, 1, sq, sk]");
  m.def("scaled_masked_softmax_backward", &mf::masked_backward,
        "gradient of the masked softmax from its output");
  m.def("layer_norm_forward", &mf::layer_norm_forward,
        "layer norm of [rows, cols] -> (y, mean, rstd)");
  m.def("layer_norm_backward", &mf::layer_norm_backward, "layer norm gradients -> (dx, dw, db)");
  m.def("layer_norm", &mf::layer_norm_autograd,
        "layer norm of x [..., hidden] with weight and bias, differentiable (one autograd node)");
  m.def("rms_norm_forward", &mf::rms_norm_forward, "RMSNorm of [rows, cols] -> (y, rstd)");
  m.def("rms_norm_backward", &mf::rms_norm_backward, "RMSNorm gradients -> (dx, dw)");
  m.def("bias_gelu_forward", &mf::bias_gelu_forward,
        "tanh-approximated GeLU of x [rows, cols] + optional bias [cols]");
  m.def("bias_gelu_backward", &mf::bias_gelu_backward, "bias-GeLU gradients -> (dx, db or None)");
  m.def("add_to_float_", &mf::add_to_float_,
        "acc (float32) += x (bfloat16) in place, one pass (no float32 copy of x)");
  m.def("exp_sum_", &mf::exp_sum_,
        "x [rows, cols] <- exp(x - row max), in place -> (row max, row sums) (cross entropy)");
  m.def("max_exp_sum", &mf::max_exp_sum,
        "x [rows, cols] -> (row max, row sums of exp(x - row max)) in float32 (cross entropy)");
  m.def("softmax_minus_target_", &mf::softmax_minus_target_,
        "x [rows, cols] <- softmax(x) - one_hot(target) in place (target < 0: none in this "
        "shard), from the given row max and sums or each row's own -> (row max, row sums)",
        py::arg("x"), py::arg("target"), py::arg("row_max") = py::none(),
        py::arg("sums") = py::none());
  m.def("causal_attention_forward", &mf::attention_forward,
        "softmax(scale q k^T) v of q, k, v [sq, b, heads, head_dim] (float32, or bfloat16 "
        "where attention_bf16_dot()), causal or over all keys, "
        "with attention dropout, optional per-head sinks [heads] and a sliding window (keys "
        "i - window < j <= i; 0: none); brgemm: bfloat16 products with oneDNN's microkernels "
        "(where attention_brgemm()) -> (out, lse)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("causal") = true,
        py::arg("dropout_p") = 0.0, py::arg("seed") = 0, py::arg("sinks") = py::none(),
        py::arg("window") = 0, py::arg("brgemm") = false);
  m.def("causal_attention_backward", &mf::attention_backward,
        "gradients of causal_attention_forward -> (dq, dk, dv)", py::arg("dout"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("scale"),
        py::arg("causal") = true, py::arg("dropout_p") = 0.0, py::arg("seed") = 0,
        py::arg("window") = 0, py::arg("brgemm") = false);
  m.def("attention_bf16_dot", &mf::cpu::attention_bf16_supported,
        "whether causal_attention_forward / backward take bfloat16 q, k, v (with the "
        "AVX512-BF16 dot products: this build is avx512 and the CPU has them)");
  m.def("attention_brgemm", &mf::cpu::attention_brgemm_supported,
        "whether causal_attention_forward / backward take brgemm=True: bfloat16 products with "
        "oneDNN's microkernels (at::native::cpublas::brgemm) in this torch");
  m.def("attention_brgemm_amx", &mf::cpu::attention_brgemm_amx,
        "whether oneDNN's bfloat16 microkernels use AMX tiles on this CPU");
  m.def("attention_dropout_keep", &mf::attention_dropout_keep,
        "the keep mask [tasks, sq, sq] of the attention kernels' dropout (uint8)");
  m.def("cpu_caches",
        []() {
          const auto c = mf::cpu::cpu_caches();
          return std::make_tuple(c.l1d, c.l2);
        },
        "(L1 data, L2) cache bytes per core that the attention kernels' blocks are sized by");
  m.def("set_cpu_caches", &mf::cpu::set_cpu_caches,
        "override the cache sizes the blocks are sized by (tests; 0, 0: those read at start-up)",
        py::arg("l1d"), py::arg("l2"));
  m.def("attention_tiles",
        [](int64_t sq, int64_t hn) {
          const auto t = mf::cpu::attention_tiles(sq, hn);
          return std::make_tuple(t.rows, t.forward_keys, t.backward_keys);
        },
        "(query rows, forward keys, backward keys) per block of the attention kernels");
  m.def("swiglu_experts_forward", &mf::cpu::swiglu_experts_forward,
        "SwiGLU experts of rows x [N, h] sorted by expert: w1 [E, 2F, h], w2 [E, h, F], "
        "counts [E] -> (y [N, h], pre-activation [N, 2F])");
  m.def("swiglu_experts_backward", &mf::cpu::swiglu_experts_backward,
        "gradients of swiglu_experts_forward -> (dx or None, dw1, dw2: None where added into "
        "the given buffers)");
  m.def("set_poison_outputs", [](bool on) { mf::poison_outputs_flag() = on; },
        "fill outputs with NaN before kernels run (tests)");
  m.def("poison_outputs", []() { return mf::poison_outputs_flag(); });
  m.attr("isa") = mf::cpu::lanes::kIsa;  // the instruction set it was built for
}
