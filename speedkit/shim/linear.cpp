// A Linear layer, y = x Wᵀ + b, as a C++ autograd function whose backward costs fewer passes over
// memory than ATen's composite under autocast:
//  - the weight gradient comes out of its GEMM in the weight's own type (bf16 × bf16 → fp32 on
//    cuBLAS, ATen's mm.dtype), where autocast's composite writes it in bf16 and then casts it to
//    the fp32 master weight's type in a separate kernel;
//  - the bias gradient is a column sum on speedkit's kernel (kernels/bias_grad.cuh), at HBM
//    bandwidth, where ATen's generic reduction runs at about a quarter of it, followed by a cast;
//  - an output used as equal column blocks (q, k and v of one projection) is returned as those
//    blocks, and their gradients are put side by side by the pass that sums the bias gradient,
//    where autograd would run a cat kernel for the split's backward and the sum would read its
//    result again.
// The forward runs the GEMMs ATen's linear runs (addmm with its bias epilogue), on the same operands
// autocast would give it: x, W and b in the autocast type where autocast is on for CUDA. W's and b's
// copies in that type come from weight_casts.cpp, which keeps them across steps (speedkit's AdamW
// writes them in its update pass) instead of casting each weight in every forward. The
// Rust side (nn/linear.rs) decides when this path applies and otherwise runs ATen's `linear`.
//
// Differentiable once: the backward is not itself recorded for a second derivative.
#include "shim.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#if SK_WITH_CUDA
#include "bias_grad.cuh"

#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/mm.h>

#include <utility>
#include <vector>
#endif

namespace {

#if SK_WITH_CUDA
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The type the GEMMs run in: autocast's where it is on for CUDA, else the input's.
at::ScalarType compute_type(const at::Tensor& x) {
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
    return {dy, with_bias ? sk::kernels::bias_grad::column_sums(dy, bias_type) : at::Tensor()};
  }
  std::vector<at::Tensor> parts;
  for (const at::Tensor& g : grads) parts.push_back(g.to(type).contiguous());
  if (with_bias && parts.size() <= static_cast<size_t>(sk::kernels::bias_grad::kMaxParts))
    return sk::kernels::bias_grad::concat_and_column_sums(parts, bias_type);
  at::Tensor dy = at::cat(parts, 1);
  return {dy, with_bias ? sk::kernels::bias_grad::column_sums(dy, bias_type) : at::Tensor()};
}

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  // x: [rows, in]; weight: [out, in]; bias_in: [out] when has_bias, else sk::placeholder_unless's
  // placeholder. Returns y
  // [rows, out] as `chunks` equal column blocks (views of one tensor).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias_in, bool has_bias, int64_t chunks) {
    const at::Tensor bias = has_bias ? bias_in : at::Tensor();
    const at::ScalarType type = compute_type(x);
    at::Tensor x_c = x.to(type);
    at::Tensor w_c = sk::weight_casts::get(weight, type);
    ctx->save_for_backward({x_c, w_c});
    ctx->saved_data["weight_type"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["bias_type"] = static_cast<int64_t>(bias.defined() ? bias.scalar_type() : type);
    ctx->saved_data["has_bias"] = bias.defined();
    at::Tensor y = bias.defined() ? at::addmm(sk::weight_casts::get(bias, type), x_c, w_c.t()) : at::mm(x_c, w_c.t());
    if (chunks == 1) return {y};
    return y.chunk(chunks, 1);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const auto weight_type = static_cast<at::ScalarType>(ctx->saved_data["weight_type"].toInt());
    const auto bias_type = static_cast<at::ScalarType>(ctx->saved_data["bias_type"].toInt());
    const bool with_bias = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
    auto [dy, db] = output_gradient(grads, x.scalar_type(), with_bias, bias_type);
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = at::mm(dy, w);
    if (ctx->needs_input_grad(1)) dw = weight_gradient(dy, x, weight_type);
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};

void check_linear_arguments(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias) {
  TORCH_CHECK(weight.dim() == 2, "linear: the weight must be [out, in], got ", weight.sizes());
  const int64_t in = weight.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "linear: the input's last dimension must be ", in,
              " (the weight is ", weight.sizes(), "), got an input of ", x.sizes());
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == weight.size(0)), "linear: the bias must be [",
              weight.size(0), "], got ", bias->sizes());
}

// x Wᵀ + b over x's last dimension through LinearFunction, each of the `chunks` outputs shaped as x
// with its last dimension out / chunks.
variable_list apply_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias, int64_t chunks) {
  const int64_t in = weight.size(1);
  at::Tensor rows2d = x.reshape({-1, in});
  variable_list outputs = LinearFunction::apply(
      rows2d, weight, sk::placeholder_unless(bias != nullptr, bias ? *bias : at::Tensor(), weight), bias != nullptr,
      chunks);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = weight.size(0) / chunks;
  for (at::Tensor& output : outputs) output = output.view(shape);
  return outputs;
}
#endif

}  // namespace

extern "C" {

// *y = x Wᵀ + b over x's last dimension, in the autocast type where autocast is on for CUDA (else
// in x's type). x: CUDA, fp32/bf16/fp16, [..., in]; weight: [out, in]; bias: [out] or null.
// Differentiable through LinearFunction.
int sk_linear(at::Tensor* x, at::Tensor* weight, at::Tensor* bias, at::Tensor** y) {
#if SK_WITH_CUDA
  SK_TRY({
    check_linear_arguments(*x, *weight, bias);
    *y = new at::Tensor(apply_linear(*x, *weight, bias, 1)[0]);
  })
#else
  (void)x; (void)weight; (void)bias; (void)y;
  SK_NO_CUDA();
#endif
}

// As sk_linear, returning the output as `chunks` equal blocks of its last dimension (views into one
// tensor, as `chunk` gives), y[0], ..., y[chunks - 1]; out features must be a multiple of `chunks`.
int sk_linear_chunks(at::Tensor* x, at::Tensor* weight, at::Tensor* bias, int64_t chunks, at::Tensor** y) {
#if SK_WITH_CUDA
  SK_TRY({
    check_linear_arguments(*x, *weight, bias);
    TORCH_CHECK(chunks >= 1 && weight->size(0) % chunks == 0, "linear: ", weight->size(0),
                " output features do not split into ", chunks, " equal chunks");
    variable_list parts = apply_linear(*x, *weight, bias, chunks);
    for (int64_t i = 0; i < chunks; ++i) y[i] = new at::Tensor(parts[i]);
  })
#else
  (void)x; (void)weight; (void)bias; (void)chunks; (void)y;
  SK_NO_CUDA();
#endif
}

}  // extern "C"
