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
// Linears reading the same unchanged input (a model's q, k and v projections of one normalised
// input) cast it to the autocast type once and keep that one copy for their weight gradients, as
// torch.compile's graph does (InputCasts). A linear keeps its input in that type for its weight
// gradient even where the input is cheap to compute again (a GELU's output): the backward's GEMM
// reads it whole, so computing it again would cost a kernel writing as much as the forward did;
// torch.compile's partitioner keeps such inputs too.
//
// Differentiable once: a second derivative through the backward is an error (fused_op_gradients).
#include "bias_grad.cuh"
#include "column_sums.h"
#include "fused_op.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>

#include <algorithm>
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

// The input in `type`, cast once for every linear that reads the same unchanged tensor: a
// model's q, k and v projections (or a SwiGLU's gate and up) of one normalised input would each
// cast it and keep their own copy for their weight gradients, where torch.compile's graph casts
// it once. Only activations (results of autograd's graph) are remembered: a leaf (a parameter,
// the data) can be written without its version moving, by an optimizer's kernel. A cast is
// remembered while the tensor it was cast from lives unchanged (its memory, place, layout and
// version), and forgotten at the first cast after that, or when speedkit's backward ends
// (sk_linear_forget_input_casts): the memory is held as long as its source lives and until one of
// those, where each linear's own cast would have lived until its backward.
class InputCasts {
 public:
  void clear() { entries_.clear(); }

  at::Tensor get(const at::Tensor& x, at::ScalarType type) {
    if (x.scalar_type() == type || !activation(x)) return x.to(type);
    entries_.erase(std::remove_if(entries_.begin(), entries_.end(), [](const Entry& e) { return e.stale(); }),
                   entries_.end());
    for (const Entry& entry : entries_)
      if (entry.casts(x, type)) return entry.cast;
    at::Tensor cast = x.to(type);
    if (entries_.size() == kEntries) entries_.erase(entries_.begin());
    entries_.push_back(Entry{x.storage().getWeakStorageImpl(), x.storage_offset(), x.sizes().vec(),
                             x.strides().vec(), x._version(), cast, cast._version()});
    return cast;
  }

 private:
  static constexpr size_t kEntries = 4;

  static bool activation(const at::Tensor& x) {
    if (!x.has_storage() || x.is_inference()) return false;
    return !(x.is_view() ? x._base() : x).is_leaf();
  }

  struct Entry {
    c10::weak_intrusive_ptr<c10::StorageImpl> source;
    int64_t offset;
    std::vector<int64_t> sizes, strides;
    int64_t version;
    at::Tensor cast;
    int64_t cast_version;

    // Its source is gone (no later linear can read it), or the cast was written since.
    bool stale() const { return source.expired() || cast._version() != cast_version; }

    // Whether it is the cast of `x` in `type`.
    bool casts(const at::Tensor& x, at::ScalarType type) const {
      return source.lock().get() == x.storage().unsafeGetStorageImpl() && offset == x.storage_offset() &&
             x.sizes() == at::IntArrayRef(sizes) && x.strides() == at::IntArrayRef(strides) &&
             version == x._version() && cast.scalar_type() == type;
    }
  };

  std::vector<Entry> entries_;
};

// This thread's remembered casts: a model's forward runs on one thread.
InputCasts& input_casts() {
  static thread_local InputCasts casts;
  return casts;
}

at::Tensor input_operand(const at::Tensor& x, at::ScalarType type) { return input_casts().get(x, type); }

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  // x: [rows, in]; weight: [out, in]; bias_in: [out] when has_bias, else sk::placeholder_unless's
  // placeholder; `requested` the GEMMs' type (compute_type). Returns y [rows, out] as `chunks`
  // equal column blocks (views of one tensor).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias_in, bool has_bias, int64_t chunks, int64_t requested) {
    const at::Tensor bias = has_bias ? bias_in : at::Tensor();
    const at::ScalarType type = compute_type(x, requested);
    at::Tensor x_c = input_operand(x, type);
    at::Tensor w_c = weight_operand(weight, x.size(0), type);
    // Only what the backward will use: the first layer of a model (an input without gradient)
    // needs no weight for its backward, and a frozen weight no input.
    ctx->save_for_backward({weight.requires_grad() ? x_c : at::Tensor(), x.requires_grad() ? w_c : at::Tensor()});
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
    // The weight's gradient first: the saved input is released before the input's gradient exists.
    if (ctx->needs_input_grad(1)) dw = weight_gradient(dy, saved[0], weight_type);
    saved[0] = at::Tensor();
    if (ctx->needs_input_grad(0)) dx = at::mm(dy, w);
    return fused_op_gradients(
        {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor()}, "Linear");
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
        variable_list outputs =
            LinearFunction::apply(x.reshape({-1, in}), weight, sk::placeholder_unless(bias.defined(), bias, weight),
                                  bias.defined(), chunks, type);
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

int sk_linear_forget_input_casts(void) {
  SK_TRY({ sk::input_casts().clear(); })
}

}  // extern "C"
