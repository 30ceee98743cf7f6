// ZeRO-3's parameters, as PyTorch's FSDP2 keeps them: each unit of parameters (a block of the
// model) is one flat buffer in the compute type (bf16 under autocast) whose storage holds memory
// only while the unit is gathered. The parameters stay the same tensors, with the same shapes and
// autograd identity; they become views of that buffer (set_data), so autograd's records of them,
// and the views it saves for the backward pass, follow the buffer wherever its memory is. Each rank
// keeps its own contiguous part of every unit in fp32, the optimizer's master copy; a gather casts
// it into this rank's place in the buffer and all-gathers the others' around it.
//
// A unit is gathered when a call first takes a tensor on its storage: the interposer's fallback
// (interposer.h) tells the residency of every call on the thread that made it, and on autograd's
// threads during that thread's backward passes. When the step moves on to another unit, the units
// behind it are let go, but for "pinned" ones (the parameters outside the model's numbered blocks:
// embeddings, the final norm, the head), kept until the optimizer step. The order in which the
// units were used in one step is the order the next step prefetches in: each unit's all-gather
// starts, on the collective's stream, when the unit before it comes into use. Every rank runs the
// same calls, so every rank issues the same collectives in the same order.
//
// A call that writes into a gathered unit (a checkpoint's load into the parameters) marks it, and
// this rank's part is taken back into its fp32 copy when the unit is let go.
#include "distributed.h"
#include "interposer.h"

#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StorageImpl.h>

#include <mutex>
#include <thread>
#include <unordered_map>

namespace sk::dist {
namespace {

struct ResidentUnit {
  std::vector<at::Tensor> params;  // views of `full`, shaped as given
  at::Tensor full;                 // [padded] in the compute type; memory only while gathered
  at::Tensor master;               // this rank's part in fp32: the optimizer's
  int64_t full_bytes = 0;
  bool pinned = false;
  bool gathered = false;
  bool written = false;                  // a call wrote into the gathered unit
  c10::intrusive_ptr<c10d::Work> work;  // a prefetch's all-gather, not yet joined
};

// `t`'s storage given `bytes` of fresh memory from its own allocator (the caching allocator on
// CUDA, on the current stream), or none. Every tensor on the storage sees the change.
void set_storage_bytes(const at::Tensor& t, size_t bytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (bytes == 0) {
    storage->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  } else {
    storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  }
  storage->set_nbytes(bytes);
}

}  // namespace

class Residency : public interposer::CallObserver {
 public:
  Residency(c10::intrusive_ptr<c10d::ProcessGroup> pg, int backend) : pg_(std::move(pg)), backend_(backend) {}

  Residency(const Residency&) = delete;
  Residency& operator=(const Residency&) = delete;

  ~Residency() override { stop_observing(); }

  size_t add_unit(const std::vector<at::Tensor>& params, at::ScalarType compute, bool pinned) {
    TORCH_CHECK(!params.empty(), "a unit of parameters needs at least one");
    at::NoGradGuard no_grad;
    const int64_t world = pg_->getSize(), rank = pg_->getRank();
    int64_t numel = 0;
    for (const at::Tensor& p : params) numel += p.numel();
    const int64_t chunk = (numel + world - 1) / world;
    const auto options = params[0].options().requires_grad(false);
    at::Tensor whole = at::zeros({chunk * world}, options.dtype(at::kFloat));
    const std::vector<at::Tensor> values = views_of(whole, params);
    for (size_t i = 0; i < params.size(); ++i) values[i].copy_(params[i]);

    ResidentUnit u;
    u.params = params;
    u.pinned = pinned;
    u.master = whole.narrow(0, rank * chunk, chunk).clone();
    u.full = at::empty({chunk * world}, options.dtype(compute));
    u.full_bytes = u.full.numel() * static_cast<int64_t>(u.full.element_size());
    const std::vector<at::Tensor> views = views_of(u.full, params);
    for (size_t i = 0; i < params.size(); ++i) const_cast<at::Tensor&>(params[i]).set_data(views[i]);
    set_storage_bytes(u.full, 0);

    std::lock_guard<std::mutex> lock(mutex_);
    unit_of_[u.full.storage().unsafeGetStorageImpl()] = units_.size();
    units_.push_back(std::move(u));
    return units_.size() - 1;
  }

  const at::Tensor& master(size_t unit) const { return units_.at(unit).master; }

  void start_observing() {
    thread_ = std::this_thread::get_id();
    interposer::observe(this);
    included_ = std::make_unique<c10::impl::IncludeDispatchKeyGuard>(interposer::kKey);
  }

  // The observer taken away, and the key from the thread that included it: with no fallback left
  // registered, a call through the key would fail.
  void stop_observing() {
    interposer::stop_observing(this);
    if (!included_) return;
    if (thread_ == std::this_thread::get_id()) {
      included_.reset();
    } else {
      (void)included_.release();  // not this thread's keys to put back
    }
  }

  void before(const c10::OperatorHandle& op, const torch::jit::Stack& stack) override {
    const auto& arguments = op.schema().arguments();
    if (stack.size() < arguments.size()) return;
    const size_t base = stack.size() - arguments.size();
    for (size_t i = 0; i < arguments.size(); ++i) {
      const c10::IValue& v = stack[base + i];
      const bool writes = arguments[i].alias_info() != nullptr && arguments[i].alias_info()->isWrite();
      if (v.isTensor()) {
        touch(v.toTensor(), writes);
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) touch(t, writes);
      }
    }
  }

  void refresh(size_t unit) {
    std::lock_guard<std::mutex> lock(mutex_);
    const c10::impl::ExcludeDispatchKeyGuard unseen(interposer::kKey);
    refresh_unit(units_.at(unit));
  }

  // A unit whose gradients are all in is not used again before the optimizer step: as FSDP2
  // reshards after a block's backward, its memory goes now rather than when the step moves on.
  void done_with(size_t unit) {
    std::lock_guard<std::mutex> lock(mutex_);
    const c10::impl::ExcludeDispatchKeyGuard unseen(interposer::kKey);
    ResidentUnit& u = units_.at(unit);
    if (u.pinned) return;
    release(u);
    if (current_ == static_cast<int64_t>(unit)) current_ = -1;
  }

  void after_step() {
    std::lock_guard<std::mutex> lock(mutex_);
    const c10::impl::ExcludeDispatchKeyGuard unseen(interposer::kKey);
    for (ResidentUnit& u : units_) refresh_unit(u);
    order_ = std::move(used_);
    used_.clear();
    position_ = 0;
    current_ = -1;
  }

  int64_t resident_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t bytes = 0;
    for (const ResidentUnit& u : units_) {
      bytes += u.master.numel() * static_cast<int64_t>(u.master.element_size());
      if (u.gathered) bytes += u.full_bytes;
    }
    return bytes;
  }

  // Ends the sharding: the parameters take their whole fp32 values back (`gather`, a collective), or
  // become empty tensors, which any later use reports, rather than views of memory that is gone.
  void unshard(bool gather) {
    stop_observing();
    std::vector<at::Tensor> whole;
    if (gather) whole = gather_masters();
    std::lock_guard<std::mutex> lock(mutex_);
    at::NoGradGuard no_grad;
    size_t next = 0;
    for (ResidentUnit& u : units_) {
      if (u.work) wait(u.work);
      u.work.reset();
      for (at::Tensor& p : u.params) {
        at::Tensor data = gather ? whole.at(next) : at::empty({0}, u.master.options());
        p.set_data(data);
        ++next;
      }
      u.gathered = false;
    }
    unit_of_.clear();
  }

  std::vector<at::Tensor> gather_masters() {
    std::lock_guard<std::mutex> lock(mutex_);
    const c10::impl::ExcludeDispatchKeyGuard unseen(interposer::kKey);
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> out;
    for (ResidentUnit& u : units_) {
      if (u.written && u.gathered) take_back(u);
      at::Tensor whole = at::empty({u.master.numel() * pg_->getSize()}, u.master.options());
      at::Tensor mine = backend_ == kNccl ? u.master : u.master.clone();
      wait(pg_->_allgather_base(whole, mine));
      for (at::Tensor& v : views_of(whole, u.params)) out.push_back(v);
    }
    return out;
  }

 private:
  // A call takes `t`: the unit on its storage, if any, is gathered and becomes the current one.
  void touch(const at::Tensor& t, bool writes) {
    if (!t.defined() || !t.has_storage()) return;
    const auto found = unit_of_.find(t.storage().unsafeGetStorageImpl());
    if (found == unit_of_.end()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    const c10::impl::ExcludeDispatchKeyGuard unseen(interposer::kKey);
    use(found->second);
    if (writes) units_[found->second].written = true;
  }

  void use(size_t k) {
    ResidentUnit& u = units_[k];
    if (!u.gathered) start_gather(u);
    if (u.work) {
      wait(u.work);
      u.work.reset();
    }
    if (current_ == static_cast<int64_t>(k)) return;
    current_ = static_cast<int64_t>(k);
    used_.push_back(k);
    // The unit the last step used after this one, if this step follows it so far.
    int64_t next = -1;
    if (position_ < order_.size() && order_[position_] == k) {
      ++position_;
      if (position_ < order_.size()) next = static_cast<int64_t>(order_[position_]);
    } else {
      position_ = order_.size();
    }
    for (size_t other = 0; other < units_.size(); ++other)
      if (other != k && static_cast<int64_t>(other) != next && !units_[other].pinned) release(units_[other]);
    if (next >= 0 && !units_[static_cast<size_t>(next)].gathered) start_gather(units_[static_cast<size_t>(next)]);
  }

  // Memory for the unit, this rank's part cast into its place, and the all-gather of the others'
  // around it, started (in place for NCCL; Gloo is given a copy, as it makes no such promise).
  void start_gather(ResidentUnit& u) {
    at::NoGradGuard no_grad;
    set_storage_bytes(u.full, static_cast<size_t>(u.full_bytes));
    const int64_t chunk = u.master.numel();
    at::Tensor mine = u.full.narrow(0, pg_->getRank() * chunk, chunk);
    mine.copy_(u.master);
    if (backend_ != kNccl) mine = mine.clone();
    u.work = pg_->_allgather_base(u.full, mine);
    u.gathered = true;
  }

  void release(ResidentUnit& u) {
    if (!u.gathered) return;
    if (u.work) {
      wait(u.work);
      u.work.reset();
    }
    if (u.written) take_back(u);
    set_storage_bytes(u.full, 0);
    u.gathered = false;
  }

  // This rank's part of a unit a call wrote into, back into its fp32 copy.
  void take_back(ResidentUnit& u) {
    at::NoGradGuard no_grad;
    const int64_t chunk = u.master.numel();
    u.master.copy_(u.full.narrow(0, pg_->getRank() * chunk, chunk));
    u.written = false;
  }

  void refresh_unit(ResidentUnit& u) {
    u.written = false;  // the optimizer's update supersedes a write
    release(u);
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int backend_;
  std::vector<ResidentUnit> units_;
  std::unordered_map<const c10::StorageImpl*, size_t> unit_of_;
  mutable std::mutex mutex_;
  int64_t current_ = -1;
  std::vector<size_t> used_;   // this step's units, in the order they came into use
  std::vector<size_t> order_;  // the last step's
  size_t position_ = 0;        // how far this step has followed `order_`
  std::thread::id thread_;
  std::unique_ptr<c10::impl::IncludeDispatchKeyGuard> included_;
};

std::shared_ptr<Residency> make_residency(c10::intrusive_ptr<c10d::ProcessGroup> pg, int backend) {
  return std::make_shared<Residency>(std::move(pg), backend);
}

size_t add_unit(Residency& r, const std::vector<at::Tensor>& params, at::ScalarType compute, bool pinned) {
  return r.add_unit(params, compute, pinned);
}

const at::Tensor& master_of(const Residency& r, size_t unit) { return r.master(unit); }

void start_observing(Residency& r) { r.start_observing(); }

void refresh(Residency& r, size_t unit) { r.refresh(unit); }

void done_with(Residency& r, size_t unit) { r.done_with(unit); }

void after_step(Residency& r) { r.after_step(); }

int64_t resident_bytes(const Residency& r) { return r.resident_bytes(); }

std::vector<at::Tensor> gather_masters(Residency& r) { return r.gather_masters(); }

void unshard(Residency& r, bool gather) { r.unshard(gather); }

}  // namespace sk::dist
