// Python bindings of the CUDA fused kernels (module built as megatron_fused_cuda).
// Only compiles against a CUDA build of torch. Same function names and arguments
// as the CPU module, so Python picks a module by the tensor's device.
#include <tuple>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "bindings_common.h"
#include "fused_cuda.h"

namespace megatron_fused {
namespace {

constexpr auto kCUDA = c10::DeviceType::CUDA;

cuda::DType storage_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return cuda::DType::kFloat32;
    case at::kHalf: return cuda::DType::kFloat16;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    default: break;
  }
  TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  return cuda::DType::kFloat32;  // not reached
}

int checked_int(int64_t v, const char* what) {
  TORCH_CHECK(v > 0 && v <= cuda::kMaxRowLength, what, " = ", v, " is outside [1, ",
              cuda::kMaxRowLength, "] supported by the CUDA kernels");
  return static_cast<int>(v);
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

at::Tensor upper_triang_forward(const at::Tensor& input, double scale) {
  check_upper_triang_input(input, kCUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = new_output(input.sizes(), input.options());
  check_launch(cuda::upper_triang_softmax_forward(
                   storage_type(input), input.data_ptr(), out.data_ptr(), input.size(0),
                   checked_int(input.size(1), "sq"), static_cast<float>(scale), stream_of(input)),
               "scaled_upper_triang_masked_softmax_forward");
  return out;
}

at::Tensor upper_triang_backward(const at::Tensor& grad, const at::Tensor& out,
                                    double scale) {
  check_softmax_backward(grad, out, 3, "upper_triang backward", kCUDA);
  const c10::cuda::CUDAGuard guard(out.device());
  at::Tensor dx = new_output(out.sizes(), out.options());
  check_launch(cuda::upper_triang_softmax_backward(
                   storage_type(out), grad.data_ptr(), out.data_ptr(), dx.data_ptr(),
                   out.size(0), checked_int(out.size(1), "sq"), static_cast<float>(scale),
                   stream_of(out)),
               "scaled_upper_triang_masked_softmax_backward");
  return dx;
}

at::Tensor masked_forward(const at::Tensor& input, const at::Tensor& mask,
                             double scale) {
  const int64_t mb = check_masked_input(input, mask, kCUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = new_output(input.sizes(), input.options());
  check_launch(cuda::masked_softmax_forward(
                   storage_type(input), input.data_ptr(), mask_data(mask), out.data_ptr(),
                   input.size(0), static_cast<int>(input.size(1)),
                   static_cast<int>(input.size(2)), checked_int(input.size(3), "sk"),
                   static_cast<int>(mb), static_cast<float>(scale), stream_of(input)),
               "scaled_masked_softmax_forward");
  return out;
}

at::Tensor masked_backward(const at::Tensor& grad, const at::Tensor& out,
                              const at::Tensor& mask, double scale) {
  check_softmax_backward(grad, out, 4, "masked softmax backward", kCUDA);
  const int64_t mb = check_mask(mask, out, kCUDA);
  const c10::cuda::CUDAGuard guard(out.device());
  at::Tensor dx = new_output(out.sizes(), out.options());
  check_launch(cuda::masked_softmax_backward(
                   storage_type(out), grad.data_ptr(), out.data_ptr(), mask_data(mask),
                   dx.data_ptr(), out.size(0), static_cast<int>(out.size(1)),
                   static_cast<int>(out.size(2)), checked_int(out.size(3), "sk"),
                   static_cast<int>(mb), static_cast<float>(scale), stream_of(out)),
               "scaled_masked_softmax_backward");
  return dx;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(
    const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
  check_layer_norm_forward(x, w, b, kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = new_output(x.sizes(), x.options());
  at::Tensor mean = new_output({x.size(0)}, x.options().dtype(at::kFloat));
  at::Tensor rstd = new_output({x.size(0)}, x.options().dtype(at::kFloat));
  check_launch(cuda::layer_norm_forward(storage_type(x), x.data_ptr(), w.data_ptr(), b.data_ptr(),
                                        y.data_ptr(), mean.data_ptr<float>(),
                                        rstd.data_ptr<float>(), x.size(0),
                                        checked_int(x.size(1), "hidden size"),
                                        static_cast<float>(eps), stream_of(x)),
               "layer_norm_forward");
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& w) {
  check_layer_norm_backward(dy, x, mean, rstd, w, kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int cols = checked_int(x.size(1), "hidden size");
  at::Tensor dx = new_output(x.sizes(), x.options());
  at::Tensor dw = new_output(w.sizes(), w.options());
  at::Tensor db = new_output(w.sizes(), w.options());
  const int splits = cuda::norm_backward_splits(x.size(0));
  at::Tensor workspace = at::empty({2LL * splits * cols}, x.options().dtype(at::kFloat));
  check_launch(cuda::layer_norm_backward(storage_type(x), dy.data_ptr(), x.data_ptr(),
                                         mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                         w.data_ptr(), dx.data_ptr(), dw.data_ptr(),
                                         db.data_ptr(), workspace.data_ptr<float>(), x.size(0),
                                         cols, stream_of(x)),
               "layer_norm_backward");
  return {dx, dw, db};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& w,
                                                    double eps) {
  check_layer_norm_params(x, w, kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = new_output(x.sizes(), x.options());
  at::Tensor rstd = new_output({x.size(0)}, x.options().dtype(at::kFloat));
  check_launch(cuda::rms_norm_forward(storage_type(x), x.data_ptr(), w.data_ptr(), y.data_ptr(),
                                      rstd.data_ptr<float>(), x.size(0),
                                      checked_int(x.size(1), "hidden size"),
                                      static_cast<float>(eps), stream_of(x)),
               "rms_norm_forward");
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& rstd,
                                                     const at::Tensor& w) {
  check_rms_norm_backward(dy, x, rstd, w, kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int cols = checked_int(x.size(1), "hidden size");
  at::Tensor dx = new_output(x.sizes(), x.options());
  at::Tensor dw = new_output(w.sizes(), w.options());
  const int splits = cuda::norm_backward_splits(x.size(0));
  at::Tensor workspace = at::empty({1LL * splits * cols}, x.options().dtype(at::kFloat));
  check_launch(cuda::rms_norm_backward(storage_type(x), dy.data_ptr(), x.data_ptr(),
                                       rstd.data_ptr<float>(), w.data_ptr(), dx.data_ptr(),
                                       dw.data_ptr(), workspace.data_ptr<float>(), x.size(0),
                                       cols, stream_of(x)),
               "rms_norm_backward");
  return {dx, dw};
}

}  // namespace
}  // namespace megatron_fused

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace mf = megatron_fused;
  m.doc() = "Megatron fused softmax, layer-norm and RMSNorm kernels (CUDA)";
  m.def("scaled_upper_triang_masked_softmax_forward", &mf::upper_triang_forward);
  m.def("scaled_upper_triang_masked_softmax_backward", &mf::upper_triang_backward);
  m.def("scaled_masked_softmax_forward", &mf::masked_forward);
  m.def("scaled_masked_softmax_backward", &mf::masked_backward);
  m.def("layer_norm_forward", &mf::layer_norm_forward);
  m.def("layer_norm_backward", &mf::layer_norm_backward);
  m.def("rms_norm_forward", &mf::rms_norm_forward);
  m.def("rms_norm_backward", &mf::rms_norm_backward);
  m.def("set_poison_outputs", [](bool on) { mf::poison_outputs_flag() = on; });
  m.def("poison_outputs", []() { return mf::poison_outputs_flag(); });
  m.attr("max_row_length") = mf::cuda::kMaxRowLength;
}
