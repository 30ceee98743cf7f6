// The fused classifier loss (kernels/classifier.cuh) as a C++ autograd function: mean softmax
// cross-entropy of [rows, vocab] logits against int64 targets, ignore_index rows left out. The
// Rust side (nn/cross_entropy.rs) decides when this path applies and otherwise runs ATen's.
#include "shim.h"

#include <torch/csrc/autograd/custom_function.h>

#if SK_WITH_CUDA
#include "classifier.cuh"

#include <ATen/ops/div.h>
#include <ATen/ops/ne.h>
#include <ATen/ops/sum.h>
#endif

namespace {

#if SK_WITH_CUDA
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
namespace ce = sk::kernels::classifier;

struct CrossEntropyFunction : torch::autograd::Function<CrossEntropyFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t ignore_index) {
    ce::Forward out = ce::forward(logits, targets, ignore_index);
    // Counted on the device: the mean never waits for the host. No counted row gives 0/0 = NaN,
    // as PyTorch's mean cross-entropy does.
    at::Tensor count = at::ne(targets, ignore_index).sum(at::kFloat);
    ctx->save_for_backward({logits, targets, out.row_lse, count});
    ctx->saved_data["ignore_index"] = ignore_index;
    return at::div(out.row_loss.sum(), count);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    at::Tensor dloss = grads[0].to(at::kFloat).contiguous();
    at::Tensor dlogits = ce::backward(saved[0], saved[1], saved[2], dloss, saved[3], ignore_index);
    return {dlogits, at::Tensor(), at::Tensor()};
  }
};
#endif

}  // namespace

extern "C" {

// The mean cross-entropy of logits [rows, vocab] (CUDA, fp32/bf16/fp16, contiguous) against targets
// [rows] (int64), rows whose target is ignore_index left out; *loss is an fp32 scalar.
int sk_cross_entropy(at::Tensor* logits, at::Tensor* targets, int64_t ignore_index, at::Tensor** loss) {
#if SK_WITH_CUDA
  SK_TRY({
    at::Tensor result = CrossEntropyFunction::apply(logits->contiguous(), targets->contiguous(), ignore_index);
    *loss = new at::Tensor(result);
  })
#else
  (void)logits; (void)targets; (void)ignore_index; (void)loss;
  SK_NO_CUDA();
#endif
}

}  // extern "C"
