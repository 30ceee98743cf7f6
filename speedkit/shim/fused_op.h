// What every fused op's shim file (layernorm.cpp, classifier.cpp, bias_gelu.cpp, embedding.cpp,
// linear.cpp, ...) builds on: its C++ autograd Function, whose backward is the fused kernel too; the
// run-or-fall-back path and the eligibility helpers (kernels.h); and the reshapes to and from the
// [rows, width] matrices the kernels take.
#pragma once

#include "kernels.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <vector>

namespace sk {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// `t` as a contiguous [rows, width] matrix over its last dimension.
inline at::Tensor rows_of(const at::Tensor& t, int64_t width) { return t.reshape({-1, width}).contiguous(); }

// `t` ([rows, width]) back in the shape of `like` with its last dimension `width`.
inline at::Tensor shaped_like(const at::Tensor& t, const at::Tensor& like, int64_t width) {
  std::vector<int64_t> shape = like.sizes().vec();
  shape.back() = width;
  return t.view(shape);
}

// The type an op writes its output in: the autocast type where autocast is on for `t`'s device (the
// next op would cast to it anyway), else `t`'s own.
inline at::ScalarType autocast_type_for(const at::Tensor& t) {
  const auto device = t.device().type();
  return at::autocast::is_autocast_enabled(device) ? at::autocast::get_autocast_dtype(device) : t.scalar_type();
}

}  // namespace sk
