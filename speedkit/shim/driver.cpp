// The CUDA driver API, loaded with dlopen("libcuda.so.1"): loads speedkit's cubins into the device's
// primary context (the one PyTorch's runtime uses) and launches their kernels.
//
// dlopen, because libcuda exists only where a GPU driver is installed: the shim must load (and CI
// must compile kernels) on machines without one. Only these few entry points are needed.
#include "kernels.h"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>

#if SK_WITH_CUDA
#include <cuda.h>
#endif

namespace sk::kernels::driver {

#if SK_WITH_CUDA
namespace {

struct Api {
  CUresult (*GetErrorString)(CUresult, const char**);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*CtxGetCurrent)(CUcontext*);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*ModuleLoadData)(CUmodule*, const void*);
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*FuncSetAttribute)(CUfunction, CUfunction_attribute, int);
  CUresult (*OccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           CUstream, void**, void**);
};

template <typename F>
void bind(void* library, F*& slot, const char* name) {
  slot = reinterpret_cast<F*>(dlsym(library, name));
  if (slot == nullptr) throw std::runtime_error(std::string("libcuda.so.1 lacks ") + name);
}

const Api& api() {
  static std::once_flag once;
  static Api loaded{};
  static std::string failure;
  std::call_once(once, [] {
    try {
      void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
      if (library == nullptr)
        throw std::runtime_error(std::string("the CUDA driver library cannot be loaded: ") + dlerror());
      bind(library, loaded.GetErrorString, "cuGetErrorString");
      bind(library, loaded.DeviceGet, "cuDeviceGet");
      bind(library, loaded.CtxGetCurrent, "cuCtxGetCurrent");
      bind(library, loaded.CtxSetCurrent, "cuCtxSetCurrent");
      bind(library, loaded.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
      bind(library, loaded.ModuleLoadData, "cuModuleLoadData");
      bind(library, loaded.ModuleGetFunction, "cuModuleGetFunction");
      bind(library, loaded.FuncSetAttribute, "cuFuncSetAttribute");
      bind(library, loaded.OccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
      bind(library, loaded.LaunchKernel, "cuLaunchKernel");
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  if (!failure.empty()) throw std::runtime_error(failure);
  return loaded;
}

void check(CUresult result, const std::string& what) {
  if (result == CUDA_SUCCESS) return;
  const char* message = nullptr;
  api().GetErrorString(result, &message);
  throw std::runtime_error(what + ": " + (message ? message : "unknown CUDA driver error"));
}

}  // namespace

// Modules belong to a context; PyTorch's runtime works in each device's primary context.
void make_primary_context_current(c10::DeviceIndex index) {
  CUcontext current = nullptr;
  check(api().CtxGetCurrent(&current), "cuCtxGetCurrent");
  if (current != nullptr) return;
  CUdevice device = 0;
  check(api().DeviceGet(&device, index), "cuDeviceGet");
  CUcontext primary = nullptr;
  check(api().DevicePrimaryCtxRetain(&primary, device), "cuDevicePrimaryCtxRetain");
  check(api().CtxSetCurrent(primary), "cuCtxSetCurrent");
}


bool available(std::string* why_not) {
  try {
    api();
    return true;
  } catch (const std::exception& e) {
    if (why_not != nullptr) *why_not = e.what();
    return false;
  }
}

void* load_module(const std::vector<char>& cubin, c10::DeviceIndex device) {
  make_primary_context_current(device);
  CUmodule module = nullptr;
  check(api().ModuleLoadData(&module, cubin.data()), "cuModuleLoadData");
  return module;
}

void* function(void* module, const std::string& name) {
  CUfunction function = nullptr;
  check(api().ModuleGetFunction(&function, static_cast<CUmodule>(module), name.c_str()),
        "speedkit kernel " + name);
  return function;
}

void set_max_dynamic_shared_memory(void* function, int bytes) {
  check(api().FuncSetAttribute(static_cast<CUfunction>(function),
                               CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes),
        "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)");
}

int max_active_blocks(void* function, int threads, int shared_bytes) {
  int blocks = 0;
  check(api().OccupancyMaxActiveBlocksPerMultiprocessor(&blocks, static_cast<CUfunction>(function), threads,
                                                        static_cast<size_t>(shared_bytes)),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  return blocks;
}

void launch(void* function, Dim3 grid, Dim3 block, int shared_bytes, void* stream, void** args) {
  check(api().LaunchKernel(static_cast<CUfunction>(function), grid.x, grid.y, grid.z, block.x, block.y, block.z,
                           static_cast<unsigned>(shared_bytes), static_cast<CUstream>(stream), args, nullptr),
        "cuLaunchKernel");
}

#else  // a libtorch without CUDA: nothing can load or launch

namespace {
[[noreturn]] void no_cuda() {
  throw std::runtime_error("speedkit was built against a libtorch without CUDA support, so its kernels cannot run");
}
}  // namespace

bool available(std::string* why_not) {
  if (why_not != nullptr) *why_not = "speedkit was built against a libtorch without CUDA support";
  return false;
}
void make_primary_context_current(c10::DeviceIndex) { no_cuda(); }
void* load_module(const std::vector<char>&, c10::DeviceIndex) { no_cuda(); }
void* function(void*, const std::string&) { no_cuda(); }
void set_max_dynamic_shared_memory(void*, int) { no_cuda(); }
int max_active_blocks(void*, int, int) { no_cuda(); }
void launch(void*, Dim3, Dim3, int, void*, void**) { no_cuda(); }

#endif

}  // namespace sk::kernels::driver
