// The fused classifier loss (kernels/classifier.cuh) as a C++ autograd function: mean softmax
// cross-entropy of [rows, vocab] logits against int64 targets, ignore_index rows left out. Inputs
// the kernels do not take run ATen's log_softmax in fp32 and nll_loss instead, as tch's
// cross_entropy_for_logits does (sk::ops::run_or_fall_back).
#include "classifier.cuh"
#include "fused_op.h"

#include <torch/csrc/autograd/graph_task.h>

#include <ATen/ops/log_softmax.h>
#include <ATen/ops/nll_loss.h>
#include <ATen/ops/div.h>
#include <ATen/ops/ne.h>
#include <ATen/ops/sum.h>

namespace sk {
namespace {

namespace ce = kernels::classifier;

// Whether the gradient may take the logits' memory, as llm.c's fused classifier does: nothing reads
// the logits after this backward. The step's memory peaks at the start of the backward, with every
// activation alive, and the [rows, vocab] logits and their gradient can be its largest pair; in
// place, the pair is one matrix. Only where the logits are held by this node's saved variable and
// `logits` alone (no tensor of the user's, no other view, no other node), and the graph is not kept
// for a second backward (`retain_graph`), which would read them again.
bool logits_are_ours_alone(const at::Tensor& logits) {
  if (logits.use_count() != 2 || !logits.is_contiguous() || torch::autograd::get_current_graph_task_keep_graph())
    return false;
  if (!logits.is_view()) return logits.storage().use_count() == 1;
  // Logits flattened by a view (`[batch, seq, vocab]` as `[rows, vocab]`, as a transformer's loss
  // takes them): the view keeps its base alive, so the base must be held by the view alone (the
  // caller dropped the 3-D logits), and the storage by the two of them, all of it in the view.
  const at::TensorBase& base = logits._base();
  return !base.is_view() && base.use_count() == 1 && logits.storage().use_count() == 2 &&
         logits.storage_offset() == 0 && logits.numel() == base.numel();
}

struct CrossEntropyFunction : torch::autograd::Function<CrossEntropyFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t ignore_index) {
    ce::Rows rows = ce::forward(logits, targets, ignore_index);
    // Counted on the device: the mean never waits for the host. No counted row gives 0/0 = NaN,
    // as PyTorch's mean cross-entropy does.
    at::Tensor count = at::ne(targets, ignore_index).sum(at::kFloat);
    ctx->save_for_backward({logits, targets, rows.lse, count});
    ctx->saved_data["ignore_index"] = ignore_index;
    return at::div(rows.loss.sum(), count);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    at::Tensor dloss = grads[0].to(at::kFloat).contiguous();
    at::Tensor logits = std::move(saved[0]);
    at::Tensor dlogits = ce::backward(logits, saved[1], saved[2], dloss, saved[3], ignore_index,
                                      logits_are_ours_alone(logits));
    return fused_op_gradients({dlogits, at::Tensor(), at::Tensor()}, "cross-entropy");
  }
};

std::string classifier_unsupported(const at::Tensor& logits, const at::Tensor& targets) {
  if (auto why = sk::ops::unusable(SK_OP_CROSS_ENTROPY, logits.device()); !why.empty()) return why;
  if (auto why = sk::ops::floating("logits", logits); !why.empty()) return why;
  if (logits.dim() != 2 || targets.dim() != 1 || targets.size(0) != logits.size(0))
    return "logits " + c10::str(logits.sizes()) + " and targets " + c10::str(targets.sizes()) +
           " are not [rows, classes] and [rows]";
  if (targets.scalar_type() != at::kLong || targets.device() != logits.device())
    return std::string("targets of type ") + c10::toString(targets.scalar_type()) + " on " + targets.device().str();
  if (logits.size(1) == 0) return "logits with no classes";
  return sk::ops::fits_int32(logits.size(0), logits.size(1));
}

}  // namespace
}  // namespace sk

extern "C" {

int sk_cross_entropy(sk_tensor logits, sk_tensor targets, int64_t ignore_index, sk_tensor* loss) {
  SK_TRY({
    at::Tensor result = sk::ops::run_or_fall_back(
        SK_OP_CROSS_ENTROPY, sk::classifier_unsupported(*logits, *targets),
        [&] { return sk::CrossEntropyFunction::apply(logits->contiguous(), targets->contiguous(), ignore_index); },
        [&] { return at::nll_loss(at::log_softmax(*logits, -1, at::kFloat), *targets, {}, at::Reduction::Mean, ignore_index); });
    *loss = sk::give(result);
  })
}

int sk_cross_entropy_unsupported(sk_tensor logits, sk_tensor targets, const char** reason) {
  SK_TRY(sk::hand_out(sk::classifier_unsupported(*logits, *targets), reason))
}

}  // extern "C"
