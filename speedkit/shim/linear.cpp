// A Linear layer, y = x Wᵀ + b, as a C++ autograd function whose backward costs fewer passes over
// memory than ATen's composite under autocast:
//  - the weight gradient comes out of its GEMM in the weight's own type (bf16 × bf16 → fp32 on
//    cuBLAS, ATen's mm.dtype), where autocast's composite writes it in bf16 and then casts it to
//    the fp32 master weight's type in a separate kernel;
//  - the bias gradient is speedkit::column_sums (column_sums.cpp): speedkit's kernel at HBM bandwidth,
//    where ATen's generic reduction runs at about a quarter of it, followed by a cast; an operator the
//    fusion engine sees, and sums inside the kernel that makes the gradient where it generates one;
//  - an output used as equal column blocks (q, k and v of one projection) is returned as those
//    blocks, and their gradients are put side by side by the pass that sums the bias gradient,
//    where autograd would run a cat kernel for the split's backward and the sum would read its
//    result again.
// The forward runs the GEMMs ATen's linear runs (addmm with its bias epilogue), on the same operands
// autocast would give it: x, W and b in the autocast type where autocast is on for CUDA. W's and b's
// copies in that type come from weight_casts.cpp, which keeps them across steps (speedkit's AdamW
// writes them in its update pass) instead of casting each weight in every forward, for the layers
// where that costs no memory at the step's peak (weight_operand). Inputs the kernels do not take run
// ATen's `linear` instead (sk::ops::run_or_fall_back).
//
// A linear whose input is a GELU's output (a transformer MLP's second layer) keeps the GELU's input
// for its weight gradient instead of that output, and recomputes the GELU there: the GELU's own
// backward keeps its input anyway, so the output ([rows, 4·d] per block) is freed as soon as the
// forward is done with it, what torch.compile's partitioner does for the same pair. A linear whose
// input is a product of two tensors of its shape (SwiGLU's silu(gate) · up before a Llama MLP's
// down projection) keeps the two factors the product's own backward keeps, and multiplies again.
//
// Differentiable once: a second derivative through the backward is an error (fused_op_gradients).
#include "bias_grad.cuh"
#include "column_sums.h"
#include "fused_op.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <torch/csrc/autograd/generated/Functions.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace sk {
namespace {

// The type the GEMMs run in: `requested` where it is one (kAutocastType: autocast's where it is
// on for CUDA, else the input's).
constexpr int64_t kAutocastType = -1;
at::ScalarType compute_type(const at::Tensor& x, int64_t requested) {
  if (requested != kAutocastType) return static_cast<at::ScalarType>(requested);
  if (x.is_cuda() && at::autocast::is_autocast_enabled(at::kCUDA)) return at::autocast::get_autocast_dtype(at::kCUDA);
  return x.scalar_type();
}

bool is_half(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// dy [rows, out]ᵀ · x [rows, in] in the weight's type: straight from cuBLAS when the weight is fp32
// and the GEMM runs in bf16/fp16, else a cast after the GEMM (a no-op when the types agree).
at::Tensor weight_gradient(const at::Tensor& dy, const at::Tensor& x, at::ScalarType weight_type) {
  if (weight_type == at::kFloat && is_half(dy.scalar_type())) return at::mm(dy.t(), x, at::kFloat);
  return at::mm(dy.t(), x).to(weight_type);
}

// The output gradient as one [rows, out] matrix, from the gradients of the `chunks` column blocks
// the forward returned, with the bias gradient (of type `bias_type`, when `with_bias`) summed in the
// same pass where it can be.
std::pair<at::Tensor, at::Tensor> output_gradient(const variable_list& grads, at::ScalarType type, bool with_bias,
                                                  at::ScalarType bias_type) {
  if (grads.size() == 1) {
    at::Tensor dy = grads[0].to(type).contiguous();
    return {dy, with_bias ? sk::column_sums(dy, bias_type) : at::Tensor()};
  }
  std::vector<at::Tensor> parts;
  for (const at::Tensor& g : grads) parts.push_back(g.to(type).contiguous());
  if (with_bias && parts.size() <= static_cast<size_t>(sk::kernels::bias_grad::kMaxParts))
    return sk::kernels::bias_grad::concat_and_column_sums(parts, bias_type);
  at::Tensor dy = at::cat(parts, 1);
  return {dy, with_bias ? sk::column_sums(dy, bias_type) : at::Tensor()};
}

// How an input `x` the backward needs can be computed again from tensors autograd keeps anyway
// (its own node's saved inputs, detached): a GELU of `first` (`approximate`), or the product of
// `first` and `second`.
struct Recomputable {
  at::Tensor first;
  at::Tensor second;  // undefined for a GELU
  std::string approximate;
};

// `saved`'s tensor where it still holds one of x's shape and type, else undefined (released after
// a backward, or changed in place: x is kept as usual).
at::Tensor unpacked_like(const torch::autograd::SavedVariable& saved, const at::Tensor& x) {
  at::Tensor t;
  try {
    t = saved.unpack();
  } catch (const c10::Error&) {
    return at::Tensor();
  }
  if (!t.defined() || t.sizes() != x.sizes() || t.scalar_type() != x.scalar_type()) return at::Tensor();
  return t.detach();
}

// How `x` is computed again where it is the whole output of a GELU or of a product of two tensors
// of its shape, recorded by autograd (whose nodes keep those inputs for their own backward); else
// none.
std::optional<Recomputable> recomputable(const at::Tensor& x) {
  if (!x.requires_grad() || x.is_view() || x.output_nr() != 0) return std::nullopt;
  const auto node = x.grad_fn().get();
  if (auto* gelu = dynamic_cast<torch::autograd::generated::GeluBackward0*>(node)) {
    at::Tensor input = unpacked_like(gelu->self_, x);
    if (!input.defined()) return std::nullopt;
    return Recomputable{input, at::Tensor(), gelu->approximate};
  }
  if (auto* mul = dynamic_cast<torch::autograd::generated::MulBackward0*>(node)) {
    at::Tensor a = unpacked_like(mul->self_, x), b = unpacked_like(mul->other_, x);
    if (!a.defined() || !b.defined()) return std::nullopt;
    return Recomputable{a, b, std::string()};
  }
  return std::nullopt;
}

// `x` computed again from `how` (as the forward computed it: the same ATen operator on the same
// inputs gives the same values).
at::Tensor recompute(const Recomputable& how) {
  return how.second.defined() ? at::mul(how.first, how.second) : at::gelu(how.first, how.approximate);
}

// The weight in `type` for a GEMM of `rows` rows: the copy weight_casts.cpp keeps across steps where
// the layer's input (rows × in) is at least as large as its weight (out × in), else a cast that
// lives until the layer's backward. Where activations outweigh weights, the step's memory peaks
// near the end of the forward, when every layer's cast would be alive anyway, and the kept copy
// only saves the cast's pass. Where the weights outweigh the activations (wide layers on a small
// batch), the peak comes at the end of the backward, beside every gradient: a cast is freed by then
// and a kept copy is not.
at::Tensor weight_operand(const at::Tensor& weight, int64_t rows, at::ScalarType type) {
  return rows >= weight.size(0) ? sk::weight_casts::get(weight, type) : weight.to(type);
}

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  // x: [rows, in]; weight: [out, in]; bias_in: [out] when has_bias, else sk::placeholder_unless's
  // placeholder; `requested` the GEMMs' type (compute_type); `first` and `second` what x is
  // computed again from where it is a GELU's output (`first`, with `approximate`) or a product
  // (`first` · `second`, `approximate` empty), as rows like x (recomputable), else placeholders
  // (`approximate` none: x itself is kept). Returns y [rows, out] as `chunks` equal column blocks
  // (views of one tensor).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias_in, bool has_bias, int64_t chunks, int64_t requested,
                               const at::Tensor& first, const at::Tensor& second,
                               const std::optional<std::string>& approximate) {
    const at::Tensor bias = has_bias ? bias_in : at::Tensor();
    const at::ScalarType type = compute_type(x, requested);
    at::Tensor x_c = x.to(type);
    at::Tensor w_c = weight_operand(weight, x.size(0), type);
    // Only what the backward will use: the first layer of a model (an input without gradient)
    // needs no weight for its backward, and a frozen weight no input.
    const bool again = approximate.has_value();
    const bool product = again && approximate->empty();
    ctx->save_for_backward({weight.requires_grad() ? (again ? first : x_c) : at::Tensor(),
                            x.requires_grad() ? w_c : at::Tensor(),
                            weight.requires_grad() && product ? second : at::Tensor()});
    if (again) ctx->saved_data["recompute"] = *approximate;
    ctx->saved_data["type"] = static_cast<int64_t>(type);
    ctx->saved_data["weight_type"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["bias_type"] = static_cast<int64_t>(bias.defined() ? bias.scalar_type() : type);
    ctx->saved_data["has_bias"] = bias.defined();
    at::Tensor y = bias.defined() ? at::addmm(sk::weight_casts::get(bias, type), x_c, w_c.t()) : at::mm(x_c, w_c.t());
    if (chunks == 1) return {y};
    return y.chunk(chunks, 1);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& w = saved[1];
    const auto type = static_cast<at::ScalarType>(ctx->saved_data["type"].toInt());
    const auto weight_type = static_cast<at::ScalarType>(ctx->saved_data["weight_type"].toInt());
    const auto bias_type = static_cast<at::ScalarType>(ctx->saved_data["bias_type"].toInt());
    const bool with_bias = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
    auto [dy, db] = output_gradient(grads, type, with_bias, bias_type);
    at::Tensor dx, dw;
    // The weight's gradient first: a GELU's output recomputed for it is freed before the input's
    // gradient exists, so the two [rows, in] matrices are never alive together (for a wide MLP,
    // 0.5 GiB at the peak of the step).
    if (ctx->needs_input_grad(1)) {
      // The forward's x_c again: the same ATen operator on the same inputs gives the same values.
      const auto how = ctx->saved_data.find("recompute");
      const at::Tensor x =
          how == ctx->saved_data.end()
              ? saved[0]
              : recompute(Recomputable{saved[0], saved[2], how->second.toStringRef()}).to(type);
      dw = weight_gradient(dy, x, weight_type);
    }
    saved[0] = saved[2] = at::Tensor();
    if (ctx->needs_input_grad(0)) dx = at::mm(dy, w);
    return fused_op_gradients(
        {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()}, "Linear");
  }
};

void check_linear_arguments(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(weight.dim() == 2, "linear: the weight must be [out, in], got ", weight.sizes());
  const int64_t in = weight.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "linear: the input's last dimension must be ", in,
              " (the weight is ", weight.sizes(), "), got an input of ", x.sizes());
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), "linear: the bias must be [",
              weight.size(0), "], got ", bias.sizes());
}

std::string linear_unsupported(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (auto why = sk::ops::unusable(SK_OP_LINEAR, x.device()); !why.empty()) return why;
  if (auto why = sk::ops::first_of({sk::ops::floating("input", x), sk::ops::floating("weight", weight),
                                    bias.defined() ? sk::ops::floating("bias", bias) : std::string()});
      !why.empty())
    return why;
  if (auto why = sk::ops::first_of({sk::ops::on_device("weight", weight, x.device()),
                                    sk::ops::on_device("bias", bias, x.device())});
      !why.empty())
    return why;
  return sk::ops::fits_int32(x.numel() / std::max<int64_t>(weight.size(1), 1), weight.size(0));
}

// `t` in `type`, as autocast casts an operand (an undefined tensor stays undefined).
at::Tensor cast_operand(const at::Tensor& t, int64_t type) {
  return t.defined() && type != kAutocastType ? t.to(static_cast<at::ScalarType>(type)) : t;
}

// x Wᵀ + b over x's last dimension as `chunks` column blocks, each shaped as x with its last
// dimension out / chunks, the GEMMs in `type` (compute_type): through LinearFunction, else ATen's
// linear of the operands cast to that type, and a split.
variable_list linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t chunks,
                     int64_t type = kAutocastType) {
  const int64_t in = weight.size(1), out = weight.size(0);
  return sk::ops::run_or_fall_back(
      SK_OP_LINEAR, linear_unsupported(x, weight, bias),
      [&] {
        const std::optional<Recomputable> how = recomputable(x);
        const auto rows = [&](const at::Tensor& t) {
          return t.defined() ? t.reshape({-1, in}) : sk::placeholder_unless(false, x, x);
        };
        variable_list outputs = LinearFunction::apply(
            x.reshape({-1, in}), weight, sk::placeholder_unless(bias.defined(), bias, weight), bias.defined(), chunks,
            type, rows(how ? how->first : at::Tensor()), rows(how ? how->second : at::Tensor()),
            how ? std::optional<std::string>(how->approximate) : std::nullopt);
        for (at::Tensor& output : outputs) output = sk::shaped_like(output, x, out / chunks);
        return outputs;
      },
      [&] {
        at::Tensor y = at::linear(cast_operand(x, type), cast_operand(weight, type), cast_operand(bias, type));
        return chunks == 1 ? variable_list{y} : y.split(out / chunks, -1);
      });
}

}  // namespace
}  // namespace sk

extern "C" {

int sk_linear(sk_tensor x, sk_tensor weight, sk_tensor bias, sk_tensor* y) {
  SK_TRY({
    const at::Tensor b = sk::optional_tensor(bias);
    sk::check_linear_arguments(*x, *weight, b);
    *y = sk::give(sk::linear(*x, *weight, b, 1)[0]);
  })
}

int sk_linear_in(sk_tensor x, sk_tensor weight, sk_tensor bias, int gemm_type, sk_tensor* y) {
  SK_TRY({
    const at::Tensor b = sk::optional_tensor(bias);
    sk::check_linear_arguments(*x, *weight, b);
    *y = sk::give(sk::linear(*x, *weight, b, 1, gemm_type)[0]);
  })
}

int sk_linear_chunks(sk_tensor x, sk_tensor weight, sk_tensor bias, int64_t chunks, sk_tensor* y) {
  SK_TRY({
    const at::Tensor b = sk::optional_tensor(bias);
    sk::check_linear_arguments(*x, *weight, b);
    TORCH_CHECK(chunks >= 1 && weight->size(0) % chunks == 0, "linear: ", weight->size(0),
                " output features do not split into ", chunks, " equal chunks");
    sk::variable_list parts = sk::linear(*x, *weight, b, chunks);
    for (int64_t i = 0; i < chunks; ++i) y[i] = sk::give(parts[static_cast<size_t>(i)]);
  })
}

}  // extern "C"
