// The fused classifier loss (kernels/classifier.cuh) as a C++ autograd function: mean softmax
// cross-entropy of [rows, vocab] logits against int64 targets, ignore_index rows left out. Inputs
// the kernels do not take run ATen's log_softmax in fp32 and nll_loss instead, as tch's
// cross_entropy_for_logits does (sk::ops::run_or_fall_back).
//
// The chunked classifier (ChunkedClassifierFunction): the head's GEMM and the loss together, a
// block of rows at a time, as Liger's fused linear cross-entropy: each block's logits are made,
// reduced to their loss, turned into their gradient in place and consumed by the two gradient
// GEMMs before the next block's exist, so that the [rows, vocab] logits are never whole. The
// gradients are computed in the forward for a loss gradient of 1 and scaled by the real one in
// the backward (a GradScaler's power of two scales bf16 exactly).
#include "classifier.cuh"
#include "fused_op.h"
#include "saved_offload.h"

#include <torch/csrc/autograd/graph_task.h>

#include <ATen/ops/addmm.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/mm.h>
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

// The head's weight in `type` for a GEMM of `rows` rows, as linear.cpp's weight_operand: the copy
// kept across steps where the rows outnumber the weight's, else a cast freed with the forward.
at::Tensor head_weight(const at::Tensor& weight, int64_t rows, at::ScalarType type) {
  return rows >= weight.size(0) ? sk::weight_casts::get(weight, type) : weight.to(type);
}

// The gradients the blocks of rows add up, from each block's logits turned into their gradient:
// x's rows of it (written into `dx`'s block), and the weight's and bias's sums (fp32 for an fp32
// weight, straight from cuBLAS), which the first block writes and the later ones add to.
struct HeadGradients {
  bool x, weight, bias;
  at::ScalarType weight_type;
  at::Tensor dx, dw, db;

  void add(const at::Tensor& dlogits, const at::Tensor& x_block, const at::Tensor& w, int64_t first_row) {
    if (x) {
      at::Tensor block = dx.narrow(0, first_row, dlogits.size(0));
      at::mm_out(block, dlogits, w);
    }
    if (weight) {
      const bool fp32 = weight_type == at::kFloat && dlogits.scalar_type() != at::kFloat;
      if (first_row == 0) {
        dw = fp32 ? at::mm(dlogits.t(), x_block, at::kFloat) : at::mm(dlogits.t(), x_block).to(weight_type);
      } else if (fp32) {
        at::addmm_out(dw, dw, dlogits.t(), x_block, at::kFloat);
      } else {
        dw.add_(at::mm(dlogits.t(), x_block));
      }
    }
    if (bias) {
      at::Tensor sum = dlogits.sum(0, false, at::kFloat);
      db = first_row == 0 ? sum : db.add_(sum);
    }
  }
};

struct ChunkedClassifierFunction : torch::autograd::Function<ChunkedClassifierFunction> {
  // x: [rows, in]; weight: [vocab, in]; bias_in: [vocab] when has_bias (else a placeholder);
  // targets: [rows] int64. The mean (or, `mean` false, the sum) of the rows' losses, fp32.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias_in, bool has_bias, const at::Tensor& targets,
                            int64_t ignore_index, bool mean, int64_t gemm_type, int64_t block_rows) {
    const auto type = static_cast<at::ScalarType>(gemm_type);
    const int64_t rows = x.size(0);
    const at::Tensor x_c = x.to(type), w_c = head_weight(weight, rows, type);
    const at::Tensor b_c = has_bias ? sk::weight_casts::get(bias_in, type) : at::Tensor();
    const auto floats = x.options().dtype(at::kFloat);
    // Counted on the device, as the fused loss counts: the mean never waits for the host.
    const at::Tensor count = at::ne(targets, ignore_index).sum(at::kFloat);
    const at::Tensor one = at::ones({}, floats);
    HeadGradients grads{x.requires_grad(), weight.requires_grad(), has_bias && bias_in.requires_grad(),
                        weight.scalar_type(), at::Tensor(), at::Tensor(), at::Tensor()};
    if (grads.x) grads.dx = at::empty({rows, x.size(1)}, x_c.options());
    at::Tensor total = at::zeros({}, floats);
    for (int64_t first = 0; first < rows; first += block_rows) {
      const int64_t n = std::min(block_rows, rows - first);
      const at::Tensor x_block = x_c.narrow(0, first, n), t_block = targets.narrow(0, first, n);
      at::Tensor logits = has_bias ? at::addmm(b_c, x_block, w_c.t()) : at::mm(x_block, w_c.t());
      // The block's logits become their gradient in the pass that reads them for the loss.
      ce::Rows block = ce::forward_backward(logits, t_block, ignore_index, one, mean ? count : one);
      total.add_(block.loss.sum());
      grads.add(logits, x_block, w_c, first);
    }
    ctx->save_for_backward({grads.dx, grads.dw, grads.db});
    ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["bias_type"] = static_cast<int64_t>(has_bias ? bias_in.scalar_type() : at::kFloat);
    return mean ? at::div(total, count) : total;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor g = grads[0].to(at::kFloat);
    const auto x_type = static_cast<at::ScalarType>(ctx->saved_data["x_type"].toInt());
    const auto bias_type = static_cast<at::ScalarType>(ctx->saved_data["bias_type"].toInt());
    auto scaled = [&](const at::Tensor& t, at::ScalarType type) {
      return t.defined() ? t.mul(g).to(type) : at::Tensor();
    };
    // Scaled in place (no second [vocab, in] fp32 matrix at the classifier's backward), unless
    // the graph is kept for another backward, which reads the saved sum again.
    const bool again = torch::autograd::get_current_graph_task_keep_graph();
    const at::Tensor dw = !saved[1].defined() ? at::Tensor() : again ? saved[1].mul(g) : saved[1].mul_(g);
    return fused_op_gradients({scaled(saved[0], x_type), dw, scaled(saved[2], bias_type), at::Tensor(),
                               at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
                               at::Tensor()},
                              "chunked classifier");
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
        [&] {
          // The backward writes the gradient into the logits where only this node holds them:
          // its saved variables, made as apply() returns, stay as they are.
          sk::saved_offload::KeptOnDevice kept;
          return sk::CrossEntropyFunction::apply(logits->contiguous(), targets->contiguous(), ignore_index);
        },
        [&] { return at::nll_loss(at::log_softmax(*logits, -1, at::kFloat), *targets, {}, at::Reduction::Mean, ignore_index); });
    *loss = sk::give(result);
  })
}

int sk_chunked_cross_entropy(sk_tensor x, sk_tensor weight, sk_tensor bias, sk_tensor targets, int64_t ignore_index,
                             int mean, int gemm_type, int64_t block_rows, sk_tensor* loss) {
  SK_TRY({
    TORCH_CHECK(x->dim() == 2 && weight->dim() == 2 && x->size(1) == weight->size(1) && targets->dim() == 1 &&
                    targets->size(0) == x->size(0) && block_rows > 0,
                "the chunked classifier takes x [rows, in], a weight [vocab, in] and targets [rows] in blocks of "
                "more than 0 rows; got ",
                x->sizes(), ", ", weight->sizes(), ", ", targets->sizes(), " in blocks of ", block_rows);
    const at::Tensor b = sk::optional_tensor(bias);
    at::Tensor result = sk::ChunkedClassifierFunction::apply(
        *x, *weight, sk::placeholder_unless(b.defined(), b, *weight), b.defined(), targets->contiguous(), ignore_index, mean != 0,
        static_cast<int64_t>(gemm_type), block_rows);
    *loss = sk::give(result);
  })
}

int sk_cross_entropy_unsupported(sk_tensor logits, sk_tensor targets, const char** reason) {
  SK_TRY(sk::hand_out(sk::classifier_unsupported(*logits, *targets), reason))
}

}  // extern "C"
