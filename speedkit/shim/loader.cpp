// The run-time loader of loader.h.
#include "loader.h"

#include <c10/core/Allocator.h>  // c10::GetAllocator: a symbol of libc10, to locate libtorch

namespace sk::loader {

Library Library::open(const std::string& what, const std::vector<std::string>& candidates, bool already_loaded) {
  if (already_loaded) {
    for (const std::string& name : candidates) {
      if (void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_NOLOAD)) return Library(what, handle);
    }
  }
  std::string tried;
  for (const std::string& name : candidates) {
    if (void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) return Library(what, handle);
    const char* why = dlerror();
    tried += (tried.empty() ? "" : "; ") + name + ": " + (why ? why : "not found");
  }
  throw std::runtime_error(what + " cannot be loaded (" + tried + ")");
}

std::filesystem::path torch_lib_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&c10::GetAllocator), &info) == 0 || info.dli_fname == nullptr) return {};
  std::error_code ignored;
  return std::filesystem::canonical(std::filesystem::path(info.dli_fname), ignored).parent_path();
}

}  // namespace sk::loader
