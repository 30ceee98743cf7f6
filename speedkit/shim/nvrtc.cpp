// NVRTC, loaded at run time (loader.h): compiles kernel sources to cubins for one GPU architecture.
//
// Compiling needs no GPU and no libcuda: CI compiles every kernel this way. ATen's own lazy NVRTC
// stub (ATenNVRTC.h) is not shipped in the wheel, and libcaffe2_nvrtc.so needs libcuda, so neither
// serves.
#include "kernels.h"
#include "loader.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <sstream>
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

// The wheel's nvidia/cu* trees next to the libtorch this process loaded (newest CUDA first), then
// CUDA_HOME, CUDA_PATH, the toolkit speedkit was built against and /usr/local/cuda.
std::vector<fs::path> candidate_roots() {
  std::vector<fs::path> roots;
  const fs::path torch_lib = loader::torch_lib_dir();
  if (!torch_lib.empty()) {
    const fs::path site_packages = torch_lib.parent_path().parent_path();
    for (const char* cu : {"cu13", "cu12"}) roots.push_back(site_packages / "nvidia" / cu);
  }
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
void preload_builtins(const fs::path& lib_dir) {
  std::error_code ignored;
  for (const auto& entry : fs::directory_iterator(lib_dir, ignored)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("libnvrtc-builtins.so.", 0) == 0) dlopen(entry.path().c_str(), RTLD_NOW | RTLD_GLOBAL);
  }
}

const Api& api() {
  return loader::once<Api>([] {
    const Toolkit& kit = toolkit();
    preload_builtins(fs::path(kit.nvrtc_library).parent_path());
    const auto library = loader::Library::open("NVRTC", {kit.nvrtc_library});
    Api api{};
    library.bind(api.GetErrorString, "nvrtcGetErrorString");
    library.bind(api.Version, "nvrtcVersion");
    library.bind(api.CreateProgram, "nvrtcCreateProgram");
    library.bind(api.DestroyProgram, "nvrtcDestroyProgram");
    library.bind(api.CompileProgram, "nvrtcCompileProgram");
    library.bind(api.GetProgramLogSize, "nvrtcGetProgramLogSize");
    library.bind(api.GetProgramLog, "nvrtcGetProgramLog");
    library.bind(api.GetCUBINSize, "nvrtcGetCUBINSize");
    library.bind(api.GetCUBIN, "nvrtcGetCUBIN");
    return api;
  });
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

// NVRTC's log with the source line of each message under it: `file(12): error: ...` gains
// `   12 | <line 12 of file>`.
std::string with_source_lines(const std::string& log, const Source& file) {
  std::vector<std::string> lines;
  std::istringstream text(file.text);
  for (std::string line; std::getline(text, line);) lines.push_back(line);
  std::ostringstream out;
  std::istringstream messages(log);
  const std::string prefix = file.name + "(";
  for (std::string message; std::getline(messages, message);) {
    out << message << "\n";
    if (message.rfind(prefix, 0) != 0) continue;
    const size_t close = message.find(')', prefix.size());
    if (close == std::string::npos) continue;
    const std::string number = message.substr(prefix.size(), close - prefix.size());
    if (number.empty() || number.find_first_not_of("0123456789") != std::string::npos) continue;
    const size_t at = std::stoul(number);
    if (at >= 1 && at <= lines.size()) out << "  " << number << " | " << lines[at - 1] << "\n";
  }
  return out.str();
}

// Whether the cubin's string table names `symbol` (a NUL-terminated name, not a longer name's
// prefix or suffix).
bool names_symbol(const std::vector<char>& cubin, const std::string& symbol) {
  std::string needle(1, '\0');
  needle += symbol;
  needle += '\0';
  return std::search(cubin.begin(), cubin.end(), needle.begin(), needle.end()) != cubin.end();
}

}  // namespace

const Toolkit& toolkit() {
  return loader::once<Toolkit>([] { return find_toolkit(); });
}

int version() {
  int major = 0, minor = 0;
  check(api().Version(&major, &minor), "nvrtcVersion");
  return major * 1000 + minor * 10;
}

std::vector<char> compile(const Source& file, int major, int minor, const std::string& entry_point) {
  std::vector<const char*> header_texts, header_names;
  for (int i = 0; i < source_count(); ++i) {
    const Source& other = source(i);
    if (other.index == file.index) continue;
    header_texts.push_back(other.text.c_str());
    header_names.push_back(other.name.c_str());
  }
  ProgramHandle handle;
  check(api().CreateProgram(&handle.program, file.text.c_str(), file.name.c_str(),
                            static_cast<int>(header_texts.size()), header_texts.data(), header_names.data()),
        "nvrtcCreateProgram");
  const std::string arch = "--gpu-architecture=sm_" + std::to_string(major) + std::to_string(minor);
  const std::string include = "--include-path=" + toolkit().include_dir;
  std::vector<const char*> options = {arch.c_str(), include.c_str(), "--std=c++17"};
  // common.cuh's SK_ENTRY keeps the one entry point whose SK_WANT_<name> is defined.
  const std::string wanted = "-DSK_WANT_" + entry_point + "=~,1";
  if (!entry_point.empty()) {
    options.push_back("-DSK_ONE_ENTRY_POINT");
    options.push_back(wanted.c_str());
  }
  Result compiled = api().CompileProgram(handle.program, static_cast<int>(options.size()), options.data());
  const std::string what = entry_point.empty() ? file.name : entry_point + " of " + file.name;
  if (compiled != 0) {
    throw std::runtime_error("kernel source " + what + " does not compile for sm_" +
                             std::to_string(major) + std::to_string(minor) + " (" +
                             api().GetErrorString(compiled) + "):\n" +
                             with_source_lines(program_log(handle.program), file));
  }
  size_t size = 0;
  check(api().GetCUBINSize(handle.program, &size), "nvrtcGetCUBINSize");
  std::vector<char> cubin(size);
  check(api().GetCUBIN(handle.program, cubin.data()), "nvrtcGetCUBIN");
  if (!entry_point.empty() && !names_symbol(cubin, entry_point))
    throw std::runtime_error("kernel source " + file.name + " has no entry point " + entry_point);
  return cubin;
}

}  // namespace sk::kernels::nvrtc
