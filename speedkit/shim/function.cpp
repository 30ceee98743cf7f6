// Autograd functions whose forward and backward are written in Rust (speedkit::function), and
// activation checkpointing built on the same node (speedkit::checkpoint): a torch::autograd::Function
// whose static forward and backward call back into Rust through speedkit.h's sk_function_vtable,
// with the Rust state kept alive by the node (a Capsule in the context's saved data) and freed by the
// vtable's drop when the node is destroyed.
//
// A callback never throws across the boundary: the Rust side catches panics and reports failures
// through sk_function_call_fail; the C++ side turns that into an exception, which the autograd
// engine carries to the caller of backward() (and sk_function_apply's status for the forward).
#include "fused_op.h"
#include "saved_offload.h"
#include "shim.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <c10/util/SmallVector.h>

#if SK_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace sk {
namespace {

// The random generators' states (the CPU's and the current CUDA device's) at one moment, to draw
// the same numbers again in a recomputation. Not inside a CUDA graph capture (the caller says),
// where reading a generator's state is not allowed: there they are left as they are
// (speedkit::checkpoint says so).
struct RandomState {
  at::Tensor cpu, cuda;
  int cuda_device = -1;

  static RandomState now(bool capturing = false) {
    RandomState s;
    if (capturing) return s;
#if SK_WITH_CUDA
    if (c10::cuda::device_count() > 0) {
      s.cuda_device = c10::cuda::current_device();
      s.cuda = at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(s.cuda_device)).get_state();
    }
#endif
    s.cpu = at::detail::getDefaultCPUGenerator().get_state();
    return s;
  }

  // Puts these states back, returning the ones they replace.
  RandomState swap_in() const {
    RandomState previous = cpu.defined() ? now() : RandomState();
    if (cpu.defined()) {
      at::Generator generator = at::detail::getDefaultCPUGenerator();
      generator.set_state(cpu);
    }
#if SK_WITH_CUDA
    if (cuda.defined()) {
      at::Generator generator = at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(cuda_device));
      generator.set_state(cuda);
    }
#endif
    return previous;
  }
};

// The Rust side of one application: its vtable and state, freed with the node.
struct RustState : torch::CustomClassHolder {
  sk_function_vtable vtable;
  void* state;
  // The autocast state the forward ran under, restored for the backward (torch.amp.custom_bwd).
  bool autocast_enabled = false;
  at::ScalarType autocast_type = at::kBFloat16;
  // How many inputs the forward took (the backward returns a gradient for each).
  int64_t inputs = 0;
  // Checkpointing: the random generators' states before the forward, and whether the last input
  // is the anchor (see sk_checkpoint_apply), not one of the function's.
  RandomState random;
  bool anchored = false;
  // The function's name when its backward is not differentiable again (speedkit::function's
  // Function::once_differentiable), else empty.
  std::string once_differentiable;
  RustState(const sk_function_vtable& v, void* s) : vtable(v), state(s) {}
  ~RustState() override {
    if (vtable.drop != nullptr) vtable.drop(state);
  }
};

// One callback's exchange: the context it may use and what it hands back.
struct Call {
  explicit Call(AutogradContext* context) : ctx(context) {}
  AutogradContext* ctx;
  variable_list results;
  bool results_set = false;
  std::string error;
};

c10::intrusive_ptr<RustState> state_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<RustState>(ctx->saved_data["state"].toCapsule());
}

// Runs a callback; its failure (or results never handed back) as an exception.
variable_list run(const char* what, Call& call, int status) {
  if (status != 0) throw std::runtime_error(call.error.empty() ? std::string(what) + " failed" : call.error);
  if (!call.results_set) throw std::runtime_error(std::string(what) + " handed back no results");
  return std::move(call.results);
}

// Sets CUDA autocast to `enabled` in `type` for a scope, touching nothing when it already is: a
// node's backward passes here on every step.
struct AutocastAs {
  std::pair<bool, at::ScalarType> cuda;
  bool changed;
  AutocastAs(bool enabled, at::ScalarType type)
      : cuda(at::autocast::is_autocast_enabled(at::kCUDA), at::autocast::get_autocast_dtype(at::kCUDA)),
        changed(cuda.first != enabled || (enabled && cuda.second != type)) {
    if (!changed) return;
    at::autocast::set_autocast_enabled(at::kCUDA, enabled);
    if (enabled) at::autocast::set_autocast_dtype(at::kCUDA, type);
  }
  ~AutocastAs() {
    if (!changed) return;
    at::autocast::set_autocast_enabled(at::kCUDA, cuda.first);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda.second);
  }
};

// The handles of `tensors` for a callback, on the stack for the usual few.
using Handles = c10::SmallVector<sk_tensor, 8>;
template <typename List>
Handles handles_of(List& tensors) {
  Handles handles;
  for (auto& t : tensors) handles.push_back(t.defined() ? const_cast<at::Tensor*>(&t) : nullptr);
  return handles;
}

const variable_list& check_count(const variable_list& outputs, int64_t capacity) {
  TORCH_CHECK(static_cast<int64_t>(outputs.size()) <= capacity, "a speedkit Function returns at most ", capacity,
              " outputs, this one ", outputs.size());
  return outputs;
}

// Whether the forward sees its inputs cast: a cast type (a ScalarType code, -1 for none) and
// autocast on for CUDA (torch.amp.custom_fwd(cast_inputs=...)).
bool casts_inputs(int64_t cast_to) { return cast_to >= 0 && at::autocast::is_autocast_enabled(at::kCUDA); }

// The inputs as the forward sees them: floating CUDA inputs in the cast type.
variable_list cast_inputs(at::TensorList inputs, int64_t cast_to) {
  variable_list cast;
  for (const at::Tensor& t : inputs)
    cast.push_back(t.is_cuda() && t.is_floating_point() ? t.to(static_cast<at::ScalarType>(cast_to)) : t);
  return cast;
}

// A node whose forward and backward are the Rust callbacks.
struct RustFunction : torch::autograd::Function<RustFunction> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, c10::intrusive_ptr<RustState> state,
                               int64_t cast_to) {
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    state->inputs = static_cast<int64_t>(inputs.size());
    state->autocast_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
    state->autocast_type = at::autocast::get_autocast_dtype(at::kCUDA);
    // With its inputs cast, the forward runs with autocast off, as custom_fwd does.
    const bool cast = casts_inputs(cast_to);
    const variable_list given = cast ? cast_inputs(inputs, cast_to) : variable_list();
    std::optional<AutocastAs> off;
    if (cast) off.emplace(false, state->autocast_type);
    Handles handles = cast ? handles_of(given) : handles_of(inputs);
    Call call(ctx);
    return run("the Function's forward", call,
               state->vtable.forward(state->state, &call, handles.data(), static_cast<int64_t>(handles.size())));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state = state_of(ctx);
    AutocastAs autocast(state->autocast_enabled, state->autocast_type);
    Handles handles = handles_of(grads);
    Call call(ctx);
    variable_list input_grads = run("the Function's backward", call,
                                    state->vtable.backward(state->state, &call, handles.data(),
                                                           static_cast<int64_t>(handles.size())));
    TORCH_CHECK(static_cast<int64_t>(input_grads.size()) == state->inputs,
                "the Function's backward returned an incorrect number of gradients (", input_grads.size(), " for ",
                state->inputs, " inputs): one per input, None for an input without one");
    if (!state->once_differentiable.empty())
      input_grads = once_differentiable(std::move(input_grads), "the autograd Function " + state->once_differentiable);
    input_grads.emplace_back();  // the state argument
    input_grads.emplace_back();  // the cast type
    return input_grads;
  }
};

// Checkpointing: the forward runs the Rust function without keeping its graph and saves the
// inputs; the backward runs it again with grad mode on (on the inputs detached, autocast and the
// random generators as they were in the forward) and back-propagates through that graph, which
// accumulates the gradients of the parameters it uses and gives the inputs theirs.
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, c10::intrusive_ptr<RustState> state,
                               bool capturing) {
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    state->autocast_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
    state->autocast_type = at::autocast::get_autocast_dtype(at::kCUDA);
    state->random = RandomState::now(capturing);
    const at::TensorList own = state->anchored ? inputs.slice(0, inputs.size() - 1) : inputs;
    ctx->save_for_backward(own.vec());
    return recompute(ctx, *state, own.vec());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The recomputation's own backward runs without create_graph and adds to the parameters'
    // gradients as it goes, so a second derivative through it would be silently incomplete.
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "speedkit::checkpoint does not support a second derivative (a backward with create_graph): "
                "run the function without checkpointing for such a step");
    const auto state = state_of(ctx);
    variable_list inputs;
    for (const at::Tensor& saved : ctx->get_saved_variables()) {
      at::Tensor input = saved.detach();
      input.requires_grad_(saved.is_floating_point() || saved.is_complex());
      inputs.push_back(input);
    }
    variable_list outputs;
    {
      at::AutoGradMode grad_mode(true);
      AutocastAs autocast(state->autocast_enabled, state->autocast_type);
      const RandomState after_forward = state->random.swap_in();
      outputs = recompute(ctx, *state, inputs);
      after_forward.swap_in();
    }
    variable_list differentiable, their_grads;
    for (size_t i = 0; i < outputs.size() && i < grads.size(); ++i) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        differentiable.push_back(outputs[i]);
        their_grads.push_back(grads[i]);
      }
    }
    if (!differentiable.empty()) torch::autograd::backward(differentiable, their_grads);
    variable_list input_grads;
    for (const at::Tensor& input : inputs) input_grads.push_back(input.grad());
    if (state->anchored) input_grads.emplace_back();
    input_grads.emplace_back();  // the state argument
    input_grads.emplace_back();  // whether the forward was captured
    return input_grads;
  }

  static variable_list recompute(AutogradContext* ctx, const RustState& state, const variable_list& inputs) {
    Handles handles = handles_of(inputs);
    Call call(ctx);
    return run("the checkpointed function", call,
               state.vtable.forward(state.state, &call, handles.data(), static_cast<int64_t>(handles.size())));
  }
};

// The C++ twin of a one-line Rust Function (y = x · k, saving nothing): what a Rust node's cost is
// measured against (examples/custom_op/main.rs).
struct ReferenceScale : torch::autograd::Function<ReferenceScale> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double k) {
    ctx->saved_data["k"] = k;
    return x * k;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0] * ctx->saved_data["k"].toDouble(), at::Tensor()};
  }
};

Call& call_of(void* call) { return *static_cast<Call*>(call); }

void hand_back(const variable_list& outputs, sk_tensor* out, int64_t capacity, int64_t* count) {
  check_count(outputs, capacity);
  *count = static_cast<int64_t>(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) out[i] = sk::give_or_null(outputs[i]);
}

}  // namespace
}  // namespace sk

extern "C" {

int sk_function_apply(const sk_function_vtable* vtable, void* state, int cast_inputs, const char* once_differentiable,
                      const sk_tensor* inputs, int64_t n_inputs, sk_tensor* outputs, int64_t capacity,
                      int64_t* n_outputs) {
  // The holder owns `state` from here on, also when the forward fails.
  auto holder = c10::make_intrusive<sk::RustState>(*vtable, state);
  if (once_differentiable != nullptr) holder->once_differentiable = once_differentiable;
  SK_TRY({
    // A Rust backward may overwrite what it saved where nothing else holds it (may_overwrite): the
    // saved variables, made as apply() returns, stay as they are.
    sk::saved_offload::KeptOnDevice kept;
    sk::hand_back(sk::RustFunction::apply(at::TensorList(sk::tensor_list(inputs, n_inputs)), holder,
                                          static_cast<int64_t>(cast_inputs)),
                  outputs, capacity, n_outputs);
  })
}

int sk_checkpoint_apply(const sk_function_vtable* vtable, void* state, int capturing, const sk_tensor* inputs,
                        int64_t n_inputs, sk_tensor* outputs, int64_t capacity, int64_t* n_outputs) {
  auto holder = c10::make_intrusive<sk::RustState>(*vtable, state);
  SK_TRY({
    std::vector<at::Tensor> all = sk::tensor_list(inputs, n_inputs);
    // The function may use parameters that need gradients while none of its inputs does (the first
    // block, on token embeddings computed without grad): autograd only records a node one of whose
    // inputs requires grad, so an empty anchor that does joins them and the backward reaches the
    // recomputation (what torch.utils.checkpoint's non-reentrant variant achieves with hooks).
    holder->anchored = at::GradMode::is_enabled() &&
                       std::none_of(all.begin(), all.end(), [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
    if (holder->anchored) all.push_back(at::empty({0}, at::kFloat).requires_grad_(true));
    sk::hand_back(sk::CheckpointFunction::apply(at::TensorList(all), holder, capturing != 0), outputs, capacity,
                  n_outputs);
  })
}

int sk_function_reference_scale(sk_tensor x, double k, sk_tensor* y) {
  SK_TRY(*y = sk::give(sk::ReferenceScale::apply(*x, k)))
}

int sk_function_call_set_results(void* call, const sk_tensor* results, int64_t n) {
  SK_TRY({
    auto& c = sk::call_of(call);
    c.results.clear();
    for (int64_t i = 0; i < n; ++i) c.results.push_back(sk::optional_tensor(results[i]));
    c.results_set = true;
  })
}

int sk_function_call_fail(void* call, const char* message) {
  SK_TRY(sk::call_of(call).error = message ? message : "the Rust callback failed")
}

int sk_function_call_save_for_backward(void* call, const sk_tensor* tensors, int64_t n) {
  SK_TRY(sk::call_of(call).ctx->save_for_backward(sk::tensor_list(tensors, n)))
}

int sk_function_call_mark_non_differentiable(void* call, const sk_tensor* tensors, int64_t n) {
  SK_TRY(sk::call_of(call).ctx->mark_non_differentiable(sk::tensor_list(tensors, n)))
}

int sk_function_call_set_materialize_grads(void* call, int value) {
  SK_TRY(sk::call_of(call).ctx->set_materialize_grads(value != 0))
}

int sk_function_call_saved(void* call, sk_tensor* out, int64_t capacity, int64_t* count) {
  SK_TRY(sk::hand_back(sk::call_of(call).ctx->get_saved_variables(), out, capacity, count))
}

int sk_function_call_needs_input_grad(void* call, int64_t index, int* out) {
  SK_TRY(*out = sk::call_of(call).ctx->needs_input_grad(static_cast<size_t>(index)) ? 1 : 0)
}

int sk_function_call_may_overwrite(void* call, sk_tensor tensor, int* out) {
  SK_TRY({
    (void)sk::call_of(call);
    const at::Tensor& t = *tensor;
    // Two owners of the TensorImpl: the caller's handle and the saved variable. One TensorImpl on
    // the storage: no view, base or alias of it lives anywhere else. The engine releases saved
    // variables after the node unless the graph is kept, when the next backward reads them again.
    const bool exclusive = t.defined() && t.has_storage() && t.storage().data() != nullptr &&
                           t.use_count() <= 2 && t.storage().use_count() == 1;
    *out = exclusive && !torch::autograd::get_current_graph_task_keep_graph() ? 1 : 0;
  })
}

}  // extern "C"
