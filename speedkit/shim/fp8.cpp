// FP8 Linear: y = x Wᵀ + b with e4m3 operands in the forward GEMM and e5m2 gradients in the two
// backward GEMMs (torch._scaled_mm on FP8 Tensor Cores), as a custom autograd function so that the
// backward is FP8 as well. Weights stay fp32 (master weights); the output is `out_dtype`.
//
// Scaling, per tensor: q = saturate(t · s) in FP8, s = FP8_MAX / amax, and _scaled_mm multiplies the
// product back by 1/s of each operand. `dynamic` takes amax from the tensor itself; `delayed`
// (Transformer Engine's recipe) takes the largest amax of the last steps from a device-side history
// and then records this step's amax in it. Both stay on the device: no host synchronisation, so a
// step using them can be captured in a CUDA graph. Values beyond the delayed scale saturate at
// FP8_MAX instead of overflowing to NaN.
#include "shim.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <cmath>
#include <utility>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double E4M3_MAX = 448.0;
constexpr double E5M2_MAX = 57344.0;

struct Quantized {
  at::Tensor data;         // FP8, same shape as the input
  at::Tensor inverse_scale; // fp32 scalar: data · inverse_scale ≈ the input
};

// One pass for amax (an ∞-norm reduction), one for scale-and-saturate, one for the cast.
Quantized quantize(const at::Tensor& t, at::ScalarType fp8, double fp8_max, const at::Tensor& history) {
  at::Tensor amax = at::linalg_vector_norm(t, INFINITY, at::OptionalIntArrayRef{}, false, at::kFloat);
  at::Tensor scale_from = amax;
  if (history.numel() > 0) {
    at::Tensor past = history.amax();
    scale_from = at::where(past > 0, past, amax);
    history.copy_(history.roll(1));
    history.select(0, 0).copy_(amax);
  }
  at::Tensor scale = at::reciprocal(scale_from.clamp_min(1e-12)).mul_(fp8_max);
  at::Tensor q = t.mul(scale.to(t.scalar_type())).clamp_(-fp8_max, fp8_max).to(fp8);
  return {q, at::reciprocal(scale)};
}

// Autograd's Function::apply needs every tensor argument defined (it records each one's device), so
// "none" crosses as an empty tensor: no bias, or no history (dynamic scaling).
at::Tensor none_like(const at::Tensor& x) { return at::empty({0}, x.options().dtype(at::kFloat)); }

struct Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& x_history,
                            const at::Tensor& w_history, const at::Tensor& g_history,
                            int64_t out_dtype) {
    // The GEMM dtypes are chosen here; autocast must not re-cast the FP8 operands.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto out_type = static_cast<at::ScalarType>(out_dtype);
    const int64_t in_features = weight.size(1);
    const at::Tensor x2 = x.reshape({-1, in_features});
    Quantized xq = quantize(x2, at::kFloat8_e4m3fn, E4M3_MAX, x_history);
    Quantized wq = quantize(weight, at::kFloat8_e4m3fn, E4M3_MAX, w_history);
    std::optional<at::Tensor> b;
    if (bias.numel() > 0) b = bias.to(out_type);
    // _scaled_mm wants its second operand column-major: wq (out, in) row-major is exactly Wᵀ so.
    at::Tensor y = at::_scaled_mm(xq.data, wq.data.t(), xq.inverse_scale, wq.inverse_scale, b,
                                  std::nullopt, out_type, /*use_fast_accum=*/true);
    ctx->save_for_backward({xq.data, wq.data, xq.inverse_scale, wq.inverse_scale});
    // Not saved as tensors: the backward writes to it, which would trip autograd's version check.
    ctx->saved_data["g_history"] = g_history;
    ctx->saved_data["has_bias"] = bias.numel() > 0;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    std::vector<int64_t> out_sizes = x.sizes().vec();
    out_sizes.back() = weight.size(0);
    return y.view(out_sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& xq = saved[0];
    const at::Tensor& wq = saved[1];
    const at::Tensor& x_inverse = saved[2];
    const at::Tensor& w_inverse = saved[3];
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const at::Tensor g = grad_outputs[0].reshape({-1, wq.size(0)}).contiguous();
    Quantized gq = quantize(g, at::kFloat8_e5m2, E5M2_MAX, ctx->saved_data["g_history"].toTensor());
    // dX = G W: W as the column-major (out, in) operand is Wᵀ laid out row-major.
    at::Tensor wt = wq.t().contiguous();
    at::Tensor dx = at::_scaled_mm(gq.data, wt.t(), gq.inverse_scale, w_inverse, std::nullopt,
                                   std::nullopt, x_dtype, /*use_fast_accum=*/false);
    // dW = Gᵀ X, in fp32 for the fp32 master weights.
    at::Tensor gt = gq.data.t().contiguous();
    at::Tensor xt = xq.t().contiguous();
    at::Tensor dw = at::_scaled_mm(gt, xt.t(), gq.inverse_scale, x_inverse, std::nullopt, std::nullopt,
                                   at::kFloat, /*use_fast_accum=*/false);
    at::Tensor db;
    if (ctx->saved_data["has_bias"].toBool()) db = g.sum(0, false, at::kFloat);
    return {dx.view(ctx->saved_data["x_sizes"].toIntVector()), dw, db, at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

at::Tensor or_none(at::Tensor* t, const at::Tensor& x) { return t == nullptr ? none_like(x) : *t; }

}  // namespace

extern "C" {

// `histories` are the delayed recipe's amax histories (fp32, 1-d) of x, W and the output gradient,
// or all null for the dynamic recipe. `bias` may be null.
int sk_fp8_linear(at::Tensor* x, at::Tensor* weight, at::Tensor* bias, at::Tensor* x_history,
                  at::Tensor* w_history, at::Tensor* g_history, int out_dtype, at::Tensor** out) {
  SK_TRY(*out = new at::Tensor(Fp8LinearFunction::apply(
             *x, *weight, or_none(bias, *x), or_none(x_history, *x), or_none(w_history, *x),
             or_none(g_history, *x), static_cast<int64_t>(out_dtype))))
}

}  // extern "C"
