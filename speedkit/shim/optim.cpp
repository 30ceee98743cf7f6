// AdamW (fused and multi-tensor, both capturable) and the parameter-list helpers of the optimizer and
// the context: gradients dropped or re-pointed, channels-last weights (and the census that decides
// whether they stay), foreach norms and scaling.
// tch's generated API has no in-place TensorList ops, hence these.
#include "adamw.cuh"
#include "kernels.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <tuple>

namespace {

// The parameters speedkit's AdamW kernel can update (contiguous fp32 on CUDA, where the kernel
// switch allows it), updated by it, their kept autocast copies (weight_casts.cpp) written in the same
// pass; the others' indices are returned for ATen's fused AdamW.
std::vector<size_t> adamw_with_copies(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g,
                                      const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& v,
                                      const std::vector<at::Tensor>& s, const at::Tensor& lr, double beta1,
                                      double beta2, double weight_decay, double eps, const at::Tensor& grad_scale,
                                      const at::Tensor& found_inf) {
  std::vector<size_t> rest;
  if (p.empty() || !sk::ops::unusable(SK_OP_ADAMW, lr.device()).empty()) {
    for (size_t i = 0; i < p.size(); ++i) rest.push_back(i);
    return rest;
  }
  namespace kernel = sk::kernels::adamw;
  // Copies of one type per launch; parameters without a copy join the first group.
  std::vector<kernel::Entry> bf16, f16, plain;
  for (size_t i = 0; i < p.size(); ++i) {
    kernel::Entry e{p[i], g[i], m[i], v[i], s[i], sk::weight_casts::copy_of(p[i])};
    if (!kernel::unsupported(e).empty() || lr.device() != p[i].device()) {
      rest.push_back(i);
      continue;
    }
    if (!e.copy.defined()) plain.push_back(e);
    else (e.copy.scalar_type() == at::kBFloat16 ? bf16 : f16).push_back(e);
  }
  std::vector<kernel::Entry>& with_plain = bf16.empty() && !f16.empty() ? f16 : bf16;
  with_plain.insert(with_plain.end(), plain.begin(), plain.end());
  for (const auto& [group, copy_type] : {std::pair{&bf16, at::kBFloat16}, std::pair{&f16, at::kHalf}}) {
    kernel::step(*group, copy_type, lr, beta1, beta2, weight_decay, eps, grad_scale, found_inf);
    for (const kernel::Entry& e : *group) {
      // Written through raw pointers: bump the version counters as an in-place ATen op would.
      for (const at::Tensor* t : {&e.param, &e.exp_avg, &e.exp_avg_sq, &e.grad, &e.copy})
        if (t->defined()) t->unsafeGetTensorImpl()->bump_version();
      if (e.copy.defined()) sk::weight_casts::mark_current(e.param);
    }
  }
  if (rest.size() < p.size()) sk::ops::note_ran(SK_OP_ADAMW);
  return rest;
}

// An sk_adamw_lists as tensors.
struct Lists {
  std::vector<at::Tensor> p, g, m, v, s;
  explicit Lists(const sk_adamw_lists& l)
      : p(sk::tensor_list(l.params, l.n)),
        g(sk::tensor_list(l.grads, l.n)),
        m(sk::tensor_list(l.exp_avgs, l.n)),
        v(sk::tensor_list(l.exp_avg_sqs, l.n)),
        s(sk::tensor_list(l.steps, l.n)) {}
};

std::vector<at::Tensor> pick(const std::vector<at::Tensor>& list, const std::vector<size_t>& indices) {
  std::vector<at::Tensor> out;
  out.reserve(indices.size());
  for (size_t i : indices) out.push_back(list[i]);
  return out;
}

}  // namespace

namespace sk {

// The channels-last census (sk_channels_last_census_start): GroupNorm calls on channels-last input.
// A call of group_norm that reaches native_group_norm is counted once: by then the input is NCHW.
std::mutex census_mutex;
std::optional<at::CallbackHandle> census;
std::atomic<int64_t> census_calls{0};

// aten::group_norm makes the NCHW copy (input.contiguous()) before aten::native_group_norm; a
// direct call of the latter with channels-last input has it made inside.
std::unique_ptr<at::ObserverContext> count_group_norm(const at::RecordFunction& fn) {
  if (std::strcmp(fn.name(), "aten::group_norm") != 0 && std::strcmp(fn.name(), "aten::native_group_norm") != 0)
    return nullptr;
  const auto inputs = fn.inputs();
  if (!inputs.empty() && inputs[0].isTensor()) {
    const at::Tensor& input = inputs[0].toTensor();
    if (input.dim() == 4 && !input.is_contiguous() && input.is_contiguous(at::MemoryFormat::ChannelsLast))
      census_calls.fetch_add(1);
  }
  return nullptr;
}

}  // namespace sk

extern "C" {

// torch._fused_adamw_ with a tensor learning rate (capturable: lr and steps live on the device);
// speedkit's AdamW kernel takes every parameter it can where the kernel switch allows it.
int sk_fused_adamw_(const sk_adamw_lists* lists, const sk_adamw_hyper* hyper, sk_tensor grad_scale,
                    sk_tensor found_inf) {
  SK_TRY({
    auto [p, g, m, v, s] = Lists(*lists);
    const at::Tensor& lr = *hyper->lr;
    const auto [beta1, beta2, weight_decay, eps] = std::tuple(hyper->beta1, hyper->beta2, hyper->weight_decay, hyper->eps);
    // PyTorch's optimizer increments the steps before the kernel and takes the increment back for
    // a step that the scaler skipped (found_inf), so counts stay equal to the applied updates.
    at::_foreach_add_(s, 1);
    // Parameters with a kept autocast copy take speedkit's kernel, which writes the copy in the same
    // pass; the rest ATen's, after which their copies (if any) are re-cast.
    const std::vector<size_t> rest =
        adamw_with_copies(p, g, m, v, s, lr, beta1, beta2, weight_decay, eps, sk::optional_tensor(grad_scale),
                          sk::optional_tensor(found_inf));
    if (!rest.empty()) {
      const auto rest_p = pick(p, rest);
      at::_fused_adamw_(rest_p, pick(g, rest), pick(m, rest), pick(v, rest), {}, pick(s, rest), lr, beta1, beta2,
                        weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false,
                        sk::present(sk::optional_tensor(grad_scale)), sk::present(sk::optional_tensor(found_inf)));
      sk::weight_casts::refresh(rest_p);
    }
    if (found_inf != nullptr) at::_foreach_sub_(s, std::vector<at::Tensor>(s.size(), *found_inf));
  })
}

// The multi-tensor (foreach) AdamW of torch.optim.AdamW with capturable=True: the same update as the
// fused kernel, in a few multi-tensor launches, with the step count and lr as device tensors.
int sk_foreach_adamw_(const sk_adamw_lists* lists, const sk_adamw_hyper* hyper) {
  SK_TRY({
    if (lists->n == 0) return 0;
    auto [p, g, m, v, s] = Lists(*lists);
    const at::Tensor& lr = *hyper->lr;
    const auto [beta1, beta2, weight_decay, eps] = std::tuple(hyper->beta1, hyper->beta2, hyper->weight_decay, hyper->eps);
    at::_foreach_add_(s, 1);
    if (weight_decay != 0.0) at::_foreach_mul_(p, 1.0 - lr * weight_decay);
    at::_foreach_lerp_(m, g, 1.0 - beta1);
    at::_foreach_mul_(v, beta2);
    at::_foreach_addcmul_(v, g, g, 1.0 - beta2);
    // step_size = -lr / (1 - beta1^t); denominator = sqrt(v) / sqrt(1 - beta2^t) + eps
    auto bias1 = at::_foreach_pow(beta1, s);
    auto bias2 = at::_foreach_pow(beta2, s);
    at::_foreach_sub_(bias1, 1);
    at::_foreach_sub_(bias2, 1);
    at::_foreach_neg_(bias2);
    at::_foreach_div_(bias1, lr);
    at::_foreach_reciprocal_(bias1);
    at::_foreach_sqrt_(bias2);
    auto denom = at::_foreach_sqrt(v);
    at::_foreach_div_(denom, bias2);
    at::_foreach_add_(denom, eps);
    at::_foreach_div_(denom, bias1);
    at::_foreach_addcdiv_(p, m, denom);
    sk::weight_casts::refresh(p);
  })
}

// Re-lays a 4-d (conv) weight out in channels-last memory order, keeping it the same parameter
// (set_data keeps autograd identity and the optimizer's reference).
int sk_to_channels_last_(sk_tensor tensor) {
  SK_TRY({
    if (tensor->dim() == 4) {
      at::NoGradGuard no_grad;
      tensor->set_data(tensor->contiguous(at::MemoryFormat::ChannelsLast));
    }
  })
}

int sk_is_channels_last(sk_tensor tensor, int* out) {
  SK_TRY(*out = tensor->dim() == 4 && tensor->is_contiguous(at::MemoryFormat::ChannelsLast) ? 1 : 0)
}

int sk_to_contiguous_(sk_tensor tensor) {
  SK_TRY({
    at::NoGradGuard no_grad;
    tensor->set_data(tensor->contiguous());
  })
}

// The channels-last census: a RecordFunction callback while it counts. Its state is static, so a
// call in flight on another thread when it stops finds valid memory.
int sk_channels_last_census_start(void) {
  SK_TRY({
    std::lock_guard<std::mutex> lock(sk::census_mutex);
    TORCH_CHECK(at::isRecordFunctionEnabled(), "the channels-last census needs RecordFunction, switched off here");
    if (!sk::census) {
      sk::census_calls = 0;
      sk::census = at::addGlobalCallback(
          at::RecordFunctionCallback(&sk::count_group_norm).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
    }
  })
}

int sk_channels_last_census_stop(int64_t* calls) {
  SK_TRY({
    std::lock_guard<std::mutex> lock(sk::census_mutex);
    if (sk::census) {
      at::removeCallback(*sk::census);
      sk::census.reset();
    }
    *calls = sk::census_calls.exchange(0);
  })
}

// Drops the gradients of a parameter list (`param.grad = None`), as PyTorch's
// `zero_grad(set_to_none=True)`: the next backward writes fresh gradients instead of adding to
// zero-filled ones, which saves a fill and an add over every parameter.
int sk_clear_grads(const sk_tensor* tensors, int64_t n) {
  SK_TRY({
    for (int64_t i = 0; i < n; ++i) {
      tensors[i]->mutable_grad().reset();
    }
  })
}

// Points `params[i].grad` at `grads[i]`: a replayed CUDA graph writes the gradients into the
// tensors it allocated during capture, so the parameters must refer to those again before it runs.
int sk_set_grads(const sk_tensor* params, const sk_tensor* grads, int64_t n) {
  SK_TRY({
    for (int64_t i = 0; i < n; ++i) {
      params[i]->mutable_grad() = *grads[i];
    }
  })
}

// Plain multi-tensor helpers the Rust side uses on parameter lists.
int sk_foreach_zero_(const sk_tensor* tensors, int64_t n) {
  SK_TRY({
    auto list = sk::tensor_list(tensors, n);
    at::_foreach_zero_(list);
  })
}

int sk_foreach_norm(const sk_tensor* tensors, int64_t n, double ord, sk_tensor* out) {
  SK_TRY({
    auto list = sk::tensor_list(tensors, n);
    auto norms = at::_foreach_norm(list, ord);
    *out = sk::give(at::linalg_vector_norm(at::stack(norms), ord));
  })
}

int sk_foreach_mul_scalar_tensor_(const sk_tensor* tensors, int64_t n, sk_tensor factor) {
  SK_TRY({
    auto list = sk::tensor_list(tensors, n);
    at::_foreach_mul_(list, *factor);
  })
}

}  // extern "C"
