// Shared libraries the shim loads at run time instead of linking: the CUDA driver (libcuda exists
// only where a GPU driver is installed), NVRTC (in the torch wheel's nvidia/cu13 tree, which a host's
// loader path need not contain) and cuBLASLt (already loaded by libtorch_cuda; binding it at run time
// adds no link-time dependency on the wheel's library path). One loader for the three: candidates in
// order, every symbol bound or a message naming the library and the symbol, and the outcome of the
// first attempt kept, so a missing library costs one search and gives the same error every time.
#pragma once

#include <dlfcn.h>

#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace sk::loader {

// A library opened with dlopen; its symbols are bound into an API table's function pointers.
class Library {
 public:
  // The first of `candidates` (sonames the loader path resolves, or full paths) that loads; throws
  // naming `what` and every candidate with its dlerror when none does. `already_loaded` first asks
  // for a copy the process already holds (RTLD_NOLOAD), so its state is shared.
  static Library open(const std::string& what, const std::vector<std::string>& candidates,
                      bool already_loaded = false);

  // Binds `slot` to `symbol`; throws "<what> lacks <symbol>" when the library has none.
  template <typename F>
  void bind(F& slot, const char* symbol) const {
    if (!bind_optional(slot, symbol)) throw std::runtime_error(what_ + " lacks " + symbol);
  }

  // Binds `slot` to `symbol` where the library has it (newer entry points); whether it did.
  template <typename F>
  bool bind_optional(F& slot, const char* symbol) const {
    slot = reinterpret_cast<F>(dlsym(handle_, symbol));
    return slot != nullptr;
  }

 private:
  Library(std::string what, void* handle) : what_(std::move(what)), handle_(handle) {}
  std::string what_;
  void* handle_;
};

// `load()`'s table, made on the first call; its error, when it failed, thrown again at every call.
// One table per call site: each passes its own lambda, whose type keys the statics below.
template <typename Api, typename Load>
const Api& once(Load load) {
  static std::once_flag flag;
  static Api api{};
  static std::string failure;
  std::call_once(flag, [&] {
    try {
      api = load();
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  if (!failure.empty()) throw std::runtime_error(failure);
  return api;
}

// The lib/ directory of the libtorch this process loaded (found from the address of one of libc10's
// functions), or empty: the torch wheel's nvidia/cu13 tree lies two levels above it.
std::filesystem::path torch_lib_dir();

}  // namespace sk::loader
