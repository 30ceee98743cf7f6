// LayerNorm on speedkit's kernels (kernels/layernorm.cuh) as a C++ autograd function, so that the
// backward is the fused kernel too: y = LN(x); with a residual, (y, s) = (LN(x + r), x + r); and
// (y, x) when the input is also used later, so that its gradient from there joins dx in the kernel.
// The Rust side (nn/layer_norm.rs) decides when this path applies and otherwise runs ATen's.
#include "shim.h"

#include <torch/csrc/autograd/custom_function.h>

#if SK_WITH_CUDA
#include "layernorm.cuh"
#endif

namespace {

#if SK_WITH_CUDA
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
namespace ln = sk::kernels::layernorm;

// Which optional inputs are present; an absent one is passed as sk::placeholder_unless's placeholder.
// kKeepInput (without a residual) asks for x back as a second output.
enum Present : int64_t { kResidual = 1, kWeight = 2, kBias = 4, kKeepInput = 8 };

// Inputs are [rows, width] contiguous (the caller flattens); residual, weight, bias are used as
// `present` says. Outputs: y, and s = x + r when there is a residual, or x itself with kKeepInput.
struct LayerNormFunction : torch::autograd::Function<LayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& residual_in,
                               const at::Tensor& weight_in, const at::Tensor& bias_in, double eps,
                               int64_t out_type, int64_t present) {
    const at::Tensor residual = (present & kResidual) ? residual_in : at::Tensor();
    const at::Tensor weight = (present & kWeight) ? weight_in : at::Tensor();
    const at::Tensor bias = (present & kBias) ? bias_in : at::Tensor();
    ln::Forward out = ln::forward(x, residual, weight, bias, eps, static_cast<at::ScalarType>(out_type));
    const bool with_residual = residual.defined();
    const bool keep_input = !with_residual && (present & kKeepInput);
    ctx->saved_data["has_bias"] = bias.defined();
    ctx->saved_data["with_residual"] = with_residual;
    ctx->saved_data["keep_input"] = keep_input;
    ctx->saved_data["residual_type"] = static_cast<int64_t>(with_residual ? residual.scalar_type() : x.scalar_type());
    ctx->save_for_backward({with_residual ? out.sum : x, weight, out.mean, out.rstd});
    // An unused output's gradient stays undefined instead of a materialised tensor of zeros.
    ctx->set_materialize_grads(false);
    if (with_residual) return {out.y, out.sum};
    // An input returned as an output: autograd gives it this node as its gradient function, so
    // the gradient of x's later uses arrives here as grads[1].
    if (keep_input) return {out.y, x};
    return {out.y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const bool with_residual = ctx->saved_data["with_residual"].toBool();
    at::Tensor dy = grads[0];
    const bool second_output = with_residual || ctx->saved_data["keep_input"].toBool();
    at::Tensor dsum = second_output ? grads[1] : at::Tensor();
    if (dsum.defined()) dsum = dsum.contiguous();
    if (!dy.defined()) {
      // Only s was used: the gradient passes through the sum unchanged; the parameters get none.
      at::Tensor dx = dsum.defined() ? dsum : at::Tensor();
      return {dx, with_residual ? dx : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
              at::Tensor()};
    }
    // A bf16/fp16 branch joining an fp32 stream gets its gradient in its own type from the kernel's
    // pass, instead of autograd casting the fp32 one in a kernel of its own.
    const auto residual_type = static_cast<at::ScalarType>(ctx->saved_data["residual_type"].toInt());
    const bool branch_in_dy_type =
        with_residual && residual_type == dy.scalar_type() && residual_type != x.scalar_type();
    ln::Backward out =
        ln::backward(dy.contiguous(), x, weight, has_bias, saved[2], saved[3], dsum, branch_in_dy_type);
    at::Tensor dresidual = with_residual ? (branch_in_dy_type ? out.dx_branch : out.dx) : at::Tensor();
    return {out.dx, dresidual, out.dweight, out.dbias, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
#endif

}  // namespace

extern "C" {

// Whether the fused backward fits a row of `width` on CUDA device `index` (its per-warp shared
// memory accumulators); wider rows take the ATen path.
int sk_layer_norm_width_supported(int index, int64_t width, int* out) {
#if SK_WITH_CUDA
  SK_TRY(*out = ln::backward_warps(width, c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index))) > 0)
#else
  (void)index; (void)width; (void)out;
  SK_NO_CUDA();
#endif
}

// y = LN(x [+ residual]) over the last dimension in `out_type` (a c10::ScalarType code); with a
// residual also *sum = x + residual; without one and with `keep_input`, *sum = x, passed through. x and residual: CUDA, the same shape and floating type;
// weight, bias: [width] or null. Differentiable through LayerNormFunction.
int sk_layer_norm(at::Tensor* x, at::Tensor* residual, at::Tensor* weight, at::Tensor* bias, double eps,
                  int out_type, int keep_input, at::Tensor** y, at::Tensor** sum) {
#if SK_WITH_CUDA
  SK_TRY({
    const int64_t width = x->size(-1);
    const auto rows2d = [width](const at::Tensor& t) { return t.reshape({-1, width}).contiguous(); };
    at::Tensor x2d = rows2d(*x);
    const bool second_output = residual != nullptr || keep_input != 0;
    const int64_t present = (residual != nullptr ? kResidual : 0) | (weight != nullptr ? kWeight : 0) |
                            (bias != nullptr ? kBias : 0) | (keep_input != 0 ? kKeepInput : 0);
    at::Tensor r = sk::placeholder_unless(residual != nullptr, residual ? rows2d(*residual) : at::Tensor(), x2d);
    at::Tensor w = sk::placeholder_unless(weight != nullptr, weight ? weight->contiguous() : at::Tensor(), x2d);
    at::Tensor b = sk::placeholder_unless(bias != nullptr, bias ? bias->contiguous() : at::Tensor(), x2d);
    auto outputs = LayerNormFunction::apply(x2d, r, w, b, eps, static_cast<int64_t>(out_type), present);
    *y = new at::Tensor(outputs[0].view(x->sizes()));
    *sum = second_output ? new at::Tensor(outputs[1].view(x->sizes())) : nullptr;
  })
#else
  (void)x; (void)residual; (void)weight; (void)bias; (void)eps; (void)out_type; (void)keep_input; (void)y;
  (void)sum;
  SK_NO_CUDA();
#endif
}

}  // extern "C"
