// speedkit::column_sums (column_sums.cpp): a bias's gradient, the sum of a tensor over every
// dimension but the last, as an operator of speedkit's own namespace.
#pragma once

#include <ATen/core/Tensor.h>

namespace sk {

// Σ of `t` over every dimension but the last, as a [t.size(-1)] tensor of type `out`, through the
// dispatcher (so that the execution trace and the fusion engine see the call).
at::Tensor column_sums(const at::Tensor& t, at::ScalarType out);

}  // namespace sk
