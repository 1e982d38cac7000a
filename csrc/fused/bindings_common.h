// Argument checks and output allocation shared by the CPU and CUDA bindings.
#pragma once

#include <cstdlib>
#include <deque>
#include <iterator>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <sys/mman.h>

// Light includes instead of <torch/extension.h>: the binding compiles ~3x faster.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

namespace megatron_fused {

// When set, every output is filled with NaN before a kernel runs, so that an
// element a kernel forgets to write shows up in tests.
inline bool& poison_outputs_flag() {
  static bool flag = false;
  return flag;
}

// CPU outputs of 2 MiB or more come from a small cache of freed output buffers (exact sizes,
// at most kCachedBytes parked), new ones 2 MiB-aligned and advised into transparent huge
// pages. A training step asks for the same shapes every iteration, and glibc serves buffers
// that large from fresh mmap-ed or trimmed memory, whose first write faults in every page:
// a fresh [8192, 1024] float32 output took 11 ms to fill here (3 ms in huge pages, 0.6 ms
// reused), 3x the layer norm kernel itself; a [8192, 1024] bf16 output still spent 14% of
// the forward clearing pages.
constexpr size_t kHugePageBytes = size_t{2} << 20;
constexpr size_t kCachedBytes = size_t{256} << 20;

class OutputCache {
 public:
  void* take(size_t nbytes) {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      for (auto it = parked_.rbegin(); it != parked_.rend(); ++it) {  // newest: cache-warm
        if (it->first != nbytes) continue;
        void* data = it->second;
        parked_.erase(std::next(it).base());
        bytes_ -= nbytes;
        return data;
      }
    }
    void* data = nullptr;
    if (posix_memalign(&data, kHugePageBytes, nbytes) != 0) return nullptr;
    madvise(data, nbytes, MADV_HUGEPAGE);  // advice only: failure leaves 4 KiB pages
    return data;
  }

  // Parks `data` for reuse, dropping the oldest parked buffers beyond kCachedBytes.
  void give_back(void* data, size_t nbytes) {
    std::vector<void*> dropped;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      parked_.emplace_back(nbytes, data);
      bytes_ += nbytes;
      while (bytes_ > kCachedBytes) {
        dropped.push_back(parked_.front().second);
        bytes_ -= parked_.front().first;
        parked_.pop_front();
      }
    }
    for (void* p : dropped) std::free(p);
  }

  static OutputCache& instance() {
    static OutputCache* cache = new OutputCache();  // never destroyed: outputs outlive exit
    return *cache;
  }

 private:
  std::mutex mutex_;
  std::deque<std::pair<size_t, void*>> parked_;  // oldest first
  size_t bytes_ = 0;
};

inline at::Tensor empty_cpu_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  size_t nbytes = options.dtype().itemsize();
  for (int64_t s : sizes) nbytes *= static_cast<size_t>(s);
  void* data = nbytes >= kHugePageBytes ? OutputCache::instance().take(nbytes) : nullptr;
  if (data == nullptr) return at::empty(sizes, options);
  return at::from_blob(
      data, sizes, [nbytes](void* p) { OutputCache::instance().give_back(p, nbytes); },
      options.memory_format(std::nullopt));  // contiguous
}

inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor out = options.device().is_cpu() ? empty_cpu_output(sizes, options)
                                             : at::empty(sizes, options);
  if (poison_outputs_flag()) out.fill_(std::numeric_limits<float>::quiet_NaN());
  return out;
}

inline void check_float_type(const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, name,
              " must be float32, bfloat16 or float16, got ", st);
}

inline void check_tensor(const at::Tensor& t, const char* name, int64_t dim,
                         c10::DeviceType device) {
  TORCH_CHECK(t.device().type() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline void check_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.sizes() == b.sizes(), what, ": shapes differ, ", a.sizes(), " vs ", b.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, ": dtypes differ, ", a.scalar_type(),
              " vs ", b.scalar_type());
}

// mask [mask_b, 1, sq, sk] of bool/uint8 for input [b, np, sq, sk]; returns mask_b.
inline int64_t check_mask(const at::Tensor& mask, const at::Tensor& input,
                          c10::DeviceType device) {
  check_tensor(mask, "mask", 4, device);
  const auto st = mask.scalar_type();
  TORCH_CHECK(st == at::kBool || st == at::kByte, "mask must be bool or uint8, got ", st);
  const int64_t mb = mask.size(0);
  TORCH_CHECK((mb == 1 || mb == input.size(0)) && mask.size(1) == 1 &&
                  mask.size(2) == input.size(2) && mask.size(3) == input.size(3),
              "mask shape ", mask.sizes(), " does not fit input ", input.sizes(),
              "; expected [1 or b, 1, sq, sk]");
  return mb;
}

// Argument checks of each op, the same on every device.

// Causal softmax input: [batches, sq, sq].
inline void check_upper_triang_input(const at::Tensor& input, c10::DeviceType device) {
  check_tensor(input, "input", 3, device);
  check_float_type(input, "input");
  TORCH_CHECK(input.size(1) == input.size(2), "input must be [batches, sq, sq], got ",
              input.sizes());
}

// Softmax backward: gradient and saved output of equal shape and a float type.
inline void check_softmax_backward(const at::Tensor& grad, const at::Tensor& out, int64_t dim,
                                   const char* what, c10::DeviceType device) {
  check_tensor(grad, "grad", dim, device);
  check_tensor(out, "softmax output", dim, device);
  check_same(grad, out, what);
  check_float_type(out, "softmax output");
}

// Masked softmax input [b, np, sq, sk] and its mask; returns the mask's batch size.
inline int64_t check_masked_input(const at::Tensor& input, const at::Tensor& mask,
                                  c10::DeviceType device) {
  check_tensor(input, "input", 4, device);
  check_float_type(input, "input");
  return check_mask(mask, input, device);
}

inline void check_layer_norm_params(const at::Tensor& x, const at::Tensor& w,
                                    c10::DeviceType device) {
  check_tensor(x, "input", 2, device);
  check_float_type(x, "input");
  check_tensor(w, "weight", 1, device);
  TORCH_CHECK(w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "weight must be [", x.size(1), "] of ", x.scalar_type(), ", got ", w.sizes(),
              " of ", w.scalar_type());
}

inline void check_layer_norm_forward(const at::Tensor& x, const at::Tensor& w,
                                     const at::Tensor& b, c10::DeviceType device) {
  check_layer_norm_params(x, w, device);
  check_tensor(b, "bias", 1, device);
  check_same(w, b, "layer_norm weight and bias");
}

// A saved per-row statistic (mean, rstd) of input x: float32 [rows].
inline void check_row_stat(const at::Tensor& t, const at::Tensor& x, const char* name,
                           c10::DeviceType device) {
  check_tensor(t, name, 1, device);
  TORCH_CHECK(t.size(0) == x.size(0) && t.scalar_type() == at::kFloat, name,
              " must be float32 [", x.size(0), "], got ", t.sizes(), " of ", t.scalar_type());
}

// Norm backward (layer norm or RMSNorm): grad and input [rows, cols], weight [cols].
inline void check_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                const char* what, c10::DeviceType device) {
  check_layer_norm_params(x, w, device);
  check_tensor(dy, "grad", 2, device);
  check_same(dy, x, what);
}

inline void check_layer_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                      const at::Tensor& mean, const at::Tensor& rstd,
                                      const at::Tensor& w, c10::DeviceType device) {
  check_norm_backward(dy, x, w, "layer_norm backward", device);
  check_row_stat(mean, x, "mean", device);
  check_row_stat(rstd, x, "rstd", device);
}

inline void check_rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                    const at::Tensor& rstd, const at::Tensor& w,
                                    c10::DeviceType device) {
  check_norm_backward(dy, x, w, "rms_norm backward", device);
  check_row_stat(rstd, x, "rstd", device);
}

inline const uint8_t* mask_data(const at::Tensor& mask) {
  return static_cast<const uint8_t*>(mask.data_ptr());
}

}  // namespace megatron_fused
