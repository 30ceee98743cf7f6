// What every fused op's shim file (layernorm.cpp, classifier.cpp, bias_gelu.cpp, embedding.cpp,
// linear.cpp, ...) builds on: its C++ autograd Function, whose backward is the fused kernel too; the
// run-or-fall-back path and the eligibility helpers (kernels.h); and the reshapes to and from the
// [rows, width] matrices the kernels take.
#pragma once

#include "kernels.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <memory>
#include <string>
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

// Gradients differentiable once (torch.autograd.function.once_differentiable), for a backward that
// runs kernels autograd does not record: where it runs under create_graph (grad mode on inside a
// backward), they carry a node that fails when a second derivative reaches it, naming `what`,
// instead of that derivative silently missing the node's part. Without create_graph they are
// returned as they are.
inline variable_list once_differentiable(variable_list grads, const std::string& what, const char* remedy = "") {
  if (!at::GradMode::is_enabled()) return grads;
  for (at::Tensor& g : grads)
    if (g.defined() && (g.is_floating_point() || g.is_complex())) g = g.detach().requires_grad_(true);
  auto error = std::make_shared<torch::autograd::DelayedError>(
      what + " is differentiable once: its backward is not recorded by autograd, so a second derivative (a "
             "backward with create_graph) cannot pass through it" + remedy,
      static_cast<int64_t>(grads.size()));
  return (*error)(std::move(grads));
}

// The same for one of speedkit's fused ops (`op`), whose ATen composite a step that needs a second
// derivative can run instead.
inline variable_list fused_op_gradients(variable_list grads, const char* op) {
  return once_differentiable(std::move(grads), std::string("speedkit's fused ") + op,
                             "; for a step that needs one, turn speedkit's kernels off (`kernels: false` in the speed "
                             "config), which runs ATen's ops instead");
}

}  // namespace sk
