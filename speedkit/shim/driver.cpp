// The CUDA driver API, loaded at run time (loader.h): loads kernel cubins into the device's primary
// context (the one PyTorch's runtime uses) and launches their kernels, and pins host memory for
// pinned_host.cpp. libcuda exists only where a GPU driver is installed: the shim must load (and CI
// must compile kernels) on machines without one.
#include "kernels.h"
#include "loader.h"

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
  // CUDA 12.4 and newer: the offset and size of a kernel's parameter, or an error past the last.
  CUresult (*FuncGetParamInfo)(CUfunction, size_t, size_t*, size_t*);
  CUresult (*MemHostRegister)(void*, size_t, unsigned);
  CUresult (*MemHostUnregister)(void*);
  CUresult (*StreamIsCapturing)(CUstream, CUstreamCaptureStatus*);
};

const Api& api() {
  return loader::once<Api>([] {
    const auto library = loader::Library::open("the CUDA driver library", {"libcuda.so.1"});
    Api api{};
    library.bind(api.GetErrorString, "cuGetErrorString");
    library.bind(api.DeviceGet, "cuDeviceGet");
    library.bind(api.CtxGetCurrent, "cuCtxGetCurrent");
    library.bind(api.CtxSetCurrent, "cuCtxSetCurrent");
    library.bind(api.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    library.bind(api.ModuleLoadData, "cuModuleLoadData");
    library.bind(api.ModuleGetFunction, "cuModuleGetFunction");
    library.bind(api.FuncSetAttribute, "cuFuncSetAttribute");
    library.bind(api.OccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
    library.bind(api.LaunchKernel, "cuLaunchKernel");
    library.bind_optional(api.FuncGetParamInfo, "cuFuncGetParamInfo");
    library.bind(api.MemHostRegister, "cuMemHostRegister_v2");
    library.bind(api.MemHostUnregister, "cuMemHostUnregister");
    library.bind(api.StreamIsCapturing, "cuStreamIsCapturing");
    return api;
  });
}

void check(CUresult result, const std::string& what) {
  if (result == CUDA_SUCCESS) return;
  const char* message = nullptr;
  api().GetErrorString(result, &message);
  throw std::runtime_error(what + ": " + (message ? message : "unknown CUDA driver error"));
}

}  // namespace

// Modules belong to a context; PyTorch's runtime works in each device's primary context.
void make_primary_context_current(int index) {
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

void* load_module(const std::vector<char>& cubin, int device) {
  make_primary_context_current(device);
  CUmodule module = nullptr;
  check(api().ModuleLoadData(&module, cubin.data()), "cuModuleLoadData");
  return module;
}

void* function(void* module, const std::string& name) {
  CUfunction function = nullptr;
  check(api().ModuleGetFunction(&function, static_cast<CUmodule>(module), name.c_str()), "kernel " + name);
  return function;
}

std::vector<size_t> parameter_sizes(void* function) {
  std::vector<size_t> sizes;
  if (api().FuncGetParamInfo == nullptr) return sizes;
  for (size_t index = 0;; ++index) {
    size_t offset = 0, size = 0;
    if (api().FuncGetParamInfo(static_cast<CUfunction>(function), index, &offset, &size) != CUDA_SUCCESS) break;
    sizes.push_back(size);
  }
  return sizes;
}

void set_max_dynamic_shared_memory(void* function, int bytes) {
  check(api().FuncSetAttribute(static_cast<CUfunction>(function), CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                               bytes),
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

void register_host_memory(void* data, size_t bytes, int device) {
  make_primary_context_current(device);
  // Portable: pinned for every context, as the runtime's own pinned memory is.
  check(api().MemHostRegister(data, bytes, CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister");
}

void unregister_host_memory(void* data) { check(api().MemHostUnregister(data), "cuMemHostUnregister"); }

bool stream_is_capturing(void* stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  check(api().StreamIsCapturing(static_cast<CUstream>(stream), &status), "cuStreamIsCapturing");
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

#else  // a libtorch without CUDA: nothing can load or launch

bool available(std::string* why_not) {
  if (why_not != nullptr) *why_not = "speedkit was built against a libtorch without CUDA support";
  return false;
}

std::vector<size_t> parameter_sizes(void*) { return {}; }

void register_host_memory(void*, size_t, int) {
  throw std::runtime_error("speedkit was built against a libtorch without CUDA support: no memory can be pinned");
}

void unregister_host_memory(void*) {}

bool stream_is_capturing(void*) { return false; }

#endif

}  // namespace sk::kernels::driver
