// Depthwise convolutions on speedkit's kernels (kernels/depthwise_conv.cuh) where they beat the
// plans' or ATen's (depthwise_conv.cpp).
#pragma once

#include "conv_plans.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>

namespace sk::depthwise_conv {

// Why speedkit's depthwise kernels do not take a convolution of `x` by `w` in `groups` (they take
// 2-D ones over channels-last CUDA tensors of one type, bf16 or fp16, with one 3×3, 5×5 or
// 7×7 filter per channel, channels a multiple of 8, stride 1, no dilation and a padding below the
// filter's size), or empty when they do.
std::string unsupported(const at::Tensor& x, const at::Tensor& w, const conv_plans::Geometry& geometry,
                        int64_t groups);

// y = x ⋆ w on speedkit's kernel when it takes the convolution (unsupported() is empty) and was
// timed faster than `other` for this problem, else other(): the plans' or ATen's convolution. The
// first time a process meets a problem outside a CUDA-graph capture, both run and are timed; until
// then, other() runs.
at::Tensor forward(const at::Tensor& x, const at::Tensor& w, const conv_plans::Geometry& geometry,
                   const std::function<at::Tensor()>& other);

// The input's gradient from the output's `dy` (channels-last) as forward() chooses: speedkit's
// kernel (the convolution of dy by the filters turned 180°) or other().
at::Tensor input_gradient(const at::Tensor& dy, const at::Tensor& w, const conv_plans::Geometry& geometry,
                          const std::function<at::Tensor()>& other);

// How the kernel is chosen: timed once per problem (the default), or always speedkit's kernel, or
// always the other path, untimed (the same kernels from run to run).
enum class Choice { timed = 0, kernel = 1, other = 2 };

// Sets how the kernel is chosen from now on; returns the previous setting.
Choice choose(Choice choice);

// The problems (a pass over one set of shapes, type and padding) this process timed: given to
// speedkit's kernels, or left to the other path as the faster; and the passes its kernel ran.
struct Counts {
  int64_t on_kernels = 0;
  int64_t left = 0;
  int64_t kernel_runs = 0;
};
Counts counts();

}  // namespace sk::depthwise_conv
