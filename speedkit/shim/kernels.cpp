// The kernel layer of kernels.h: the source registry with a cubin cache keyed per source, loading and
// typed launches, the kernel switch, the notes channel, and their C ABI (speedkit.h, module kernels).
#include "kernels.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <unistd.h>

#if SK_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fs = std::filesystem;

namespace sk::kernels {
namespace {

// ----- the registry ----------------------------------------------------------------------------------

struct Sources {
  std::mutex mutex;
  // A deque: references handed out stay valid as sources are added.
  std::deque<Source> all;
  int builtin = 0;
};

Sources& sources() {
  static Sources* registry = [] {
    auto* r = new Sources();
    // build.rs writes one {name, raw string literal} entry per speedkit/kernels/*.cuh, sorted.
    static const std::pair<const char*, const char*> embedded[] = {
#include "kernel_sources.inc"
    };
    for (const auto& [name, text] : embedded) r->all.push_back(Source{static_cast<int>(r->all.size()), name, text});
    r->builtin = static_cast<int>(r->all.size());
    return r;
  }();
  return *registry;
}

// FNV-1a, a cache key rather than a security measure; the separator keeps ("ab", "c") and ("a",
// "bc") apart.
struct Fnv {
  uint64_t hash = 1469598103934665603ull;
  void mix(const std::string& bytes) {
    for (unsigned char c : bytes) {
      hash ^= c;
      hash *= 1099511628211ull;
    }
    hash ^= 0xff;
    hash *= 1099511628211ull;
  }
  std::string hex() const {
    std::ostringstream out;
    out << std::hex << hash;
    return out.str();
  }
};

// The names `text` includes with `#include "name"`.
std::vector<std::string> quoted_includes(const std::string& text) {
  std::vector<std::string> names;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const auto start = line.find_first_not_of(" \t");
    if (start == std::string::npos || line.compare(start, 8, "#include") != 0) continue;
    const auto open = line.find('"', start);
    const auto close = open == std::string::npos ? open : line.find('"', open + 1);
    if (close != std::string::npos) names.push_back(line.substr(open + 1, close - open - 1));
  }
  return names;
}

// A file name's safe stem: letters, digits, '-' and '_' kept, the rest '_'.
std::string file_stem(const std::string& name) {
  std::string stem = name.substr(0, name.find('.'));
  for (char& c : stem)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') c = '_';
  return stem;
}

// Cubins compiled or read by this process, by their cache file's name: what a compile ahead of the
// loads (sk_kernel_prepare, on several threads) leaves for them, with or without a disk cache.
struct Cubins {
  std::mutex mutex;
  std::map<std::string, std::vector<char>> by_name;
};

Cubins& cubins() {
  static Cubins* store = new Cubins();
  return *store;
}

// The cubin of `file` (of its one `entry_point` where one is named): this process's, the disk
// cache's, or compiled; *compiled says whether NVRTC ran.
std::vector<char> cubin_for(const Source& file, int major, int minor, const std::string& entry_point,
                            bool* compiled = nullptr) {
  const std::string what = entry_point.empty() ? file_stem(file.name) : file_stem(file.name) + "-" + entry_point;
  const std::string name =
      what + "-sm_" + std::to_string(major) + std::to_string(minor) + "-" + cache_key(file, major, minor) + ".cubin";
  if (compiled != nullptr) *compiled = false;
  Cubins& store = cubins();
  {
    std::lock_guard<std::mutex> lock(store.mutex);
    auto found = store.by_name.find(name);
    if (found != store.by_name.end()) return found->second;
  }
  const fs::path dir = cache_dir();
  std::vector<char> cubin = dir.empty() ? std::vector<char>() : read_file(dir / name);
  if (cubin.empty()) {
    cubin = nvrtc::compile(file, major, minor, entry_point);
    if (compiled != nullptr) *compiled = true;
    if (!dir.empty()) write_file_atomically(dir / name, cubin);
  }
  std::lock_guard<std::mutex> lock(store.mutex);
  return store.by_name.emplace(name, std::move(cubin)).first->second;
}

// ----- loaded modules --------------------------------------------------------------------------------

struct Loaded {
  std::mutex mutex;
  std::map<std::tuple<int, int, std::string>, void*> modules;  // (device, source, entry point) -> CUmodule
  std::map<std::pair<int, std::string>, Kernel> kernels;       // (device, kernel name) -> kernel
};

// The entry point a launch of `name` compiles `file` for: speedkit's own files one entry point at a
// time (their SK_ENTRY macros; a cold start then compiles what it launches, not every type
// combination), a source registered at run time whole (one module for all its kernels).
std::string entry_point_to_compile(const Source& file, const std::string& name) {
  return file.index < builtin_source_count() ? name : std::string();
}

Loaded& loaded() {
  static Loaded* l = new Loaded();
  return *l;
}

std::string describe_parameters(const std::vector<size_t>& sizes) {
  std::string text;
  for (size_t size : sizes) text += (text.empty() ? "" : ", ") + std::to_string(size);
  return "(" + text + ") bytes";
}

}  // namespace

// ----- the on-disk cache (kernels.h) ----------------------------------------------------------------

fs::path cache_dir() {
  if (const char* dir = std::getenv("SPEEDKIT_KERNEL_CACHE")) return fs::path(dir);
  if (const char* xdg = std::getenv("XDG_CACHE_HOME")) return fs::path(xdg) / "speedkit" / "kernels";
  if (const char* home = std::getenv("HOME")) return fs::path(home) / ".cache" / "speedkit" / "kernels";
  return {};
}

std::vector<char> read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_file_atomically(const fs::path& path, const std::vector<char>& bytes) {
  std::error_code error;
  fs::create_directories(path.parent_path(), error);
  fs::path temporary = path;
  // Threads of one process may write at once (kernels compiled in parallel): each its own name.
  temporary += ".tmp." + std::to_string(::getpid()) + "." +
               std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) return;
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) return;
  }
  fs::rename(temporary, path, error);
  if (error) fs::remove(temporary, error);
}

bool prepare(const Source& file, int major, int minor) {
  if (file.index < builtin_source_count())
    throw std::invalid_argument("speedkit's own kernel file " + file.name +
                                " is compiled one entry point at a time, as its kernels launch");
  bool compiled = false;
  cubin_for(file, major, minor, entry_point_to_compile(file, {}), &compiled);
  return compiled;
}

int source_count() {
  Sources& s = sources();
  std::lock_guard<std::mutex> lock(s.mutex);
  return static_cast<int>(s.all.size());
}

int builtin_source_count() { return sources().builtin; }

const Source& source(int index) {
  Sources& s = sources();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (index < 0 || index >= static_cast<int>(s.all.size()))
    throw std::out_of_range("speedkit has no kernel source " + std::to_string(index));
  return s.all[static_cast<size_t>(index)];
}

const Source& source(const std::string& name) {
  Sources& s = sources();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (const Source& candidate : s.all)
    if (candidate.name == name) return candidate;
  throw std::runtime_error("speedkit has no kernel source " + name);
}

int register_source(const std::string& name, const std::string& text) {
  if (name.empty() || name.find('/') != std::string::npos)
    throw std::invalid_argument("a kernel source needs a plain file name, not \"" + name + "\"");
  Sources& s = sources();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (const Source& existing : s.all) {
    if (existing.name != name) continue;
    if (existing.text == text) return existing.index;
    throw std::invalid_argument("a kernel source named " + name +
                                " is already registered with other text; give the new one another name");
  }
  s.all.push_back(Source{static_cast<int>(s.all.size()), name, text});
  return s.all.back().index;
}

std::string cache_key(const Source& file, int major, int minor) {
  Fnv key;
  key.mix("speedkit-kernel-cache-v2");
  key.mix(std::to_string(nvrtc::version()));
  key.mix(std::to_string(major * 10 + minor));
  std::set<std::string> seen;
  std::vector<const Source*> pending{&file};
  while (!pending.empty()) {
    const Source* next = pending.back();
    pending.pop_back();
    if (!seen.insert(next->name).second) continue;
    key.mix(next->name);
    key.mix(next->text);
    for (const std::string& included : quoted_includes(next->text)) {
      try {
        pending.push_back(&source(included));
      } catch (const std::exception&) {
        // Not a registered source (a CUDA header): NVRTC's version stands for it.
      }
    }
  }
  return key.hex();
}

const char* type_tag(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return "f32";
    case c10::ScalarType::BFloat16: return "bf16";
    case c10::ScalarType::Half: return "f16";
    default: throw std::runtime_error(std::string("speedkit's kernels do not take ") + c10::toString(type));
  }
}

std::string kernel_name(const char* base, std::initializer_list<c10::ScalarType> types, const std::string& variant) {
  std::string name = base;
  for (c10::ScalarType type : types) name += std::string("_") + type_tag(type);
  if (!variant.empty()) name += "_" + variant;
  return name;
}

bool aligned_to(int64_t elements, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (t->defined() && reinterpret_cast<uintptr_t>(t->data_ptr()) % (elements * t->element_size()) != 0)
      return false;
  }
  return true;
}

#if SK_WITH_CUDA

Kernel load(const Source& file, const std::string& name, const c10::Device& device,
            std::optional<size_t> parameter_bytes) {
  TORCH_CHECK(device.is_cuda(), "speedkit kernel ", name, " needs a CUDA tensor, got one on ", device.str());
  const int index = device.index() < 0 ? c10::cuda::current_device() : device.index();
  Loaded& l = loaded();
  std::lock_guard<std::mutex> lock(l.mutex);
  auto found = l.kernels.find({index, name});
  if (found != l.kernels.end()) return found->second;
  const std::string entry_point = entry_point_to_compile(file, name);
  void*& module = l.modules[{index, file.index, entry_point}];
  if (module == nullptr) {
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index));
    c10::DeviceGuard guard(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index)));
    module = driver::load_module(cubin_for(file, props->major, props->minor, entry_point), index);
  }
  Kernel kernel{driver::function(module, name), index, name};
  if (parameter_bytes) {
    const std::vector<size_t> sizes = driver::parameter_sizes(kernel.function);
    if (!sizes.empty() && (sizes.size() != 1 || sizes[0] != *parameter_bytes)) {
      throw std::runtime_error("speedkit kernel " + name + " takes parameters of " + describe_parameters(sizes) +
                               ", but its launcher passes one params struct of " +
                               std::to_string(*parameter_bytes) + " bytes: the struct and the kernel differ");
    }
  }
  l.kernels.emplace(std::make_pair(index, name), kernel);
  return kernel;
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

void launch_raw(const Kernel& kernel, Dim3 grid, Dim3 block, int shared_bytes, void** args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  const auto device = static_cast<c10::DeviceIndex>(kernel.device);
  // Device-generic guard: c10::cuda::CUDAGuard inlines CUDA runtime calls (see shim.h).
  c10::DeviceGuard guard(c10::Device(c10::kCUDA, device));
  driver::make_primary_context_current(kernel.device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  driver::launch(kernel.function, grid, block, shared_bytes, stream, args);
}

int64_t max_dynamic_shared_memory(const c10::Device& device) {
  return static_cast<int64_t>(at::cuda::getDeviceProperties(device.index())->sharedMemPerBlockOptin);
}

int multiprocessors(const c10::Device& device) {
  return at::cuda::getDeviceProperties(device.index())->multiProcessorCount;
}

namespace {
std::string find_unavailable_reason(int index) {
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
}  // namespace

std::string unavailable_reason(int index) {
  static std::mutex mutex;
  static auto* known = new std::map<int, std::string>();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = known->find(index);
  if (it == known->end()) it = known->emplace(index, find_unavailable_reason(index)).first;
  return it->second;
}

#else

Kernel load(const Source&, const std::string& name, const c10::Device&, std::optional<size_t>) {
  throw std::runtime_error("speedkit kernel " + name + " needs CUDA, and speedkit was built without it");
}
void allow_dynamic_shared_memory(const Kernel&, int) {}
int resident_blocks_per_sm(const Kernel&, int, int) { return 0; }
void launch_raw(const Kernel&, Dim3, Dim3, int, void**) {
  throw std::runtime_error("speedkit was built without CUDA, so its kernels cannot run");
}
int64_t max_dynamic_shared_memory(const c10::Device&) { return 0; }
int multiprocessors(const c10::Device&) { return 0; }
std::string unavailable_reason(int) { return "speedkit was built against a libtorch without CUDA support"; }

#endif

}  // namespace sk::kernels

// ----- the kernel switch and the notes ---------------------------------------------------------------

namespace sk::ops {
namespace {

void check_op(int op) {
  if (op < 0 || op >= SK_OP_COUNT) throw std::out_of_range("speedkit has no op " + std::to_string(op));
}

// On by default, so that speedkit::nn used without a context still takes the kernels where they run.
std::array<std::atomic<bool>, SK_OP_COUNT>& switches() {
  static auto* on = [] {
    auto* all = new std::array<std::atomic<bool>, SK_OP_COUNT>();
    for (auto& s : *all) s.store(true);
    return all;
  }();
  return *on;
}

struct Note {
  int op;
  std::string reason;  // empty: ran on the kernel
  int64_t count;
};

struct Notes {
  std::mutex mutex;
  std::deque<Note> all;  // in order of first occurrence; a deque keeps `reason` pointers stable
};

Notes& notes() {
  static Notes* n = new Notes();
  return *n;
}

void note(int op, const std::string& reason) {
  Notes& n = notes();
  std::lock_guard<std::mutex> lock(n.mutex);
  for (Note& existing : n.all) {
    if (existing.op == op && existing.reason == reason) {
      ++existing.count;
      return;
    }
  }
  n.all.push_back(Note{op, reason, 1});
}

}  // namespace

bool switched_on(int op) {
  check_op(op);
  return switches()[SK_OP_ALL].load(std::memory_order_relaxed) && switches()[op].load(std::memory_order_relaxed);
}

std::string unusable(int op, const c10::Device& device) {
  if (!switched_on(op)) return "speedkit's kernels are off (kernels: false)";
  if (!device.is_cuda()) return "speedkit's kernels run on CUDA devices, not on " + device.str();
  return kernels::unavailable_reason(device.has_index() ? device.index() : 0);
}

void note_ran(int op) { note(op, {}); }

void note_fell_back(int op, const std::string& reason) { note(op, reason.empty() ? "no reason given" : reason); }

std::string floating(const char* what, const at::Tensor& t) {
  const auto type = t.scalar_type();
  if (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf) return {};
  return std::string(what) + " of type " + c10::toString(type) + " (the kernels take fp32, bf16, fp16)";
}

std::string on_device(const char* what, const at::Tensor& t, const c10::Device& device) {
  if (!t.defined() || t.device() == device) return {};
  return std::string(what) + " on " + t.device().str() + ", not on " + device.str();
}

std::string fits_int32(int64_t rows, int64_t columns) {
  const int64_t limit = INT32_MAX;
  if (rows <= limit && columns <= limit) return {};
  return std::to_string(rows) + " rows × " + std::to_string(columns) + " columns exceed the kernels' 32-bit indices";
}

}  // namespace sk::ops

// ----- the C ABI -------------------------------------------------------------------------------------

extern "C" {

int sk_kernels_setting_get(int op, int* on) {
  SK_TRY({
    sk::ops::check_op(op);
    *on = sk::ops::switches()[op].load() ? 1 : 0;
  })
}

int sk_kernels_setting_set(int op, int on) {
  SK_TRY({
    sk::ops::check_op(op);
    sk::count_flag_write();
    sk::ops::switches()[op].store(on != 0);
  })
}

int sk_kernels_unavailable_reason(int index, const char** reason) {
  SK_TRY(sk::hand_out(sk::kernels::unavailable_reason(index), reason))
}

int sk_kernel_note_count(int64_t* out) {
  SK_TRY({
    auto& n = sk::ops::notes();
    std::lock_guard<std::mutex> lock(n.mutex);
    *out = static_cast<int64_t>(n.all.size());
  })
}

int sk_kernel_note_get(int64_t index, sk_kernel_note* out) {
  SK_TRY({
    auto& n = sk::ops::notes();
    std::lock_guard<std::mutex> lock(n.mutex);
    const auto& note = n.all.at(static_cast<size_t>(index));
    out->op = note.op;
    out->reason = note.reason.c_str();
    out->count = note.count;
  })
}

int sk_kernel_note_add(int op, const char* reason) {
  SK_TRY({
    sk::ops::check_op(op);
    if (reason == nullptr || *reason == '\0') {
      sk::ops::note_ran(op);
    } else {
      sk::ops::note_fell_back(op, reason);
    }
  })
}

int sk_kernel_source_count(int* out, int* builtin) {
  SK_TRY({
    *out = sk::kernels::source_count();
    *builtin = sk::kernels::builtin_source_count();
  })
}

int sk_kernel_source_name(int index, const char** out) { SK_TRY(*out = sk::kernels::source(index).name.c_str()) }

int sk_kernel_source_register(const char* name, const char* text, int* index) {
  SK_TRY(*index = sk::kernels::register_source(name, text))
}

int sk_kernel_compile(int index, const char* entry_point, int major, int minor, int64_t* cubin_bytes) {
  SK_TRY({
    const std::string entry = entry_point == nullptr ? std::string() : std::string(entry_point);
    *cubin_bytes = static_cast<int64_t>(sk::kernels::nvrtc::compile(sk::kernels::source(index), major, minor, entry).size());
  })
}

int sk_nvrtc_version(int* out) { SK_TRY(*out = sk::kernels::nvrtc::version()) }

int sk_kernel_prepare(int index, int major, int minor, int* compiled) {
  SK_TRY(*compiled = sk::kernels::prepare(sk::kernels::source(index), major, minor) ? 1 : 0)
}

int sk_kernel_load(int index, const char* name, int device, void** kernel, int64_t* param_sizes, int64_t capacity,
                   int64_t* param_count) {
  SK_TRY({
    const c10::Device on(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
    auto loaded = std::make_unique<sk::kernels::Kernel>(sk::kernels::load(sk::kernels::source(index), name, on));
    const std::vector<size_t> sizes = sk::kernels::driver::parameter_sizes(loaded->function);
    *param_count = sizes.empty() ? -1 : static_cast<int64_t>(sizes.size());
    for (size_t i = 0; i < sizes.size() && static_cast<int64_t>(i) < capacity; ++i)
      param_sizes[i] = static_cast<int64_t>(sizes[i]);
    *kernel = loaded.release();
  })
}

int sk_kernel_launch(void* kernel, const uint32_t* grid, const uint32_t* block, int shared_bytes, void** args) {
  SK_TRY(sk::kernels::launch_raw(*static_cast<sk::kernels::Kernel*>(kernel), {grid[0], grid[1], grid[2]},
                                 {block[0], block[1], block[2]}, shared_bytes, args))
}

void sk_kernel_free(void* kernel) { delete static_cast<sk::kernels::Kernel*>(kernel); }

}  // extern "C"
