// GEMMs with cuBLASLt epilogues, and the transformer MLP (x → fc1 → gelu_tanh → fc2) built on them as
// a C++ autograd function, so that the bias adds, the GELU, its derivative and both bias gradients
// happen inside the GEMMs instead of in separate passes over the activations:
//   forward   fc1: h = gelu(x W1ᵀ + b1), keeping z = x W1ᵀ + b1  (GELU_AUX_BIAS)
//             fc2: y = h W2ᵀ + b2                                (BIAS)
//   backward  fc2 wgrad: dW2 = dyᵀ h, db2 = Σ dy                  (BGRADB)
//             fc2 dgrad: dz = (dy W2) · gelu'(z), db1 = Σ dz     (DGELU, or DGELU_BGRAD)
// (each backward epilogue can be switched to ATen's separate pass: `fusion` below; by default
// db1 is ATen's column sum, measured faster than DGELU_BGRAD)
//             fc1 wgrad and dgrad: dW1 = dzᵀ x, dx = dz W1        (plain GEMMs)
// Every GEMM whose epilogue cuBLASLt's heuristic cannot serve (shape, alignment, an empty dimension)
// runs ATen's ops for that step instead, and the reason is noted once for the Rust side's audit.
//
// libcublasLt is resolved at run time, as NVRTC and libcuda are (nvrtc.cpp, driver.cpp): libtorch_cuda
// has already loaded it, so binding its symbols adds no link-time dependency on the wheel's library
// path. The GEMMs run on PyTorch's current stream with its cuBLASLt handle and its cuBLASLt workspace
// (from the caching allocator), so they are captured in CUDA graphs like ATen's own.
#include "fused_op.h"
#include "loader.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/linear.h>

#if SK_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <atomic>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#endif

namespace {

// cuBLASLt's epilogues want 16-byte rows of bf16/fp16 and a GELU buffer whose leading dimension is
// a multiple of 8: every width must be a multiple of this.
constexpr int64_t kWidthMultiple = 8;

#if SK_WITH_CUDA

// ----- the library ---------------------------------------------------------------------------------

struct Api {
  decltype(&::cublasLtMatmulDescCreate) MatmulDescCreate;
  decltype(&::cublasLtMatmulDescDestroy) MatmulDescDestroy;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  decltype(&::cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
  decltype(&::cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy;
  decltype(&::cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate;
  decltype(&::cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic;
  decltype(&::cublasLtMatmul) Matmul;
};

// The copy libtorch_cuda already loaded (its state shared), else the wheel's, else the loader path's.
const Api& api() {
  return sk::loader::once<Api>([] {
    const auto torch_lib = sk::loader::torch_lib_dir();
    const std::string wheel =
        torch_lib.empty() ? std::string() : (torch_lib.parent_path().parent_path() / "nvidia" / "cu13" / "lib" / "libcublasLt.so.13").string();
    std::vector<std::string> candidates{"libcublasLt.so.13"};
    if (!wheel.empty()) candidates.insert(candidates.begin(), wheel);
    const auto library = sk::loader::Library::open("cuBLASLt", candidates, /*already_loaded=*/true);
    Api api{};
    library.bind(api.MatmulDescCreate, "cublasLtMatmulDescCreate");
    library.bind(api.MatmulDescDestroy, "cublasLtMatmulDescDestroy");
    library.bind(api.MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
    library.bind(api.MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
    library.bind(api.MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
    library.bind(api.MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
    library.bind(api.MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
    library.bind(api.MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
    library.bind(api.MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
    library.bind(api.Matmul, "cublasLtMatmul");
    return api;
  });
}

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLASLt ") + what + " failed with status " + std::to_string(status));
}

// ----- one GEMM ------------------------------------------------------------------------------------

// D (m × n, column-major, ld ldd) = epilogue(op(A) · op(B)), in cuBLASLt's column-major terms: a
// row-major PyTorch matrix [r, c] is a column-major c × r matrix with leading dimension c.
struct Gemm {
  const char* name;
  bool trans_a, trans_b;
  int64_t m, n, k;
  const at::Tensor& a;
  int64_t lda;
  const at::Tensor& b;
  int64_t ldb;
  at::Tensor& d;
  int64_t ldd;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const at::Tensor* bias = nullptr;  // the bias, or the bias gradient it writes (D's type)
  const at::Tensor* aux = nullptr;   // GELU's pre-activation, m × n with ld ldd
};

cudaDataType_t cuda_type(at::ScalarType type) {
  switch (type) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: throw std::runtime_error(std::string("cuBLASLt GEMM on an unsupported type ") + c10::toString(type));
  }
}

// The largest power of two up to 256 that divides the address: what the heuristic may assume.
uint32_t alignment(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t bytes = 256;
  while (bytes > 1 && address % bytes != 0) bytes /= 2;
  return bytes;
}

template <typename T, typename Destroy>
struct Owned {
  T value = nullptr;
  Destroy destroy;
  explicit Owned(Destroy d) : destroy(d) {}
  ~Owned() {
    if (value != nullptr) destroy(value);
  }
};

template <typename V>
void set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const V& value) {
  check(api().MatmulDescSetAttribute(desc, attribute, &value, sizeof(value)), "MatmulDescSetAttribute");
}

// Algorithms found for a GEMM's shape, types, epilogue and alignments (nullopt: none), so that the
// heuristic runs once per shape rather than every step.
std::mutex algo_mutex;
std::map<std::string, std::optional<cublasLtMatmulAlgo_t>> algo_cache;

std::string algo_key(const Gemm& g, int device, const uint32_t (&align)[5]) {
  std::ostringstream key;
  key << device << ' ' << g.trans_a << g.trans_b << ' ' << g.m << ' ' << g.n << ' ' << g.k << ' ' << g.lda << ' '
      << g.ldb << ' ' << g.ldd << ' ' << static_cast<int>(g.a.scalar_type()) << ' '
      << static_cast<int>(g.d.scalar_type()) << ' ' << static_cast<int>(g.epilogue);
  for (uint32_t a : align) key << ' ' << a;
  return key.str();
}

// Runs the GEMM on cuBLASLt and returns true, or returns false (running nothing) when cuBLASLt has
// no algorithm for it; throws when a chosen algorithm fails.
bool lt_gemm(const Gemm& g) {
  if (g.m == 0 || g.n == 0 || g.k == 0) return false;
  const Api& lt = api();
  using DescDestroy = decltype(lt.MatmulDescDestroy);
  using LayoutDestroy = decltype(lt.MatrixLayoutDestroy);
  using PrefDestroy = decltype(lt.MatmulPreferenceDestroy);
  Owned<cublasLtMatmulDesc_t, DescDestroy> desc(lt.MatmulDescDestroy);
  check(lt.MatmulDescCreate(&desc.value, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  set(desc.value, CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  set(desc.value, CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  set(desc.value, CUBLASLT_MATMUL_DESC_EPILOGUE, g.epilogue);
  if (g.bias != nullptr) set(desc.value, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias->data_ptr());
  if (g.aux != nullptr) {
    set(desc.value, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux->data_ptr());
    set(desc.value, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.ldd);
  }
  const cudaDataType_t ab = cuda_type(g.a.scalar_type()), dt = cuda_type(g.d.scalar_type());
  Owned<cublasLtMatrixLayout_t, LayoutDestroy> la(lt.MatrixLayoutDestroy), lb(lt.MatrixLayoutDestroy),
      ld(lt.MatrixLayoutDestroy);
  check(lt.MatrixLayoutCreate(&la.value, ab, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda), "layout A");
  check(lt.MatrixLayoutCreate(&lb.value, ab, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb), "layout B");
  check(lt.MatrixLayoutCreate(&ld.value, dt, g.m, g.n, g.ldd), "layout D");

  const uint32_t align[5] = {alignment(g.a.data_ptr()), alignment(g.b.data_ptr()), alignment(g.d.data_ptr()),
                             g.bias ? alignment(g.bias->data_ptr()) : 256u,
                             g.aux ? alignment(g.aux->data_ptr()) : 256u};
  const int device = g.d.get_device();
  const std::string key = algo_key(g, device, align);
  std::optional<cublasLtMatmulAlgo_t> algo;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(algo_mutex);
    auto found = algo_cache.find(key);
    if (found != algo_cache.end()) {
      algo = found->second;
      cached = true;
    }
  }
  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  if (!cached) {
    Owned<cublasLtMatmulPreference_t, PrefDestroy> pref(lt.MatmulPreferenceDestroy);
    check(lt.MatmulPreferenceCreate(&pref.value), "MatmulPreferenceCreate");
    const auto pref_set = [&](cublasLtMatmulPreferenceAttributes_t attribute, auto value) {
      check(lt.MatmulPreferenceSetAttribute(pref.value, attribute, &value, sizeof(value)), "preference");
    };
    pref_set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(workspace_size));
    pref_set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align[0]);
    pref_set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align[1]);
    pref_set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align[2]);
    pref_set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align[2]);
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    const cublasStatus_t status = lt.MatmulAlgoGetHeuristic(handle, desc.value, la.value, lb.value, ld.value,
                                                            ld.value, pref.value, 1, &result, &returned);
    if (status == CUBLAS_STATUS_SUCCESS && returned > 0) algo = result.algo;
    std::lock_guard<std::mutex> lock(algo_mutex);
    algo_cache[key] = algo;
  }
  if (!algo) return false;
  const float alpha = 1.0f, beta = 0.0f;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  check(lt.Matmul(handle, desc.value, &alpha, g.a.data_ptr(), la.value, g.b.data_ptr(), lb.value, &beta,
                  g.d.data_ptr(), ld.value, g.d.data_ptr(), ld.value, &*algo, at::cuda::getCUDABlasLtWorkspace(),
                  workspace_size, stream),
        g.name);
  return true;
}

// Notes that `what` ran on ATen's ops: an empty dimension (nothing for cuBLASLt to do), or no
// cuBLASLt algorithm for these sizes and alignments.
void note_aten(const char* what, int64_t m, int64_t n, int64_t k, at::ScalarType type) {
  const std::string gemm = "GEMM " + std::to_string(m) + " × " + std::to_string(n) + " × " + std::to_string(k) +
                           " in " + c10::toString(type);
  if (m == 0 || n == 0 || k == 0) {
    sk::ops::note_fell_back(SK_OP_MLP, std::string(what) + ": " + gemm + " has an empty dimension; ATen's ops ran it");
  } else {
    sk::ops::note_fell_back(SK_OP_MLP, std::string(what) + ": cuBLASLt has no algorithm for " + gemm + "; ATen's ops ran it");
  }
}

// ----- the MLP -------------------------------------------------------------------------------------

using sk::AutogradContext;
using sk::variable_list;

// Which parts of the backward run inside cuBLASLt's GEMMs (the rest on ATen's ops): set from Rust
// (speedkit::nn::set_mlp_backward_fusion), because an epilogue is not always faster than the
// separate pass it replaces. The default leaves db1 to ATen's column sum: on an H200 at the
// transformer's shape DGELU_BGRAD cost ~0.15 ms more per MLP than DGELU plus that sum
// (docs/benchmarks/data/2026-11-23-h200-mlp-timings.log).
enum Fusion : int {
  kFp32WeightGrads = 1,  // weight-gradient GEMMs write fp32 (else the compute type, then a cast)
  kFc2BiasGrad = 2,      // db2 in fc2's weight-gradient GEMM (BGRADB)
  kGeluGrad = 4,         // gelu'(z) in fc2's input-gradient GEMM (DGELU)
  kFc1BiasGrad = 8,      // db1 in that same GEMM (DGELU_BGRAD; needs kGeluGrad)
};
std::atomic<int> fusion{kFp32WeightGrads | kFc2BiasGrad | kGeluGrad};

// A weight gradient dW (rows × cols, row-major) = gᵀ · act over `tokens` rows, with Σ g as the bias
// gradient when `bias_grad` (BGRADB epilogue, or an ATen sum as `fusion` says). Written in fp32
// straight from the GEMM where cuBLASLt can and `fusion` asks, else in the compute type and cast.
// Returns {dW, db} in fp32.
std::pair<at::Tensor, at::Tensor> weight_grad(const char* what, const at::Tensor& g, const at::Tensor& act,
                                              bool bias_grad) {
  const int64_t tokens = g.size(0), rows = g.size(1), cols = act.size(1);
  const int mask = fusion.load();
  const bool fused_bias = bias_grad && (mask & kFc2BiasGrad);
  std::vector<at::ScalarType> outs{g.scalar_type()};
  if (mask & kFp32WeightGrads) outs.insert(outs.begin(), at::kFloat);
  for (at::ScalarType out : outs) {
    at::Tensor dw = at::empty({rows, cols}, g.options().dtype(out));
    at::Tensor db = fused_bias ? at::empty({rows}, g.options().dtype(out)) : at::Tensor();
    Gemm gemm{what, false, true, cols, rows, tokens, act, cols, g, rows, dw, cols};
    if (fused_bias) {
      gemm.epilogue = CUBLASLT_EPILOGUE_BGRADB;
      gemm.bias = &db;
    }
    if (lt_gemm(gemm)) {
      if (bias_grad && !fused_bias) db = g.sum(0, false, at::kFloat);
      return {dw.to(at::kFloat), bias_grad ? db.to(at::kFloat) : at::Tensor()};
    }
  }
  note_aten(what, cols, rows, tokens, g.scalar_type());
  at::Tensor dw = g.t().mm(act).to(at::kFloat);
  return {dw, bias_grad ? g.sum(0, false, at::kFloat) : at::Tensor()};
}

// dz = (dy W2) · gelu'(z) and db1 = Σ dz, with as much inside fc2's input-gradient GEMM as
// `fusion` asks (DGELU_BGRAD, DGELU, or a plain GEMM) and the rest on ATen. db1 in fp32.
std::pair<at::Tensor, at::Tensor> gelu_input_grad(const at::Tensor& dy, const at::Tensor& w2, const at::Tensor& z) {
  const int64_t tokens = dy.size(0), out = dy.size(1), hidden = w2.size(1);
  const auto type = dy.scalar_type();
  const int mask = fusion.load();
  const bool gelu = mask & kGeluGrad, bias = gelu && (mask & kFc1BiasGrad);
  at::Tensor d = at::empty({tokens, hidden}, dy.options()), db1 = at::empty({hidden}, dy.options());
  Gemm gemm{"fc2 dgrad", false, false, hidden, tokens, out, w2, hidden, dy, out, d, hidden};
  if (gelu) {
    gemm.epilogue = bias ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
    gemm.aux = &z;
  }
  if (bias) gemm.bias = &db1;
  if (!lt_gemm(gemm)) {
    note_aten("mlp fc2 input gradient + GELU backward", hidden, tokens, out, type);
    d = dy.mm(w2);
    return {at::gelu_backward(d, z, "tanh"), at::Tensor()};
  }
  if (!gelu) d = at::gelu_backward(d, z, "tanh");
  return {d, bias ? db1.to(at::kFloat) : at::Tensor()};
}

// Inputs: x [tokens, in] (any floating type), fc1 and fc2 weights and biases (fp32 masters or the
// compute type), and the compute type (bf16 or fp16, the autocast type).
struct MlpFunction : torch::autograd::Function<MlpFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& w1_in,
                               const at::Tensor& b1_in, const at::Tensor& w2_in, const at::Tensor& b2_in,
                               int64_t type_code) {
    // The operand types are chosen here; autocast must not re-cast them.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto type = static_cast<at::ScalarType>(type_code);
    const at::Tensor x = x_in.to(type).contiguous();
    const at::Tensor w1 = w1_in.to(type).contiguous(), b1 = b1_in.to(type).contiguous();
    const at::Tensor w2 = w2_in.to(type).contiguous(), b2 = b2_in.to(type).contiguous();
    const int64_t tokens = x.size(0), in = w1.size(1), hidden = w1.size(0), out = w2.size(0);
    at::Tensor z = at::empty({tokens, hidden}, x.options()), h = at::empty_like(z);
    Gemm fc1{"fc1 forward", true, false, hidden, tokens, in, w1, in, x, in, h, hidden};
    fc1.epilogue = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    fc1.bias = &b1;
    fc1.aux = &z;
    if (!lt_gemm(fc1)) {
      note_aten("mlp fc1 + GELU forward", hidden, tokens, in, type);
      z = at::addmm(b1, x, w1.t());
      h = at::gelu(z, "tanh");
    }
    at::Tensor y = at::empty({tokens, out}, x.options());
    Gemm fc2{"fc2 forward", true, false, out, tokens, hidden, w2, hidden, h, hidden, y, out};
    fc2.epilogue = CUBLASLT_EPILOGUE_BIAS;
    fc2.bias = &b2;
    if (!lt_gemm(fc2)) {
      note_aten("mlp fc2 forward", out, tokens, hidden, type);
      y = at::addmm(b2, h, w2.t());
    }
    ctx->save_for_backward({x, w1, w2, z, h});
    ctx->saved_data["x_type"] = static_cast<int64_t>(x_in.scalar_type());
    ctx->saved_data["types"] = std::vector<int64_t>{static_cast<int64_t>(w1_in.scalar_type()),
                                                    static_cast<int64_t>(b1_in.scalar_type()),
                                                    static_cast<int64_t>(w2_in.scalar_type()),
                                                    static_cast<int64_t>(b2_in.scalar_type())};
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w1 = saved[1], &w2 = saved[2], &z = saved[3], &h = saved[4];
    const auto type = x.scalar_type();
    const int64_t tokens = x.size(0), in = w1.size(1), hidden = w1.size(0);
    const at::Tensor dy = grads[0].to(type).contiguous();
    const auto types = ctx->saved_data["types"].toIntVector();
    const auto as = [&](const at::Tensor& t, size_t i) {
      return t.defined() ? t.to(static_cast<at::ScalarType>(types[i])) : t;
    };

    auto [dw2, db2] = weight_grad("mlp fc2 weight/bias gradient", dy, h, true);
    auto [dz, db1] = gelu_input_grad(dy, w2, z);
    if (!db1.defined()) db1 = dz.sum(0, false, at::kFloat);
    auto [dw1, unused] = weight_grad("mlp fc1 weight gradient", dz, x, false);
    at::Tensor dx;
    if (ctx->needs_input_grad(0)) {
      dx = at::empty({tokens, in}, x.options());
      Gemm dgrad1{"fc1 dgrad", false, false, in, tokens, hidden, w1, in, dz, hidden, dx, in};
      if (!lt_gemm(dgrad1)) {
        note_aten("mlp fc1 input gradient", in, tokens, hidden, type);
        dx = dz.mm(w1);
      }
      dx = dx.to(static_cast<at::ScalarType>(ctx->saved_data["x_type"].toInt()));
    }
    return sk::fused_op_gradients({dx, as(dw1, 0), as(db1, 1), as(dw2, 2), as(db2, 3), at::Tensor()}, "MLP");
  }
};

at::Tensor mlp_on_kernels(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                      const at::Tensor& b2) {
  c10::DeviceGuard guard(x.device());
  api();
  const int64_t in = w1.size(1), out = w2.size(0);
  // Rows counted, not inferred: reshape cannot infer a -1 beside other sizes when x is empty.
  const int64_t tokens = x.numel() / in;
  const auto type = sk::autocast_type_for(x);
  auto outputs = MlpFunction::apply(x.reshape({tokens, in}), w1, b1, w2, b2, static_cast<int64_t>(type));
  return sk::shaped_like(outputs[0], x, out);
}

#else

int fusion_mask = 0;

at::Tensor mlp_on_kernels(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  throw std::runtime_error("speedkit was built without CUDA, so the fused MLP cannot run");
}

#endif

// Why the fused path cannot take these inputs, or empty.
std::string mlp_unsupported(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                        const at::Tensor& b2) {
  if (auto why = sk::ops::unusable(SK_OP_MLP, x.device()); !why.empty()) return why;
  const auto compute = sk::autocast_type_for(x);
  const bool in_autocast = at::autocast::is_autocast_enabled(x.device().type());
  if (!in_autocast || (compute != at::kBFloat16 && compute != at::kHalf)) return "not inside a bf16 or fp16 autocast";
  if (auto why = sk::ops::floating("input", x); !why.empty()) return why;
  if (!b1.defined() || !b2.defined()) return "a layer has no bias";
  for (const at::Tensor* p : {&w1, &b1, &w2, &b2}) {
    if (auto why = sk::ops::first_of({sk::ops::floating("parameter", *p), sk::ops::on_device("parameter", *p, x.device())});
        !why.empty())
      return why;
  }
  if (w1.dim() != 2 || w2.dim() != 2) return "weights " + c10::str(w1.sizes()) + " and " + c10::str(w2.sizes()) + " are not 2-d";
  const int64_t in = w1.size(1), hidden = w1.size(0), out = w2.size(0);
  if (x.dim() == 0 || x.size(-1) != in || w2.size(1) != hidden || b1.sizes() != at::IntArrayRef{hidden} ||
      b2.sizes() != at::IntArrayRef{out})
    return "input " + c10::str(x.sizes()) + ", fc1 " + c10::str(w1.sizes()) + " and fc2 " + c10::str(w2.sizes()) +
           " do not chain";
  for (int64_t width : {in, hidden, out}) {
    if (width <= 0 || width % kWidthMultiple != 0)
      return "widths " + std::to_string(in) + " → " + std::to_string(hidden) + " → " + std::to_string(out) +
             ": cuBLASLt's epilogues need positive multiples of " + std::to_string(kWidthMultiple);
  }
  return {};
}

at::Tensor mlp_on_aten(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                   const at::Tensor& b2) {
  return at::linear(at::gelu(at::linear(x, w1, b1), "tanh"), w2, b2);
}

}  // namespace

extern "C" {

int sk_mlp(sk_tensor x, sk_tensor w1, sk_tensor b1, sk_tensor w2, sk_tensor b2, sk_tensor* y) {
  SK_TRY({
    const at::Tensor bias1 = sk::optional_tensor(b1), bias2 = sk::optional_tensor(b2);
    *y = sk::give(sk::ops::run_or_fall_back(
        SK_OP_MLP, mlp_unsupported(*x, *w1, bias1, *w2, bias2), [&] { return mlp_on_kernels(*x, *w1, bias1, *w2, bias2); },
        [&] { return mlp_on_aten(*x, *w1, bias1, *w2, bias2); }));
  })
}

int sk_mlp_unsupported(sk_tensor x, sk_tensor w1, sk_tensor b1, sk_tensor w2, sk_tensor b2, const char** reason) {
  SK_TRY(sk::hand_out(mlp_unsupported(*x, *w1, sk::optional_tensor(b1), *w2, sk::optional_tensor(b2)), reason))
}

// Sets which parts of the MLP's backward run in cuBLASLt epilogues (a mask of Fusion bits) and
// returns the previous mask in *previous.
int sk_mlp_set_backward_fusion(int mask, int* previous) {
#if SK_WITH_CUDA
  SK_TRY(*previous = fusion.exchange(mask))
#else
  SK_TRY({
    *previous = fusion_mask;
    fusion_mask = mask;
  })
#endif
}

}  // extern "C"
