// AdamW over fp32 parameters that also writes each parameter's copy in the autocast type (bf16 or
// fp16), the copy speedkit's Linear multiplies with (shim/weight_casts.cpp). Parameters without a
// copy (embeddings, norms, biases) take the same launch, so that one kernel updates the whole model.
//
// The update is torch.optim.AdamW's (ATen's _fused_adamw_, capturable): with the step count t and
// the learning rate read from device memory, and, under a GradScaler, the gradient divided by the
// scale (written back unscaled, as ATen does) and the whole step skipped when found_inf is set,
//   p ← p − lr·wd·p;  m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²;
//   p ← p − lr / (1 − β1^t) · m / (√v / √(1 − β2^t) + ε);  copy ← p in the copy's type.
// ATen's kernel followed by a separate multi-tensor cast reads p again and writes the copy: 6 more
// bytes per parameter against the 2 of the copy's store here, about 0.34 ms a step of `linear3`'s
// 201 M parameters on an H200.
//
// Multi-tensor: one launch takes up to ADAMW_TENSORS tensors, their pointers passed by value in an
// TensorList (as ATen's multi_tensor_apply does, so nothing is read from host memory and the launch
// can be captured in a CUDA graph); each block takes ADAMW_CHUNK elements of one tensor.
#pragma once

#include "common.cuh"

namespace sk::kernels::adamw {

// Tensors per launch: what keeps the params struct under the 4 KiB kernel-parameter limit.
constexpr int kTensors = 48;

// One launch's tensors, their pointers by value.
struct TensorList {
  unsigned long long param[kTensors], grad[kTensors], exp_avg[kTensors], exp_avg_sq[kTensors], copy[kTensors],
      step[kTensors];
  long long numel[kTensors];
  int first_block[kTensors + 1];
  int tensors;
};

// One AdamW step over `list`; lr, grad_scale and found_inf are fp32 scalars on the device (the last
// two null without a GradScaler). Entry points adamw_with_copy_<copy type>.
struct Step {
  SK_KERNEL_ENTRY("adamw.cuh", "adamw_with_copy");
  TensorList list;
  const float* lr;
  float beta1;
  float beta2;
  float weight_decay;
  float eps;
  const float* grad_scale;
  const float* found_inf;
};

}  // namespace sk::kernels::adamw

#ifdef __CUDACC_RTC__

namespace sk {

constexpr int ADAMW_CHUNK = 8192;

template <typename TC>
__device__ void adamw_with_copy(const kernels::adamw::Step& h) {
  const kernels::adamw::TensorList& list = h.list;
  const float* __restrict__ grad_scale = h.grad_scale;
  if (h.found_inf != nullptr && *h.found_inf != 0.f) return;
  int t = 0;
  while (t + 1 < list.tensors && static_cast<int>(blockIdx.x) >= list.first_block[t + 1]) ++t;
  float* p = reinterpret_cast<float*>(list.param[t]);
  float* g = reinterpret_cast<float*>(list.grad[t]);
  float* m = reinterpret_cast<float*>(list.exp_avg[t]);
  float* v = reinterpret_cast<float*>(list.exp_avg_sq[t]);
  TC* copy = reinterpret_cast<TC*>(list.copy[t]);
  const double step = *reinterpret_cast<const float*>(list.step[t]);
  const double lr = *h.lr;
  const float step_size = static_cast<float>(lr / (1.0 - pow(static_cast<double>(h.beta1), step)));
  const float bias_correction2_sqrt = static_cast<float>(sqrt(1.0 - pow(static_cast<double>(h.beta2), step)));
  const float decay = static_cast<float>(lr * h.weight_decay);
  const float scale = grad_scale != nullptr ? *grad_scale : 1.f;
  const long long start = static_cast<long long>(blockIdx.x - list.first_block[t]) * ADAMW_CHUNK;
  const long long end = min(list.numel[t], start + ADAMW_CHUNK);
  for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
    float grad = g[i];
    if (grad_scale != nullptr) {
      grad /= scale;
      g[i] = grad;
    }
    float param = p[i];
    if (h.weight_decay != 0.f) param -= decay * param;
    const float mi = h.beta1 * m[i] + (1.f - h.beta1) * grad;
    const float vi = h.beta2 * v[i] + (1.f - h.beta2) * grad * grad;
    const float denom = sqrtf(vi) / bias_correction2_sqrt + h.eps;
    param -= step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
    p[i] = param;
    if (copy != nullptr) copy[i] = from_float<TC>(param);
  }
}

}  // namespace sk

// The params struct stays in parameter memory (__grid_constant__): the list is indexed at run time.
#define SK_ADAMW(tag, TC, ...)                                                           \
  SK_ENTRY(adamw_with_copy_##tag, (const __grid_constant__ sk::kernels::adamw::Step p) { \
    sk::adamw_with_copy<TC>(p);                                                          \
  })
SK_ADAMW(bf16, sk::bf16)
SK_ADAMW(f16, sk::f16)

#else  // host: the launcher

#include "kernels.h"

#include <algorithm>
#include <vector>

namespace sk::kernels::adamw {

constexpr int64_t kChunk = 8192;
constexpr unsigned kThreads = 512;

// One parameter's tensors: fp32 param, grad, exp_avg, exp_avg_sq, step (one float), and its copy in
// bf16/fp16 or none (undefined); all on one CUDA device, contiguous, the same number of elements.
struct Entry {
  at::Tensor param, grad, exp_avg, exp_avg_sq, step, copy;
};

// Why `e` cannot take this kernel, or an empty string when it can.
inline std::string unsupported(const Entry& e) {
  for (const at::Tensor* t : {&e.param, &e.grad, &e.exp_avg, &e.exp_avg_sq, &e.step})
    if (!t->defined() || !t->is_cuda() || t->scalar_type() != at::kFloat || !t->is_contiguous())
      return "not a contiguous fp32 CUDA tensor";
  if (e.copy.defined() && (!(e.copy.scalar_type() == at::kBFloat16 || e.copy.scalar_type() == at::kHalf) ||
                           !e.copy.is_contiguous()))
    return "a copy that is not contiguous bf16/fp16";
  const int64_t n = e.param.numel();
  if (e.grad.numel() != n || e.exp_avg.numel() != n || e.exp_avg_sq.numel() != n ||
      (e.copy.defined() && e.copy.numel() != n) || e.step.numel() != 1)
    return "mismatched sizes";
  for (const at::Tensor* t : {&e.grad, &e.exp_avg, &e.exp_avg_sq, &e.step, &e.copy})
    if (t->defined() && t->device() != e.param.device()) return "another device";
  return "";
}

// Updates every entry (those with a copy all of `copy_type`) in as few launches as the per-launch
// tensor count allows.
inline void step(const std::vector<Entry>& entries, at::ScalarType copy_type, const at::Tensor& lr, double beta1,
                 double beta2, double weight_decay, double eps, const at::Tensor& grad_scale,
                 const at::Tensor& found_inf) {
  if (entries.empty()) return;
  const auto kernel = get<Step>({copy_type}, entries.front().param.device());
  for (size_t first = 0; first < entries.size(); first += kTensors) {
    Step p{.list = {},
           .lr = lr.data_ptr<float>(),
           .beta1 = static_cast<float>(beta1),
           .beta2 = static_cast<float>(beta2),
           .weight_decay = static_cast<float>(weight_decay),
           .eps = static_cast<float>(eps),
           .grad_scale = grad_scale.defined() ? grad_scale.data_ptr<float>() : nullptr,
           .found_inf = found_inf.defined() ? found_inf.data_ptr<float>() : nullptr};
    TensorList& list = p.list;
    const auto address = [](const at::Tensor& t) {
      return reinterpret_cast<unsigned long long>(t.defined() ? t.data_ptr() : nullptr);
    };
    int blocks = 0;
    const size_t last = std::min(entries.size(), first + kTensors);
    for (size_t i = first; i < last; ++i) {
      const Entry& e = entries[i];
      const size_t k = i - first;
      list.param[k] = address(e.param);
      list.grad[k] = address(e.grad);
      list.exp_avg[k] = address(e.exp_avg);
      list.exp_avg_sq[k] = address(e.exp_avg_sq);
      list.copy[k] = address(e.copy);
      list.step[k] = address(e.step);
      list.numel[k] = e.param.numel();
      list.first_block[k] = blocks;
      // An empty tensor still gets one block (which finds nothing to do), so the block → tensor
      // search stays monotone.
      blocks += static_cast<int>(std::max<int64_t>(1, (e.param.numel() + kChunk - 1) / kChunk));
    }
    list.tensors = static_cast<int>(last - first);
    list.first_block[list.tensors] = blocks;
    launch(kernel, {static_cast<unsigned>(blocks), 1, 1}, {kThreads, 1, 1}, 0, p);
  }
}

}  // namespace sk::kernels::adamw

#endif
