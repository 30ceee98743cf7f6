// NVRTC, loaded with dlopen: compiles speedkit's kernel files to cubins for one GPU architecture.
//
// dlopen rather than linking, because NVRTC ships in the torch wheel's nvidia/cu13 tree (or a CUDA
// toolkit) that a host's loader path need not contain, and because compiling needs no GPU and no
// libcuda: CI compiles every kernel this way. ATen's own lazy NVRTC stub (ATenNVRTC.h) is not
// shipped in the wheel, and libcaffe2_nvrtc.so needs libcuda, so neither serves.
#include "kernels.h"

#include <c10/core/Allocator.h>  // c10::GetAllocator: a symbol of libc10, to locate the wheel
#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <stdexcept>

namespace fs = std::filesystem;

namespace sk::kernels::nvrtc {
namespace {

// NVRTC's C ABI (nvrtc.h), declared here so that the shim builds without the CUDA headers.
using Result = int;
using Program = void*;
struct Api {
  const char* (*GetErrorString)(Result);
  Result (*Version)(int*, int*);
  Result (*CreateProgram)(Program*, const char*, const char*, int, const char* const*, const char* const*);
  Result (*DestroyProgram)(Program*);
  Result (*CompileProgram)(Program, int, const char* const*);
  Result (*GetProgramLogSize)(Program, size_t*);
  Result (*GetProgramLog)(Program, char*);
  Result (*GetCUBINSize)(Program, size_t*);
  Result (*GetCUBIN)(Program, char*);
};

// libnvrtc.so.13 or .12 in lib/ or lib64/ (wheels and toolkits name it so), else the unversioned one.
std::string nvrtc_library(const fs::path& root) {
  for (const char* sub : {"lib", "lib64"}) {
    for (const char* name : {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}) {
      fs::path candidate = root / sub / name;
      std::error_code ignored;
      if (fs::exists(candidate, ignored)) return candidate.string();
    }
  }
  return {};
}

// The site-packages/nvidia/cu* trees next to the libtorch this process loaded (found from the
// address of one of libc10's functions), newest CUDA first.
std::vector<fs::path> wheel_roots() {
  std::vector<fs::path> roots;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&c10::GetAllocator), &info) == 0 || info.dli_fname == nullptr)
    return roots;
  std::error_code ignored;
  fs::path lib = fs::canonical(fs::path(info.dli_fname), ignored).parent_path();  // <torch>/lib
  fs::path site_packages = lib.parent_path().parent_path();
  for (const char* cu : {"cu13", "cu12"}) roots.push_back(site_packages / "nvidia" / cu);
  return roots;
}

std::vector<fs::path> candidate_roots() {
  std::vector<fs::path> roots = wheel_roots();
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
    if (const char* home = std::getenv(var)) roots.emplace_back(home);
  }
#ifdef SK_BUILD_CUDA_ROOT
  roots.emplace_back(SK_BUILD_CUDA_ROOT);
#endif
  roots.emplace_back("/usr/local/cuda");
  return roots;
}

Toolkit find_toolkit() {
  std::string searched;
  for (const fs::path& root : candidate_roots()) {
    std::error_code ignored;
    std::string library = nvrtc_library(root);
    if (!library.empty() && fs::exists(root / "include" / "cuda_bf16.h", ignored)) {
      return Toolkit{library, (root / "include").string()};
    }
    searched += (searched.empty() ? "" : ", ") + root.string();
  }
  throw std::runtime_error("NVRTC and the CUDA headers were not found (searched " + searched +
                           "); install the torch wheel's nvidia-cuda-nvrtc/headers or set CUDA_HOME");
}

// NVRTC loads libnvrtc-builtins by soname; the wheel's directory is not on the loader path, so the
// builtins are loaded first, by full path, and NVRTC finds them already in the process.
void preload_builtins(const std::string& lib_dir) {
  std::error_code ignored;
  for (const auto& entry : fs::directory_iterator(lib_dir, ignored)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("libnvrtc-builtins.so.", 0) == 0) dlopen(entry.path().c_str(), RTLD_NOW | RTLD_GLOBAL);
  }
}

template <typename F>
void bind(void* library, F*& slot, const char* name) {
  slot = reinterpret_cast<F*>(dlsym(library, name));
  if (slot == nullptr) throw std::runtime_error(std::string("NVRTC lacks ") + name);
}

const Api& api() {
  static std::once_flag once;
  static Api loaded{};
  static std::string failure;
  std::call_once(once, [] {
    try {
      const Toolkit& kit = toolkit();
      preload_builtins(fs::path(kit.nvrtc_library).parent_path().string());
      void* library = dlopen(kit.nvrtc_library.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (library == nullptr) throw std::runtime_error("cannot load " + kit.nvrtc_library + ": " + dlerror());
      bind(library, loaded.GetErrorString, "nvrtcGetErrorString");
      bind(library, loaded.Version, "nvrtcVersion");
      bind(library, loaded.CreateProgram, "nvrtcCreateProgram");
      bind(library, loaded.DestroyProgram, "nvrtcDestroyProgram");
      bind(library, loaded.CompileProgram, "nvrtcCompileProgram");
      bind(library, loaded.GetProgramLogSize, "nvrtcGetProgramLogSize");
      bind(library, loaded.GetProgramLog, "nvrtcGetProgramLog");
      bind(library, loaded.GetCUBINSize, "nvrtcGetCUBINSize");
      bind(library, loaded.GetCUBIN, "nvrtcGetCUBIN");
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  if (!failure.empty()) throw std::runtime_error(failure);
  return loaded;
}

void check(Result result, const char* what) {
  if (result != 0) throw std::runtime_error(std::string(what) + ": " + api().GetErrorString(result));
}

// Destroys the program on every exit path.
struct ProgramHandle {
  Program program = nullptr;
  ~ProgramHandle() {
    if (program != nullptr) api().DestroyProgram(&program);
  }
};

std::string program_log(Program program) {
  size_t size = 0;
  if (api().GetProgramLogSize(program, &size) != 0 || size == 0) return {};
  std::string log(size, '\0');
  if (api().GetProgramLog(program, log.data()) != 0) return {};
  if (!log.empty() && log.back() == '\0') log.pop_back();
  return log;
}

}  // namespace

const Toolkit& toolkit() {
  static std::once_flag once;
  static Toolkit found;
  static std::string failure;
  std::call_once(once, [] {
    try {
      found = find_toolkit();
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  if (!failure.empty()) throw std::runtime_error(failure);
  return found;
}

int version() {
  int major = 0, minor = 0;
  check(api().Version(&major, &minor), "nvrtcVersion");
  return major * 1000 + minor * 10;
}

std::vector<char> compile(const Source& file, int major, int minor) {
  std::vector<const char*> header_texts, header_names;
  for (const Source& other : sources()) {
    if (std::string(other.name) == file.name) continue;
    header_texts.push_back(other.text);
    header_names.push_back(other.name);
  }
  ProgramHandle handle;
  check(api().CreateProgram(&handle.program, file.text, file.name, static_cast<int>(header_texts.size()),
                            header_texts.data(), header_names.data()),
        "nvrtcCreateProgram");
  const std::string arch = "--gpu-architecture=sm_" + std::to_string(major) + std::to_string(minor);
  const std::string include = "--include-path=" + toolkit().include_dir;
  const char* options[] = {arch.c_str(), include.c_str(), "--std=c++17"};
  Result compiled = api().CompileProgram(handle.program, 3, options);
  if (compiled != 0) {
    throw std::runtime_error(std::string("speedkit kernel ") + file.name + " does not compile for sm_" +
                             std::to_string(major) + std::to_string(minor) + " (" +
                             api().GetErrorString(compiled) + "):\n" + program_log(handle.program));
  }
  size_t size = 0;
  check(api().GetCUBINSize(handle.program, &size), "nvrtcGetCUBINSize");
  std::vector<char> cubin(size);
  check(api().GetCUBIN(handle.program, cubin.data()), "nvrtcGetCUBIN");
  return cubin;
}

}  // namespace sk::kernels::nvrtc
