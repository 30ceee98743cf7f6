// Deferred tensors: a tensor whose memory and values come at its first read. A fused op whose output
// usually feeds one consumer it fuses with (the fp32 log-probabilities of a classifier's
// log_softmax, read only by the nll_loss after it) returns one of these, and never writes the
// output where nothing else reads it.
//
// The tensor is ordinary in every way but its storage: its size in bytes with no memory (a null
// pointer, which every read of data refuses), and a DataPtr that carries a Pending context and the
// `released` deleter, which is how any view of it is recognised as pending. The size lets view
// operators check their bounds as for any tensor. While
// at least one is pending, a global RecordFunction callback sees every dispatcher call with its
// inputs; one that takes a pending tensor (other than the exempt operators, the fused consumers, and
// the operators that only make views of it)
// first gives the storage memory from the device's allocator and has the Rust side write the values,
// on the operator's own thread and current stream (so also inside a CUDA graph capture). A read
// that bypasses the dispatcher (a raw data pointer) meets ATen's "data is not allocated yet" error,
// never stale memory. A composite that runs no kernel of its own (conv2d, linear) reads nothing
// itself: the operators it calls are observed instead. The callback is removed when the last pending tensor is materialized or dies.
// A pending tensor may name what it is computed from (sk_deferred_computed_from): an operator that
// writes one of those in place (by its schema) first materializes it, and a source whose version
// moved where no operator was seen leaves it NaN with a warning, never values from new contents.
#include "shim.h"

#include "deferred.h"
#include "interposer.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace sk {
namespace {

struct Pending {
  sk_deferred_vtable vtable;
  void* state;
  std::vector<std::string> exempt_ops;
  uint64_t tag;
  std::vector<int64_t> sizes;
  at::TensorOptions options;
  size_t nbytes;
  // What its values are computed from (sk_deferred_computed_from), with their versions then.
  std::vector<at::Tensor> sources;
  std::vector<uint32_t> versions;
};

// Guards the count of pending tensors and the observer's handle.
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
int64_t pending_count = 0;
std::optional<at::CallbackHandle> observer;

// The pending tensors that have sources, by their storage (held weakly: the storage owns the
// Pending); guarded by registry_mutex.
std::vector<std::pair<Pending*, c10::weak_intrusive_ptr<c10::StorageImpl>>> computed;

// Serialises materializations; recursive, as a materializer may read another deferred tensor.
std::recursive_mutex& materialize_mutex() {
  static std::recursive_mutex m;
  return m;
}

// The pending storage's deleter: runs when the tensor is materialized (its DataPtr replaced) or dies.
void released(void* context) {
  auto* pending = static_cast<Pending*>(context);
  pending->vtable.release(pending->state);
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    if (!pending->sources.empty())
      computed.erase(std::remove_if(computed.begin(), computed.end(), [&](const auto& e) { return e.first == pending; }),
                     computed.end());
    if (--pending_count == 0 && observer) {
      at::removeCallback(*observer);
      observer.reset();
    }
  }
  // Outside the lock: a source may be a pending tensor whose last hold this is, and whose release
  // takes the lock in its turn.
  delete pending;
}

Pending* pending_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const at::DataPtr& data = t.storage().data_ptr();
  return data.get_deleter() == &released ? static_cast<Pending*>(data.get_context()) : nullptr;
}

// Whether `source` lies in `storage`.
bool in_storage(const at::Tensor& source, const c10::StorageImpl* storage) {
  return source.has_storage() && source.storage().unsafeGetStorageImpl() == storage;
}

// The storage a materialization on this thread is writing: its writer's own writes to it are the
// values it always stood for, not a change of a source.
thread_local const c10::StorageImpl* being_written = nullptr;

// Records, for the pending tensors computed from `storage`, that its materialization moved its
// version: their sources' recorded versions become the current ones.
void written_anew(const c10::StorageImpl* storage) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (const auto& entry : computed) {
    Pending* p = entry.first;
    for (size_t i = 0; i < p->sources.size(); ++i)
      if (in_storage(p->sources[i], storage)) p->versions[i] = p->sources[i]._version();
  }
}

// Which of `pending`'s sources was written in place since it was made, where one was: a write
// the observer did not see first (a kernel launched on a raw pointer that bumped the version).
std::string changed_source(const Pending& pending) {
  for (size_t i = 0; i < pending.sources.size(); ++i) {
    const uint32_t now = pending.sources[i]._version();
    if (now != pending.versions[i])
      return "its input " + std::to_string(i) + " was written in place before it was computed (version " +
             std::to_string(pending.versions[i]) + ", now " + std::to_string(now) + ")";
  }
  return "";
}

// Gives `t`'s storage its memory and values; false when it was not pending (any more).
bool materialize(const at::Tensor& t) {
  std::lock_guard<std::recursive_mutex> lock(materialize_mutex());
  Pending* pending = pending_of(t);
  if (pending == nullptr) return false;
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  c10::DeviceGuard guard(pending->options.device());
  at::DataPtr memory = c10::GetAllocator(pending->options.device().type())->allocate(pending->nbytes);
  // The swap hands back the pending DataPtr; destroying it (at the end of this scope, after the
  // values are written) releases `pending`.
  at::DataPtr was_pending = storage->set_data_ptr(std::move(memory));
  storage->set_nbytes(pending->nbytes);
  at::Tensor whole = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage)),
      c10::DispatchKeySet(pending->options.computeDispatchKey()), pending->options.dtype());
  whole.unsafeGetTensorImpl()->set_sizes_contiguous(pending->sizes);
  char message[512] = {0};
  {
    // Restored however the writing ends (fill_ may throw).
    struct Writing {
      const c10::StorageImpl* outer = being_written;
      explicit Writing(const c10::StorageImpl* s) { being_written = s; }
      ~Writing() { being_written = outer; }
    } writing(storage);
    if (const std::string changed = changed_source(*pending); !changed.empty()) {
      TORCH_WARN("speedkit: a deferred tensor's values could not be written (", changed, "); it reads as NaN");
      whole.fill_(std::numeric_limits<double>::quiet_NaN());
    } else if (pending->vtable.materialize(pending->state, &whole, message, sizeof message) != 0) {
      TORCH_WARN("speedkit: a deferred tensor's values could not be written (", message, "); it reads as NaN");
      whole.fill_(std::numeric_limits<double>::quiet_NaN());
    }
  }
  written_anew(storage);
  return true;
}

// Operators that make a view (or read only sizes) and never read data: their result shares the
// pending storage and is pending with it, so the read that needs the values comes later, through
// the view. Where one of them does more (reshape of a tensor it cannot view), it calls an operator
// that is observed in its turn.
bool only_views(const char* op) {
  static const char* const names[] = {
      "aten::view",      "aten::_unsafe_view", "aten::reshape",   "aten::_reshape_alias", "aten::permute",
      "aten::transpose", "aten::t",            "aten::expand",    "aten::as_strided",     "aten::select",
      "aten::slice",     "aten::narrow",       "aten::squeeze",   "aten::unsqueeze",      "aten::alias",
      "aten::detach",    "aten::flatten",      "aten::view_as",   "aten::expand_as",      "aten::unflatten",
      // No-ops on a tensor already so: a conversion or a copy calls _to_copy or clone, observed.
      "aten::to",        "aten::contiguous",
      // Autograd's own record of a detach, around aten::detach.
      "detach",
  };
  for (const char* name : names)
    if (std::strcmp(name, op) == 0) return true;
  return false;
}

// The operator whose read is materializing a tensor on this thread, for the writer's messages.
thread_local const char* materializing_for = nullptr;

void consider(const at::Tensor& t, const char* op) {
  // Locked: another thread may be materializing the same storage, and its op must not start before
  // the values are written.
  std::lock_guard<std::recursive_mutex> lock(materialize_mutex());
  Pending* pending = pending_of(t);
  if (pending == nullptr || only_views(op) || interposer::next_call_computed()) return;
  for (const std::string& exempt : pending->exempt_ops)
    if (exempt == op) return;
  materializing_for = op;
  materialize(t);
  materializing_for = nullptr;
}

// What the observer needs to know of an operator, asked once per operator.
struct OperatorFacts {
  // A composite that runs no kernel of its own: its implementation calls other operators (conv2d:
  // autocast's cast, then convolution), each observed in its turn, so the read that needs a pending
  // tensor's values, if any, is one of theirs.
  bool only_composes = false;
  // The positions of the arguments it writes in place (`Tensor(a!)`: `add_`'s self, an `out=`).
  std::vector<size_t> written;
};

const OperatorFacts& facts_of(const c10::OperatorName& name) {
  static std::mutex mutex;
  static auto* known = new std::unordered_map<c10::OperatorName, OperatorFacts>();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = known->find(name);
  if (it == known->end()) {
    OperatorFacts facts;
    if (const auto op = c10::Dispatcher::singleton().findOp(name); op.has_value()) {
      facts.only_composes = op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
                            !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
                            !op->hasKernelForDispatchKey(c10::DispatchKey::CUDA) &&
                            !op->hasKernelForDispatchKey(c10::DispatchKey::CPU);
      if (op->hasSchema()) {
        const auto& arguments = op->schema().arguments();
        for (size_t i = 0; i < arguments.size(); ++i)
          if (arguments[i].alias_info() && arguments[i].alias_info()->isWrite()) facts.written.push_back(i);
      }
    }
    it = known->emplace(name, std::move(facts)).first;
  }
  return it->second;
}

// Materializes, before operator `op` writes `t` in place, every pending tensor computed from
// memory `t` shares: it gets the values its sources have now, as the step that made it saw them.
void compute_before_write(const at::Tensor& t, const char* op) {
  if (!t.defined() || !t.has_storage()) return;
  const c10::StorageImpl* written = t.storage().unsafeGetStorageImpl();
  if (written == being_written) return;
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> due;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    for (const auto& [pending, storage] : computed) {
      const bool reads = std::any_of(pending->sources.begin(), pending->sources.end(),
                                     [&](const at::Tensor& s) { return in_storage(s, written); });
      if (auto alive = reads ? storage.lock() : c10::intrusive_ptr<c10::StorageImpl>()) due.push_back(alive);
    }
  }
  for (auto& storage : due) {
    std::lock_guard<std::recursive_mutex> lock(materialize_mutex());
    // A handle on the storage alone (no operator runs to make it): materialize reads its storage.
    const at::Tensor handle = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(std::move(storage)), c10::DispatchKeySet(c10::DispatchKey::CPU), caffe2::TypeMeta::Make<uint8_t>());
    materializing_for = op;
    materialize(handle);
    materializing_for = nullptr;
  }
}

// Whether a pending tensor with sources exists (guarded by registry_mutex).
bool any_computed() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  return !computed.empty();
}

std::unique_ptr<at::ObserverContext> on_operator(const at::RecordFunction& fn) {
  const auto name = fn.operator_name();
  const OperatorFacts* facts = name.has_value() ? &facts_of(*name) : nullptr;
  if (facts != nullptr && !facts->written.empty() && any_computed()) {
    const auto inputs = fn.inputs();
    for (size_t i : facts->written)
      if (i < inputs.size() && inputs[i].isTensor()) compute_before_write(inputs[i].toTensor(), fn.name());
  }
  if (facts != nullptr && facts->only_composes) return nullptr;
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor()) {
      consider(v.toTensor(), fn.name());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) consider(t, fn.name());
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef())
        if (e.isTensor()) consider(e.toTensor(), fn.name());
    }
  }
  return nullptr;
}

void count_one_more() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  if (pending_count++ == 0) {
    observer = at::addGlobalCallback(at::RecordFunctionCallback(&on_operator)
                                         .needsInputs(true)
                                         .scopes({at::RecordScope::FUNCTION}));
  }
}

// "a,b" → {"a", "b"}; "" → {}.
std::vector<std::string> names_of(const char* list) {
  std::vector<std::string> names;
  std::string rest = list ? list : "";
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    names.push_back(rest.substr(0, comma));
    rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
  }
  return names;
}

at::Tensor deferred(std::vector<int64_t> sizes, at::TensorOptions options, const char* exempt_ops, uint64_t tag,
                    const sk_deferred_vtable& vtable, void* state) {
  auto* pending = new Pending{vtable, state, {}, tag, std::move(sizes), options, 0, {}, {}};
  try {
    pending->exempt_ops = names_of(exempt_ops);
    TORCH_CHECK(at::isRecordFunctionEnabled(),
                "a deferred tensor needs RecordFunction, which is switched off on this thread");
    int64_t numel = 1;
    for (int64_t s : pending->sizes) {
      TORCH_CHECK(s >= 0, "a deferred tensor's size is negative");
      numel *= s;
    }
    pending->nbytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  } catch (...) {
    vtable.release(state);
    delete pending;
    throw;
  }
  count_one_more();
  // From here the storage owns `pending`: its death runs `released`.
  c10::Storage storage(c10::Storage::use_byte_size_t(), pending->nbytes,
                       at::DataPtr(nullptr, pending, &released, options.device()),
                       c10::GetAllocator(options.device().type()), /*resizable=*/true);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(options.computeDispatchKey()), options.dtype());
  t.unsafeGetTensorImpl()->set_sizes_contiguous(pending->sizes);
  return t;
}

}  // namespace

const char* deferred_reader() { return materializing_for; }

at::Tensor deferred_tensor(std::vector<int64_t> sizes, at::TensorOptions options, const char* exempt_ops, uint64_t tag,
                           const sk_deferred_vtable& vtable, void* state) {
  return deferred(std::move(sizes), options, exempt_ops, tag, vtable, state);
}

}  // namespace sk

extern "C" {

int sk_deferred_new(const int64_t* sizes, int64_t ndim, int scalar_type, int device, const char* exempt_ops,
                    uint64_t tag, const sk_deferred_vtable* vtable, void* state, sk_tensor* out) {
  SK_TRY({
    auto options = at::TensorOptions().dtype(static_cast<at::ScalarType>(scalar_type));
    options = device < 0 ? options.device(at::kCPU)
                         : options.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
    *out = sk::give(sk::deferred(std::vector<int64_t>(sizes, sizes + ndim), options, exempt_ops, tag, *vtable, state));
  })
}

int sk_deferred_materialize(sk_tensor tensor, int* materialized) {
  SK_TRY(*materialized = sk::materialize(*tensor) ? 1 : 0)
}

int sk_deferred_computed_from(sk_tensor tensor, const sk_tensor* sources, int64_t count) {
  SK_TRY({
    std::lock_guard<std::recursive_mutex> lock(sk::materialize_mutex());
    sk::Pending* p = sk::pending_of(*tensor);
    TORCH_CHECK(p != nullptr, "only a pending deferred tensor takes sources");
    TORCH_CHECK(p->sources.empty(), "a deferred tensor takes its sources once");
    for (int64_t i = 0; i < count; ++i) {
      p->sources.push_back(*sources[i]);
      p->versions.push_back(sources[i]->_version());
    }
    if (count > 0) {
      std::lock_guard<std::mutex> registry(sk::registry_mutex());
      sk::computed.emplace_back(p, tensor->storage().getWeakStorageImpl());
    }
  })
}

int sk_deferred_is_pending(sk_tensor tensor, int* pending) { SK_TRY(*pending = sk::pending_of(*tensor) ? 1 : 0) }

int sk_deferred_tag(sk_tensor tensor, int* pending, uint64_t* tag) {
  SK_TRY({
    // Locked as `consider`: the Pending may be released by a materialization on another thread.
    std::lock_guard<std::recursive_mutex> lock(sk::materialize_mutex());
    const sk::Pending* p = sk::pending_of(*tensor);
    *pending = p ? 1 : 0;
    *tag = p ? p->tag : 0;
  })
}

int sk_deferred_pending(int64_t* count, int* observing) {
  SK_TRY({
    std::lock_guard<std::mutex> lock(sk::registry_mutex());
    *count = sk::pending_count;
    *observing = sk::observer.has_value() ? 1 : 0;
  })
}

}  // extern "C"
