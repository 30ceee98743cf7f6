// PyTorch's global speed flags (at::globalContext()).
//
// Float32 precision is stored twice inside libtorch 2.11: the legacy fields (`torch.set_float32_matmul_
// precision`, `torch.backends.cudnn.allow_tf32`) and the per-backend table of the new API
// (`torch.backends.cuda.matmul.fp32_precision`, ...). PyTorch's checked getters throw once the two
// disagree ("mix of the legacy and new APIs"), and user code or another library can leave them so.
// speedkit therefore reads every one of these fields raw, without the check, and restores each raw:
// capture never fails and a restore puts back exactly what was there, mixed or not. Applying a setting
// still goes through PyTorch's own setters, which keep the two APIs consistent.
#include "shim.h"

#include <ATen/Context.h>
#include <c10/core/AllocatorConfig.h>

#include <atomic>
#include <stdexcept>
#include <unordered_map>
#include <utility>

std::string& sk::last_error() {
  thread_local std::string message;
  return message;
}

namespace {

// Raw access to at::Context's private precision fields. An explicit template instantiation may name
// private members (C++17 [temp.explicit]/12); the friend function it defines hands out the member
// pointer. The compiler checks each name and type against libtorch's real class definition, so a
// libtorch that renames or retypes a field fails to compile here instead of misreading memory.
template <typename Tag, typename Tag::type Member>
struct Expose {
  friend typename Tag::type member(Tag) { return Member; }
};

struct LegacyMatmulPrecision {
  using type = at::Float32MatmulPrecision at::Context::*;
  friend type member(LegacyMatmulPrecision);
};
template struct Expose<LegacyMatmulPrecision, &at::Context::float32_matmul_precision>;

struct LegacyCudnnTf32 {
  using type = bool at::Context::*;
  friend type member(LegacyCudnnTf32);
};
template struct Expose<LegacyCudnnTf32, &at::Context::allow_tf32_cudnn>;

using PrecisionKey = std::pair<at::Float32Backend, at::Float32Op>;
using PrecisionTable = std::unordered_map<PrecisionKey, at::Float32Precision, c10::hash<PrecisionKey>>;
struct Fp32PrecisionTable {
  using type = PrecisionTable at::Context::*;
  friend type member(Fp32PrecisionTable);
};
template struct Expose<Fp32PrecisionTable, &at::Context::fp32_precision>;

// Test-only fault injection: when non-zero, the n-th flag write from now throws (once).
std::atomic<int> writes_until_fault{0};


// speedkit.h's scalar type codes are c10's: checked here, once.
static_assert(SK_INT64 == static_cast<int>(c10::ScalarType::Long));
static_assert(SK_FLOAT16 == static_cast<int>(c10::ScalarType::Half));
static_assert(SK_FLOAT32 == static_cast<int>(c10::ScalarType::Float));
static_assert(SK_FLOAT64 == static_cast<int>(c10::ScalarType::Double));
static_assert(SK_BFLOAT16 == static_cast<int>(c10::ScalarType::BFloat16));
static_assert(SK_FLOAT8_E5M2 == static_cast<int>(c10::ScalarType::Float8_e5m2));
static_assert(SK_FLOAT8_E4M3FN == static_cast<int>(c10::ScalarType::Float8_e4m3fn));

// The per-backend entries of the new API that speedkit's settings move (speedkit.h's sk_fp32_precision_entry).
PrecisionKey precision_key(int which) {
  switch (which) {
    case SK_FP32_CUDA_MATMUL: return {at::Float32Backend::CUDA, at::Float32Op::MATMUL};
    case SK_FP32_MKLDNN_MATMUL: return {at::Float32Backend::MKLDNN, at::Float32Op::MATMUL};
    case SK_FP32_CUDNN_CONV: return {at::Float32Backend::CUDA, at::Float32Op::CONV};
    case SK_FP32_CUDNN_RNN: return {at::Float32Backend::CUDA, at::Float32Op::RNN};
    default: throw std::invalid_argument("unknown speedkit fp32 precision id " + std::to_string(which));
  }
}

// 0 = none (inherit), 1 = ieee, 2 = tf32, 3 = bf16 (PyTorch's Float32Precision order).
int precision_code(at::Float32Precision p) { return static_cast<int>(p); }

at::Float32Precision precision_from(int code) {
  if (code < 0 || code > 3) throw std::invalid_argument("fp32 precision must be 0..3");
  return static_cast<at::Float32Precision>(code);
}

bool reduction_allowed(at::CuBLASReductionOption option) {
  return option == at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK;
}

}  // namespace

void sk::count_flag_write() {
  int n = writes_until_fault.load();
  while (n > 0 && !writes_until_fault.compare_exchange_weak(n, n - 1)) {
  }
  if (n == 1) throw std::runtime_error("injected fault: this flag write was made to fail by a test");
}

extern "C" {

const char* sk_last_error(void) { return sk::last_error().c_str(); }

void sk_test_fail_nth_flag_write(int n) { writes_until_fault.store(n > 0 ? n : 0); }

int sk_flag_write(void) { SK_TRY(sk::count_flag_write()) }

int sk_flag_get_bool(int flag, int* out) {
  SK_TRY({
    auto& ctx = at::globalContext();
    bool value = false;
    switch (flag) {
      // What PyTorch's checked getter returns when the two APIs agree, read without the check.
      case SK_FLAG_CUDA_MATMUL_ALLOW_TF32:
        value = ctx.float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL) ==
                at::Float32Precision::TF32;
        break;
      case SK_FLAG_CUDA_MATMUL_ALLOW_BF16_REDUCED_PRECISION_REDUCTION:
        value = reduction_allowed(ctx.allowBF16ReductionCuBLAS());
        break;
      case SK_FLAG_CUDA_MATMUL_ALLOW_FP16_REDUCED_PRECISION_REDUCTION:
        value = reduction_allowed(ctx.allowFP16ReductionCuBLAS());
        break;
      case SK_FLAG_CUDNN_ALLOW_TF32: value = ctx.*member(LegacyCudnnTf32{}); break;
      case SK_FLAG_CUDNN_BENCHMARK: value = ctx.benchmarkCuDNN(); break;
      case SK_FLAG_CUDNN_DETERMINISTIC: value = ctx.deterministicCuDNN(); break;
      case SK_FLAG_CUDNN_ENABLED: value = ctx.userEnabledCuDNN(); break;
      case SK_FLAG_SDP_FLASH: value = ctx.userEnabledFlashSDP(); break;
      case SK_FLAG_SDP_MEM_EFFICIENT: value = ctx.userEnabledMemEfficientSDP(); break;
      case SK_FLAG_SDP_MATH: value = ctx.userEnabledMathSDP(); break;
      case SK_FLAG_SDP_CUDNN: value = ctx.userEnabledCuDNNSDP(); break;
      case SK_FLAG_USE_DETERMINISTIC_ALGORITHMS: value = ctx.deterministicAlgorithms(); break;
      case SK_FLAG_CUDA_EXPANDABLE_SEGMENTS:
        value = c10::CachingAllocator::AcceleratorAllocatorConfig::use_expandable_segments();
        break;
      default: throw std::invalid_argument("unknown speedkit flag id " + std::to_string(flag));
    }
    *out = value ? 1 : 0;
  })
}

// Sets a flag as PyTorch's Python setter does (the TF32 ones write both APIs consistently).
int sk_flag_set_bool(int flag, int value) {
  SK_TRY({
    sk::count_flag_write();
    auto& ctx = at::globalContext();
    const bool b = value != 0;
    switch (flag) {
      case SK_FLAG_CUDA_MATMUL_ALLOW_TF32: ctx.setAllowTF32CuBLAS(b); break;
      // split-K stays allowed either way, as with PyTorch's Python setters.
      case SK_FLAG_CUDA_MATMUL_ALLOW_BF16_REDUCED_PRECISION_REDUCTION: ctx.setAllowBF16ReductionCuBLAS(b); break;
      case SK_FLAG_CUDA_MATMUL_ALLOW_FP16_REDUCED_PRECISION_REDUCTION: ctx.setAllowFP16ReductionCuBLAS(b); break;
      case SK_FLAG_CUDNN_ALLOW_TF32: ctx.setAllowTF32CuDNN(b); break;
      case SK_FLAG_CUDNN_BENCHMARK: ctx.setBenchmarkCuDNN(b); break;
      case SK_FLAG_CUDNN_DETERMINISTIC: ctx.setDeterministicCuDNN(b); break;
      case SK_FLAG_CUDNN_ENABLED: ctx.setUserEnabledCuDNN(b); break;
      case SK_FLAG_SDP_FLASH: ctx.setSDPUseFlash(b); break;
      case SK_FLAG_SDP_MEM_EFFICIENT: ctx.setSDPUseMemEfficient(b); break;
      case SK_FLAG_SDP_MATH: ctx.setSDPUseMath(b); break;
      case SK_FLAG_SDP_CUDNN: ctx.setSDPUseCuDNN(b); break;
      case SK_FLAG_USE_DETERMINISTIC_ALGORITHMS:
        // Keep the current warn_only setting: speedkit only toggles the mode itself.
        ctx.setDeterministicAlgorithms(b, ctx.deterministicAlgorithmsWarnOnly());
        break;
      // As torch.cuda.memory._set_allocator_settings: segments made from now on grow in place.
      case SK_FLAG_CUDA_EXPANDABLE_SEGMENTS:
        c10::CachingAllocator::setAllocatorSettings(b ? "expandable_segments:True" : "expandable_segments:False");
        break;
      default: throw std::invalid_argument("unknown speedkit flag id " + std::to_string(flag));
    }
  })
}

// Writes only the flag's own field, for restoring a captured state: the legacy cuDNN TF32 field
// alone (its per-backend entries are restored as flags of their own); every other flag as set above.
// `allow_tf32` of cuBLAS has no field of its own (it is a view of the CUDA matmul entry), so
// restoring it is the caller's mistake.
int sk_flag_restore_bool(int flag, int value) {
  if (flag == SK_FLAG_CUDNN_ALLOW_TF32) {
    SK_TRY(sk::count_flag_write(); at::globalContext().*member(LegacyCudnnTf32{}) = value != 0)
  }
  if (flag == SK_FLAG_CUDA_MATMUL_ALLOW_TF32) {
    sk::set_error("torch.backends.cuda.matmul.allow_tf32 is a view of the CUDA matmul fp32 precision; restore that");
    return 1;
  }
  return sk_flag_set_bool(flag, value);
}

// The legacy field behind torch.get_float32_matmul_precision(): 0 = highest, 1 = high, 2 = medium.
int sk_matmul_precision_get(int* out) {
  SK_TRY(*out = static_cast<int>(at::globalContext().*member(LegacyMatmulPrecision{})))
}

// torch.set_float32_matmul_precision(): the legacy field and the CUDA and oneDNN matmul entries together.
int sk_matmul_precision_set(int value) {
  SK_TRY({
    sk::count_flag_write();
    static const char* names[] = {"highest", "high", "medium"};
    if (value < 0 || value > 2) throw std::invalid_argument("matmul precision must be 0, 1 or 2");
    at::globalContext().setFloat32MatmulPrecision(names[value]);
  })
}

// The legacy field alone, for restoring a captured state.
int sk_matmul_precision_restore(int value) {
  SK_TRY({
    sk::count_flag_write();
    if (value < 0 || value > 2) throw std::invalid_argument("matmul precision must be 0, 1 or 2");
    at::globalContext().*member(LegacyMatmulPrecision{}) = static_cast<at::Float32MatmulPrecision>(value);
  })
}

// One entry of the new API's table, as stored (0 = none: inherits from the backend's `all` entry).
int sk_fp32_precision_get(int which, int* out) {
  SK_TRY({
    const auto& table = at::globalContext().*member(Fp32PrecisionTable{});
    auto it = table.find(precision_key(which));
    if (it == table.end()) throw std::logic_error("libtorch has no such fp32 precision entry");
    *out = precision_code(it->second);
  })
}

// Writes one entry of the new API's table (PyTorch's own setter, which rejects bf16 for CUDA).
int sk_fp32_precision_set(int which, int value) {
  SK_TRY({
    sk::count_flag_write();
    const auto key = precision_key(which);
    at::globalContext().setFloat32Precision(key.first, key.second, precision_from(value));
  })
}

}  // extern "C"
