// speedkit's kernel layer, in two parts.
//
// The registry: kernel sources (speedkit/kernels/*.cuh, embedded at build time, and sources
// registered at run time), their compilation with NVRTC for the GPU in use (nvrtc.cpp) with an
// on-disk cubin cache keyed per source, loading through the CUDA driver API (driver.cpp), and typed
// launches (launch.h) on PyTorch's current stream.
//
// The ops' one path: each fused op (layernorm.cpp, classifier.cpp, ...) asks run_or_fall_back() to
// run its kernel when the kernel switch allows it and its own eligibility check finds nothing wrong,
// and ATen's composite otherwise; every outcome goes to one channel of notes (ran, or fell back and
// why, with counts) that Rust reads for the audit, the runner and the profiler.
//
// Everything here throws std::runtime_error (or c10::Error) with a message naming the kernel; the
// sk_* entry points turn that into speedkit.h's error contract.
#pragma once

#include "launch.h"
#include "shim.h"

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <vector>

namespace sk::kernels {

// ----- sources -----------------------------------------------------------------------------------

// One kernel source: CUDA C++ that NVRTC compiles, the other registered sources available to it as
// headers by their names.
struct Source {
  int index;
  std::string name;
  std::string text;
};

// How many sources are registered: speedkit's own (sorted by name) first, then the run-time ones.
int source_count();

// How many of them are speedkit's own.
int builtin_source_count();

// Source `index`; throws when there is none. The reference stays valid for the life of the process.
const Source& source(int index);

// The source called `name`; throws when there is none.
const Source& source(const std::string& name);

// Registers `text` under `name` and returns its index; the same name and text again returns the
// same index, the same name with other text is an error.
int register_source(const std::string& name, const std::string& text);

// The key of `source`'s cubin for sm_<major><minor>: its own text, the text of every registered
// source it includes (transitively), the architecture and NVRTC's version.
std::string cache_key(const Source& source, int major, int minor);

// ----- the on-disk cache -------------------------------------------------------------------------

// The directory of speedkit's compiled kernels and chosen cuDNN plans (conv_plans.cpp):
// SPEEDKIT_KERNEL_CACHE, else $XDG_CACHE_HOME/speedkit/kernels, else ~/.cache/speedkit/kernels;
// empty when none is known (then every process compiles afresh).
std::filesystem::path cache_dir();

// The bytes of the file at `path`, or none where it cannot be read.
std::vector<char> read_file(const std::filesystem::path& path);

// `bytes` written to a private temporary name and renamed to `path`, so that a concurrent reader
// sees either nothing or the whole file. A cache that cannot be written is only a slower next start.
void write_file_atomically(const std::filesystem::path& path, const std::vector<char>& bytes);

// ----- NVRTC ---------------------------------------------------------------------------------------

// The CUDA toolkit parts NVRTC needs: its library and the CUDA headers.
struct Toolkit {
  std::string nvrtc_library;
  std::string include_dir;
};

namespace nvrtc {
// The toolkit in use (next to libtorch, in CUDA_HOME/CUDA_PATH, in the toolkit speedkit was built
// against, or in /usr/local/cuda); throws with the places searched when there is none.
const Toolkit& toolkit();
// NVRTC's version as major * 1000 + minor * 10 (e.g. 13000); loads NVRTC on first use.
int version();
// The cubin of `source` for sm_<major><minor>, the registered sources available to it as
// headers: of every entry point, or of `entry_point` alone (common.cuh's SK_ENTRY). Throws with
// NVRTC's log when it does not compile.
std::vector<char> compile(const Source& source, int major, int minor, const std::string& entry_point = {});
}  // namespace nvrtc

// ----- the CUDA driver -----------------------------------------------------------------------------

namespace driver {
// Whether libcuda.so.1 can be loaded; the reason when not.
bool available(std::string* why_not);
// Makes `device`'s primary context (PyTorch's) current on this thread if no context is: a thread
// that only ever used the runtime API (e.g. an autograd worker) may have none for the driver API.
void make_primary_context_current(int device);
// Loads a cubin into `device`'s primary context and returns the CUmodule.
void* load_module(const std::vector<char>& cubin, int device);
// The CUfunction `name` of a module; throws naming the kernel when it is missing.
void* function(void* module, const std::string& name);
// The byte sizes of a kernel's parameters, in order; empty when the driver cannot tell (before
// CUDA 12.4's cuFuncGetParamInfo).
std::vector<size_t> parameter_sizes(void* function);
void set_max_dynamic_shared_memory(void* function, int bytes);
// How many blocks of `threads` threads and `shared_bytes` of dynamic shared memory fit on one SM at
// once (registers, shared memory and thread slots considered).
int max_active_blocks(void* function, int threads, int shared_bytes);
void launch(void* function, Dim3 grid, Dim3 block, int shared_bytes, void* stream, void** args);
// Pins `bytes` of host memory at `data` (page-aligned) for copies with any device, through
// `device`'s primary context; unregister_host_memory unpins it.
void register_host_memory(void* data, size_t bytes, int device);
void unregister_host_memory(void* data);
// Whether `stream` (a CUstream: PyTorch's cudaStream_t) is capturing a CUDA graph.
bool stream_is_capturing(void* stream);
}  // namespace driver

// ----- loading -------------------------------------------------------------------------------------

// The suffix of kernel names for a storage type (f32, bf16, f16); throws for any other type.
const char* type_tag(c10::ScalarType type);

// The one rule kernel names follow: `base`, then `_<tag>` per type, then `_<variant>` if any
// (layernorm_backward_f32_f32_bf16_768). The .cuh files' entry-point macros spell the same names.
std::string kernel_name(const char* base, std::initializer_list<c10::ScalarType> types,
                        const std::string& variant = {});

// Compiles a source registered at run time for `sm_<major><minor>` (or reads its cubin from the disk
// cache) ahead of the loads of its kernels, which then find it in this process; whether NVRTC ran.
// Thread-safe: a step's generated kernels are compiled on several threads at once.
bool prepare(const Source& file, int major, int minor);

// The kernel `name` of source `file`, compiled (or read from the on-disk cache) and loaded on
// `device` on first use; later calls are a map lookup. When `parameter_bytes` is given, a kernel
// that does not take exactly one parameter of that size is refused.
Kernel load(const Source& file, const std::string& name, const c10::Device& device,
            std::optional<size_t> parameter_bytes = std::nullopt);

// The entry point of `Params`'s kernel for `types` (and `variant`), refused unless its one parameter
// has Params's size.
template <typename Params>
TypedKernel<Params> get(std::initializer_list<c10::ScalarType> types, const c10::Device& device,
                        const std::string& variant = {}) {
  TypedKernel<Params> typed;
  static_cast<Kernel&>(typed) =
      load(source(Params::kFile), kernel_name(Params::kName, types, variant), device, sizeof(Params));
  return typed;
}

// Allows `kernel` more than the default 48 KiB of dynamic shared memory.
void allow_dynamic_shared_memory(const Kernel& kernel, int bytes);

// How many blocks of `kernel` (`threads` threads, `shared_bytes` of dynamic shared memory) are
// resident on one SM at once: what a grid-stride kernel's grid should be sized by.
int resident_blocks_per_sm(const Kernel& kernel, int threads, int shared_bytes);

// Device properties the launchers size their grids by.
int64_t max_dynamic_shared_memory(const c10::Device& device);
int multiprocessors(const c10::Device& device);

// Whether speedkit's kernels can run on CUDA device `index`: SM >= 8.0, NVRTC and the CUDA headers
// found, the driver library loadable. Empty when they can, else the reason (asked once per device).
std::string unavailable_reason(int index);

// Whether every tensor's data starts on a multiple of `elements` of its own element size (what 8-
// and 16-byte vector loads need); undefined tensors pass.
bool aligned_to(int64_t elements, std::initializer_list<const at::Tensor*> tensors);

}  // namespace sk::kernels

namespace sk::ops {

// Whether the kernels of `op` (an sk_op of speedkit.h) are switched on: the switch of every op and
// the op's own.
bool switched_on(int op);

// Why `op`'s kernels cannot run for a tensor on `device` now, or empty: switched off, not a CUDA
// device, or a device the kernels cannot run on.
std::string unusable(int op, const c10::Device& device);

// The notes channel: `op` ran on its kernel, or took ATen's path for `reason`.
void note_ran(int op);
void note_fell_back(int op, const std::string& reason);

// The one run-or-fall-back path of every fused op: `kernel()` when `why_not` is empty, else (or
// when the kernel throws) `fallback()`, ATen's composite; the outcome noted for the audit. An op
// switched off is not noted: the plan already says so.
template <typename Kernel, typename Fallback>
auto run_or_fall_back(int op, const std::string& why_not, Kernel&& kernel, Fallback&& fallback)
    -> decltype(fallback()) {
  if (why_not.empty()) {
    try {
      auto result = kernel();
      note_ran(op);
      return result;
    } catch (const std::exception& e) {
      note_fell_back(op, "the kernel failed (" + first_line_of(e) + ")");
    }
  } else if (switched_on(op)) {
    note_fell_back(op, why_not);
  }
  return fallback();
}

// Eligibility helpers the ops' checks share. Each returns empty when the inputs pass.
// A storage type the kernels take: fp32, bf16, fp16.
std::string floating(const char* what, const at::Tensor& t);
// `t` on `device` (undefined passes).
std::string on_device(const char* what, const at::Tensor& t, const c10::Device& device);
// Rows and columns that fit the kernels' 32-bit indices.
std::string fits_int32(int64_t rows, int64_t columns);

// The first non-empty of `reasons`, else empty: `first_of({check1, check2, ...})`.
inline std::string first_of(std::initializer_list<std::string> reasons) {
  for (const std::string& reason : reasons)
    if (!reason.empty()) return reason;
  return {};
}

}  // namespace sk::ops
