// Token embedding plus an optional position embedding (kernels/embedding.cuh) as a C++ autograd
// function, so that the backward runs the deterministic sorted-run kernel instead of ATen's
// sort-and-segment pipeline. Inputs the kernels do not take run ATen's embedding and a broadcast add
// instead (sk::ops::run_or_fall_back).
#include "embedding.cuh"
#include "fused_op.h"

#include <ATen/ops/add.h>
#include <ATen/ops/embedding.h>

namespace sk {
namespace {

namespace emb = kernels::embedding;

struct EmbeddingFunction : torch::autograd::Function<EmbeddingFunction> {
  // tokens: [rows] int64; table: [vocab, width]; positions_in: [max_seq, width] when has_positions,
  // else sk::placeholder_unless's placeholder; row r takes position r % seq.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& tokens, const at::Tensor& table,
                            const at::Tensor& positions_in, bool has_positions, int64_t seq) {
    const at::Tensor positions = has_positions ? positions_in : at::Tensor();
    ctx->save_for_backward({tokens});
    ctx->saved_data["vocab"] = table.size(0);
    ctx->saved_data["max_seq"] = has_positions ? positions.size(0) : int64_t{0};
    ctx->saved_data["has_positions"] = has_positions;
    ctx->saved_data["seq"] = seq;
    return emb::forward(tokens, table, positions, seq);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor tokens = ctx->get_saved_variables()[0];
    at::Tensor dout = grads[0].contiguous();
    at::Tensor dtable, dpositions;
    if (ctx->needs_input_grad(1)) dtable = emb::table_grad(dout, tokens, ctx->saved_data["vocab"].toInt());
    if (ctx->saved_data["has_positions"].toBool() && ctx->needs_input_grad(2))
      dpositions = emb::positions_grad(dout, ctx->saved_data["seq"].toInt(), ctx->saved_data["max_seq"].toInt());
    return fused_op_gradients({at::Tensor(), dtable, dpositions, at::Tensor(), at::Tensor()}, "embedding");
  }
};

// The shapes fit together on every path: int64 tokens, a [vocab, width] table, and with positions
// [batch, seq] tokens and a [>= seq, width] position table of the table's type.
void check_shapes(const at::Tensor& tokens, const at::Tensor& table, const at::Tensor& positions) {
  TORCH_CHECK(table.dim() == 2, "embedding: the table must be [vocab, width], got ", table.sizes());
  TORCH_CHECK(tokens.scalar_type() == at::kLong, "embedding: the tokens must be int64, got ", tokens.scalar_type());
  if (!positions.defined()) return;
  TORCH_CHECK(tokens.dim() == 2, "embedding: with positions the tokens must be [batch, seq], got ", tokens.sizes());
  TORCH_CHECK(positions.dim() == 2 && positions.size(1) == table.size(1) && positions.size(0) >= tokens.size(1),
              "embedding: the positions must be [>= ", tokens.size(1), ", ", table.size(1), "], got ",
              positions.sizes());
  TORCH_CHECK(positions.scalar_type() == table.scalar_type(), "embedding: the positions must be of the table's type");
}

std::string embedding_unsupported(const at::Tensor& tokens, const at::Tensor& table, const at::Tensor& positions) {
  const c10::Device device = table.device();
  if (auto why = sk::ops::unusable(SK_OP_EMBEDDING, device); !why.empty()) return why;
  if (auto why = sk::ops::floating("a table", table); !why.empty()) return why;
  if (auto why = sk::ops::first_of(
          {sk::ops::on_device("tokens", tokens, device), sk::ops::on_device("positions", positions, device)});
      !why.empty())
    return why;
  if (table.dim() != 2) return "a table of shape " + c10::str(table.sizes());
  const int64_t limit = INT32_MAX;
  if (tokens.numel() > limit || table.size(0) > limit || table.size(1) > limit)
    return std::to_string(tokens.numel()) + " tokens over a table of " + c10::str(table.sizes());
  return {};
}

at::Tensor embedding_on_kernels(const at::Tensor& tokens, const at::Tensor& table, const at::Tensor& positions) {
  const int64_t seq = positions.defined() ? tokens.size(1) : 1;
  at::Tensor result = EmbeddingFunction::apply(
      tokens.reshape({-1}).contiguous(), table.contiguous(),
      sk::placeholder_unless(positions.defined(), positions.defined() ? positions.contiguous() : positions, table),
      positions.defined(), seq);
  std::vector<int64_t> shape = tokens.sizes().vec();
  shape.push_back(table.size(1));
  return result.view(shape);
}

at::Tensor embedding_on_aten(const at::Tensor& tokens, const at::Tensor& table, const at::Tensor& positions) {
  at::Tensor out = at::embedding(table, tokens);
  return positions.defined() ? at::add(out, positions.narrow(0, 0, tokens.size(1))) : out;
}

}  // namespace
}  // namespace sk

extern "C" {

int sk_embedding(sk_tensor tokens, sk_tensor table, sk_tensor positions, sk_tensor* out) {
  SK_TRY({
    const at::Tensor p = sk::optional_tensor(positions);
    sk::check_shapes(*tokens, *table, p);
    *out = sk::give(sk::ops::run_or_fall_back(
        SK_OP_EMBEDDING, sk::embedding_unsupported(*tokens, *table, p), [&] { return sk::embedding_on_kernels(*tokens, *table, p); },
        [&] { return sk::embedding_on_aten(*tokens, *table, p); }));
  })
}

int sk_embedding_unsupported(sk_tensor tokens, sk_tensor table, sk_tensor positions, const char** reason) {
  SK_TRY(sk::hand_out(sk::embedding_unsupported(*tokens, *table, sk::optional_tensor(positions)), reason))
}

}  // extern "C"
