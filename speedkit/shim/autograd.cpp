// The backward graph behind a tensor: every autograd node reachable from its grad_fn, by name, and
// the leaf variables its AccumulateGrad nodes write gradients to.
#include "shim.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>

#include <unordered_set>

at::Tensor sk::placeholder_unless(bool present, const at::Tensor& t, const at::Tensor& like) {
  return present ? t : at::empty({0}, like.options());
}

namespace {

struct Graph {
  std::vector<std::string> node_names;
  std::vector<uint64_t> leaf_ids;  // TensorImpl addresses of the AccumulateGrad variables
};

}  // namespace

extern "C" {

// Walks the backward graph of `root` (each node once); `*out` receives it (sk_autograd_graph_free).
// Fails when `root` has no grad_fn (it does not require grad, or it is a leaf).
int sk_autograd_graph(sk_tensor root, void** out) {
  SK_TRY({
    const auto& grad_fn = torch::autograd::impl::gradient_edge(*root).function;
    if (!grad_fn) {
      throw std::runtime_error(
          "the tensor has no backward graph (it does not require grad, or it is a leaf)");
    }
    auto graph = std::make_unique<Graph>();
    std::unordered_set<torch::autograd::Node*> seen{grad_fn.get()};
    std::vector<torch::autograd::Node*> pending{grad_fn.get()};
    while (!pending.empty()) {
      auto* node = pending.back();
      pending.pop_back();
      graph->node_names.push_back(node->name());
      if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
        graph->leaf_ids.push_back(reinterpret_cast<uint64_t>(acc->variable.unsafeGetTensorImpl()));
      }
      for (const auto& edge : node->next_edges()) {
        auto* next = edge.function.get();
        if (next != nullptr && seen.insert(next).second) pending.push_back(next);
      }
    }
    *out = graph.release();
  })
}

int sk_autograd_graph_sizes(void* graph, int64_t* nodes, int64_t* leaves) {
  SK_TRY({
    auto* g = static_cast<Graph*>(graph);
    *nodes = static_cast<int64_t>(g->node_names.size());
    *leaves = static_cast<int64_t>(g->leaf_ids.size());
  })
}

// The name of node `index`; the pointer lives as long as the graph.
int sk_autograd_graph_node(void* graph, int64_t index, const char** name) {
  SK_TRY(*name = static_cast<Graph*>(graph)->node_names.at(static_cast<size_t>(index)).c_str())
}

int sk_autograd_graph_leaf(void* graph, int64_t index, uint64_t* id) {
  SK_TRY(*id = static_cast<Graph*>(graph)->leaf_ids.at(static_cast<size_t>(index)))
}

void sk_autograd_graph_free(void* graph) { delete static_cast<Graph*>(graph); }

int sk_grad_mode_enabled(int* enabled) { SK_TRY(*enabled = at::GradMode::is_enabled() ? 1 : 0) }

// The identity autograd keys a variable by (its TensorImpl), comparable with sk_autograd_graph_leaf.
int sk_tensor_identity(sk_tensor tensor, uint64_t* id) {
  SK_TRY(*id = reinterpret_cast<uint64_t>(tensor->unsafeGetTensorImpl()))
}

int sk_tensor_grad_fn_identity(sk_tensor tensor, uint64_t* id) {
  SK_TRY(*id = reinterpret_cast<uint64_t>(tensor->grad_fn().get()))
}

int sk_autograd_backward(const sk_tensor* outputs, const sk_tensor* grad_outputs, int64_t n) {
  SK_TRY(torch::autograd::backward(sk::tensor_list(outputs, n), sk::tensor_list(grad_outputs, n)))
}

int sk_autograd_grad(const sk_tensor* outputs, const sk_tensor* grad_outputs, int64_t n, const sk_tensor* inputs,
                     int64_t m, sk_tensor* out) {
  SK_TRY({
    const auto grads = torch::autograd::grad(sk::tensor_list(outputs, n), sk::tensor_list(inputs, m),
                                             sk::tensor_list(grad_outputs, n), /*retain_graph=*/std::nullopt,
                                             /*create_graph=*/false, /*allow_unused=*/true);
    for (int64_t i = 0; i < m; ++i) out[i] = sk::give_or_null(grads[static_cast<size_t>(i)]);
  })
}

}  // extern "C"
