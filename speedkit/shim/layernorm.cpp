// LayerNorm on speedkit's kernels (kernels/layernorm.cuh) as a C++ autograd function, so that the
// backward is the fused kernel too: y = LN(x); with a residual, (y, s) = (LN(x + r), x + r); and
// (y, x) when the input is also used later, so that its gradient from there joins dx in the kernel.
// Inputs the kernels do not take run ATen's layer_norm instead (sk::ops::run_or_fall_back).
#include "fused_op.h"
#include "layernorm.cuh"

#include <ATen/ops/add.h>
#include <ATen/ops/layer_norm.h>

namespace sk {
namespace {

namespace ln = kernels::layernorm;

// Which optional inputs are present; an absent one is passed as sk::placeholder_unless's placeholder.
// kKeepInput (without a residual) asks for x back as a second output.
constexpr int64_t kResidual = 1, kWeight = 2, kBias = 4, kKeepInput = 8;

// Inputs are [rows, width] contiguous; residual, weight, bias are used as `present` says. Outputs: y,
// and s = x + r when there is a residual, or x itself with kKeepInput.
struct LayerNormFunction : torch::autograd::Function<LayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& residual_in,
                               const at::Tensor& weight_in, const at::Tensor& bias_in, double eps,
                               int64_t out_type, int64_t present) {
    const at::Tensor residual = (present & kResidual) ? residual_in : at::Tensor();
    const at::Tensor weight = (present & kWeight) ? weight_in : at::Tensor();
    const at::Tensor bias = (present & kBias) ? bias_in : at::Tensor();
    ln::Normalised out = ln::forward(x, residual, weight, bias, eps, static_cast<at::ScalarType>(out_type));
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
    ln::Gradients out =
        ln::backward(dy.contiguous(), x, weight, has_bias, saved[2], saved[3], dsum, branch_in_dy_type);
    at::Tensor dresidual = with_residual ? (branch_in_dy_type ? out.dx_branch : out.dx) : at::Tensor();
    return fused_op_gradients({out.dx, dresidual, out.dweight, out.dbias, at::Tensor(), at::Tensor(), at::Tensor()},
                               "LayerNorm");
  }
};

struct Inputs {
  at::Tensor x, residual, weight, bias;
  double eps;
  bool keep_input;
};

struct Outputs {
  at::Tensor y, second;  // second: the sum with a residual, x with keep_input, else undefined
};

// Why the kernels cannot take these inputs, or empty.
std::string layer_norm_unsupported(const Inputs& in) {
  const at::Tensor& x = in.x;
  const c10::Device device = x.device();
  if (auto why = sk::ops::unusable(SK_OP_LAYER_NORM, device); !why.empty()) return why;
  if (auto why = sk::ops::floating("input", x); !why.empty()) return why;
  if (x.dim() == 0) return "a 0-d input has no last dimension to normalise";
  const int64_t width = x.size(-1);
  if (in.residual.defined()) {
    // An fp32 residual stream may take a bf16/fp16 branch output (autocast's mix).
    const auto r = in.residual.scalar_type();
    const bool types_fit = r == x.scalar_type() || (x.scalar_type() == at::kFloat && (r == at::kBFloat16 || r == at::kHalf));
    if (!types_fit || in.residual.sizes() != x.sizes() || in.residual.device() != device)
      return std::string("residual ") + c10::toString(r) + " " + c10::str(in.residual.sizes()) +
             " differs from the input " + c10::toString(x.scalar_type()) + " " + c10::str(x.sizes());
  }
  for (const at::Tensor* p : {&in.weight, &in.bias}) {
    if (!p->defined()) continue;
    if (auto why = sk::ops::first_of({sk::ops::floating("parameter", *p), sk::ops::on_device("parameter", *p, device)});
        !why.empty())
      return why;
    if (p->dim() != 1 || p->size(0) != width) return "parameters of shape " + c10::str(p->sizes()) + " for width " + std::to_string(width);
  }
  if (in.weight.defined() && in.bias.defined() && in.weight.scalar_type() != in.bias.scalar_type())
    return "weight and bias differ in type";
  if (auto why = sk::ops::fits_int32(x.numel() / std::max<int64_t>(width, 1), width); !why.empty()) return why;
  if (ln::backward_warps(width, device) == 0)
    return "width " + std::to_string(width) + " exceeds the shared memory of the backward kernel";
  return {};
}

Outputs layer_norm_on_kernels(const Inputs& in) {
  const int64_t width = in.x.size(-1);
  at::Tensor x2d = sk::rows_of(in.x, width);
  const int64_t present = (in.residual.defined() ? kResidual : 0) | (in.weight.defined() ? kWeight : 0) |
                          (in.bias.defined() ? kBias : 0) | (in.keep_input ? kKeepInput : 0);
  const auto optional_input = [&](const at::Tensor& t, bool rows) {
    return sk::placeholder_unless(t.defined(), t.defined() ? (rows ? sk::rows_of(t, width) : t.contiguous()) : t, x2d);
  };
  auto outputs = LayerNormFunction::apply(x2d, optional_input(in.residual, true), optional_input(in.weight, false),
                                          optional_input(in.bias, false), in.eps,
                                          static_cast<int64_t>(sk::autocast_type_for(in.x)), present);
  const bool second_output = in.residual.defined() || in.keep_input;
  return {outputs[0].view(in.x.sizes()), second_output ? outputs[1].view(in.x.sizes()) : at::Tensor()};
}

Outputs layer_norm_on_aten(const Inputs& in) {
  const auto normalise = [&](const at::Tensor& t) {
    return at::layer_norm(t, {t.size(-1)}, in.weight, in.bias, in.eps);
  };
  if (in.residual.defined()) {
    at::Tensor sum = at::add(in.x, in.residual);
    return {normalise(sum), sum};
  }
  return {normalise(in.x), in.keep_input ? in.x : at::Tensor()};
}

Inputs inputs(sk_tensor x, sk_tensor residual, sk_tensor weight, sk_tensor bias, double eps, int keep_input) {
  return {*x, sk::optional_tensor(residual), sk::optional_tensor(weight), sk::optional_tensor(bias), eps,
          keep_input != 0};
}

}  // namespace
}  // namespace sk

extern "C" {

int sk_layer_norm(sk_tensor x, sk_tensor residual, sk_tensor weight, sk_tensor bias, double eps, int keep_input,
                  sk_tensor* y, sk_tensor* sum) {
  SK_TRY({
    const sk::Inputs in = sk::inputs(x, residual, weight, bias, eps, keep_input);
    sk::Outputs out = sk::ops::run_or_fall_back(
        SK_OP_LAYER_NORM, sk::layer_norm_unsupported(in), [&] { return sk::layer_norm_on_kernels(in); }, [&] { return sk::layer_norm_on_aten(in); });
    *y = sk::give(out.y);
    *sum = sk::give_or_null(out.second);
  })
}

int sk_layer_norm_unsupported(sk_tensor x, sk_tensor residual, sk_tensor weight, sk_tensor bias, const char** reason) {
  SK_TRY(sk::hand_out(sk::layer_norm_unsupported(sk::inputs(x, residual, weight, bias, 0.0, 0)), reason))
}

}  // extern "C"
