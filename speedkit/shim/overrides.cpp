// Operator overrides: speedkit's kernels registered as the CUDA implementations of ATen operators,
// through the dispatcher (what `torch.library.Library("aten", "IMPL")` does), so that models written
// with tch's own modules run them with no change. Each group of operators is one torch::Library:
// made when the group is switched on, destroyed when it is switched off, which removes its kernels
// and brings back the ones they replaced. speedkit::flags holds the switch like any flag (restored
// when the context drops, also on a panic).
//
// Each kernel takes the inputs its kernels take and hands the rest to ATen's own CUDA kernel
// (at::cuda::<op>, which bypasses the dispatcher, so never this override again), through the one
// run-or-fall-back path, whose notes the audit counts.
#include "fused_op.h"
#include "layernorm.cuh"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "quiet_warnings.h"
#if SK_WITH_CUDA
#include <ATen/ops/native_layer_norm_backward_cuda_dispatch.h>
#include <ATen/ops/native_layer_norm_cuda_dispatch.h>
#endif

#include <array>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>

namespace sk {
namespace {

#if SK_WITH_CUDA
namespace ln = kernels::layernorm;

using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

const at::Tensor& or_undefined(const std::optional<at::Tensor>& t) {
  static const at::Tensor undefined;
  return t.has_value() ? *t : undefined;
}

// ---- LayerNorm: aten::native_layer_norm and aten::native_layer_norm_backward ----

// Why speedkit's LayerNorm kernels cannot take this call, or empty. The statistics they write
// (fp32 mean and rstd per row) are ATen's for fp32, bf16 and fp16 inputs, so a forward on one side
// and a backward on the other agree.
std::string layer_norm_unsupported(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                                   const at::Tensor& weight, const at::Tensor& bias) {
  const c10::Device device = input.device();
  if (auto why = ops::unusable(SK_OP_LAYER_NORM, device); !why.empty()) return why;
  if (normalized_shape.size() != 1)
    return "normalised over " + std::to_string(normalized_shape.size()) + " dimensions (the kernels take the last)";
  if (auto why = ops::floating("input", input); !why.empty()) return why;
  if (input.dim() == 0 || !input.is_contiguous()) return "an input that is not contiguous";
  const int64_t width = input.size(-1);
  for (const at::Tensor* p : {&weight, &bias}) {
    if (!p->defined()) continue;
    if (auto why = ops::first_of({ops::floating("parameter", *p), ops::on_device("parameter", *p, device)});
        !why.empty())
      return why;
    if (p->dim() != 1 || p->size(0) != width || !p->is_contiguous())
      return "parameters of shape " + c10::str(p->sizes()) + " for width " + std::to_string(width);
  }
  if (weight.defined() && bias.defined() && weight.scalar_type() != bias.scalar_type())
    return "weight and bias differ in type";
  if (auto why = ops::fits_int32(input.numel() / std::max<int64_t>(width, 1), width); !why.empty()) return why;
  // Past the rows the kernels keep in registers ATen's kernels are faster (on an H100, 16384 rows of
  // 4096 fp32: forward 0.50 against 0.27 ms, backward 0.98 against 0.18 for ATen's parameter
  // gradients alone), so the override would cost time there.
  if (width > ln::kRegisterWidth)
    return "width " + std::to_string(width) + " (ATen's kernels are faster past " +
           std::to_string(ln::kRegisterWidth) + " columns)";
  if (ln::backward_warps(width, device) == 0)
    return "width " + std::to_string(width) + " exceeds the shared memory of the backward kernel";
  return {};
}

// ATen's shape of the statistics: the input's leading dimensions, then a 1 for the normalised one.
std::vector<int64_t> stats_shape(const at::Tensor& input) {
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = 1;
  return shape;
}

Tensors3 layer_norm_forward(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                            const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                            double eps) {
  const at::Tensor &w = or_undefined(weight), &b = or_undefined(bias);
  return ops::run_or_fall_back(
      SK_OP_LAYER_NORM, layer_norm_unsupported(input, normalized_shape, w, b),
      [&]() -> Tensors3 {
        const int64_t width = input.size(-1);
        ln::Normalised out = ln::forward(input.view({-1, width}), at::Tensor(), w, b, eps, input.scalar_type());
        const auto shape = stats_shape(input);
        return {out.y.view(input.sizes()), out.mean.view(shape), out.rstd.view(shape)};
      },
      [&] { return at::cuda::native_layer_norm_symint(input, normalized_shape, weight, bias, eps); });
}

Tensors3 layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                             const at::Tensor& mean, const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
                             const std::optional<at::Tensor>& bias, std::array<bool, 3> output_mask) {
  const at::Tensor &w = or_undefined(weight), &b = or_undefined(bias);
  std::string why = layer_norm_unsupported(input, normalized_shape, w, b);
  if (why.empty() && (mean.scalar_type() != at::kFloat || rstd.scalar_type() != at::kFloat))
    why = "statistics in " + std::string(c10::toString(mean.scalar_type())) + ", not fp32";
  // Without the input's gradient ATen runs its parameter-gradient kernel alone, which reads less
  // than the one pass here that also writes dx.
  if (why.empty() && !output_mask[0]) why = "no input gradient asked for";
  return ops::run_or_fall_back(
      SK_OP_LAYER_NORM, why,
      [&]() -> Tensors3 {
        const int64_t width = input.size(-1);
        const int64_t rows = input.numel() / width;
        ln::Gradients out = ln::backward(grad_out.reshape({rows, width}).contiguous(), input.view({rows, width}), w,
                                         b.defined(), mean.reshape({rows}), rstd.reshape({rows}), at::Tensor());
        return {output_mask[0] ? out.dx.view(input.sizes()) : at::Tensor(),
                output_mask[1] ? out.dweight : at::Tensor(), output_mask[2] ? out.dbias : at::Tensor()};
      },
      [&] {
        return at::cuda::native_layer_norm_backward_symint(grad_out, input, normalized_shape, mean, rstd, weight, bias,
                                                           output_mask);
      });
}

void register_layer_norm(torch::Library& library) {
  library.impl("native_layer_norm", TORCH_FN(layer_norm_forward));
  library.impl("native_layer_norm_backward", TORCH_FN(layer_norm_backward));
}
#else
void register_layer_norm(torch::Library&) {
  throw std::runtime_error("speedkit was built against a libtorch without CUDA support, so it has no CUDA kernels "
                           "to register");
}
#endif

// ---- The registrations ----

using Register = void (*)(torch::Library&);
constexpr std::array<Register, SK_OVERRIDE_COUNT> kRegister = {register_layer_norm};

std::mutex registrations_mutex;
std::array<std::unique_ptr<torch::Library>, SK_OVERRIDE_COUNT> registrations;

void check_which(int which) {
  TORCH_CHECK(which >= 0 && which < SK_OVERRIDE_COUNT, "no operator override ", which);
}

bool is_registered(int which) {
  check_which(which);
  std::lock_guard<std::mutex> lock(registrations_mutex);
  return registrations[which] != nullptr;
}

void set_registered(int which, bool on) {
  check_which(which);
  // A write like any flag's, so the fault tests (sk_test_fail_nth_flag_write) reach it too.
  count_flag_write();
  std::lock_guard<std::mutex> lock(registrations_mutex);
  if (on == (registrations[which] != nullptr)) return;
  if (!on) {
    registrations[which].reset();
    return;
  }
  const QuietWarnings quiet;  // for this registration alone
  // Built whole before it is kept: a registration that fails part-way is destroyed, which removes
  // whatever part of it was registered.
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::CUDA, __FILE__,
                                                  static_cast<uint32_t>(__LINE__));
  kRegister[which](*library);
  registrations[which] = std::move(library);
}

}  // namespace
}  // namespace sk

extern "C" {

int sk_override_get(int which, int* on) { SK_TRY(*on = sk::is_registered(which) ? 1 : 0) }

int sk_override_set(int which, int on) { SK_TRY(sk::set_registered(which, on != 0)) }

int sk_dispatcher_table(const char* name, const char* overload, const char** out) {
  SK_TRY(sk::hand_out(c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).dumpComputedTable(), out))
}

}  // extern "C"
