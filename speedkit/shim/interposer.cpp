// The interposer: a step's operator calls seen where they reach the kernels (below autograd and
// autocast), recorded once, then replaced by a program: the calls a fused group computes return
// their outputs without running ATen's kernels (an in-place call returns its argument, which the
// kernel rewrites), and the group's generated kernel runs, through a Rust callback, once the
// group's inputs exist. It is how speedkit::fusion runs its kernels inside
// an unchanged model's step. An observer (interposer.h) is told of every call before it runs:
// ZeRO-3's parameter residency (parameter_residency.cpp) gathers parameters that way.
//
// The calls are caught by a boxed fallback on the dispatch key `Fake`, which libtorch registers no
// kernel or fallback for (Python's fake tensors dispatch through the `Python` key) and which sits
// below autograd, above the backends. The fallback (one torch::Library) is registered while a
// session or an observer needs it, and destroyed, which removes it, when the last one ends. Each
// adds the key to its thread's included keys (a c10 guard, put back at its end); autograd's threads
// copy the thread's dispatch keys for the backward, so the backward's calls come too. Calls on
// other threads never see it.
//
// Recording numbers the calls in the order they come and notes, per call, the RecordFunction
// handle of the operator (PyTorch's execution trace, which speedkit::trace reads, names its calls
// by the same handle) and how many calls it made itself (a composite's inner calls): replacing a
// call skips those.
#include "shim.h"

#include "deferred.h"
#include "interposer.h"

#include <ATen/Functions.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

namespace sk {
namespace {

constexpr c10::DispatchKey kInterposerKey = interposer::kKey;

struct RecordedCall {
  std::string op;
  uint64_t rf_id;
  int64_t span;
};

struct OutputLayout {
  at::ScalarType type;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  bool unwritten;  // no kernel writes or reads its memory: an intermediate of its group
};

// A tensor a group's kernel takes: an input or output of one of the program's calls, or element
// `element` of a list of tensors the call takes (-1: the argument is one tensor).
struct ArgRef {
  int64_t call;
  bool output;
  int32_t index;
  int32_t element;
};

// An argument of a call that group `group`'s kernel takes: its position, and its element where it
// is a list of tensors (-1: one tensor).
struct CapturedInput {
  int64_t group;
  int32_t index;
  int32_t element;
};

struct ProgramCall {
  std::string op;
  int64_t group;  // -1: ATen runs it
  bool computed;  // the group's kernel computes its outputs; ATen does not run it
  bool launch;    // the group's kernel launches once this call returns
  int64_t span;
  std::vector<OutputLayout> outputs;    // of a computed call, in result order
  std::vector<CapturedInput> captured_inputs;  // the inputs a kernel takes
  // (group, output): the outputs its own group's kernel writes, and those another group's kernel
  // reads (a group norm's statistics, which its normalised elements are recomputed from).
  std::vector<std::pair<int64_t, int32_t>> captured_outputs;
  // A computed call whose result `deferred_result` is deferred: group `deferred_by`'s kernel
  // writes it at its first read, from the inputs captured for that group (-1: none).
  int64_t deferred_by = -1;
  int32_t deferred_result = 0;
  // A cast of a weight that outlives the step, which the weight's kept copy serves
  // (weight_casts.cpp): no kernel where the copy is current.
  bool kept_copy = false;
};

// A program's callbacks, shared with the deferred results that launch its kernels later.
struct Callbacks {
  sk_interposer_vtable vtable;
  void* state;

  Callbacks(const sk_interposer_vtable& v, void* s) : vtable(v), state(s) {}
  Callbacks(const Callbacks&) = delete;
  Callbacks& operator=(const Callbacks&) = delete;
  ~Callbacks() {
    if (vtable.release) vtable.release(state);
  }
};

struct Program {
  c10::Device device{at::kCPU};
  std::vector<ProgramCall> calls;
  std::vector<std::vector<ArgRef>> group_args;
  // Per group, its first call: an input captured before it (a forward tensor a backward kernel
  // computes a recomputed result from) is checked against in-place writes at the launch.
  std::vector<int64_t> first_call;
  std::shared_ptr<Callbacks> callbacks;
};

// (group, call, output, index, element): one group's hold on a call's argument or result.
using SlotKey = std::tuple<int64_t, int64_t, bool, int32_t, int32_t>;

// The RecordFunction handles of the operators entered on this thread, innermost last (recording
// only): the call the fallback sees is the innermost one entered.
thread_local std::vector<std::pair<uint64_t, const char*>> entered_ops;

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  entered_ops.emplace_back(fn.handle(), fn.name());
  return nullptr;
}

void on_exit(const at::RecordFunction&, at::ObserverContext*) {
  if (!entered_ops.empty()) entered_ops.pop_back();
}

// A result a computed call handed to the step before its group's kernel ran, which the kernel
// writes at its launch. It is held weakly, by its memory: autograd accumulates a gradient in place
// and steals a parameter's gradient only from a tensor no one else holds, and must make the choices
// it made when the step was recorded, without the interposer. A result whose memory was freed
// before the launch is read by no one.
struct HandedResult {
  c10::weak_intrusive_ptr<c10::StorageImpl> memory;
  c10::DispatchKeySet keys;
  caffe2::TypeMeta dtype;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset;

  explicit HandedResult(const at::Tensor& t)
      : memory(t.storage().getWeakStorageImpl()),
        keys(t.key_set()),
        dtype(t.dtype()),
        sizes(t.sizes().vec()),
        strides(t.strides().vec()),
        offset(t.storage_offset()) {}

  // The result again, on its memory; undefined where that memory was freed.
  at::Tensor get() const {
    c10::intrusive_ptr<c10::StorageImpl> storage = memory.lock();
    if (!storage) return {};
    at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(std::move(storage)), keys, dtype);
    t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
    return t;
  }
};

struct Session {
  Program* program = nullptr;  // null: recording
  std::thread::id thread = std::this_thread::get_id();
  std::mutex mutex;
  int64_t next = 0;
  std::vector<RecordedCall> recorded;
  // The tensors of kernel arguments seen or made, until their group's launch has them.
  std::map<SlotKey, at::Tensor> slots;
  // The results handed to the step before their group's launch, held by their memory only.
  std::map<SlotKey, HandedResult> handed;
  // The version of each input as it was captured.
  std::map<SlotKey, int64_t> versions;
  std::vector<bool> launched;
  // A recording's casts of parameters to 16 bits, by call (sk_interposer_keep_copies makes the
  // copies of those the program serves).
  std::map<int64_t, std::pair<at::Tensor, at::ScalarType>> weight_casts;
  // The weights whose kept copies were current when a cast was served from them: the step itself
  // (its optimizer) must leave them current, or a replay of it reads a stale copy.
  std::vector<std::pair<at::Tensor, at::ScalarType>> served_current;
  std::string failure;
  bool holds_fallback = false;
  // Made and destroyed on the session's thread (its dispatch keys are that thread's).
  std::unique_ptr<c10::impl::IncludeDispatchKeyGuard> included;
  std::optional<at::CallbackHandle> observer;
};

std::atomic<Session*> active{nullptr};
std::atomic<interposer::CallObserver*> call_observer{nullptr};

// The fallback, registered while a session or an observer needs it (one registration per key).
std::mutex fallback_mutex;
int fallback_users = 0;
std::unique_ptr<torch::Library> fallback_library;

void interpose(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);

void acquire_fallback() {
  std::lock_guard<std::mutex> lock(fallback_mutex);
  if (fallback_users == 0) {
    count_flag_write();
    fallback_library = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kInterposerKey, __FILE__,
                                                        static_cast<uint32_t>(__LINE__));
    fallback_library->fallback(torch::CppFunction::makeFromBoxedFunction<&interpose>());
  }
  ++fallback_users;
}

void release_fallback() {
  std::lock_guard<std::mutex> lock(fallback_mutex);
  if (--fallback_users == 0) fallback_library.reset();
}

c10::DispatchKeySet below_interposer(c10::DispatchKeySet keys) {
  return keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kInterposerKey);
}

// The weight and type of a `_to_copy` on `stack` (its arguments, before the call) that a kept copy
// can stand for: an fp32 CUDA parameter (a leaf that requires grad) cast to bf16 or fp16 on its
// device, in its own layout.
std::optional<std::pair<at::Tensor, at::ScalarType>> weight_cast(const c10::OperatorHandle& op,
                                                                const torch::jit::Stack& stack) {
  constexpr size_t kArguments = 7;  // self, dtype, layout, device, pin_memory, non_blocking, memory_format
  if (op.operator_name().name != "aten::_to_copy" || op.schema().arguments().size() != kArguments ||
      stack.size() < kArguments)
    return std::nullopt;
  const c10::IValue* args = &stack[stack.size() - kArguments];
  if (!args[0].isTensor() || !args[1].isInt()) return std::nullopt;
  const at::Tensor& self = args[0].toTensor();
  const auto type = static_cast<at::ScalarType>(args[1].toInt());
  const bool on_device = args[3].isNone() || (args[3].isDevice() && args[3].toDevice() == self.device());
  const bool own_layout =
      args[6].isNone() ||
      (args[6].isInt() && static_cast<at::MemoryFormat>(args[6].toInt()) == at::MemoryFormat::Preserve);
  const bool strided =
      args[2].isNone() || (args[2].isInt() && static_cast<at::Layout>(args[2].toInt()) == at::kStrided);
  const bool parameter = self.is_cuda() && self.is_leaf() && self.requires_grad() && self.scalar_type() == at::kFloat;
  const bool to_16_bits = type == at::kBFloat16 || type == at::kHalf;
  if (!parameter || !to_16_bits || !on_device || !own_layout || !strided || !self.is_non_overlapping_and_dense())
    return std::nullopt;
  return std::pair{self, type};
}

void record(Session& s, const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const std::string& name = op.operator_name().name;
  uint64_t rf_id = 0;
  if (!entered_ops.empty() && name == entered_ops.back().second) rf_id = entered_ops.back().first;
  int64_t index = 0;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    index = s.next++;
    s.recorded.push_back({name, rf_id, 0});
  }
  const auto cast = weight_cast(op, *stack);
  op.redispatchBoxed(below_interposer(keys), stack);
  std::lock_guard<std::mutex> lock(s.mutex);
  s.recorded[static_cast<size_t>(index)].span = s.next - index;
  if (cast) s.weight_casts.emplace(index, *cast);
}

// Serves kept-copy call `call` (a weight's cast) from the weight's kept copy: pushes its result in
// place of the arguments, and returns true; false where the call is not such a cast, and ATen runs it.
// A copy that was stale is cast again here (captured with the step, so each replay casts it); one that
// was current makes no kernel, and the session checks at its end that the step kept it current.
bool serve_kept_copy(Session& s, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto cast = weight_cast(op, *stack);
  if (!cast) return false;
  const auto& [weight, type] = *cast;
  const c10::impl::ExcludeDispatchKeyGuard unseen(kInterposerKey);
  const bool current = weight_casts::is_current(weight, type);
  at::Tensor copy = weight_casts::get(weight, type);
  if (copy.sizes() != weight.sizes() || copy.strides() != weight.strides()) return false;
  if (current) s.served_current.emplace_back(weight, type);
  torch::jit::drop(*stack, op.schema().arguments().size());
  // Its own tensor on the copy's memory: autograd records this cast's history on it, not on the copy.
  stack->emplace_back(at::alias(copy));
  return true;
}

void fail_session(const std::string& why);

// An unwritten intermediate's writer (see output_of): a read of it departs from the plan, which
// has no call reading it, and fails the fused step's run (the tensor reads as NaN, deferred.cpp).
int write_unwritten(void* state, sk_tensor, char* message, int64_t capacity) {
  const char* reader = deferred_reader();
  std::snprintf(message, static_cast<size_t>(capacity), "%s was read by %s, where the traced step read it only "
                "inside its group's kernel", static_cast<const std::string*>(state)->c_str(),
                reader ? reader : "a direct read of its memory");
  fail_session(message);
  return 1;
}

void release_unwritten(void* state) { delete static_cast<std::string*>(state); }

// Whether `layout` is its sizes' contiguous layout (strides of dimensions of size 1 aside).
bool contiguous(const OutputLayout& layout) {
  int64_t expected = 1;
  for (size_t d = layout.sizes.size(); d-- > 0;) {
    if (layout.sizes[d] != 1 && layout.strides[d] != expected) return false;
    expected *= layout.sizes[d];
  }
  return true;
}

// The smallest intermediate handed out without memory: below it, the pending tensor's bookkeeping
// costs more than the memory it saves.
constexpr int64_t kUnwrittenBytes = 1 << 20;

// Output `index` of computed call `call`: the one a launch made ahead of it; else, for a result whose
// memory no kernel writes or reads (an intermediate of its group, which only the group's later
// members take, themselves substituted: the program says which), a tensor of its traced layout with
// no memory (deferred.cpp), so that the step's memory does not hold what nothing writes; else a
// fresh tensor (a result the launch to come writes, or an intermediate too small to matter or not
// contiguous).
at::Tensor output_of(Session& s, int64_t call, int32_t index) {
  const ProgramCall& c = s.program->calls[static_cast<size_t>(call)];
  const auto slot = s.slots.find({c.group, call, true, index, -1});
  if (slot != s.slots.end()) return slot->second;
  const OutputLayout& layout = c.outputs.at(static_cast<size_t>(index));
  const auto options = at::TensorOptions().dtype(layout.type).device(s.program->device);
  // Not a call of the step: the allocation does not come back here.
  const c10::impl::ExcludeDispatchKeyGuard unseen(kInterposerKey);
  int64_t bytes = static_cast<int64_t>(c10::elementSize(layout.type));
  for (int64_t size : layout.sizes) bytes *= size;
  if (layout.unwritten && contiguous(layout) && bytes >= kUnwrittenBytes) {
    const sk_deferred_vtable vtable{&write_unwritten, &release_unwritten};
    auto what = std::make_unique<std::string>("result " + std::to_string(index) + " of call " + std::to_string(call) +
                                              " (" + c.op + ")");
    try {
      return deferred_tensor(layout.sizes, options, "", 0, vtable, what.release());
    } catch (const std::exception&) {
      // No RecordFunction on this thread to see a read by: the intermediate gets its memory.
    }
  }
  return at::empty_strided(layout.sizes, layout.strides, options);
}

// What a deferred result needs to be written: its kernel's group, the kernel's inputs, and the
// versions they had when the step handed them over (autograd's check of a saved tensor: an input
// written in place since would give other values than the step's).
struct Recompute {
  std::shared_ptr<Callbacks> callbacks;
  int64_t group;
  std::vector<at::Tensor> inputs;
  std::vector<int64_t> versions;
};

// Records `why` as the running session's failure: the fused step's run then fails with it.
void fail_session(const std::string& why) {
  if (Session* s = active.load()) {
    std::lock_guard<std::mutex> lock(s->mutex);
    if (s->failure.empty()) s->failure = why;
  }
}

// A deferred result's writer. Where it cannot write (an input written in place since), the tensor
// reads as NaN (deferred.cpp) and the fused step's run fails with the reason.
int write_recomputed(void* state, sk_tensor out, char* message, int64_t capacity) {
  auto* r = static_cast<Recompute*>(state);
  for (size_t i = 0; i < r->inputs.size(); ++i) {
    if (r->inputs[i]._version() != r->versions[i]) {
      std::snprintf(message, static_cast<size_t>(capacity),
                    "input %zu of fused group %lld was written in place before the result it recomputes was read", i,
                    static_cast<long long>(r->group));
      fail_session(message);
      return 1;
    }
  }
  std::vector<sk_tensor> handles;
  handles.reserve(r->inputs.size() + 1);
  for (at::Tensor& t : r->inputs) handles.push_back(&t);
  handles.push_back(out);
  int status = 0;
  {
    // What the callback calls (a scalar's value) is not a call of the step.
    const c10::impl::ExcludeDispatchKeyGuard unseen(kInterposerKey);
    status = r->callbacks->vtable.launch(r->callbacks->state, r->group, handles.data(),
                                         static_cast<int64_t>(handles.size()), message, capacity);
  }
  if (status != 0) fail_session("fused group " + std::to_string(r->group) + ": " + message);
  return status;
}

void release_recomputed(void* state) { delete static_cast<Recompute*>(state); }

// Result `call.deferred_result` of computed call `index`, deferred: the tensor, with no memory
// yet, that group `call.deferred_by`'s kernel writes when the backward first reads it (speedkit's
// recompute instead of save), holding that kernel's inputs until then.
at::Tensor deferred_output(Session& s, int64_t index, const ProgramCall& call) {
  const int64_t group = call.deferred_by;
  auto recompute = std::make_unique<Recompute>();
  recompute->callbacks = s.program->callbacks;
  recompute->group = group;
  for (const ArgRef& ref : s.program->group_args.at(static_cast<size_t>(group))) {
    const auto slot = s.slots.find({group, ref.call, ref.output, ref.index, ref.element});
    TORCH_CHECK(slot != s.slots.end(), "input ", ref.index, " of call ", ref.call, " was not seen before call ", index,
                " deferred its result");
    recompute->inputs.push_back(slot->second);
    recompute->versions.push_back(slot->second._version());
    s.versions.erase(slot->first);
    s.slots.erase(slot);
  }
  const OutputLayout& layout = call.outputs.at(static_cast<size_t>(call.deferred_result));
  const sk_deferred_vtable vtable{&write_recomputed, &release_recomputed};
  // Not a call of the step: the allocation of the pending tensor does not come back here.
  const c10::impl::ExcludeDispatchKeyGuard unseen(kInterposerKey);
  return deferred_tensor(layout.sizes, at::TensorOptions().dtype(layout.type).device(s.program->device), "", 0,
                         vtable, recompute.release());
}

// Result `k` of computed call `index`: deferred where the program says so, else as output_of. A
// deferral that fails is a departure, and the result an ordinary tensor.
at::Tensor result_of(Session& s, int64_t index, const ProgramCall& call, int32_t k) {
  if (k != call.deferred_result || call.deferred_by < 0) return output_of(s, index, k);
  try {
    return deferred_output(s, index, call);
  } catch (const std::exception& e) {
    if (s.failure.empty()) s.failure = "call " + std::to_string(index) + " (" + call.op + "): " + e.what();
    return output_of(s, index, k);
  }
}

// The argument that result `k` of `schema` is, rewritten in place (`add_`'s `self`: the schema's
// write alias), or -1: a new tensor.
int rewritten_argument(const c10::FunctionSchema& schema, size_t k) {
  const c10::AliasInfo* result = schema.returns().at(k).alias_info();
  if (result == nullptr || !result->isWrite()) return -1;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const c10::AliasInfo* argument = schema.arguments()[i].alias_info();
    if (argument != nullptr && argument->isWrite() && argument->beforeSets() == result->beforeSets())
      return static_cast<int>(i);
  }
  return -1;
}

// Runs group `group`'s kernel on its arguments (lock held by the caller, released around the
// callback, which launches on this thread's current stream).
void launch(Session& s, std::unique_lock<std::mutex>& lock, int64_t group) {
  const auto& refs = s.program->group_args.at(static_cast<size_t>(group));
  std::vector<at::Tensor> args;
  args.reserve(refs.size());
  for (const ArgRef& ref : refs) {
    const SlotKey key{group, ref.call, ref.output, ref.index, ref.element};
    auto slot = s.slots.find(key);
    if (const auto handed = s.handed.find(key); slot == s.slots.end() && handed != s.handed.end()) {
      at::Tensor result = handed->second.get();
      if (result.defined()) slot = s.slots.emplace(key, std::move(result)).first;
    }
    const int64_t first = static_cast<size_t>(group) < s.program->first_call.size()
                              ? s.program->first_call[static_cast<size_t>(group)]
                              : -1;
    if (slot != s.slots.end() && !ref.output && ref.call < first && s.versions[key] != slot->second._version()) {
      s.failure = "fused group " + std::to_string(group) + ": input " + std::to_string(ref.index) + " of call " +
                  std::to_string(ref.call) + " was written in place before the group's kernel read it";
      return;
    }
    if (slot == s.slots.end()) {
      if (!ref.output) {
        s.failure = "fused group " + std::to_string(group) + ": input " + std::to_string(ref.index) + " of call " +
                    std::to_string(ref.call) + " was not seen before the launch";
        return;
      }
      slot = s.slots.emplace(key, output_of(s, ref.call, ref.index)).first;
    }
    args.push_back(slot->second);
  }
  s.launched[static_cast<size_t>(group)] = true;
  // Its inputs, and the outputs of calls already made, are held no longer.
  for (const ArgRef& ref : refs)
    if (!ref.output || ref.call < s.next) {
      s.slots.erase({group, ref.call, ref.output, ref.index, ref.element});
      s.handed.erase({group, ref.call, ref.output, ref.index, ref.element});
      s.versions.erase({group, ref.call, ref.output, ref.index, ref.element});
    }
  std::vector<sk_tensor> handles;
  handles.reserve(args.size());
  for (at::Tensor& t : args) handles.push_back(&t);
  char message[512] = {0};
  const Callbacks& callbacks = *s.program->callbacks;
  lock.unlock();
  int status = 0;
  {
    // What the callback calls (a scalar's value) is not a call of the step.
    const c10::impl::ExcludeDispatchKeyGuard unseen(kInterposerKey);
    status = callbacks.vtable.launch(callbacks.state, group, handles.data(), static_cast<int64_t>(handles.size()), message,
                           sizeof message);
  }
  lock.lock();
  if (status != 0 && s.failure.empty()) s.failure = "fused group " + std::to_string(group) + ": " + message;
}

// Whether the call `name` stands for the recorded `recorded`: the same operator, or the
// out-of-place twin of a recorded in-place one. Autograd accumulates a gradient's parts with
// `add_` into a tensor only it holds, else with `add`; a group's kernel may hold it until its
// launch where ATen's kernel had let it go. An out-of-place call computes the same values into
// new memory, which the group's kernel writes as it would have written the old.
bool same_operator(const std::string& recorded, const std::string& name) {
  return recorded == name || (recorded.size() == name.size() + 1 && recorded.back() == '_' &&
                              recorded.compare(0, name.size(), name) == 0);
}

void substitute(Session& s, const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  std::unique_lock<std::mutex> lock(s.mutex);
  const int64_t index = s.next++;
  const auto& calls = s.program->calls;
  const std::string& name = op.operator_name().name;
  const bool off_program = !s.failure.empty() || index >= static_cast<int64_t>(calls.size());
  if (!off_program && !same_operator(calls[static_cast<size_t>(index)].op, name))
    s.failure = "call " + std::to_string(index) + " of the step is " + name + " where the traced step called " +
                calls[static_cast<size_t>(index)].op;
  if (off_program || !s.failure.empty()) {
    lock.unlock();
    op.redispatchBoxed(below_interposer(keys), stack);
    return;
  }
  const ProgramCall& call = calls[static_cast<size_t>(index)];
  if (call.kept_copy && serve_kept_copy(s, op, stack)) {
    s.next = index + call.span;
    return;
  }
  const size_t arguments = op.schema().arguments().size();
  // A computed call's own in-place write, which autograd counts once this call returns, is its
  // kernel's: the value a recomputation reads there is the argument as it came.
  const auto own_write = [&](int32_t i) {
    if (!call.computed) return 0;
    for (size_t k = 0; k < op.schema().returns().size(); ++k)
      if (rewritten_argument(op.schema(), k) == i) return 1;
    return 0;
  };
  // Inputs a group's kernel takes, from its members or from a call before them (not a member of
  // any group) that held the tensor a member reads only later.
  for (const auto& [g, i, element] : call.captured_inputs) {
    const c10::IValue& v = (*stack)[stack->size() - arguments + static_cast<size_t>(i)];
    if (element < 0 && v.isTensor()) {
      s.slots[{g, index, false, i, element}] = v.toTensor();
      s.versions[{g, index, false, i, element}] = v.toTensor()._version() + own_write(i);
    } else if (element >= 0 && v.isTensorList() && static_cast<size_t>(element) < v.toTensorList().size()) {
      s.slots[{g, index, false, i, element}] = v.toTensorList().get(static_cast<size_t>(element));
      s.versions[{g, index, false, i, element}] = v.toTensorList().get(static_cast<size_t>(element))._version();
    } else {
      s.failure = "call " + std::to_string(index) + " (" + name + ") takes no tensor at argument " + std::to_string(i) +
                  (element < 0 ? "" : ", element " + std::to_string(element));
      break;
    }
  }
  if (call.computed && op.schema().returns().size() != call.outputs.size())
    s.failure = name + " returns " + std::to_string(op.schema().returns().size()) + " values where the program has " +
                std::to_string(call.outputs.size());
  if (!call.computed || !s.failure.empty()) {
    lock.unlock();
    op.redispatchBoxed(below_interposer(keys), stack);
    lock.lock();
  } else {
    // An in-place operator's result is its argument, which the kernel writes.
    std::vector<at::Tensor> rewritten(call.outputs.size());
    for (size_t k = 0; k < call.outputs.size(); ++k) {
      const int i = rewritten_argument(op.schema(), k);
      const c10::IValue& v = i < 0 ? c10::IValue() : (*stack)[stack->size() - arguments + static_cast<size_t>(i)];
      if (v.isTensor()) rewritten[k] = v.toTensor();
    }
    torch::jit::drop(*stack, arguments);
    const bool launched = s.launched[static_cast<size_t>(call.group)];
    std::vector<at::Tensor> outs(call.outputs.size());
    // The last first: a deferred first result holds those of the others its kernel reads.
    for (int32_t k = static_cast<int32_t>(call.outputs.size()) - 1; k >= 0; --k) {
      const bool in_place = rewritten[static_cast<size_t>(k)].defined();
      if (in_place && launched && s.failure.empty())
        s.failure = "call " + std::to_string(index) + " (" + name + ") rewrites its argument after its kernel ran";
      at::Tensor out = in_place ? rewritten[static_cast<size_t>(k)] : result_of(s, index, call, k);
      if (launched) s.slots.erase({call.group, index, true, k, -1});
      for (const auto& [g, output] : call.captured_outputs) {
        if (output != k) continue;
        if (g != call.group) {
          s.slots[{g, index, true, k, -1}] = out;
        } else if (!launched) {
          s.handed.insert_or_assign({call.group, index, true, k, -1}, HandedResult(out));
        }
      }
      outs[static_cast<size_t>(k)] = std::move(out);
    }
    for (at::Tensor& out : outs) stack->emplace_back(std::move(out));
    // The calls ATen's kernel would have made itself are not made.
    s.next = index + call.span;
  }
  if (call.launch && s.failure.empty()) launch(s, lock, call.group);
}

void interpose(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (interposer::CallObserver* o = call_observer.load()) o->before(op, *stack);
  Session* s = active.load();
  if (s == nullptr) {
    op.redispatchBoxed(below_interposer(keys), stack);
  } else if (s->program == nullptr) {
    record(*s, op, keys, stack);
  } else {
    substitute(*s, op, keys, stack);
  }
}

Session* begin(Program* program) {
  auto s = std::make_unique<Session>();
  s->program = program;
  if (program != nullptr) s->launched.assign(program->group_args.size(), false);
  Session* expected = nullptr;
  TORCH_CHECK(active.compare_exchange_strong(expected, s.get()),
              "another interposer session is running (one at a time per process)");
  try {
    acquire_fallback();
    s->holds_fallback = true;
    if (program == nullptr)
      s->observer = at::addGlobalCallback(
          at::RecordFunctionCallback(&on_enter, &on_exit).needsIds(true).scopes({at::RecordScope::FUNCTION}));
    s->included = std::make_unique<c10::impl::IncludeDispatchKeyGuard>(kInterposerKey);
  } catch (...) {
    if (s->observer) at::removeCallback(*s->observer);
    if (s->holds_fallback) release_fallback();
    active.store(nullptr);
    throw;
  }
  return s.release();
}

// Removes what the session put in place; its thread's keys only on that thread (elsewhere they are
// not this thread's to put back, and the guard is let go).
void tear_down(Session& s) {
  if (s.thread == std::this_thread::get_id()) {
    s.included.reset();
  } else {
    (void)s.included.release();
  }
  if (s.observer) at::removeCallback(*s.observer);
  s.observer.reset();
  if (s.holds_fallback) release_fallback();
  s.holds_fallback = false;
  Session* self = &s;
  active.compare_exchange_strong(self, nullptr);
}

void end(Session& s) {
  TORCH_CHECK(s.thread == std::this_thread::get_id(), "an interposer session ends on the thread it began on");
  tear_down(s);
  entered_ops.clear();
  if (s.program != nullptr && s.failure.empty() && s.next != static_cast<int64_t>(s.program->calls.size()))
    s.failure = "the step made " + std::to_string(s.next) + " operator calls where the traced step made " +
                std::to_string(s.program->calls.size());
  for (const auto& [weight, type] : s.served_current) {
    if (!s.failure.empty() || weight_casts::is_current(weight, type)) continue;
    s.failure = "a weight of sizes " + c10::str(weight.sizes()) +
                " was cast from its kept copy, which the step's optimizer does not keep current (speedkit's "
                "AdamW does)";
  }
  s.served_current.clear();
  s.slots.clear();
  s.handed.clear();
  s.versions.clear();
}

Program& program_of(void* p) {
  TORCH_CHECK(p != nullptr, "no interposer program");
  return *static_cast<Program*>(p);
}

}  // namespace

void interposer::observe(CallObserver* o) {
  CallObserver* expected = nullptr;
  TORCH_CHECK(call_observer.compare_exchange_strong(expected, o), "another interposer observer is in place (one at a time per process)");
  try {
    acquire_fallback();
  } catch (...) {
    call_observer.store(nullptr);
    throw;
  }
}

bool interposer::next_call_computed() {
  Session* s = active.load();
  if (s == nullptr || s->program == nullptr) return false;
  std::lock_guard<std::mutex> lock(s->mutex);
  const auto& calls = s->program->calls;
  if (!s->failure.empty() || s->next >= static_cast<int64_t>(calls.size())) return false;
  return calls[static_cast<size_t>(s->next)].computed;
}

void interposer::stop_observing(CallObserver* o) {
  CallObserver* expected = o;
  if (call_observer.compare_exchange_strong(expected, nullptr)) release_fallback();
}

}  // namespace sk

extern "C" {

int sk_interposer_program_new(int device, const sk_interposer_vtable* vtable, void* state, void** out) {
  auto program = std::make_unique<sk::Program>();
  program->callbacks = std::make_shared<sk::Callbacks>(*vtable, state);
  SK_TRY({
    program->device = device < 0 ? c10::Device(at::kCPU) : c10::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device));
    *out = program.release();
  })
}

int sk_interposer_program_add_call(void* program, const char* op, int64_t group, int computed, int launch,
                                   int64_t span) {
  SK_TRY({
    auto& p = sk::program_of(program);
    if (group >= 0) {
      if (p.first_call.size() <= static_cast<size_t>(group)) p.first_call.resize(static_cast<size_t>(group) + 1, -1);
      if (p.first_call[static_cast<size_t>(group)] < 0)
        p.first_call[static_cast<size_t>(group)] = static_cast<int64_t>(p.calls.size());
    }
    p.calls.push_back({op, group, computed != 0, launch != 0, span, {}, {}, {}});
  })
}

int sk_interposer_program_add_output(void* program, int64_t call, int scalar_type, const int64_t* sizes,
                                     const int64_t* strides, int64_t ndim, int unwritten) {
  SK_TRY({
    auto& p = sk::program_of(program);
    TORCH_CHECK(call >= 0 && call < static_cast<int64_t>(p.calls.size()), "no call ", call);
    p.calls[static_cast<size_t>(call)].outputs.push_back(
        {static_cast<at::ScalarType>(scalar_type), std::vector<int64_t>(sizes, sizes + ndim),
         std::vector<int64_t>(strides, strides + ndim), unwritten != 0});
  })
}

int sk_interposer_program_keep_copy(void* program, int64_t call) {
  SK_TRY({
    auto& p = sk::program_of(program);
    TORCH_CHECK(call >= 0 && call < static_cast<int64_t>(p.calls.size()), "no call ", call);
    auto& c = p.calls[static_cast<size_t>(call)];
    TORCH_CHECK(c.group < 0 && c.op == "aten::_to_copy", "call ", call, " is not a cast left to ATen");
    c.kept_copy = true;
  })
}

int sk_interposer_keep_copies(void* session, const int64_t* calls, int64_t n) {
  SK_TRY({
    auto& s = *static_cast<sk::Session*>(session);
    TORCH_CHECK(s.program == nullptr, "copies are kept for the casts a recording saw");
    for (int64_t i = 0; i < n; ++i) {
      // A call that cast no parameter (an input the step does not compute) keeps no copy, and
      // ATen casts it in the fused step too.
      const auto cast = s.weight_casts.find(calls[i]);
      if (cast != s.weight_casts.end()) (void)sk::weight_casts::get(cast->second.first, cast->second.second);
    }
  })
}

int sk_interposer_program_defer(void* program, int64_t call, int32_t output, int64_t group) {
  SK_TRY({
    auto& p = sk::program_of(program);
    TORCH_CHECK(group >= 0 && call >= 0 && call < static_cast<int64_t>(p.calls.size()), "no call ", call);
    auto& c = p.calls[static_cast<size_t>(call)];
    TORCH_CHECK(c.computed && output >= 0 && static_cast<size_t>(output) < c.outputs.size(), "call ", call,
                " is not computed by a group, or has no result ", output);
    c.deferred_by = group;
    c.deferred_result = output;
    // A kernel that reads nothing (a dropout's mask, drawn again) has no arguments added.
    if (p.group_args.size() <= static_cast<size_t>(group)) p.group_args.resize(static_cast<size_t>(group) + 1);
  })
}

int sk_interposer_program_add_arg(void* program, int64_t group, int64_t call, int output, int32_t index,
                                  int32_t element) {
  SK_TRY({
    auto& p = sk::program_of(program);
    TORCH_CHECK(group >= 0 && call >= 0 && call < static_cast<int64_t>(p.calls.size()), "no call ", call);
    if (p.group_args.size() <= static_cast<size_t>(group)) p.group_args.resize(static_cast<size_t>(group) + 1);
    TORCH_CHECK(output == 0 || element < 0, "a result is one tensor, not an element of a list");
    p.group_args[static_cast<size_t>(group)].push_back({call, output != 0, index, element});
    auto& c = p.calls[static_cast<size_t>(call)];
    if (output == 0) {
      c.captured_inputs.push_back({group, index, element});
    } else {
      c.captured_outputs.emplace_back(group, index);
    }
  })
}

void sk_interposer_program_free(void* program) {
  try {
    delete static_cast<sk::Program*>(program);
  } catch (...) {
    // Nothing to report to during teardown.
  }
}

int sk_interposer_begin(void* program, void** out) { SK_TRY(*out = sk::begin(static_cast<sk::Program*>(program))) }

int sk_interposer_end(void* session) { SK_TRY(sk::end(*static_cast<sk::Session*>(session))) }

int sk_interposer_recorded_count(void* session, int64_t* out) {
  SK_TRY(*out = static_cast<int64_t>(static_cast<sk::Session*>(session)->recorded.size()))
}

int sk_interposer_recorded_get(void* session, int64_t index, const char** op, uint64_t* rf_id, int64_t* span) {
  SK_TRY({
    const auto& call = static_cast<sk::Session*>(session)->recorded.at(static_cast<size_t>(index));
    *op = call.op.c_str();
    *rf_id = call.rf_id;
    *span = call.span;
  })
}

int sk_interposer_failure(void* session, const char** out) {
  SK_TRY(sk::hand_out(static_cast<sk::Session*>(session)->failure, out))
}

int sk_interposer_active(int* out) { SK_TRY(*out = sk::active.load() != nullptr ? 1 : 0) }

void sk_interposer_free(void* session) {
  auto* s = static_cast<sk::Session*>(session);
  if (s == nullptr) return;
  try {
    sk::tear_down(*s);
  } catch (...) {
    // Nothing to report to during teardown.
  }
  delete s;
}

}  // extern "C"
