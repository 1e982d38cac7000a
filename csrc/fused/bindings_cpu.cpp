// Python bindings of the CPU fused kernels (module built as megatron_fused_cpu).
#include <tuple>

#include "bindings_common.h"
#include "cpu_kernels.h"

namespace megatron_fused {
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
  check_tensor(input, "input", 3, kCPU);
  check_float_type(input, "input");
  TORCH_CHECK(input.size(1) == input.size(2), "input must be [batches, sq, sq], got ",
              input.sizes());
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
  check_tensor(grad, "grad", 3, kCPU);
  check_tensor(out, "softmax output", 3, kCPU);
  check_same(grad, out, "upper_triang backward");
  check_float_type(out, "softmax output");
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
  check_tensor(input, "input", 4, kCPU);
  check_float_type(input, "input");
  const int64_t mb = check_mask(mask, input, kCPU);
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
  check_tensor(grad, "grad", 4, kCPU);
  check_tensor(out, "softmax output", 4, kCPU);
  check_same(grad, out, "masked softmax backward");
  check_float_type(out, "softmax output");
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

void check_layer_norm_params(const at::Tensor& x, const at::Tensor& w) {
  check_tensor(x, "input", 2, kCPU);
  check_float_type(x, "input");
  check_tensor(w, "weight", 1, kCPU);
  TORCH_CHECK(w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "weight must be [", x.size(1), "] of ", x.scalar_type(), ", got ", w.sizes(),
              " of ", w.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(
    const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
  check_layer_norm_params(x, w);
  check_tensor(b, "bias", 1, kCPU);
  check_same(w, b, "layer_norm weight and bias");
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
  check_layer_norm_params(x, w);
  check_tensor(dy, "grad", 2, kCPU);
  check_same(dy, x, "layer_norm backward");
  for (const auto* t : {&mean, &rstd}) {
    check_tensor(*t, "mean/rstd", 1, kCPU);
    TORCH_CHECK(t->size(0) == x.size(0) && t->scalar_type() == at::kFloat,
                "mean/rstd must be float32 [", x.size(0), "], got ", t->sizes());
  }
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

}  // namespace
}  // namespace megatron_fused

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace mf = megatron_fused;
  m.doc() = "Megatron fused softmax and layer-norm kernels (CPU)";
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
  m.def("set_poison_outputs", [](bool on) { mf::poison_outputs_flag() = on; },
        "fill outputs with NaN before kernels run (tests)");
  m.def("poison_outputs", []() { return mf::poison_outputs_flag(); });
}
