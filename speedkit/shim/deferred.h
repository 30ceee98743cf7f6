// Deferred tensors (deferred.cpp) for the shim's own callers: the interposer defers a fused
// group's result that only the backward reads, to be recomputed there (interposer.cpp).
#pragma once

#include "shim.h"

#include <cstdint>
#include <vector>

namespace sk {

// As sk_deferred_new: a contiguous tensor of `sizes` and `options` with no memory yet, which
// `vtable.materialize` writes at its first read; `state` belongs to it from here on, also when this
// throws.
at::Tensor deferred_tensor(std::vector<int64_t> sizes, at::TensorOptions options, const char* exempt_ops, uint64_t tag,
                           const sk_deferred_vtable& vtable, void* state);

// The operator whose read is materializing a deferred tensor on this thread (for a writer's
// messages), or null: a materialization asked for directly (sk_deferred_materialize).
const char* deferred_reader();

}  // namespace sk
