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
#include "fp8_cast.cuh"
#include "fused_op.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cmath>
#include <mutex>
#include <string>
#include <utility>

namespace sk {
namespace {

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

// Why the fused kernels (kernels/fp8_cast.cuh) cannot cast `t`, or an empty string when they can.
std::string kernel_unsupported(const at::Tensor& t, const at::Tensor& history) {
  if (auto why = sk::ops::unusable(SK_OP_FP8_CAST, t.device()); !why.empty()) return why;
  return sk::kernels::fp8_cast::unsupported(t, history);
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
// fused kernels where the kernel switch allows and they take t, else through ATen's composite (the
// same bytes). The kernels also give t's column sums when `column_sums` (ATen's composite leaves
// them undefined).
Quantized quantize(const at::Tensor& t, const Cast& cast, bool transpose, bool column_sums = false) {
  namespace k = sk::kernels::fp8_cast;
  return sk::ops::run_or_fall_back(
      SK_OP_FP8_CAST, kernel_unsupported(t, cast.history),
      [&] {
        return cast.rowwise ? k::cast_axiswise(t, cast.fp8, transpose, column_sums)
                            : k::cast(t, cast.fp8, cast.history, transpose, column_sums);
      },
      [&] {
        return cast.rowwise ? quantize_rowwise_aten(t, cast.fp8, cast.fp8_max, transpose)
                            : quantize_aten(t, cast.fp8, cast.fp8_max, cast.history, transpose);
      });
}

// An inverse scale as _scaled_mm takes it for its first operand ([M, 1] row-wise) or its second
// ([1, N]); a per-tensor scalar as it is.
at::Tensor as_first_operand_scale(const at::Tensor& s) { return s.dim() == 0 ? s : s.view({-1, 1}); }
at::Tensor as_second_operand_scale(const at::Tensor& s) { return s.dim() == 0 ? s : s.view({1, -1}); }

// Autograd's Function::apply needs every tensor argument defined (it records each one's device), so
// "none" crosses as an empty tensor: no bias, or no history (dynamic scaling).
at::Tensor none_like(const at::Tensor& x) { return at::empty({0}, x.options().dtype(at::kFloat)); }

// What the caller decided for this call (sk_fp8_linear's `options`, speedkit.h's SK_FP8_ROWWISE and
// SK_FP8_E4M3_GRADIENTS, and kBackward added here): a backward will follow (so the casts also write
// the transposes the backward GEMMs take); scale row-wise; cast the output gradient to e4m3 rather
// than e5m2.
constexpr int64_t kBackward = 2, kRowwise = SK_FP8_ROWWISE, kE4m3Gradients = SK_FP8_E4M3_GRADIENTS;

struct Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& x_history,
                            const at::Tensor& w_history, const at::Tensor& g_history,
                            int64_t out_dtype, int64_t options) {
    // The GEMM dtypes are chosen here; autocast must not re-cast the FP8 operands.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto out_type = static_cast<at::ScalarType>(out_dtype);
    const bool backward = options & kBackward, rowwise = options & kRowwise;
    const int64_t in_features = weight.size(1);
    const at::Tensor x2 = x.reshape({-1, in_features}).contiguous();
    Quantized xq = quantize(x2, e4m3(x_history, rowwise), backward);
    Quantized wq = quantize(weight.contiguous(), e4m3(w_history, rowwise), backward);
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
    Quantized gq = quantize(g, cast, /*transpose=*/true, has_bias);
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
    return fused_op_gradients({dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()},
                               "FP8 Linear");
  }
};

at::Tensor or_none(sk_tensor t, const at::Tensor& x) { return t == nullptr ? none_like(x) : *t; }

// The amax histories of layers that keep none (tch's nn::linear under the Linear override), per
// weight: what speedkit::nn::Linear keeps as its fp8_amax_history buffer. Held weakly by the
// weight, as the weight copies are (weight_casts.cpp), so a dropped model's histories go, and a new
// tensor at a freed weight's address never inherits them.
namespace histories {

WeakWeightTable<at::Tensor>& table() {
  static auto* histories = new WeakWeightTable<at::Tensor>();
  return *histories;
}

at::Tensor of(const at::Tensor& weight, int64_t length) {
  std::lock_guard<std::mutex> lock(table().mutex);
  if (const at::Tensor* kept = table().find(weight); kept != nullptr && kept->size(1) == length) return *kept;
  at::Tensor history = at::zeros({3, length}, weight.options().dtype(at::kFloat).requires_grad(false));
  return table().insert(weight, history);
}

}  // namespace histories
}  // namespace
}  // namespace sk

extern "C" {

int sk_fp8_linear(sk_tensor x, sk_tensor weight, sk_tensor bias, sk_tensor x_history, sk_tensor w_history,
                  sk_tensor g_history, int out_dtype, int options, sk_tensor* out) {
  SK_TRY({
    const bool backward = at::GradMode::is_enabled() && (x->requires_grad() || weight->requires_grad());
    const int64_t all = (options & (sk::kRowwise | sk::kE4m3Gradients)) | (backward ? sk::kBackward : 0);
    *out = sk::give(sk::Fp8LinearFunction::apply(*x, *weight, sk::or_none(bias, *x), sk::or_none(x_history, *x),
                                             sk::or_none(w_history, *x), sk::or_none(g_history, *x),
                                             static_cast<int64_t>(out_dtype), all));
  })
}

int sk_fp8_weight_histories(sk_tensor weight, int64_t length, sk_tensor* out) {
  SK_TRY({
    TORCH_CHECK(length > 0, "an amax history needs at least one step, got ", length);
    *out = sk::give(sk::histories::of(*weight, length));
  })
}

int sk_fp8_weight_histories_release(int all, int64_t* freed) {
  SK_TRY({
    auto& histories = sk::histories::table();
    std::lock_guard<std::mutex> lock(histories.mutex);
    *freed = 0;
    histories.drop(all != 0, [&](const at::Tensor&) { ++*freed; });
  })
}

int sk_fp8_quantize(sk_tensor t, int format, sk_tensor history, int rowwise, int transpose, sk_tensor* data,
                    sk_tensor* transposed, sk_tensor* inverse_scale, sk_tensor* transposed_inverse_scale) {
  SK_TRY({
    const at::Tensor h = history == nullptr ? sk::none_like(*t) : *history;
    const sk::Cast cast = format == SK_FP8_E5M2 ? sk::e5m2(h, rowwise != 0) : sk::e4m3(h, rowwise != 0);
    sk::Quantized q = sk::quantize(*t, cast, transpose != 0);
    *data = sk::give(q.data);
    *transposed = sk::give_or_null(q.transpose);
    *inverse_scale = sk::give(q.inverse_scale);
    *transposed_inverse_scale = sk::give_or_null(q.transpose_inverse_scale);
  })
}

}  // extern "C"
