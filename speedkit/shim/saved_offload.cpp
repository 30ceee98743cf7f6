// Saved tensors parked in host memory while a step runs eagerly (the warm-up steps before a CUDA
// graph capture). An eager step keeps every activation autograd saves until the backward reads it,
// so it peaks far above the captured step, which fuses and recomputes. Here autograd's saved
// variables are given hooks (torch.autograd.graph.save_on_cpu's mechanism): a saved tensor's memory
// moves to the host once nothing but the saved variables holds it, and comes back when the backward
// unpacks it.
//
// Unlike save_on_cpu, nothing is copied while the forward still holds the tensor, and the storage
// object stays the same: its bytes leave and come back (another device address). Each pack and
// unpack is marked in PyTorch's execution trace (record functions named below), so speedkit::trace
// can give the backward's reads the keys of the forward's tensors again.
//
// libtorch asks its default autograd engine for the hooks. A session puts a subclass in its place
// (which runs every backward on libtorch's own engine) and puts libtorch's back at its end. Only the
// session's thread gets hooks; the calls the hooks make (autograd's detach before a pack, the
// copies) reach neither the execution trace nor the interposer.
#include "shim.h"

#include "interposer.h"
#include "pinned_host.h"
#include "saved_offload.h"

#include <ATen/Functions.h>
#include <ATen/record_function.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

namespace sk::saved_offload {
namespace {

// Set by KeptOnDevice.
thread_local bool kept_on_device = false;

using torch::autograd::Engine;

// The record functions that mark a pack (its tensor as saved) and an unpack (the tensor the
// backward reads, then the saved one), as speedkit::trace reads them.
constexpr const char* kPackedMarker = "speedkit::saved_tensor_packed";
constexpr const char* kUnpackedMarker = "speedkit::saved_tensor_unpacked";

// This thread's operator calls reach neither record functions (the execution trace) nor the
// interposer between begin() and end(); end() puts back what begin() found.
class HiddenCalls {
 public:
  void begin() {
    if (on_) return;
    record_functions_ = at::isRecordFunctionEnabled();
    interposer_excluded_ = c10::impl::tls_is_dispatch_key_excluded(interposer::kKey);
    at::enableRecordFunction(false);
    c10::impl::tls_set_dispatch_key_excluded(interposer::kKey, true);
    on_ = true;
  }
  void end() {
    if (!on_) return;
    c10::impl::tls_set_dispatch_key_excluded(interposer::kKey, interposer_excluded_);
    at::enableRecordFunction(record_functions_);
    on_ = false;
  }
  ~HiddenCalls() { end(); }

 private:
  bool on_ = false;
  bool record_functions_ = true;
  bool interposer_excluded_ = false;
};

// Scoped HiddenCalls.
struct Hidden {
  HiddenCalls calls;
  Hidden() { calls.begin(); }
};

// A storage some saved tensors live on.
struct SavedStorage {
  int64_t aliases = 0;    // the hooks' tensors on it, each holding it once
  at::Tensor host;        // its bytes while parked; undefined while on the device
  bool read = false;      // unpacked by the backward: it stays on the device from then on
};

// One session's saved storages, shared by the hooks it made (which may outlive it).
class Parking {
 public:
  Parking(std::thread::id thread, int64_t min_bytes) : thread_(thread), min_bytes_(min_bytes) {}

  bool serves(std::thread::id thread) const { return !ended_ && thread == thread_; }
  void end() { ended_ = true; }

  void add(const at::Tensor& alias) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++storages_[alias.storage().unsafeGetStorageImpl()].aliases;
    park_unheld();
  }

  void remove(const at::Tensor& alias) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = storages_.find(alias.storage().unsafeGetStorageImpl());
    if (it != storages_.end() && --it->second.aliases == 0) storages_.erase(it);
  }

  // Brings `alias`'s storage back to the device where it is parked, to stay there.
  void restore(const at::Tensor& alias) {
    std::lock_guard<std::mutex> lock(mutex_);
    c10::StorageImpl* storage = alias.storage().unsafeGetStorageImpl();
    auto it = storages_.find(storage);
    if (it == storages_.end()) return;
    if (it->second.host.defined()) {
      bring_back(*storage, it->second.host, alias.device());
      it->second.host = at::Tensor();
    }
    it->second.read = true;
    park_unheld();
  }

  std::pair<int64_t, int64_t> parked() const { return {parked_count_.load(), parked_bytes_.load()}; }

 private:
  // Parks every storage that only the hooks' tensors hold: nothing else can read or write it
  // before the backward unpacks one of them.
  void park_unheld() {
    if (ended_) return;
    for (auto& [storage, saved] : storages_) {
      if (saved.host.defined() || saved.read || !parkable(*storage)) continue;
      if (c10::raw::intrusive_ptr::use_count(storage) != static_cast<uint32_t>(saved.aliases)) continue;
      saved.host = move_out(*storage);
      ++parked_count_;
      parked_bytes_ += static_cast<int64_t>(storage->nbytes());
    }
  }

  bool parkable(const c10::StorageImpl& storage) const {
    const auto type = storage.device_type();
    return (type == c10::kCPU || type == c10::kCUDA) && storage.allocator() != nullptr &&
           storage.data() != nullptr && static_cast<int64_t>(storage.nbytes()) >= min_bytes_;
  }

  static at::Tensor bytes_of(void* data, size_t nbytes, c10::Device device) {
    return at::from_blob(data, {static_cast<int64_t>(nbytes)}, at::TensorOptions().dtype(at::kByte).device(device));
  }

  // Copies the storage's bytes to the host (pinned_host's memory for a CUDA storage, copied on the
  // current stream) and frees its device memory; the storage keeps no memory until bring_back.
  static at::Tensor move_out(c10::StorageImpl& storage) {
    Hidden hidden;
    const c10::Device device = storage.device();
    const bool cuda = device.is_cuda();
    const auto nbytes = static_cast<int64_t>(storage.nbytes());
    at::Tensor host =
        cuda ? pinned_host::take(nbytes, device) : at::empty({nbytes}, at::TensorOptions().dtype(at::kByte));
    host.copy_(bytes_of(storage.mutable_data(), storage.nbytes(), device), /*non_blocking=*/cuda);
    if (cuda) {
      // Its memory is reused only after the copy, wherever it was allocated.
      const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(device);
      c10::getDeviceAllocator(c10::kCUDA)->recordStream(storage.data_ptr(), stream);
    }
    storage.set_data_ptr_noswap(c10::DataPtr(nullptr, device));
    return host;
  }

  static void bring_back(c10::StorageImpl& storage, const at::Tensor& host, c10::Device device) {
    Hidden hidden;
    c10::DataPtr memory = storage.allocator()->allocate(storage.nbytes());
    bytes_of(memory.get(), storage.nbytes(), device).copy_(host, /*non_blocking=*/device.is_cuda());
    storage.set_data_ptr_noswap(std::move(memory));
  }

  const std::thread::id thread_;
  const int64_t min_bytes_;
  std::atomic<bool> ended_{false};
  std::mutex mutex_;
  std::unordered_map<c10::StorageImpl*, SavedStorage> storages_;
  std::atomic<int64_t> parked_count_{0};
  std::atomic<int64_t> parked_bytes_{0};
};

std::string describe(const at::Tensor& t) {
  std::ostringstream text;
  text << t.toString() << " " << t.sizes();
  return text.str();
}

// One saved variable's hooks: its tensor as an alias of its own (no autograd history, so no cycle
// through an output's grad_fn), and the version the tensor had when saved.
class ParkingHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit ParkingHooks(std::shared_ptr<Parking> parking) : parking_(std::move(parking)) {
    // Autograd detaches the tensor before it calls the pack hook: a call of the step's that the
    // step without hooks does not make.
    hidden_.begin();
  }

  ~ParkingHooks() override {
    hidden_.end();
    if (alias_.defined()) parking_->remove(alias_);
  }

  void call_pack_hook(const at::Tensor& tensor) override {
    hidden_.end();
    alias_ = tensor.tensor_data();
    version_ = alias_._version();
    if (!alias_.has_storage()) return;
    RECORD_FUNCTION(kPackedMarker, std::vector<c10::IValue>{alias_});
    parking_->add(alias_);
  }

  at::Tensor call_unpack_hook() override {
    if (alias_._version() != version_) {
      TORCH_CHECK(false, "one of the variables needed for gradient computation has been modified by an inplace "
                  "operation: ", describe(alias_), " is at version ", alias_._version(), "; expected version ",
                  version_, " instead");
    }
    if (!alias_.has_storage()) return alias_.tensor_data();
    parking_->restore(alias_);
    // A tensor of its own version counter, so that autograd wraps this very object.
    at::Tensor read(alias_.unsafeGetTensorImpl()->shallow_copy_and_detach(c10::VariableVersion(0), false));
    {
      RECORD_FUNCTION(kUnpackedMarker, std::vector<c10::IValue>{read, alias_});
    }
    return read;
  }

 private:
  std::shared_ptr<Parking> parking_;
  HiddenCalls hidden_;
  at::Tensor alias_;
  uint32_t version_ = 0;
};

std::mutex session_mutex;
std::shared_ptr<Parking> session;  // the active session's parking, under session_mutex

class ParkingEngine final : public Engine {
 public:
  // Every backward runs on libtorch's engine (its threads and queues); only the hooks are ours.
  torch::autograd::variable_list execute(const torch::autograd::edge_list& roots,
                                         const torch::autograd::variable_list& inputs, bool keep_graph,
                                         bool create_graph, bool accumulate_grad,
                                         const torch::autograd::edge_list& outputs) override {
    return Engine::get_base_engine().execute(roots, inputs, keep_graph, create_graph, accumulate_grad, outputs);
  }

  c10::intrusive_ptr<at::ivalue::Future> execute_with_graph_task(
      const std::shared_ptr<torch::autograd::GraphTask>& graph_task, std::shared_ptr<torch::autograd::Node> graph_root,
      torch::autograd::InputBuffer&& input_buffer) override {
    return Engine::get_base_engine().execute_with_graph_task(graph_task, std::move(graph_root),
                                                             std::move(input_buffer));
  }

  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    std::shared_ptr<Parking> parking;
    {
      std::lock_guard<std::mutex> lock(session_mutex);
      parking = session;
    }
    if (!parking || kept_on_device || !parking->serves(std::this_thread::get_id())) return nullptr;
    return std::make_unique<ParkingHooks>(std::move(parking));
  }
};

// Never destroyed: saved variables made during a session may ask it for hooks at any time after.
Engine& parking_engine() {
  static auto* engine = new ParkingEngine();
  return *engine;
}

}  // namespace

KeptOnDevice::KeptOnDevice() : previous_(kept_on_device) { kept_on_device = true; }
KeptOnDevice::~KeptOnDevice() { kept_on_device = previous_; }

}  // namespace sk::saved_offload

extern "C" {

int sk_saved_offload_begin(int64_t min_bytes, void** out) {
  SK_TRY({
    std::lock_guard<std::mutex> lock(sk::saved_offload::session_mutex);
    if (sk::saved_offload::session) throw std::runtime_error("saved tensors are already being parked by another session");
    if (&torch::autograd::Engine::get_default_engine() != &torch::autograd::Engine::get_base_engine()) {
      throw std::runtime_error(
          "autograd's default engine is not libtorch's own (a Python process installs its own): saved tensors "
          "cannot be given hooks here");
    }
    auto parking = std::make_shared<sk::saved_offload::Parking>(std::this_thread::get_id(), min_bytes);
    sk::count_flag_write();
    torch::autograd::set_default_engine_stub(&sk::saved_offload::parking_engine);
    sk::saved_offload::session = parking;
    *out = new std::shared_ptr<sk::saved_offload::Parking>(std::move(parking));
  })
}

int sk_saved_offload_end(void* handle, int64_t* parked, int64_t* parked_bytes) {
  SK_TRY({
    auto* parking = static_cast<std::shared_ptr<sk::saved_offload::Parking>*>(handle);
    {
      std::lock_guard<std::mutex> lock(sk::saved_offload::session_mutex);
      if (sk::saved_offload::session == *parking) {
        torch::autograd::set_default_engine_stub(&torch::autograd::Engine::get_base_engine);
        sk::saved_offload::session.reset();
      }
    }
    (*parking)->end();
    std::tie(*parked, *parked_bytes) = (*parking)->parked();
    delete parking;
  })
}

int sk_saved_offload_release_host_cache(void) { SK_TRY(sk::pinned_host::release()) }

int sk_saved_offload_active(int* out) {
  SK_TRY(*out = &torch::autograd::Engine::get_default_engine() != &torch::autograd::Engine::get_base_engine() ? 1 : 0)
}

}  // extern "C"
