// cuDNN convolution plans that speedkit chooses and remembers across runs (conv_plans.cpp).
//
// With cudnn.benchmark on, ATen times cuDNN's candidate plans for every new convolution in every
// process and keeps its choices for that process only; PyTorch has no way to keep them (its issue
// #4392). speedkit's convolution (convolution.cpp) runs its 2-D convolutions in the autocast types
// through these plans instead: chosen by timing cuDNN's candidates once, kept on disk beside the
// kernel cache (kernels.h), and built again from there by later runs without timing anything.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace sk::conv_plans {

// The geometry of one convolution: its stride, padding and dilation per spatial dimension.
struct Geometry {
  at::IntArrayRef stride;
  at::IntArrayRef padding;
  at::IntArrayRef dilation;
};

// Why speedkit's plans do not take a convolution of `x` by `w` in `groups` (they take 2-D ones in
// bf16 or fp16 that ATen would run on cuDNN, with cudnn.benchmark on and no deterministic
// algorithms asked for), or empty when they do.
std::string unsupported(const at::Tensor& x, const at::Tensor& w, const Geometry& geometry, int64_t groups);

// y = x ⋆ w (cross-correlation, `groups` from the channels), in the layout ATen's cuDNN path gives
// (channels-last where either operand is), through a chosen plan; nullopt where no plan can be had
// now (a new convolution met during a CUDA-graph capture, or none of cuDNN's candidates runs): the
// caller then runs ATen's.
std::optional<at::Tensor> forward(const at::Tensor& x, const at::Tensor& w, const Geometry& geometry);

// The gradient of the input of shape `x_sizes` from the output's gradient `dy`, every operand dense
// in `format` (the forward's: cudnn_conv_suggest_memory_format of its input and weight); nullopt as
// for forward().
std::optional<at::Tensor> backward_data(const at::Tensor& dy, const at::Tensor& w, at::IntArrayRef x_sizes,
                                        const Geometry& geometry, at::MemoryFormat format);

// The gradient of a weight shaped as `w_like`, every operand dense in `format`; nullopt as for
// forward().
std::optional<at::Tensor> backward_filter(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w_like,
                                          const Geometry& geometry, at::MemoryFormat format);

// Whether plans come only from earlier choices, this process's or the kernel cache's: a convolution
// none was kept for runs ATen's kernels, whatever cudnn.benchmark says, and nothing is timed. For
// a step whose autotuning speedkit pauses (the channels-last census), cuDNN's heuristics would
// otherwise compile kernels a kept plan has ready. Returns the previous setting.
bool set_kept_only(bool on);

// Whether plans come only from earlier choices now (set_kept_only()).
bool is_kept_only();

// What the plans did in this process: chosen by timing (and the seconds that took), built from the
// disk cache (and the seconds that took), and convolutions handed back to ATen.
struct Counts {
  int64_t timed = 0;
  double timing_seconds = 0;
  int64_t from_disk = 0;
  double building_seconds = 0;
  int64_t to_aten = 0;
};
Counts counts();

}  // namespace sk::conv_plans
