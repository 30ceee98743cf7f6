// Convolution under autocast as a C++ autograd function that keeps no copy of the weight for its
// backward. Autocast's conv2d casts the fp32 weight to bf16/fp16 and ATen's convolution node saves
// that copy until the layer's backward, so every layer's copy is alive at the end of the forward,
// the step's memory peak in a convolutional network (a CIFAR ResNet-18 holds about 21 MiB of them there). This
// function saves the fp32 weight, which the model holds anyway, and casts it again in the backward,
// what torch.compile's partitioner does for the same graph. The cast costs one pass over the weight
// per layer and step, the fraction of a convolution's time that its weight is of its operands.
//
// The convolutions run through two operators of speedkit's own, `speedkit::convolution` and
// `speedkit::convolution_backward`, on the operands autocast gives ATen's. On CUDA, for the 2-D
// convolutions in bf16 or fp16 that ATen would give cuDNN, with cudnn.benchmark on, they run cuDNN
// plans speedkit chose and keeps on disk (conv_plans.h), so a second run times nothing; elsewhere,
// and for what those plans do not take, ATen's at::convolution and at::convolution_backward. A
// depthwise convolution's forward and input gradient run speedkit's own kernels instead where
// those were timed faster (depthwise_conv.h).
// Operators rather than direct calls so that the dispatcher sees them: the execution trace records
// what they read and write, as it does ATen's.
#include "conv_plans.h"
#include "depthwise_conv.h"
#include "fused_op.h"

#include <ATen/ops/convolution.h>
#include <ATen/native/ConvUtils.h>
#include <ATen/ops/convolution_backward.h>
#include <torch/library.h>

#include <array>
#include <string>
#include <tuple>
#include <vector>

namespace sk {
namespace {

// ----- the operators -------------------------------------------------------------------------------

at::Tensor convolution_aten(const at::Tensor& x, const at::Tensor& w, at::IntArrayRef stride, at::IntArrayRef padding,
                            at::IntArrayRef dilation, int64_t groups) {
  const std::vector<int64_t> output_padding(stride.size(), 0);
  return at::convolution(x, w, at::Tensor(), stride, padding, dilation, false, output_padding, groups);
}

at::Tensor convolution_cuda(const at::Tensor& x, const at::Tensor& w, at::IntArrayRef stride, at::IntArrayRef padding,
                            at::IntArrayRef dilation, int64_t groups) {
  const conv_plans::Geometry geometry{stride, padding, dilation};
  const auto cudnn = [&] {
    if (conv_plans::unsupported(x, w, geometry, groups).empty())
      if (auto y = conv_plans::forward(x, w, geometry)) return *std::move(y);
    return convolution_aten(x, w, stride, padding, dilation, groups);
  };
  if (depthwise_conv::unsupported(x, w, geometry, groups).empty())
    return depthwise_conv::forward(x, w, geometry, cudnn);
  return cudnn();
}

std::tuple<at::Tensor, at::Tensor> convolution_backward_aten(const at::Tensor& dy, const at::Tensor& x,
                                                             const at::Tensor& w, at::IntArrayRef stride,
                                                             at::IntArrayRef padding, at::IntArrayRef dilation,
                                                             int64_t groups, std::array<bool, 2> mask) {
  const std::vector<int64_t> output_padding(stride.size(), 0);
  auto [dx, dw, unused] = at::convolution_backward(dy, x, w, std::nullopt, stride, padding, dilation, false,
                                                   output_padding, groups, {mask[0], mask[1], false});
  return {dx, dw};
}

std::tuple<at::Tensor, at::Tensor> convolution_backward_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                             const at::Tensor& w, at::IntArrayRef stride,
                                                             at::IntArrayRef padding, at::IntArrayRef dilation,
                                                             int64_t groups, std::array<bool, 2> mask) {
  at::Tensor dx, dw;
  const conv_plans::Geometry geometry{stride, padding, dilation};
  const bool plans = conv_plans::unsupported(x, w, geometry, groups).empty();
  const auto format = at::native::cudnn_conv_suggest_memory_format(x, w);
  if (mask[0] && depthwise_conv::unsupported(x, w, geometry, groups).empty()) {
    // What runs when speedkit's depthwise kernel does not: the plans', else ATen's.
    const auto other = [&] {
      std::optional<at::Tensor> planned;
      if (plans) planned = conv_plans::backward_data(dy, w, x.sizes(), geometry, format);
      if (planned) return *std::move(planned);
      return std::get<0>(convolution_backward_aten(dy, x, w, stride, padding, dilation, groups, {true, false}));
    };
    dx = depthwise_conv::input_gradient(dy, w, geometry, other);
  }
  if (plans) {
    if (mask[0] && !dx.defined())
      dx = conv_plans::backward_data(dy, w, x.sizes(), geometry, format).value_or(at::Tensor());
    if (mask[1]) dw = conv_plans::backward_filter(dy, x, w, geometry, format).value_or(at::Tensor());
  }
  const std::array<bool, 2> left = {mask[0] && !dx.defined(), mask[1] && !dw.defined()};
  if (left[0] || left[1]) {
    auto [aten_dx, aten_dw] = convolution_backward_aten(dy, x, w, stride, padding, dilation, groups, left);
    if (left[0]) dx = aten_dx;
    if (left[1]) dw = aten_dw;
  }
  return {dx, dw};
}

at::Tensor convolution(const at::Tensor& x, const at::Tensor& w, at::IntArrayRef stride, at::IntArrayRef padding,
                       at::IntArrayRef dilation, int64_t groups) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("speedkit::convolution", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                                               at::IntArrayRef, at::IntArrayRef, int64_t)>();
  return op.call(x, w, stride, padding, dilation, groups);
}

std::tuple<at::Tensor, at::Tensor> convolution_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                        at::IntArrayRef stride, at::IntArrayRef padding,
                                                        at::IntArrayRef dilation, int64_t groups,
                                                        std::array<bool, 2> mask) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("speedkit::convolution_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t,
                                                    std::array<bool, 2>)>();
  return op.call(dy, x, w, stride, padding, dilation, groups, mask);
}

// ----- the autograd function ------------------------------------------------------------------------

struct ConvolutionFunction : torch::autograd::Function<ConvolutionFunction> {
  // x [N, C, ...]; weight [out, C / groups, ...]; bias_in [out] when has_bias, else a placeholder;
  // the convolution's stride, padding and dilation per spatial dimension and its groups; `type`
  // the type it runs in. Returns y in `type`.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias_in, bool has_bias, std::vector<int64_t> stride,
                            std::vector<int64_t> padding, std::vector<int64_t> dilation, int64_t groups,
                            int64_t type) {
    const auto t = static_cast<at::ScalarType>(type);
    const at::Tensor x_c = x.to(t);
    at::Tensor y = sk::convolution(x_c, weight.to(t), stride, padding, dilation, groups);
    if (has_bias) {
      // The bias added by an operator of its own, in place, as ATen's cuDNN path adds it after the
      // convolution (the same kernel, the same values): seen on its own, a fused step's generated
      // kernel after the convolution takes it with its own work, as torch.compile does.
      std::vector<int64_t> channel(y.dim(), 1);
      channel[1] = -1;
      y.add_(bias_in.to(t).reshape(channel));
    }
    // What ATen's convolution node saves (cuDNN's backward reads both operands' layouts even for
    // one gradient), but the fp32 weight, which the model holds anyway, in place of its copy.
    ctx->save_for_backward({x_c, weight});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["type"] = type;
    ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["weight_type"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["bias_type"] = static_cast<int64_t>(has_bias ? bias_in.scalar_type() : t);
    ctx->saved_data["has_bias"] = has_bias;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& data = ctx->saved_data;
    const auto t = static_cast<at::ScalarType>(data.at("type").toInt());
    const std::array<bool, 3> mask = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                      data.at("has_bias").toBool() && ctx->needs_input_grad(2)};
    const std::vector<int64_t> stride = data.at("stride").toIntVector();
    const at::Tensor& x_c = saved[0];
    // Dense once, in the layout cuDNN takes (the weight's cast below keeps its layout): a slice of
    // a concatenation's gradient would otherwise be copied by each of cuDNN's two backward passes.
    const at::Tensor grad =
        grads[0].is_cuda() ? grads[0].to(t).contiguous(at::native::cudnn_conv_suggest_memory_format(x_c, saved[1]))
                           : grads[0].to(t);
    // The bias's gradient summed as ATen's convolution_backward sums it, but by an operator of its
    // own, first: the fused kernel that makes the gradient may sum it as it writes it.
    at::Tensor db;
    if (mask[2]) {
      std::vector<int64_t> dims;
      for (int64_t d = 0; d < grad.dim(); ++d) {
        if (d != 1) dims.push_back(d);
      }
      db = grad.sum(dims);
    }
    const at::Tensor w_c = saved[1].to(t);
    auto [dx, dw] = sk::convolution_backward(grad, x_c, w_c, stride, data.at("padding").toIntVector(),
                                             data.at("dilation").toIntVector(), data.at("groups").toInt(),
                                             {mask[0], mask[1]});
    const auto back_to = [&](const at::Tensor& g, const char* key) {
      return g.defined() ? g.to(static_cast<at::ScalarType>(data.at(key).toInt())) : g;
    };
    return {back_to(dx, "x_type"), back_to(dw, "weight_type"), back_to(db, "bias_type"), at::Tensor(), at::Tensor(),
            at::Tensor(),          at::Tensor(),               at::Tensor(),             at::Tensor()};
  }
};

std::string convolution_unsupported(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (auto why = ops::unusable(SK_OP_CONVOLUTION, x.device()); !why.empty()) return why;
  return ops::first_of({ops::floating("input", x), ops::floating("weight", weight),
                        bias.defined() ? ops::floating("bias", bias) : std::string(),
                        ops::on_device("weight", weight, x.device()), ops::on_device("bias", bias, x.device())});
}

std::vector<int64_t> ints(const int64_t* values, int64_t n) { return std::vector<int64_t>(values, values + n); }

}  // namespace
}  // namespace sk

TORCH_LIBRARY_FRAGMENT(speedkit, m) {
  m.def("convolution(Tensor input, Tensor weight, int[] stride, int[] padding, int[] dilation, int groups) -> Tensor");
  m.def(
      "convolution_backward(Tensor grad_output, Tensor input, Tensor weight, int[] stride, int[] padding, "
      "int[] dilation, int groups, bool[2] output_mask) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(speedkit, CUDA, m) {
  m.impl("convolution", &sk::convolution_cuda);
  m.impl("convolution_backward", &sk::convolution_backward_cuda);
}

TORCH_LIBRARY_IMPL(speedkit, CompositeExplicitAutograd, m) {
  m.impl("convolution", &sk::convolution_aten);
  m.impl("convolution_backward", &sk::convolution_backward_aten);
}

extern "C" {

int sk_convolution(sk_tensor x, sk_tensor weight, sk_tensor bias, const int64_t* stride, const int64_t* padding,
                   const int64_t* dilation, int64_t spatial_dims, int64_t groups, int scalar_type, sk_tensor* y) {
  SK_TRY({
    const at::Tensor b = sk::optional_tensor(bias);
    const int64_t dims = weight->dim() - 2;
    TORCH_CHECK(dims >= 1 && dims == spatial_dims && x->dim() == weight->dim(), "convolution: a weight of ",
                weight->sizes(), " and an input of ", x->sizes(), " with ", spatial_dims,
                " spatial dimensions do not match");
    const auto st = sk::ints(stride, dims), pa = sk::ints(padding, dims), di = sk::ints(dilation, dims);
    const auto t = static_cast<at::ScalarType>(scalar_type);
    *y = sk::give(sk::ops::run_or_fall_back(
        SK_OP_CONVOLUTION, sk::convolution_unsupported(*x, *weight, b),
        [&] {
          return sk::ConvolutionFunction::apply(*x, *weight, sk::placeholder_unless(b.defined(), b, *weight),
                                                b.defined(), st, pa, di, groups, static_cast<int64_t>(scalar_type));
        },
        [&] {
          const std::vector<int64_t> output_padding(st.size(), 0);
          return at::convolution(x->to(t), weight->to(t), b.defined() ? b.to(t) : b, st, pa, di, false,
                                 output_padding, groups);
        }));
  })
}

}  // extern "C"
