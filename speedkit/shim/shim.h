// What the shim files share: the C ABI they implement (speedkit.h, declared once), its error contract
// as C++ macros, the tensor-list helpers, and the weight-copy cache that several ops use.
//
// The CUDA parts compile only when libtorch was built with CUDA and the CUDA headers are present
// (SK_WITH_CUDA, decided by build.rs); without them every CUDA entry point fails with one clear
// message (SK_CUDA_TRY) and every fused op takes ATen's path. The CUDA parts only call functions
// exported by libtorch_cuda/libc10_cuda (events through c10's device-generic c10::Event), never the
// CUDA runtime directly: c10's header-inline helpers would make every executable depend on
// libcudart, which a host's loader path need not contain.
#pragma once

#include "speedkit.h"

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace sk {

// The calling thread's last error message (defined in flags.cpp, next to sk_last_error()).
std::string& last_error();

inline void set_error(const char* message) { last_error() = message ? message : "unknown error"; }

// ATen's messages end with a C++ backtrace; the first line is what a user needs.
inline std::string first_line_of(const std::exception& e) {
  std::string what = e.what();
  auto cut = what.find("\nException raised from");
  if (cut != std::string::npos) what.resize(cut);
  return what;
}

inline void set_error_from(const std::exception& e) { last_error() = first_line_of(e); }

// Counts one write of a process-wide flag (PyTorch's, or speedkit's kernel switch); throws when a
// test asked this write to fail (sk_test_fail_nth_flag_write). Defined in flags.cpp.
void count_flag_write();

// Hands `text` out through a `const char**` out-parameter: a per-thread copy, valid until the
// thread's next call that hands out text, as speedkit.h promises.
inline void hand_out(const std::string& text, const char** out) {
  thread_local std::string kept;
  kept = text;
  *out = kept.c_str();
}

inline std::vector<at::Tensor> tensor_list(const sk_tensor* tensors, int64_t n) {
  std::vector<at::Tensor> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out.push_back(*tensors[i]);
  return out;
}

// A nullable handle as a tensor: undefined where the caller passed NULL.
inline at::Tensor optional_tensor(sk_tensor t) { return t == nullptr ? at::Tensor() : *t; }

// An optional argument of an ATen op: nullopt for an undefined tensor (some ops refuse a present
// but undefined one).
inline std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// A tensor handed to Rust through an out-parameter (Rust owns it from here).
inline sk_tensor give(at::Tensor t) { return new at::Tensor(std::move(t)); }

// As give(), NULL for an undefined tensor.
inline sk_tensor give_or_null(at::Tensor t) { return t.defined() ? give(std::move(t)) : nullptr; }

// Values kept per weight for as long as the weight lives (weight_casts.cpp's copies, fp8.cpp's amax
// histories). Entries hold their weight weakly, as autocast's cache does: an entry counts only
// while its weight lives, so a new tensor at a freed one's address never sees the old entry, and
// expired entries are dropped at the next insertion or on request. Callers hold `mutex` around
// every use.
template <typename V>
class WeakWeightTable {
 public:
  std::mutex mutex;

  // `weight`'s entry while the weight lives; nullptr where it has none.
  V* find(const at::Tensor& weight) {
    auto it = entries_.find(weight.unsafeGetTensorImpl());
    return it == entries_.end() || it->second.weight.expired() ? nullptr : &it->second.value;
  }

  // Sets `weight`'s entry to `value`, dropping the expired entries first.
  V& insert(const at::Tensor& weight, V value) {
    drop(/*all=*/false, [](const V&) {});
    Entry entry{Weak(weight.getIntrusivePtr()), std::move(value)};
    return entries_.insert_or_assign(weight.unsafeGetTensorImpl(), std::move(entry)).first->second.value;
  }

  // Drops the entries whose weights are gone (with `all`, every entry), each value seen by
  // `dropping` first.
  template <typename F>
  void drop(bool all, F&& dropping) {
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (all || it->second.weight.expired()) {
        dropping(it->second.value);
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Calls `f` on the value of every entry whose weight lives.
  template <typename F>
  void for_each_live(F&& f) const {
    for (const auto& [key, entry] : entries_)
      if (!entry.weight.expired()) f(entry.value);
  }

 private:
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Entry {
    Weak weight;
    V value;
  };
  std::unordered_map<const c10::TensorImpl*, Entry> entries_;
};

// weight_casts.cpp: fp32 weights' copies in the autocast type, kept across steps.
namespace weight_casts {
// `weight` in `type`: its kept copy where that is current (same version counter and data), else a
// fresh cast, kept when `weight` is a CUDA parameter (a leaf that requires grad).
at::Tensor get(const at::Tensor& weight, at::ScalarType type);
// Re-casts the kept copies of `params` in one multi-tensor copy; the optimizers call it right after
// their in-place update.
void refresh(const std::vector<at::Tensor>& params);
// Whether `weight` has a kept copy in `type` that is current (made from its present version and data).
bool is_current(const at::Tensor& weight, at::ScalarType type);
// `param`'s kept copy (current or not), or an undefined tensor when it has none.
at::Tensor copy_of(const at::Tensor& param);
// Records that `param`'s copy was rewritten together with `param` (by speedkit's AdamW kernel).
void mark_current(const at::Tensor& param);
}  // namespace weight_casts

// `t` when `present`, else an empty tensor with `like`'s options: an autograd Function's apply()
// records every tensor argument and cannot take an undefined one, so an absent optional input is
// passed as this placeholder (defined in autograd.cpp).
at::Tensor placeholder_unless(bool present, const at::Tensor& t, const at::Tensor& like);

}  // namespace sk

// The body of an `int` entry point of speedkit.h: 0 when it completes, else 1 with the message in
// sk_last_error(). No exception leaves it.
#define SK_TRY(...)                                      \
  try {                                                  \
    __VA_ARGS__;                                         \
    return 0;                                            \
  } catch (const std::exception& e) {                    \
    sk::set_error_from(e);                               \
    return 1;                                            \
  } catch (...) {                                        \
    sk::set_error("unknown C++ exception in libtorch"); \
    return 1;                                            \
  }

// SK_TRY for an entry point that needs CUDA: without it the body is not compiled at all, and the
// call fails with status 2 and the reason.
#if SK_WITH_CUDA
#define SK_CUDA_TRY(...) SK_TRY(__VA_ARGS__)
#else
#define SK_CUDA_TRY(...)                                                                              \
  sk::set_error("speedkit was built against a libtorch without CUDA support (or without the CUDA " \
                "headers), so this CUDA operation is unavailable");                                   \
  return 2;
#endif
