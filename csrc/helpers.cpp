// Index helpers for GPT sample datasets (bound with pybind11).
//
// Both functions have a pure-numpy twin in megatron/data/helpers.py that must
// give identical arrays; the Python wrapper validates arguments and dtypes
// before calling in here, so these functions only guard memory safety.
//
// Built with -ffp-contract=off so that `weight * i - count` is rounded exactly
// as Python's float arithmetic rounds it (no fused multiply-add).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// Walks the documents of doc_idx in order and records, for every sample of
// seq_length + 1 tokens, the (position in doc_idx, offset in that document) of
// its first token.  Consecutive samples share one boundary token, so the start
// of sample s is global token s * seq_length of the concatenated epochs.
// Returns an empty string on success, or the reason it stopped.
template <typename T, typename D>
std::string fill_sample_idx(const int32_t* sizes, int64_t num_sizes, const D* doc_idx,
                            int64_t num_docs, int64_t seq_length, int64_t num_samples,
                            T* out) {
  int64_t doc_pos = 0;  // index into doc_idx
  int64_t offset = 0;   // token offset inside the current document
  out[0] = 0;
  out[1] = 0;
  for (int64_t sample = 1; sample <= num_samples; ++sample) {
    int64_t remaining = seq_length + 1;
    while (remaining != 0) {
      if (doc_pos >= num_docs) {
        return "doc_idx holds fewer tokens than num_epochs * tokens_per_epoch";
      }
      const int64_t doc_id = doc_idx[doc_pos];
      if (doc_id < 0 || doc_id >= num_sizes) {
        return "doc_idx holds document id " + std::to_string(doc_id) +
               " outside [0, " + std::to_string(num_sizes) + ")";
      }
      const int64_t doc_length = static_cast<int64_t>(sizes[doc_id]) - offset;
      remaining -= doc_length;
      if (remaining <= 0) {
        // The sample ends inside this document; the next one starts on its
        // last token (the shared boundary token).
        offset += remaining + doc_length - 1;
        remaining = 0;
      } else {
        ++doc_pos;
        offset = 0;
      }
    }
    out[2 * sample] = static_cast<T>(doc_pos);
    out[2 * sample + 1] = static_cast<T>(offset);
  }
  return "";
}

template <typename T, typename D>
py::array build_sample_idx_typed(const py::array_t<int32_t, py::array::c_style>& sizes,
                                 const py::array_t<D, py::array::c_style>& doc_idx,
                                 int64_t seq_length, int64_t num_samples) {
  py::array_t<T> result({num_samples + 1, static_cast<int64_t>(2)});
  T* out = result.mutable_data();
  const int32_t* sizes_ptr = sizes.data();
  const D* doc_ptr = doc_idx.data();
  const int64_t num_sizes = sizes.shape(0);
  const int64_t num_docs = doc_idx.shape(0);
  std::string error;
  {
    py::gil_scoped_release release;
    error = fill_sample_idx<T, D>(sizes_ptr, num_sizes, doc_ptr, num_docs, seq_length,
                                  num_samples, out);
  }
  if (!error.empty()) {
    throw py::value_error("build_sample_idx: " + error);
  }
  return std::move(result);
}

template <typename D>
py::array build_sample_idx_for(const py::array_t<int32_t, py::array::c_style>& sizes,
                               const py::array_t<D, py::array::c_style>& doc_idx,
                               int64_t seq_length, int64_t num_samples, bool use_int64) {
  if (sizes.ndim() != 1 || doc_idx.ndim() != 1) {
    throw py::value_error("build_sample_idx: sizes and doc_idx must be 1-D");
  }
  if (seq_length < 1 || num_samples < 0) {
    throw py::value_error("build_sample_idx: need seq_length >= 1 and num_samples >= 0");
  }
  if (use_int64) {
    return build_sample_idx_typed<int64_t, D>(sizes, doc_idx, seq_length, num_samples);
  }
  return build_sample_idx_typed<int32_t, D>(sizes, doc_idx, seq_length, num_samples);
}

// Greedy blending: sample i goes to the dataset whose count lags furthest behind
// its share, error[d] = weights[d] * max(i, 1) - count[d]; ties go to the lower
// dataset index.  Fills dataset_index and dataset_sample_index in place.
void build_blending_indices(py::array_t<uint8_t, py::array::c_style>& dataset_index,
                            py::array_t<int64_t, py::array::c_style>& dataset_sample_index,
                            const py::array_t<double, py::array::c_style>& weights,
                            int32_t num_datasets, int64_t size) {
  if (num_datasets < 1 || num_datasets > 256 || weights.ndim() != 1 ||
      weights.shape(0) != num_datasets) {
    throw py::value_error("build_blending_indices: need 1..256 datasets and one weight each");
  }
  if (size < 0 || dataset_index.size() < size || dataset_sample_index.size() < size) {
    throw py::value_error("build_blending_indices: output arrays shorter than size");
  }
  uint8_t* index_out = dataset_index.mutable_data();
  int64_t* sample_out = dataset_sample_index.mutable_data();
  const double* w = weights.data();
  std::vector<int64_t> counts(num_datasets, 0);
  py::gil_scoped_release release;
  for (int64_t i = 0; i < size; ++i) {
    const double scale = i > 1 ? static_cast<double>(i) : 1.0;
    int32_t best = 0;
    double best_error = w[0] * scale - static_cast<double>(counts[0]);
    for (int32_t d = 1; d < num_datasets; ++d) {
      const double error = w[d] * scale - static_cast<double>(counts[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    index_out[i] = static_cast<uint8_t>(best);
    sample_out[i] = counts[best];
    counts[best] += 1;
  }
}

}  // namespace

PYBIND11_MODULE(megatron_data_helpers, m) {
  m.doc() = "Index helpers for GPT sample datasets (see megatron/data/helpers.py).";
  // sizes: int32 [num_sequences]; doc_idx: int32 or int64 [len] (exact dtypes, no
  // conversion); returns [num_samples + 1, 2], int64 when use_int64 else int32.
  m.def("build_sample_idx", &build_sample_idx_for<int32_t>, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_samples"), py::arg("use_int64"));
  m.def("build_sample_idx", &build_sample_idx_for<int64_t>, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_samples"), py::arg("use_int64"));
  m.def("build_blending_indices", &build_blending_indices, py::arg("dataset_index"),
        py::arg("dataset_sample_index"), py::arg("weights"), py::arg("num_datasets"),
        py::arg("size"));
}
