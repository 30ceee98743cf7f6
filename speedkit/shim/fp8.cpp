// FP8 Linear: y = x Wᵀ + b with e4m3 operands in the forward GEMM and e5m2 gradients in the two
// backward GEMMs (torch._scaled_mm on FP8 Tensor Cores), as a custom autograd function so that the
// backward is FP8 as well. Weights stay fp32 (master weights); the output is `out_dtype`.
//
// Scaling: q = saturate(t · s) in FP8, s = FP8_MAX / amax, and _scaled_mm multiplies the product
// back by 1/s of each operand. Per tensor, `dynamic` takes amax from the tensor itself; `delayed`
// (Transformer Engine's recipe) takes the largest amax of the last steps from a device-side history
// and then records this step's amax in it. `rowwise` gives every row of an operand, along the axis
// its GEMM sums over, its own scale from this step's amax of that row (_scaled_mm's row-wise mode:
// scales [M, 1] and [1, N]); the backward GEMMs sum over the other axis, so their operands are cast
// column by column. All stay on the device: no host synchronisation, so a step using them can be
// captured in a CUDA graph. Values beyond the delayed scale saturate at FP8_MAX instead of
// overflowing to NaN.
//
// The casts run on speedkit's kernels (kernels/fp8_cast.cuh) where the caller allows it and they take
// the tensor: one pass writes q, its transpose (what the backward GEMMs take) and the amax, and the
// gradient's cast also gives the bias gradient. ATen's composite (same bytes) is the path otherwise.
#include "shim.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#if SK_WITH_CUDA
#include "fp8_cast.cuh"
#else
namespace sk::kernels::fp8_cast {
struct Quantized {
  at::Tensor data, transpose, inverse_scale, column_sums, transpose_inverse_scale;
};
}  // namespace sk::kernels::fp8_cast
#endif

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double E4M3_MAX = 448.0;
constexpr double E5M2_MAX = 57344.0;

using Quantized = sk::kernels::fp8_cast::Quantized;

// ATen's composite, the path wherever the kernels do not run: one pass for amax (an ∞-norm
// reduction), then scale, saturate and cast in fp32 (so that its bytes equal the kernel's), and a
// transposed copy when asked for.
Quantized quantize_aten(const at::Tensor& t, at::ScalarType fp8, double fp8_max, const at::Tensor& history,
                        bool transpose) {
  at::Tensor amax = at::linalg_vector_norm(t, INFINITY, at::OptionalIntArrayRef{}, false, at::kFloat);
  at::Tensor scale_from = amax;
  if (history.numel() > 0) {
    at::Tensor past = history.amax();
    scale_from = at::where(past > 0, past, amax);
    history.copy_(history.roll(1));
    history.select(0, 0).copy_(amax);
  }
  at::Tensor scale = at::reciprocal(scale_from.clamp_min(1e-12)).mul_(fp8_max);
  at::Tensor q = t.to(at::kFloat).mul(scale).clamp_(-fp8_max, fp8_max).to(fp8);
  at::Tensor inverse = at::reciprocal(scale);
  if (!transpose) return {q, at::Tensor(), inverse, at::Tensor(), at::Tensor()};
  return {q, q.t().contiguous(), inverse, at::Tensor(), inverse};
}

// The row-wise recipe in ATen's ops (the same bytes as the kernels): each row's scale from its own
// amax, and for the transpose each column's.
Quantized quantize_rowwise_aten(const at::Tensor& t, at::ScalarType fp8, double fp8_max, bool transpose) {
  const at::Tensor values = t.to(at::kFloat);
  const at::Tensor magnitude = values.abs();
  // amax over one axis; an axis of length zero has nothing to reduce (amax would refuse).
  const auto scales_along = [&](int64_t dim) {
    const int64_t kept = t.size(1 - dim);
    at::Tensor amax = t.size(dim) == 0 ? at::zeros({kept}, magnitude.options()) : magnitude.amax(dim);
    return at::reciprocal(amax.clamp_min(1e-12)).mul_(fp8_max);
  };
  const at::Tensor row_scale = scales_along(1);
  at::Tensor q = values.mul(row_scale.unsqueeze(1)).clamp_(-fp8_max, fp8_max).to(fp8);
  if (!transpose) return {q, at::Tensor(), at::reciprocal(row_scale), at::Tensor(), at::Tensor()};
  const at::Tensor column_scale = scales_along(0);
  at::Tensor qt = values.mul(column_scale.unsqueeze(0)).clamp_(-fp8_max, fp8_max).to(fp8).t().contiguous();
  return {q, qt, at::reciprocal(row_scale), at::Tensor(), at::reciprocal(column_scale)};
}

// Whether the last quantize() on this thread ran on the kernels: sk_fp8_linear reports whether its
// forward's casts did (autograd's apply() returns only the output).
thread_local bool last_cast_on_kernels = false;

// Why the fused kernels (kernels/fp8_cast.cuh) cannot cast `t`, or an empty string when they can.
std::string kernel_unsupported(const at::Tensor& t, const at::Tensor& history) {
#if SK_WITH_CUDA
  return sk::kernels::fp8_cast::unsupported(t, history);
#else
  (void)t; (void)history;
  return "speedkit was built without CUDA";
#endif
}

// How one call casts: the format, its largest value, and per-tensor scaling (from `history` under
// the delayed recipe, an empty tensor for dynamic) or row-wise scaling.
struct Cast {
  at::ScalarType fp8;
  double fp8_max;
  at::Tensor history;
  bool rowwise;
};

Cast e4m3(const at::Tensor& history, bool rowwise) { return {at::kFloat8_e4m3fn, E4M3_MAX, history, rowwise}; }
Cast e5m2(const at::Tensor& history, bool rowwise) { return {at::kFloat8_e5m2, E5M2_MAX, history, rowwise}; }

// t [rows, cols] in FP8 with its inverse scale(s), and its transpose when `transpose`: through the
// fused kernels when `kernels` is set and they take t, else through ATen's composite (the same
// bytes). The kernels also give t's column sums when `column_sums` (ATen's composite leaves them
// undefined).
Quantized quantize(const at::Tensor& t, const Cast& cast, bool transpose, bool kernels, bool column_sums = false) {
  last_cast_on_kernels = false;
#if SK_WITH_CUDA
  if (kernels && kernel_unsupported(t, cast.history).empty()) {
    last_cast_on_kernels = true;
    namespace k = sk::kernels::fp8_cast;
    return cast.rowwise ? k::cast_axiswise(t, cast.fp8, transpose, column_sums)
                        : k::cast(t, cast.fp8, cast.history, transpose, column_sums);
  }
#else
  (void)column_sums;
#endif
  return cast.rowwise ? quantize_rowwise_aten(t, cast.fp8, cast.fp8_max, transpose)
                      : quantize_aten(t, cast.fp8, cast.fp8_max, cast.history, transpose);
}

// An inverse scale as _scaled_mm takes it for its first operand ([M, 1] row-wise) or its second
// ([1, N]); a per-tensor scalar as it is.
at::Tensor as_first_operand_scale(const at::Tensor& s) { return s.dim() == 0 ? s : s.view({-1, 1}); }
at::Tensor as_second_operand_scale(const at::Tensor& s) { return s.dim() == 0 ? s : s.view({1, -1}); }

// Autograd's Function::apply needs every tensor argument defined (it records each one's device), so
// "none" crosses as an empty tensor: no bias, or no history (dynamic scaling).
at::Tensor none_like(const at::Tensor& x) { return at::empty({0}, x.options().dtype(at::kFloat)); }

// What the caller decided for this call (sk_fp8_linear's `options` bits, and kBackward added here):
// run the casts on the kernels; a backward will follow (so the casts also write the transposes the
// backward GEMMs take); scale row-wise; cast the output gradient to e4m3 rather than e5m2.
enum Options : int64_t { kKernels = 1, kBackward = 2, kRowwise = 4, kE4m3Gradients = 8 };

struct Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& x_history,
                            const at::Tensor& w_history, const at::Tensor& g_history,
                            int64_t out_dtype, int64_t options) {
    // The GEMM dtypes are chosen here; autocast must not re-cast the FP8 operands.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto out_type = static_cast<at::ScalarType>(out_dtype);
    const bool kernels = options & kKernels, backward = options & kBackward, rowwise = options & kRowwise;
    const int64_t in_features = weight.size(1);
    const at::Tensor x2 = x.reshape({-1, in_features}).contiguous();
    Quantized xq = quantize(x2, e4m3(x_history, rowwise), backward, kernels);
    const bool x_on_kernels = last_cast_on_kernels;
    Quantized wq = quantize(weight.contiguous(), e4m3(w_history, rowwise), backward, kernels);
    last_cast_on_kernels = last_cast_on_kernels && x_on_kernels;
    std::optional<at::Tensor> b;
    if (bias.numel() > 0) b = bias.to(out_type);
    // _scaled_mm wants its second operand column-major: wq (out, in) row-major is exactly Wᵀ so.
    at::Tensor y = at::_scaled_mm(xq.data, wq.data.t(), as_first_operand_scale(xq.inverse_scale),
                                  as_second_operand_scale(wq.inverse_scale), b, std::nullopt, out_type,
                                  /*use_fast_accum=*/true);
    // The backward GEMMs take Xᵀ and Wᵀ (row-major), which the casts wrote: X and W themselves are
    // not kept.
    ctx->save_for_backward({xq.transpose, wq.transpose, xq.transpose_inverse_scale, wq.transpose_inverse_scale});
    // Not saved as tensors: the backward writes to it, which would trip autograd's version check.
    ctx->saved_data["g_history"] = g_history;
    ctx->saved_data["has_bias"] = bias.numel() > 0;
    ctx->saved_data["kernels"] = kernels;
    ctx->saved_data["rowwise"] = rowwise;
    ctx->saved_data["e4m3_gradients"] = static_cast<bool>(options & kE4m3Gradients);
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    std::vector<int64_t> out_sizes = x.sizes().vec();
    out_sizes.back() = weight.size(0);
    return y.view(out_sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& xt = saved[0];
    const at::Tensor& wt = saved[1];
    const at::Tensor& xt_inverse = saved[2];
    const at::Tensor& wt_inverse = saved[3];
    TORCH_CHECK(xt.defined() && wt.defined(),
                "speedkit FP8 Linear: backward through a forward that ran without gradients");
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const at::Tensor g = grad_outputs[0].reshape({-1, wt.size(1)}).contiguous();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    // The bias gradient (G's column sums) comes out of the kernel's cast of G, which reads G anyway.
    const at::Tensor& g_history = ctx->saved_data["g_history"].toTensor();
    const bool rowwise = ctx->saved_data["rowwise"].toBool();
    const Cast cast = ctx->saved_data["e4m3_gradients"].toBool() ? e4m3(g_history, rowwise) : e5m2(g_history, rowwise);
    Quantized gq = quantize(g, cast, /*transpose=*/true, ctx->saved_data["kernels"].toBool(), has_bias);
    // dX = G W: W as the column-major (out, in) operand is Wᵀ laid out row-major.
    at::Tensor dx;
    if (ctx->needs_input_grad(0)) {
      dx = at::_scaled_mm(gq.data, wt.t(), as_first_operand_scale(gq.inverse_scale),
                          as_second_operand_scale(wt_inverse), std::nullopt, std::nullopt, x_dtype,
                          /*use_fast_accum=*/false)
               .view(ctx->saved_data["x_sizes"].toIntVector());
    }
    // dW = Gᵀ X, in fp32 for the fp32 master weights: X as the column-major operand is Xᵀ row-major.
    at::Tensor dw;
    if (ctx->needs_input_grad(1)) {
      dw = at::_scaled_mm(gq.transpose, xt.t(), as_first_operand_scale(gq.transpose_inverse_scale),
                          as_second_operand_scale(xt_inverse), std::nullopt, std::nullopt, at::kFloat,
                          /*use_fast_accum=*/false);
    }
    at::Tensor db;
    if (has_bias) db = gq.column_sums.defined() ? gq.column_sums : g.sum(0, false, at::kFloat);
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor or_none(at::Tensor* t, const at::Tensor& x) { return t == nullptr ? none_like(x) : *t; }

}  // namespace

extern "C" {

// `histories` are the delayed recipe's amax histories (fp32, 1-d) of x, W and the output gradient,
// or all null for the dynamic and row-wise recipes. `bias` may be null. `options`: Options' bits
// kKernels (cast on speedkit's kernels where they take the tensor; the caller has checked that they
// run on this device), kRowwise (the histories are then null) and kE4m3Gradients. `*casts_on_kernels`
// receives whether the forward's casts of x and W ran on the kernels.
int sk_fp8_linear(at::Tensor* x, at::Tensor* weight, at::Tensor* bias, at::Tensor* x_history,
                  at::Tensor* w_history, at::Tensor* g_history, int out_dtype, int options, at::Tensor** out,
                  int* casts_on_kernels) {
  SK_TRY({
    const bool backward = at::GradMode::is_enabled() && (x->requires_grad() || weight->requires_grad());
    const int64_t all = (options & (kKernels | kRowwise | kE4m3Gradients)) | (backward ? kBackward : 0);
    *out = new at::Tensor(Fp8LinearFunction::apply(*x, *weight, or_none(bias, *x), or_none(x_history, *x),
                                                   or_none(w_history, *x), or_none(g_history, *x),
                                                   static_cast<int64_t>(out_dtype), all));
    *casts_on_kernels = last_cast_on_kernels ? 1 : 0;
  })
}

// t (2-d) in FP8: `format` 0 = e4m3, 1 = e5m2; `history` the delayed recipe's (recording t's amax)
// or null for dynamic scaling; `rowwise` scales each row (and each row of the transpose) on its own
// (history then null); `*transposed` receives tᵀ in FP8 when `transpose`, else null, and
// `*transposed_inverse_scale` its inverse scale(s). Through the kernels when `use_kernels` and they
// take t, else through ATen's composite. `*reason` (may be null) receives why the kernels did not
// run, empty when they did.
int sk_fp8_quantize(at::Tensor* t, int format, at::Tensor* history, int rowwise, int transpose, int use_kernels,
                    at::Tensor** data, at::Tensor** transposed, at::Tensor** inverse_scale,
                    at::Tensor** transposed_inverse_scale, char* reason, int capacity) {
  SK_TRY({
    const at::Tensor h = history == nullptr ? none_like(*t) : *history;
    std::string why = use_kernels ? kernel_unsupported(*t, h) : "not asked to";
    const Cast cast = format == 1 ? e5m2(h, rowwise != 0) : e4m3(h, rowwise != 0);
    Quantized q = quantize(*t, cast, transpose != 0, use_kernels != 0);
    if (reason != nullptr && capacity > 0) {
      std::strncpy(reason, why.c_str(), static_cast<size_t>(capacity) - 1);
      reason[capacity - 1] = '\0';
    }
    *data = new at::Tensor(q.data);
    *transposed = q.transpose.defined() ? new at::Tensor(q.transpose) : nullptr;
    *inverse_scale = new at::Tensor(q.inverse_scale);
    *transposed_inverse_scale =
        q.transpose_inverse_scale.defined() ? new at::Tensor(q.transpose_inverse_scale) : nullptr;
  })
}

}  // extern "C"
