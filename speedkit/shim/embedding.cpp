// Token embedding plus an optional position embedding (kernels/embedding.cuh) as a C++ autograd
// function, so that the backward runs the deterministic sorted-run kernel instead of ATen's
// sort-and-segment pipeline. The Rust side (nn/embedding.rs) decides when this path applies and
// otherwise runs ATen's `embedding` and a broadcast add.
#include "shim.h"

#include <torch/csrc/autograd/custom_function.h>

#if SK_WITH_CUDA
#include "embedding.cuh"
#endif

namespace {

#if SK_WITH_CUDA
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
namespace emb = sk::kernels::embedding;

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
    return {at::Tensor(), dtable, dpositions, at::Tensor(), at::Tensor()};
  }
};
#endif

}  // namespace

extern "C" {

// *out = table[tokens] (+ positions[t] for tokens [batch, seq], t the column), shaped tokens' shape
// + [width], in the table's type. tokens: int64 on the table's CUDA device; table: [vocab, width],
// fp32/bf16/fp16; positions: [≥ seq, width] of the table's type, or null. Differentiable in the
// table and the positions through EmbeddingFunction.
int sk_embedding(at::Tensor* tokens, at::Tensor* table, at::Tensor* positions, at::Tensor** out) {
#if SK_WITH_CUDA
  SK_TRY({
    TORCH_CHECK(table->dim() == 2, "embedding: the table must be [vocab, width], got ", table->sizes());
    TORCH_CHECK(tokens->scalar_type() == at::kLong, "embedding: the tokens must be int64, got ",
                tokens->scalar_type());
    const int64_t width = table->size(1);
    int64_t seq = 1;
    if (positions) {
      TORCH_CHECK(tokens->dim() == 2, "embedding: with positions the tokens must be [batch, seq], got ",
                  tokens->sizes());
      seq = tokens->size(1);
      TORCH_CHECK(positions->dim() == 2 && positions->size(1) == width && positions->size(0) >= seq,
                  "embedding: the positions must be [>= ", seq, ", ", width, "], got ", positions->sizes());
      TORCH_CHECK(positions->scalar_type() == table->scalar_type(),
                  "embedding: the positions must be of the table's type");
    }
    at::Tensor flat = tokens->reshape({-1}).contiguous();
    at::Tensor result = EmbeddingFunction::apply(
        flat, table->contiguous(),
        sk::placeholder_unless(positions != nullptr, positions ? positions->contiguous() : at::Tensor(), *table),
        positions != nullptr, seq);
    std::vector<int64_t> shape = tokens->sizes().vec();
    shape.push_back(width);
    *out = new at::Tensor(result.view(shape));
  })
#else
  (void)tokens; (void)table; (void)positions; (void)out;
  SK_NO_CUDA();
#endif
}

}  // extern "C"
