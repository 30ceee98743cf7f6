// speedkit's C ABI over the parts of libtorch that tch does not expose: PyTorch's global speed flags
// (at::globalContext()), autocast state, CUDA device properties and allocator statistics, CUDA events,
// streams and graphs, and the tensor-list ops behind GradScaler and AdamW (`_amp_*`, `_fused_adamw_`,
// `_foreach_*`).
//
// Contract, for every `sk_*` function that returns `int`: 0 on success; otherwise non-zero, and
// `sk_last_error()` holds the message (per thread) until the next failing call. No C++ exception ever
// crosses into Rust: each entry point runs its body inside SK_TRY. Tensors cross as tch's handles
// (`at::Tensor*`, owned by Rust); tensors returned to Rust are heap-allocated and owned by the caller.
//
// The CUDA parts compile only when libtorch was built with CUDA and the CUDA headers are present
// (SK_WITH_CUDA, decided by build.rs); without them the CUDA entry points fail with a clear message.
// The CUDA parts only call functions exported by libtorch_cuda/libc10_cuda (events through c10's
// device-generic c10::Event), never the CUDA runtime directly: c10's header-inline helpers would make
// every executable depend on libcudart, which a host's loader path need not contain.

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <torch/headeronly/version.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if SK_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

thread_local std::string last_error;

void set_error(const char* message) { last_error = message ? message : "unknown error"; }

// ATen's messages end with a C++ backtrace; the first line is what a user needs.
void set_error_from(const std::exception& e) {
  std::string what = e.what();
  auto cut = what.find("\nException raised from");
  if (cut != std::string::npos) what.resize(cut);
  last_error = what;
}

#define SK_TRY(...)                                  \
  try {                                              \
    __VA_ARGS__;                                     \
    return 0;                                        \
  } catch (const std::exception& e) {                \
    set_error_from(e);                               \
    return 1;                                        \
  } catch (...) {                                    \
    set_error("unknown C++ exception in libtorch"); \
    return 1;                                        \
  }

#define SK_NO_CUDA()                                                                            \
  set_error("speedkit was built against a libtorch without CUDA support (or without the CUDA " \
            "headers), so this CUDA operation is unavailable");                                 \
  return 2

std::vector<at::Tensor> tensor_list(at::Tensor** tensors, int64_t n) {
  std::vector<at::Tensor> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out.push_back(*tensors[i]);
  return out;
}

std::optional<at::Tensor> optional_tensor(at::Tensor* t) {
  if (t == nullptr) return std::nullopt;
  return *t;
}

// Flag identifiers; the Rust side (`flags::Flag`) mirrors these numbers.
enum BoolFlag : int {
  CUDA_MATMUL_ALLOW_TF32 = 0,
  CUDA_MATMUL_ALLOW_BF16_REDUCED_PRECISION_REDUCTION = 1,
  CUDA_MATMUL_ALLOW_FP16_REDUCED_PRECISION_REDUCTION = 2,
  CUDNN_ALLOW_TF32 = 3,
  CUDNN_BENCHMARK = 4,
  CUDNN_DETERMINISTIC = 5,
  CUDNN_ENABLED = 6,
  SDP_FLASH = 7,
  SDP_MEM_EFFICIENT = 8,
  SDP_MATH = 9,
  SDP_CUDNN = 10,
  USE_DETERMINISTIC_ALGORITHMS = 11,
};

bool reduction_allowed(at::CuBLASReductionOption option) {
  return option == at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK;
}

}  // namespace

extern "C" {

const char* sk_last_error() { return last_error.c_str(); }

// ---------------------------------------------------------------------------------------------
// Global flags
// ---------------------------------------------------------------------------------------------

int sk_flag_get_bool(int flag, int* out) {
  SK_TRY({
    auto& ctx = at::globalContext();
    bool value = false;
    switch (flag) {
      case CUDA_MATMUL_ALLOW_TF32: value = ctx.allowTF32CuBLAS(); break;
      case CUDA_MATMUL_ALLOW_BF16_REDUCED_PRECISION_REDUCTION:
        value = reduction_allowed(ctx.allowBF16ReductionCuBLAS());
        break;
      case CUDA_MATMUL_ALLOW_FP16_REDUCED_PRECISION_REDUCTION:
        value = reduction_allowed(ctx.allowFP16ReductionCuBLAS());
        break;
      case CUDNN_ALLOW_TF32: value = ctx.allowTF32CuDNN(); break;
      case CUDNN_BENCHMARK: value = ctx.benchmarkCuDNN(); break;
      case CUDNN_DETERMINISTIC: value = ctx.deterministicCuDNN(); break;
      case CUDNN_ENABLED: value = ctx.userEnabledCuDNN(); break;
      case SDP_FLASH: value = ctx.userEnabledFlashSDP(); break;
      case SDP_MEM_EFFICIENT: value = ctx.userEnabledMemEfficientSDP(); break;
      case SDP_MATH: value = ctx.userEnabledMathSDP(); break;
      case SDP_CUDNN: value = ctx.userEnabledCuDNNSDP(); break;
      case USE_DETERMINISTIC_ALGORITHMS: value = ctx.deterministicAlgorithms(); break;
      default: throw std::invalid_argument("unknown speedkit flag id " + std::to_string(flag));
    }
    *out = value ? 1 : 0;
  })
}

int sk_flag_set_bool(int flag, int value) {
  SK_TRY({
    auto& ctx = at::globalContext();
    const bool b = value != 0;
    switch (flag) {
      case CUDA_MATMUL_ALLOW_TF32: ctx.setAllowTF32CuBLAS(b); break;
      // split-K stays allowed either way, as with PyTorch's Python setters.
      case CUDA_MATMUL_ALLOW_BF16_REDUCED_PRECISION_REDUCTION: ctx.setAllowBF16ReductionCuBLAS(b); break;
      case CUDA_MATMUL_ALLOW_FP16_REDUCED_PRECISION_REDUCTION: ctx.setAllowFP16ReductionCuBLAS(b); break;
      case CUDNN_ALLOW_TF32: ctx.setAllowTF32CuDNN(b); break;
      case CUDNN_BENCHMARK: ctx.setBenchmarkCuDNN(b); break;
      case CUDNN_DETERMINISTIC: ctx.setDeterministicCuDNN(b); break;
      case CUDNN_ENABLED: ctx.setUserEnabledCuDNN(b); break;
      case SDP_FLASH: ctx.setSDPUseFlash(b); break;
      case SDP_MEM_EFFICIENT: ctx.setSDPUseMemEfficient(b); break;
      case SDP_MATH: ctx.setSDPUseMath(b); break;
      case SDP_CUDNN: ctx.setSDPUseCuDNN(b); break;
      case USE_DETERMINISTIC_ALGORITHMS:
        // Keep the current warn_only setting: speedkit only toggles the mode itself.
        ctx.setDeterministicAlgorithms(b, ctx.deterministicAlgorithmsWarnOnly());
        break;
      default: throw std::invalid_argument("unknown speedkit flag id " + std::to_string(flag));
    }
  })
}

// 0 = highest, 1 = high, 2 = medium (torch.get_float32_matmul_precision()).
int sk_matmul_precision_get(int* out) {
  SK_TRY({
    switch (at::globalContext().float32MatmulPrecision()) {
      case at::Float32MatmulPrecision::HIGHEST: *out = 0; break;
      case at::Float32MatmulPrecision::HIGH: *out = 1; break;
      case at::Float32MatmulPrecision::MEDIUM: *out = 2; break;
    }
  })
}

int sk_matmul_precision_set(int value) {
  SK_TRY({
    static const char* names[] = {"highest", "high", "medium"};
    if (value < 0 || value > 2) throw std::invalid_argument("matmul precision must be 0, 1 or 2");
    at::globalContext().setFloat32MatmulPrecision(names[value]);
  })
}

// ---------------------------------------------------------------------------------------------
// Autocast (at::autocast keeps one enabled flag and one dtype per device type, thread-local)
// ---------------------------------------------------------------------------------------------

int sk_autocast_get(int device_type, int* enabled, int* dtype) {
  SK_TRY({
    const auto dt = static_cast<c10::DeviceType>(device_type);
    *enabled = at::autocast::is_autocast_enabled(dt) ? 1 : 0;
    *dtype = static_cast<int>(at::autocast::get_autocast_dtype(dt));
  })
}

int sk_autocast_set(int device_type, int enabled, int dtype) {
  SK_TRY({
    const auto dt = static_cast<c10::DeviceType>(device_type);
    at::autocast::set_autocast_dtype(dt, static_cast<c10::ScalarType>(dtype));
    at::autocast::set_autocast_enabled(dt, enabled != 0);
  })
}

int sk_autocast_increment_nesting(int* depth) { SK_TRY(*depth = at::autocast::increment_nesting()) }

int sk_autocast_decrement_nesting(int* depth) { SK_TRY(*depth = at::autocast::decrement_nesting()) }

int sk_autocast_clear_cache() { SK_TRY(at::autocast::clear_cache()) }

// ---------------------------------------------------------------------------------------------
// Versions and devices
// ---------------------------------------------------------------------------------------------

struct sk_versions {
  int torch_major, torch_minor, torch_patch;
  int built_with_cuda;      // this shim has its CUDA parts
  int64_t cuda_runtime;     // e.g. 13000, 0 when unknown
  int64_t cudnn;            // e.g. 91500, 0 when unavailable
};

int sk_versions_get(sk_versions* out) {
  SK_TRY({
    std::memset(out, 0, sizeof(*out));
    out->torch_major = TORCH_VERSION_MAJOR;
    out->torch_minor = TORCH_VERSION_MINOR;
    out->torch_patch = TORCH_VERSION_PATCH;
#if SK_WITH_CUDA
    out->built_with_cuda = 1;
    auto& ctx = at::globalContext();
    if (ctx.hasCUDA()) {
      out->cuda_runtime = ctx.versionCUDART();
      if (ctx.hasCuDNN()) out->cudnn = ctx.versionCuDNN();
    }
#endif
  })
}

struct sk_device_props {
  char name[256];
  int major, minor;
  int multiprocessors;
  int64_t total_memory;
  int64_t l2_cache_bytes;
};

int sk_cuda_device_count(int* out) {
#if SK_WITH_CUDA
  SK_TRY(*out = at::globalContext().hasCUDA() ? static_cast<int>(c10::cuda::device_count()) : 0)
#else
  *out = 0;
  return 0;
#endif
}

int sk_cuda_device_props(int index, sk_device_props* out) {
#if SK_WITH_CUDA
  SK_TRY({
    const cudaDeviceProp* p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index));
    std::memset(out, 0, sizeof(*out));
    std::strncpy(out->name, p->name, sizeof(out->name) - 1);
    out->major = p->major;
    out->minor = p->minor;
    out->multiprocessors = p->multiProcessorCount;
    out->total_memory = static_cast<int64_t>(p->totalGlobalMem);
    out->l2_cache_bytes = static_cast<int64_t>(p->l2CacheSize);
  })
#else
  (void)index; (void)out;
  SK_NO_CUDA();
#endif
}

// Bytes currently allocated, peak allocated since the last reset, and reserved by the caching allocator.
int sk_cuda_memory_stats(int index, int64_t* allocated, int64_t* peak, int64_t* reserved) {
#if SK_WITH_CUDA
  SK_TRY({
    using Stat = c10::CachingDeviceAllocator::StatType;
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
    const auto all = static_cast<size_t>(Stat::AGGREGATE);
    *allocated = stats.allocated_bytes[all].current;
    *peak = stats.allocated_bytes[all].peak;
    *reserved = stats.reserved_bytes[all].current;
  })
#else
  (void)index; (void)allocated; (void)peak; (void)reserved;
  SK_NO_CUDA();
#endif
}

int sk_cuda_reset_peak_memory(int index) {
#if SK_WITH_CUDA
  SK_TRY(c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index)))
#else
  (void)index;
  SK_NO_CUDA();
#endif
}

// ---------------------------------------------------------------------------------------------
// CUDA events (timing) and streams
// ---------------------------------------------------------------------------------------------

int sk_cuda_event_new(void** out) {
#if SK_WITH_CUDA
  // BACKEND_DEFAULT = cudaEventDefault: timing enabled.
  SK_TRY(*out = new c10::Event(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT))
#else
  (void)out;
  SK_NO_CUDA();
#endif
}

int sk_cuda_event_record(void* event) {
#if SK_WITH_CUDA
  SK_TRY(static_cast<c10::Event*>(event)->record(c10::cuda::getCurrentCUDAStream()))
#else
  (void)event;
  SK_NO_CUDA();
#endif
}

int sk_cuda_event_elapsed_ms(void* start, void* end, double* out) {
#if SK_WITH_CUDA
  SK_TRY({
    auto* e = static_cast<c10::Event*>(end);
    e->synchronize();
    *out = static_cast<c10::Event*>(start)->elapsedTime(*e);
  })
#else
  (void)start; (void)end; (void)out;
  SK_NO_CUDA();
#endif
}

void sk_cuda_event_free(void* event) {
#if SK_WITH_CUDA
  delete static_cast<c10::Event*>(event);
#else
  (void)event;
#endif
}

int sk_cuda_synchronize(int index) {
#if SK_WITH_CUDA
  SK_TRY(c10::cuda::device_synchronize(); (void)index)
#else
  (void)index;
  SK_NO_CUDA();
#endif
}

#if SK_WITH_CUDA
namespace {
// A side stream made current for a scope: it first waits for the work already queued on the stream
// it replaces, and on exit that stream waits for everything queued on the side stream, so the two
// stay ordered without a host synchronisation (what torch.cuda.stream() + wait_stream do).
struct SideStream {
  c10::cuda::CUDAStream previous;
  c10::cuda::CUDAStream side;
  explicit SideStream(c10::DeviceIndex device)
      : previous(c10::cuda::getCurrentCUDAStream(device)), side(c10::cuda::getStreamFromPool(false, device)) {
    c10::Event ready(c10::DeviceType::CUDA);
    ready.record(previous);
    ready.block(side);
    c10::cuda::setCurrentCUDAStream(side);
  }
  void exit() {
    c10::Event done(c10::DeviceType::CUDA);
    done.record(side);
    done.block(previous);
    c10::cuda::setCurrentCUDAStream(previous);
  }
};
}  // namespace
#endif

int sk_cuda_side_stream_enter(int index, void** out) {
#if SK_WITH_CUDA
  SK_TRY(*out = new SideStream(static_cast<c10::DeviceIndex>(index)))
#else
  (void)index; (void)out;
  SK_NO_CUDA();
#endif
}

int sk_cuda_side_stream_exit(void* handle) {
#if SK_WITH_CUDA
  auto* s = static_cast<SideStream*>(handle);
  int status = 0;
  try {
    s->exit();
  } catch (const std::exception& e) {
    set_error_from(e);
    status = 1;
  }
  delete s;
  return status;
#else
  (void)handle;
  SK_NO_CUDA();
#endif
}

// ---------------------------------------------------------------------------------------------
// CUDA graphs (at::cuda::CUDAGraph, memory from the caching allocator's graph pools)
// ---------------------------------------------------------------------------------------------

int sk_cuda_graph_pool_handle(uint64_t* first, uint64_t* second) {
#if SK_WITH_CUDA
  SK_TRY({
    auto id = at::cuda::graph_pool_handle();
    *first = id.first;
    *second = id.second;
  })
#else
  (void)first; (void)second;
  SK_NO_CUDA();
#endif
}

int sk_cuda_graph_new(void** out) {
#if SK_WITH_CUDA
  SK_TRY(*out = new at::cuda::CUDAGraph())
#else
  (void)out;
  SK_NO_CUDA();
#endif
}

// Begins capture on the current stream, which must not be the default stream (see SideStream).
int sk_cuda_graph_capture_begin(void* graph, uint64_t pool_first, uint64_t pool_second) {
#if SK_WITH_CUDA
  SK_TRY(static_cast<at::cuda::CUDAGraph*>(graph)->capture_begin({pool_first, pool_second}))
#else
  (void)graph; (void)pool_first; (void)pool_second;
  SK_NO_CUDA();
#endif
}

int sk_cuda_graph_capture_end(void* graph) {
#if SK_WITH_CUDA
  SK_TRY(static_cast<at::cuda::CUDAGraph*>(graph)->capture_end())
#else
  (void)graph;
  SK_NO_CUDA();
#endif
}

int sk_cuda_graph_replay(void* graph) {
#if SK_WITH_CUDA
  SK_TRY(static_cast<at::cuda::CUDAGraph*>(graph)->replay())
#else
  (void)graph;
  SK_NO_CUDA();
#endif
}

void sk_cuda_graph_free(void* graph) {
#if SK_WITH_CUDA
  try {
    delete static_cast<at::cuda::CUDAGraph*>(graph);
  } catch (...) {
    // A destructor that throws during teardown has nothing useful to report to; swallow it.
  }
#else
  (void)graph;
#endif
}

// ---------------------------------------------------------------------------------------------
// Tensor-list ops for GradScaler and AdamW (tch's generated API has no in-place TensorList ops)
// ---------------------------------------------------------------------------------------------

// torch._amp_foreach_non_finite_check_and_unscale_: grads *= inv_scale; found_inf = 1 if any non-finite.
int sk_amp_unscale_(at::Tensor** grads, int64_t n, at::Tensor* found_inf, at::Tensor* inv_scale) {
  SK_TRY({
    auto list = tensor_list(grads, n);
    at::_amp_foreach_non_finite_check_and_unscale_(list, *found_inf, *inv_scale);
  })
}

// torch._fused_adamw_ with a tensor learning rate (capturable: lr and steps live on the device).
int sk_fused_adamw_(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs, at::Tensor** exp_avg_sqs,
                    at::Tensor** steps, int64_t n, at::Tensor* lr, double beta1, double beta2,
                    double weight_decay, double eps, at::Tensor* grad_scale, at::Tensor* found_inf) {
  SK_TRY({
    auto p = tensor_list(params, n);
    auto g = tensor_list(grads, n);
    auto m = tensor_list(exp_avgs, n);
    auto v = tensor_list(exp_avg_sqs, n);
    auto s = tensor_list(steps, n);
    // PyTorch's optimizer increments the steps before the kernel and takes the increment back for
    // a step that the scaler skipped (found_inf), so counts stay equal to the applied updates.
    at::_foreach_add_(s, 1);
    at::_fused_adamw_(p, g, m, v, {}, s, *lr, beta1, beta2, weight_decay, eps, /*amsgrad=*/false,
                      /*maximize=*/false, optional_tensor(grad_scale), optional_tensor(found_inf));
    if (found_inf != nullptr) at::_foreach_sub_(s, std::vector<at::Tensor>(s.size(), *found_inf));
  })
}

// The multi-tensor (foreach) AdamW of torch.optim.AdamW with capturable=True: the same update as the
// fused kernel, in a few multi-tensor launches, with the step count and lr as device tensors.
int sk_foreach_adamw_(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs, at::Tensor** exp_avg_sqs,
                      at::Tensor** steps, int64_t n, at::Tensor* lr, double beta1, double beta2,
                      double weight_decay, double eps) {
  SK_TRY({
    if (n == 0) return 0;
    auto p = tensor_list(params, n);
    auto g = tensor_list(grads, n);
    auto m = tensor_list(exp_avgs, n);
    auto v = tensor_list(exp_avg_sqs, n);
    auto s = tensor_list(steps, n);
    at::_foreach_add_(s, 1);
    if (weight_decay != 0.0) at::_foreach_mul_(p, 1.0 - *lr * weight_decay);
    at::_foreach_lerp_(m, g, 1.0 - beta1);
    at::_foreach_mul_(v, beta2);
    at::_foreach_addcmul_(v, g, g, 1.0 - beta2);
    // step_size = -lr / (1 - beta1^t); denominator = sqrt(v) / sqrt(1 - beta2^t) + eps
    auto bias1 = at::_foreach_pow(beta1, s);
    auto bias2 = at::_foreach_pow(beta2, s);
    at::_foreach_sub_(bias1, 1);
    at::_foreach_sub_(bias2, 1);
    at::_foreach_neg_(bias2);
    at::_foreach_div_(bias1, *lr);
    at::_foreach_reciprocal_(bias1);
    at::_foreach_sqrt_(bias2);
    auto denom = at::_foreach_sqrt(v);
    at::_foreach_div_(denom, bias2);
    at::_foreach_add_(denom, eps);
    at::_foreach_div_(denom, bias1);
    at::_foreach_addcdiv_(p, m, denom);
  })
}

// Re-lays a 4-d (conv) weight out in channels-last memory order, keeping it the same parameter
// (set_data keeps autograd identity and the optimizer's reference).
int sk_to_channels_last_(at::Tensor* tensor) {
  SK_TRY({
    if (tensor->dim() == 4) {
      at::NoGradGuard no_grad;
      tensor->set_data(tensor->contiguous(at::MemoryFormat::ChannelsLast));
    }
  })
}

int sk_is_channels_last(at::Tensor* tensor, int* out) {
  SK_TRY(*out = tensor->dim() == 4 && tensor->is_contiguous(at::MemoryFormat::ChannelsLast) ? 1 : 0)
}

// Drops the gradients of a parameter list (`param.grad = None`), as PyTorch's
// `zero_grad(set_to_none=True)`: the next backward writes fresh gradients instead of adding to
// zero-filled ones, which saves a fill and an add over every parameter.
int sk_clear_grads(at::Tensor** tensors, int64_t n) {
  SK_TRY({
    for (int64_t i = 0; i < n; ++i) {
      tensors[i]->mutable_grad().reset();
    }
  })
}

// Points `params[i].grad` at `grads[i]`: a replayed CUDA graph writes the gradients into the
// tensors it allocated during capture, so the parameters must refer to those again before it runs.
int sk_set_grads(at::Tensor** params, at::Tensor** grads, int64_t n) {
  SK_TRY({
    for (int64_t i = 0; i < n; ++i) {
      params[i]->mutable_grad() = *grads[i];
    }
  })
}

// Plain multi-tensor helpers the Rust side uses on parameter lists.
int sk_foreach_zero_(at::Tensor** tensors, int64_t n) {
  SK_TRY({
    auto list = tensor_list(tensors, n);
    at::_foreach_zero_(list);
  })
}

int sk_foreach_norm(at::Tensor** tensors, int64_t n, double ord, at::Tensor** out) {
  SK_TRY({
    auto list = tensor_list(tensors, n);
    auto norms = at::_foreach_norm(list, ord);
    *out = new at::Tensor(at::linalg_vector_norm(at::stack(norms), ord));
  })
}

int sk_foreach_mul_scalar_tensor_(at::Tensor** tensors, int64_t n, at::Tensor* factor) {
  SK_TRY({
    auto list = tensor_list(tensors, n);
    at::_foreach_mul_(list, *factor);
  })
}

// ---------------------------------------------------------------------------------------------
// Benchmark runner (issue 15): peak reserved memory, and giving cached blocks back between
// workloads so that each one's reserved figure is its own. Self-contained block; it can move to
// whichever file ends up holding the allocator statistics.
// ---------------------------------------------------------------------------------------------

// Peak bytes reserved by the caching allocator since the last reset (what
// torch.cuda.max_memory_reserved reports).
int sk_cuda_peak_reserved_memory(int index, int64_t* out) {
#if SK_WITH_CUDA
  SK_TRY({
    using Stat = c10::CachingDeviceAllocator::StatType;
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
    *out = stats.reserved_bytes[static_cast<size_t>(Stat::AGGREGATE)].peak;
  })
#else
  (void)index; (void)out;
  SK_NO_CUDA();
#endif
}

// Releases every unused cached block to the driver (torch.cuda.empty_cache).
int sk_cuda_empty_cache() {
#if SK_WITH_CUDA
  SK_TRY(c10::cuda::CUDACachingAllocator::emptyCache())
#else
  SK_NO_CUDA();
#endif
}

}  // extern "C"
