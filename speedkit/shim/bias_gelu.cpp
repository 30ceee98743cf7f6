// A Linear layer's bias add and tanh-GELU on speedkit's kernels (kernels/bias_gelu.cuh) as a C++
// autograd function, so that the backward yields the bias gradient from the GELU-backward pass. The
// Rust side (nn/linear.rs, `Linear::forward_gelu`) decides when this path applies and otherwise runs
// ATen's `gelu(x Wᵀ + b)`.
#include "shim.h"

#include <torch/csrc/autograd/custom_function.h>

#if SK_WITH_CUDA
#include "bias_gelu.cuh"
#endif

namespace {

#if SK_WITH_CUDA
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
namespace bg = sk::kernels::bias_gelu;

struct BiasGeluFunction : torch::autograd::Function<BiasGeluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& bias) {
    ctx->save_for_backward({h, bias});
    return bg::forward(h, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    bg::Backward out = bg::backward(grads[0].contiguous(), saved[0], saved[1]);
    return {out.dh, out.dbias};
  }
};
#endif

}  // namespace

extern "C" {

// *y = gelu_tanh(h + bias) over the last dimension, in h's type. h: CUDA, fp32/bf16/fp16; bias:
// [width] of one of those types on the same device. Differentiable through BiasGeluFunction.
int sk_bias_gelu(at::Tensor* h, at::Tensor* bias, at::Tensor** y) {
#if SK_WITH_CUDA
  SK_TRY({
    const int64_t width = h->size(-1);
    at::Tensor rows2d = h->reshape({-1, width}).contiguous();
    at::Tensor result = BiasGeluFunction::apply(rows2d, bias->contiguous());
    *y = new at::Tensor(result.view(h->sizes()));
  })
#else
  (void)h; (void)bias; (void)y;
  SK_NO_CUDA();
#endif
}

}  // extern "C"
