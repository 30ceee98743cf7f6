// speedkit::column_sums: the sum over every dimension but the last, a bias's gradient over a batch of
// rows. On CUDA it runs speedkit's bias_grad kernel (kernels/bias_grad.cuh), which reads at HBM
// bandwidth where ATen's generic reduction runs at about a quarter of it; elsewhere ATen's sum.
//
// An operator rather than a direct launch so that the dispatcher sees the call: the execution trace
// records it, and the fusion engine sums the columns inside the kernel that makes its input (a GELU's
// backward, a layer norm's backward and its cast, the `cat` of a split's gradients) instead of
// reading that input again (speedkit/src/fusion/codegen/columns.rs). The operator is speedkit's own,
// defined once when the shim is loaded, like any extension's; no ATen operator's kernel changes.
#include "column_sums.h"

#include "bias_grad.cuh"
#include "shim.h"

#include <ATen/ops/sum.h>
#include <torch/library.h>

#include <numeric>
#include <vector>

namespace sk {
namespace {

// The dimensions a column sum reduces: all but the last.
std::vector<int64_t> all_but_last(const at::Tensor& t) {
  std::vector<int64_t> dims(static_cast<size_t>(std::max<int64_t>(t.dim() - 1, 0)));
  std::iota(dims.begin(), dims.end(), 0);
  return dims;
}

at::Tensor column_sums_anywhere(const at::Tensor& t, at::ScalarType out) {
  TORCH_CHECK(t.dim() >= 1, "speedkit::column_sums: a tensor of at least one dimension, got a 0-d one");
  return at::sum(t, all_but_last(t), false, out);
}

at::Tensor column_sums_cuda(const at::Tensor& t, at::ScalarType out) {
  TORCH_CHECK(t.dim() >= 1, "speedkit::column_sums: a tensor of at least one dimension, got a 0-d one");
  const auto type = t.scalar_type();
  const bool kernel_type = type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
  if (!kernel_type || !at::isFloatingType(out)) return column_sums_anywhere(t, out);
  const int64_t width = t.size(-1);
  return kernels::bias_grad::column_sums(t.reshape({-1, width}).contiguous(), out);
}

}  // namespace

at::Tensor column_sums(const at::Tensor& t, at::ScalarType out) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("speedkit::column_sums", "")
                             .typed<at::Tensor(const at::Tensor&, at::ScalarType)>();
  return op.call(t, out);
}

}  // namespace sk

TORCH_LIBRARY(speedkit, m) { m.def("column_sums(Tensor self, ScalarType dtype) -> Tensor"); }

TORCH_LIBRARY_IMPL(speedkit, CUDA, m) { m.impl("column_sums", &sk::column_sums_cuda); }

TORCH_LIBRARY_IMPL(speedkit, CompositeExplicitAutograd, m) { m.impl("column_sums", &sk::column_sums_anywhere); }

extern "C" {

int sk_column_sums(sk_tensor x, int dtype, sk_tensor* out) {
  SK_TRY(*out = sk::give(sk::column_sums(*x, static_cast<at::ScalarType>(dtype))))
}

}  // extern "C"
