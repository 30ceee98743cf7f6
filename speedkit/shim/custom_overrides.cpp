// A user's Rust kernel as an ATen operator's implementation under one dispatch key
// (speedkit::overrides::OperatorOverride): a boxed kernel (what a Python `torch.library.impl` is)
// whose calls go to Rust through speedkit.h's sk_override_vtable, registered in a torch::Library of
// its own so that destroying it removes exactly this kernel and brings back the one it replaced.
//
// The kernel may decline a call (a dtype, a shape it does not take): the kernel it replaced then
// runs, as speedkit's own overrides hand such calls to ATen. That kernel is the one the dispatcher
// computed for the key at registration: for a backend key ATen's (e.g. its CUDA kernel), for an
// autocast key the autocast wrapper of the operator, or, where autocast has none, the rest of the
// dispatch below the key. A call of the same operator from inside the kernel (on the same thread)
// runs that kernel too, so a Rust kernel can post-process ATen's result without recursing.
//
// Under an autocast key the kernel runs with that key excluded, as autocast's own wrappers do:
// operators it calls see no autocast, so it casts what it chooses.
#include "shim.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "quiet_warnings.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace sk {
namespace {

c10::DispatchKey dispatch_key(int key) {
  switch (key) {
    case SK_DISPATCH_CPU:
      return c10::DispatchKey::CPU;
    case SK_DISPATCH_CUDA:
      return c10::DispatchKey::CUDA;
    case SK_DISPATCH_AUTOCAST_CPU:
      return c10::DispatchKey::AutocastCPU;
    case SK_DISPATCH_AUTOCAST_CUDA:
      return c10::DispatchKey::AutocastCUDA;
    default:
      TORCH_CHECK(false, "no dispatch key ", key);
  }
}

bool is_autocast(c10::DispatchKey key) {
  return key == c10::DispatchKey::AutocastCPU || key == c10::DispatchKey::AutocastCUDA;
}

// One call's state, shared with Rust through the `call` pointer.
struct OverrideCall {
  std::vector<at::Tensor> results;
  bool answered = false;
  bool declined = false;
  std::string error;
};

// The arguments of one call as the ABI's structs, pointing into the stack and into storage kept
// here (int lists, strings) for the callback's duration.
class Arguments {
 public:
  Arguments(const c10::FunctionSchema& schema, torch::jit::Stack& stack) {
    const auto& declared = schema.arguments();
    auto first = stack.end() - static_cast<std::ptrdiff_t>(declared.size());
    args_.reserve(declared.size());
    for (size_t i = 0; i < declared.size(); ++i) args_.push_back(describe(declared[i].name(), first[i]));
  }
  const sk_override_arg* data() const { return args_.data(); }
  int64_t size() const { return static_cast<int64_t>(args_.size()); }

 private:
  sk_override_arg describe(const std::string& name, c10::IValue& value) {
    sk_override_arg arg{};
    arg.name = name.c_str();
    // An undefined tensor is how ATen's own callers pass an absent optional (batch_norm's weight).
    if (value.isNone() || (value.isTensor() && !value.toTensor().defined())) {
      arg.kind = SK_VALUE_NONE;
    } else if (value.isTensor()) {
      arg.kind = SK_VALUE_TENSOR;
      // The IValue holds the tensor itself: its address is a handle for the callback's duration.
      arg.tensor = &value.toTensor();
    } else if (value.isBool()) {
      arg.kind = SK_VALUE_BOOL;
      arg.int_value = value.toBool() ? 1 : 0;
    } else if (value.isInt()) {
      arg.kind = SK_VALUE_INT;
      arg.int_value = value.toInt();
    } else if (value.isDouble()) {
      arg.kind = SK_VALUE_DOUBLE;
      arg.double_value = value.toDouble();
    } else if (value.isIntList()) {
      const std::vector<int64_t>& ints = lists_.emplace_back(value.toIntVector());
      arg.kind = SK_VALUE_INTS;
      arg.ints = ints.data();
      arg.n_ints = static_cast<int64_t>(ints.size());
    } else if (value.isBoolList()) {
      std::vector<uint8_t>& bools = bool_lists_.emplace_back();
      for (bool b : value.toBoolList()) bools.push_back(b ? 1 : 0);
      arg.kind = SK_VALUE_BOOLS;
      arg.bools = bools.data();
      arg.n_bools = static_cast<int64_t>(bools.size());
    } else if (value.isString()) {
      arg.kind = SK_VALUE_STRING;
      arg.text = texts_.emplace_back(value.toStringRef()).c_str();
    } else {
      arg.kind = SK_VALUE_OTHER;
      arg.text = texts_.emplace_back(value.tagKind()).c_str();
    }
    return arg;
  }

  std::vector<sk_override_arg> args_;
  // Deques: their elements stay where they are as more are added.
  std::deque<std::vector<int64_t>> lists_;
  std::deque<std::vector<uint8_t>> bool_lists_;
  std::deque<std::string> texts_;
};

class RustKernel;

// The kernels running on this thread, innermost last: a kernel that finds itself here was called
// from its own callback, and runs the kernel it replaced instead.
thread_local std::vector<const RustKernel*> running;

struct Running {
  explicit Running(const RustKernel* kernel) { running.push_back(kernel); }
  ~Running() { running.pop_back(); }
  Running(const Running&) = delete;
  Running& operator=(const Running&) = delete;
};

class RustKernel final : public c10::OperatorKernel {
 public:
  RustKernel(const sk_override_vtable& vtable, void* state) : vtable_(vtable), state_(state) {}
  ~RustKernel() override {
    if (vtable_.drop != nullptr) vtable_.drop(state_);
  }
  RustKernel(const RustKernel&) = delete;
  RustKernel& operator=(const RustKernel&) = delete;

  // What a declined call runs, decided once the operator and key are known (before registering).
  void replace(const c10::OperatorHandle& op, c10::DispatchKey key) {
    key_ = key;
    returns_ = op.schema().returns().size();
    const bool direct = op.hasKernelForDispatchKey(key) && !op.isKernelFallthroughKernel(key);
    if (is_autocast(key) && !direct) return;  // the rest of the dispatch below the key
    TORCH_CHECK(op.hasComputedKernelForDispatchKey(key), op.operator_name(), " has no ", c10::toString(key),
                " kernel to hand declined calls to");
    replaced_.emplace(op.getComputedKernelForDispatchKey(key));
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    if (std::find(running.begin(), running.end(), this) != running.end()) return run_replaced(op, keys, stack);
    OverrideCall call;
    int status = 0;
    {
      Arguments args(op.schema(), *stack);
      Running guard(this);
      std::optional<c10::impl::ExcludeDispatchKeyGuard> no_autocast;
      if (is_autocast(key_)) no_autocast.emplace(key_);
      status = vtable_.kernel(state_, &call, args.data(), args.size());
    }
    TORCH_CHECK(status == 0, call.error.empty() ? "the Rust kernel failed without a message" : call.error);
    TORCH_CHECK(call.answered, "the Rust kernel of ", op.operator_name(), " neither handed back results nor declined");
    if (call.declined) return run_replaced(op, keys, stack);
    TORCH_CHECK(call.results.size() == returns_, "the Rust kernel of ", op.operator_name(), " handed back ",
                call.results.size(), " tensors; the operator returns ", returns_);
    torch::jit::drop(*stack, op.schema().arguments().size());
    for (at::Tensor& result : call.results) stack->emplace_back(std::move(result));
  }

 private:
  void run_replaced(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) const {
    if (replaced_) return replaced_->callBoxed(op, keys, stack);
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, key_), stack);
  }

  sk_override_vtable vtable_;
  void* state_;
  c10::DispatchKey key_ = c10::DispatchKey::Undefined;
  size_t returns_ = 0;
  std::optional<c10::SafeKernelFunction> replaced_;
};

// Why `op` cannot take a Rust kernel under `key`, or empty.
std::string registration_unsupported(const c10::OperatorHandle& op, c10::DispatchKey key) {
  const c10::FunctionSchema& schema = op.schema();
  for (const c10::Argument& arg : schema.arguments()) {
    if (arg.alias_info() != nullptr && arg.alias_info()->isWrite())
      return "it writes its argument `" + arg.name() + "` (an in-place or out= operator); override its functional form";
  }
  for (const c10::Argument& ret : schema.returns()) {
    if (ret.type()->kind() != c10::TypeKind::TensorType || ret.alias_info() != nullptr)
      return "it returns " + ret.type()->str() + (ret.alias_info() != nullptr ? " aliasing an input" : "") +
             ", and a Rust kernel returns new tensors only";
  }
  if (!is_autocast(key) && !op.hasKernelForDispatchKey(key) &&
      op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
    return "it is a composite of other operators (CompositeImplicitAutograd): a " + std::string(c10::toString(key)) +
           " kernel would take autograd's formula away from it; override the operators it calls, or register under "
           "an autocast key";
  return {};
}

struct Registration {
  // torch::Library keeps a pointer to its file name, so the name lives as long as the library.
  std::string file;
  std::unique_ptr<torch::Library> library;
};

Registration* register_kernel(const char* name, const char* overload, int key_code, const char* file, int line,
                              std::unique_ptr<RustKernel> kernel) {
  const c10::DispatchKey key = dispatch_key(key_code);
  const std::string qualified = name;
  const auto colons = qualified.find("::");
  TORCH_CHECK(colons != std::string::npos, "`", qualified, "` is not a qualified operator name (as `aten::gelu`)");
  const std::string space = qualified.substr(0, colons), base = qualified.substr(colons + 2);
  const std::string overload_name = overload;
  const auto op = c10::Dispatcher::singleton().findSchema({qualified, overload_name});
  const std::string shown = qualified + (overload_name.empty() ? "" : "." + overload_name);
  TORCH_CHECK(op.has_value(), "no operator ", shown, " is registered with PyTorch's dispatcher");
  const std::string why = registration_unsupported(*op, key);
  TORCH_CHECK(why.empty(), "cannot override ", shown, ": ", why);
  kernel->replace(*op, key);

  const QuietWarnings quiet;  // for this registration alone
  count_flag_write();
  auto registration = std::make_unique<Registration>();
  registration->file = file;
  registration->library = std::make_unique<torch::Library>(torch::Library::IMPL, space, key,
                                                           registration->file.c_str(), static_cast<uint32_t>(line));
  const std::string impl_name = overload_name.empty() ? base : base + "." + overload_name;
  registration->library->impl(impl_name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(kernel)));
  return registration.release();
}

OverrideCall& override_call_of(void* call) {
  TORCH_CHECK(call != nullptr, "no call");
  return *static_cast<OverrideCall*>(call);
}

}  // namespace
}  // namespace sk

extern "C" {

int sk_custom_override_register(const char* name, const char* overload, int key, const char* file, int line,
                                const sk_override_vtable* vtable, void* state, void** registration) {
  // Owned from the first line, so every failure below frees the Rust state.
  auto kernel = std::make_unique<sk::RustKernel>(*vtable, state);
  SK_TRY(*registration = sk::register_kernel(name, overload, key, file, line, std::move(kernel)))
}

int sk_custom_override_remove(void* registration) {
  SK_TRY(delete static_cast<sk::Registration*>(registration))
}

int sk_override_call_set_results(void* call, const sk_tensor* results, int64_t n) {
  SK_TRY({
    sk::OverrideCall& c = sk::override_call_of(call);
    c.results.clear();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(results[i] != nullptr && results[i]->defined(), "result ", i, " is an undefined tensor");
      c.results.push_back(*results[i]);
    }
    c.answered = true;
  })
}

int sk_override_call_decline(void* call) {
  SK_TRY({
    sk::OverrideCall& c = sk::override_call_of(call);
    c.declined = c.answered = true;
  })
}

int sk_override_call_fail(void* call, const char* message) {
  SK_TRY(sk::override_call_of(call).error = message != nullptr ? message : "")
}

}  // extern "C"
