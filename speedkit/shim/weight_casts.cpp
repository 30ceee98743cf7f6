// Copies of fp32 weights in the autocast type, kept from one step to the next.
//
// Under autocast every forward casts each fp32 weight to bf16/fp16 again: one small kernel per
// weight and per bias, a few microseconds each, about 0.36 ms of a `transformer` step. speedkit's
// Linear (linear.cpp) takes its operands from here instead, and so does a fused step's every cast
// of a parameter (interposer.cpp: a convolution's weights under autocast, any model's): a copy is current as long as the
// weight's version counter and data are the ones it was made from. After the optimizer's in-place
// update the copies are current again without a cast of their own: speedkit's AdamW kernel
// (optim.cpp, kernels/adamw.cuh) writes them in its update pass and calls mark_current();
// parameters that ATen's AdamW updated instead get refresh(), one multi-tensor copy (ATen's
// _foreach_copy_, which converts the type on its fast path). A weight changed anywhere else (a
// checkpoint load, another optimizer, the user, set_data) has a new version or new data, and its
// next use casts it again. Autocast's own cache makes the same bargain within one forward; this one
// spans steps. The copies live as long as their weights: the model's size again in 16 bits.
//
// Entries hold the weight weakly (as autocast's cache does): a dropped model's copies are freed at
// the next insertion, when a context ends, between the runner's workloads, and on request
// (sk_weight_copies_release_expired; speedkit::memory). Only CUDA leaf tensors that require grad
// (parameters) are cached.
#include "shim.h"

#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <tuple>
#include <vector>

namespace sk::weight_casts {
namespace {

// What a copy was made from: the weight's version counter and its data (set_data() swaps the data
// of a parameter without a new version).
struct Source {
  int64_t version;
  const void* data;
  bool operator==(const Source& other) const { return version == other.version && data == other.data; }
};

Source source_of(const at::Tensor& weight) { return {weight._version(), weight.data_ptr()}; }

struct Copy {
  Source source;
  at::Tensor copy;
};

WeakWeightTable<Copy>& copies() {
  static auto* table = new WeakWeightTable<Copy>();
  return *table;
}

// Off inside a checkpointed function (speedkit::checkpoint): its forward runs again in the
// backward, so a cast there lives one block at a time, where a kept copy would live through the
// whole step beside every block's.
thread_local bool keep_on_this_thread = true;

bool cacheable(const at::Tensor& weight, at::ScalarType type) {
  return keep_on_this_thread && weight.is_cuda() && weight.scalar_type() != type && weight.is_leaf() &&
         weight.requires_grad();
}

// Frees the copies whose weights are gone (or, with `all`, every copy); the bytes freed.
int64_t drop(bool all) {
  int64_t freed = 0;
  copies().drop(all, [&](const Copy& c) { freed += static_cast<int64_t>(c.copy.nbytes()); });
  return freed;
}

}  // namespace

at::Tensor get(const at::Tensor& weight, at::ScalarType type) {
  if (!cacheable(weight, type)) return weight.to(type);
  std::lock_guard<std::mutex> lock(copies().mutex);
  Copy* kept = copies().find(weight);
  // Laid out as the weight is (a channels-last convolution weight too), as autocast's cast would be.
  const bool same_weight = kept != nullptr && kept->copy.scalar_type() == type && kept->copy.sizes() == weight.sizes() &&
                           kept->copy.strides() == weight.strides();
  if (same_weight && kept->source == source_of(weight)) return kept->copy;
  at::NoGradGuard no_grad;
  if (same_weight) {
    // Recast into the same storage, so a CUDA graph that captured the copy keeps reading it.
    kept->copy.copy_(weight);
    kept->source = source_of(weight);
    return kept->copy;
  }
  // `to` keeps a dense layout (autocast's cast does the same); any other becomes contiguous.
  at::Tensor copy = weight.detach().to(type);
  if (!copy.is_non_overlapping_and_dense()) copy = copy.contiguous();
  copies().insert(weight, Copy{source_of(weight), copy});
  return copy;
}

bool is_current(const at::Tensor& weight, at::ScalarType type) {
  std::lock_guard<std::mutex> lock(copies().mutex);
  const Copy* kept = copies().find(weight);
  return kept != nullptr && kept->copy.scalar_type() == type && kept->source == source_of(weight);
}

at::Tensor copy_of(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(copies().mutex);
  const Copy* kept = copies().find(param);
  return kept != nullptr && kept->copy.sizes() == param.sizes() ? kept->copy : at::Tensor();
}

void mark_current(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(copies().mutex);
  if (Copy* kept = copies().find(param)) kept->source = source_of(param);
}

void refresh(const std::vector<at::Tensor>& params) {
  std::lock_guard<std::mutex> lock(copies().mutex);
  // One _foreach_copy_ per copy type (its fast path wants one source and one target type).
  std::vector<std::tuple<at::ScalarType, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<Copy*>>> groups;
  for (const at::Tensor& p : params) {
    Copy* kept = copies().find(p);
    if (kept == nullptr || p.scalar_type() != at::kFloat) continue;
    auto group = std::find_if(groups.begin(), groups.end(),
                              [&](const auto& g) { return std::get<0>(g) == kept->copy.scalar_type(); });
    if (group == groups.end()) group = groups.insert(groups.end(), {kept->copy.scalar_type(), {}, {}, {}});
    std::get<1>(*group).push_back(kept->copy);
    std::get<2>(*group).push_back(p.detach());
    std::get<3>(*group).push_back(kept);
  }
  at::NoGradGuard no_grad;
  for (auto& [type, targets, sources, refreshed] : groups) {
    at::_foreach_copy_(targets, sources);
    for (size_t i = 0; i < refreshed.size(); ++i) refreshed[i]->source = source_of(sources[i]);
  }
}

}  // namespace sk::weight_casts

extern "C" {

int sk_weight_copies_size(int64_t* bytes, int64_t* count) {
  SK_TRY({
    auto& copies = sk::weight_casts::copies();
    std::lock_guard<std::mutex> lock(copies.mutex);
    *bytes = 0;
    *count = 0;
    copies.for_each_live([&](const sk::weight_casts::Copy& c) {
      *bytes += static_cast<int64_t>(c.copy.nbytes());
      *count += 1;
    });
  })
}

int sk_weight_copies_release_expired(int64_t* freed) {
  SK_TRY({
    std::lock_guard<std::mutex> lock(sk::weight_casts::copies().mutex);
    *freed = sk::weight_casts::drop(/*all=*/false);
  })
}

int sk_weight_copies_clear(int64_t* freed) {
  SK_TRY({
    std::lock_guard<std::mutex> lock(sk::weight_casts::copies().mutex);
    *freed = sk::weight_casts::drop(/*all=*/true);
  })
}

int sk_weight_copies_keep_on_this_thread(int keep, int* previous) {
  SK_TRY({
    *previous = sk::weight_casts::keep_on_this_thread ? 1 : 0;
    sk::weight_casts::keep_on_this_thread = keep != 0;
  })
}

}  // extern "C"
