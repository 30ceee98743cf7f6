// The kernel registry: the embedded sources, compile-once-per-architecture with an on-disk cubin
// cache, one loaded module per (device, file), launches on PyTorch's current stream; and the C ABI
// that lets Rust list and compile the kernels (CI's compile test) and ask whether they can run.
#include "kernels.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <unistd.h>

#if SK_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fs = std::filesystem;

namespace sk::kernels {

const std::vector<Source>& sources() {
  // build.rs writes one {name, raw string literal} entry per speedkit/kernels/*.cuh.
  static const std::vector<Source> table = {
#include "kernel_sources.inc"
  };
  return table;
}

const Source& source(const std::string& name) {
  for (const Source& s : sources()) {
    if (name == s.name) return s;
  }
  throw std::runtime_error("speedkit has no kernel file " + name);
}

const char* type_tag(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return "f32";
    case c10::ScalarType::BFloat16: return "bf16";
    case c10::ScalarType::Half: return "f16";
    default: throw std::runtime_error(std::string("speedkit's kernels do not take ") + c10::toString(type));
  }
}

namespace {

// SPEEDKIT_KERNEL_CACHE, else $XDG_CACHE_HOME/speedkit/kernels, else ~/.cache/speedkit/kernels;
// empty when none is known (then every process compiles afresh).
fs::path cache_dir() {
  if (const char* dir = std::getenv("SPEEDKIT_KERNEL_CACHE")) return fs::path(dir);
  if (const char* xdg = std::getenv("XDG_CACHE_HOME")) return fs::path(xdg) / "speedkit" / "kernels";
  if (const char* home = std::getenv("HOME")) return fs::path(home) / ".cache" / "speedkit" / "kernels";
  return {};
}

// FNV-1a over everything that determines the cubin: every embedded source (a file's headers are
// the other files), the architecture and NVRTC's version. A cache key, not a security measure.
std::string cache_key(int major, int minor) {
  uint64_t hash = 1469598103934665603ull;
  auto mix = [&hash](const std::string& bytes) {
    for (unsigned char c : bytes) {
      hash ^= c;
      hash *= 1099511628211ull;
    }
    hash ^= 0xff;  // separator, so that ("ab", "c") and ("a", "bc") differ
    hash *= 1099511628211ull;
  };
  mix("speedkit-kernel-cache-v1");
  mix(std::to_string(nvrtc::version()));
  mix(std::to_string(major * 10 + minor));
  for (const Source& s : sources()) {
    mix(s.name);
    mix(s.text);
  }
  std::ostringstream hex;
  hex << std::hex << hash;
  return hex.str();
}

std::vector<char> read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Written to a private temporary name and renamed into place, so a concurrent reader sees either
// nothing or the whole cubin. A cache that cannot be written is only a slower next start.
void write_file_atomically(const fs::path& path, const std::vector<char>& bytes) {
  std::error_code error;
  fs::create_directories(path.parent_path(), error);
  fs::path temporary = path;
  temporary += ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) return;
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) return;
  }
  fs::rename(temporary, path, error);
  if (error) fs::remove(temporary, error);
}

std::vector<char> cubin_for(const Source& file, int major, int minor) {
  const fs::path dir = cache_dir();
  fs::path cached;
  if (!dir.empty()) {
    std::string stem = file.name;
    stem = stem.substr(0, stem.find('.'));
    cached = dir / (stem + "-sm_" + std::to_string(major) + std::to_string(minor) + "-" +
                    cache_key(major, minor) + ".cubin");
    std::vector<char> bytes = read_file(cached);
    if (!bytes.empty()) return bytes;
  }
  std::vector<char> cubin = nvrtc::compile(file, major, minor);
  if (!cached.empty()) write_file_atomically(cached, cubin);
  return cubin;
}

struct Registry {
  std::mutex mutex;
  std::map<std::pair<int, std::string>, void*> modules;    // (device, file) -> CUmodule
  std::map<std::pair<int, std::string>, void*> functions;  // (device, kernel) -> CUfunction
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

#if SK_WITH_CUDA

Kernel get(const char* file, const std::string& name, const c10::Device& device) {
  TORCH_CHECK(device.is_cuda(), "speedkit kernel ", name, " needs a CUDA tensor, got one on ", device.str());
  const int index = device.index() < 0 ? c10::cuda::current_device() : device.index();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto found = r.functions.find({index, name});
  if (found != r.functions.end()) return Kernel{found->second, static_cast<c10::DeviceIndex>(index)};
  void*& module = r.modules[{index, file}];
  if (module == nullptr) {
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index));
    c10::DeviceGuard guard(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index)));
    module = driver::load_module(cubin_for(source(file), props->major, props->minor),
                                 static_cast<c10::DeviceIndex>(index));
  }
  void* function = driver::function(module, name);
  r.functions[{index, name}] = function;
  return Kernel{function, static_cast<c10::DeviceIndex>(index)};
}

void allow_dynamic_shared_memory(const Kernel& kernel, int bytes) {
  driver::set_max_dynamic_shared_memory(kernel.function, bytes);
}

int resident_blocks_per_sm(const Kernel& kernel, int threads, int shared_bytes) {
  // Asked at every launch of the grid-stride and one-wave kernels: a map lookup after the first.
  static std::mutex mutex;
  static auto* known = new std::map<std::tuple<void*, int, int>, int>();
  const auto key = std::make_tuple(kernel.function, threads, shared_bytes);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = known->find(key);
  if (it != known->end()) return it->second;
  driver::make_primary_context_current(kernel.device);
  const int blocks = driver::max_active_blocks(kernel.function, threads, shared_bytes);
  known->emplace(key, blocks);
  return blocks;
}

void launch(const Kernel& kernel, Dim3 grid, Dim3 block, int shared_bytes, void** args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  // Device-generic guard: c10::cuda::CUDAGuard inlines CUDA runtime calls (see shim.h).
  c10::DeviceGuard guard(c10::Device(c10::kCUDA, kernel.device));
  driver::make_primary_context_current(kernel.device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(kernel.device).stream();
  driver::launch(kernel.function, grid, block, shared_bytes, stream, args);
}

int64_t max_dynamic_shared_memory(const c10::Device& device) {
  return static_cast<int64_t>(at::cuda::getDeviceProperties(device.index())->sharedMemPerBlockOptin);
}

int multiprocessors(const c10::Device& device) {
  return at::cuda::getDeviceProperties(device.index())->multiProcessorCount;
}

std::string unavailable_reason(int index) {
  if (!at::globalContext().hasCUDA() || index >= static_cast<int>(c10::cuda::device_count()))
    return "no CUDA device " + std::to_string(index);
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index));
  if (props->major < 8) {
    return "the GPU is SM " + std::to_string(props->major) + "." + std::to_string(props->minor) +
           " and speedkit's kernels need SM >= 8.0 (bf16 loads and the shared memory they size for)";
  }
  try {
    nvrtc::version();
  } catch (const std::exception& e) {
    return e.what();
  }
  std::string why_not;
  if (!driver::available(&why_not)) return why_not;
  return {};
}

#else

Kernel get(const char*, const std::string& name, const c10::Device&) {
  throw std::runtime_error("speedkit kernel " + name + " needs CUDA, and speedkit was built without it");
}
void allow_dynamic_shared_memory(const Kernel&, int) {}
int resident_blocks_per_sm(const Kernel&, int, int) { return 0; }
void launch(const Kernel&, Dim3, Dim3, int, void**) {
  throw std::runtime_error("speedkit was built without CUDA, so its kernels cannot run");
}
int64_t max_dynamic_shared_memory(const c10::Device&) { return 0; }
int multiprocessors(const c10::Device&) { return 0; }
std::string unavailable_reason(int) { return "speedkit was built against a libtorch without CUDA support"; }

#endif

}  // namespace sk::kernels

extern "C" {

int sk_kernel_source_count(int* out) { SK_TRY(*out = static_cast<int>(sk::kernels::sources().size())) }

// The file name of kernel source `index`, valid for the life of the process.
int sk_kernel_source_name(int index, const char** out) {
  SK_TRY(*out = sk::kernels::sources().at(static_cast<size_t>(index)).name)
}

// Compiles kernel source `index` for sm_<major><minor> with NVRTC, bypassing the cache, and reports
// the cubin's size: the CI check that every kernel compiles (no GPU needed).
int sk_kernel_compile(int index, int major, int minor, int64_t* cubin_bytes) {
  SK_TRY({
    const auto& file = sk::kernels::sources().at(static_cast<size_t>(index));
    *cubin_bytes = static_cast<int64_t>(sk::kernels::nvrtc::compile(file, major, minor).size());
  })
}

int sk_nvrtc_version(int* out) { SK_TRY(*out = sk::kernels::nvrtc::version()) }

// Why speedkit's kernels cannot run on CUDA device `index` (NUL-terminated, truncated to `capacity`),
// or an empty string when they can.
int sk_kernels_unavailable_reason(int index, char* reason, int capacity) {
  SK_TRY({
    std::string why = sk::kernels::unavailable_reason(index);
    if (capacity > 0) {
      std::strncpy(reason, why.c_str(), static_cast<size_t>(capacity) - 1);
      reason[capacity - 1] = '\0';
    }
  })
}

}  // extern "C"
