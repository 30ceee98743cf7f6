// A Linear layer's bias add and tanh-GELU on speedkit's kernels (kernels/bias_gelu.cuh) as a C++
// autograd function, so that the backward yields the bias gradient from the GELU-backward pass.
// Inputs the kernels do not take run ATen's gelu(h + bias) instead (sk::ops::run_or_fall_back).
#include "bias_gelu.cuh"
#include "fused_op.h"

#include <ATen/ops/add.h>
#include <ATen/ops/gelu.h>

namespace sk {
namespace {

namespace bg = kernels::bias_gelu;

struct BiasGeluFunction : torch::autograd::Function<BiasGeluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& bias) {
    ctx->save_for_backward({h, bias});
    return bg::forward(h, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    bg::Gradients out = bg::backward(grads[0].contiguous(), saved[0], saved[1]);
    return fused_op_gradients({out.dh, out.dbias}, "bias + GELU");
  }
};

std::string bias_gelu_unsupported(const at::Tensor& h, const at::Tensor& bias) {
  if (auto why = sk::ops::unusable(SK_OP_BIAS_GELU, h.device()); !why.empty()) return why;
  if (auto why = sk::ops::first_of({sk::ops::floating("input", h), sk::ops::floating("bias", bias)}); !why.empty())
    return why;
  if (h.dim() == 0) return "a 0-d input";
  const int64_t width = h.size(-1);
  if (bias.dim() != 1 || bias.size(0) != width || bias.device() != h.device())
    return "bias " + c10::str(bias.sizes()) + " on " + bias.device().str() + " does not match the output width " +
           std::to_string(width);
  return sk::ops::fits_int32(h.numel() / std::max<int64_t>(width, 1), width);
}

}  // namespace
}  // namespace sk

extern "C" {

int sk_bias_gelu(sk_tensor h, sk_tensor bias, sk_tensor* y) {
  SK_TRY({
    at::Tensor result = sk::ops::run_or_fall_back(
        SK_OP_BIAS_GELU, sk::bias_gelu_unsupported(*h, *bias),
        [&] {
          const int64_t width = h->size(-1);
          return sk::BiasGeluFunction::apply(sk::rows_of(*h, width), bias->contiguous()).view(h->sizes());
        },
        [&] { return at::gelu(at::add(*h, bias->to(h->scalar_type())), "tanh"); });
    *y = sk::give(result);
  })
}

}  // extern "C"
