// What other shim files use of the interposer (interposer.cpp): its dispatch key's fallback, which
// sees every operator call on a thread that includes the key (and on autograd's threads during that
// thread's backward passes), and an observer that is told of each call before it runs.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace sk::interposer {

// Below autograd and autocast, above the backends; no kernel or fallback of libtorch's own.
inline constexpr c10::DispatchKey kKey = c10::DispatchKey::Fake;

// Told of every call the fallback sees, before it runs; its own calls must exclude kKey.
class CallObserver {
 public:
  virtual ~CallObserver() = default;
  virtual void before(const c10::OperatorHandle& op, const torch::jit::Stack& stack) = 0;
};

// Puts `observer` in place (one at a time per process) and registers the fallback while it is.
void observe(CallObserver* observer);
// Whether the running program computes the next call the fallback sees. An operator observed now is
// that call (ATen's kernel will not run, and the group's kernel reads no result of another group
// but through its own arguments, which it materializes where they are deferred), or a wrapper above
// the fallback, such as autocast's, which casts its inputs before calling the operator again: its
// reads are the calls below it, each observed in its turn.
bool next_call_computed();
// Takes `observer` away again, and the fallback unless a session still needs it.
void stop_observing(CallObserver* observer);

}  // namespace sk::interposer
