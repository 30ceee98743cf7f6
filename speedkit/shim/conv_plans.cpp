// cuDNN convolution plans that speedkit chooses and remembers across runs (conv_plans.h).
//
// A convolution here is one of cuDNN's backend graphs of one operation (forward, data gradient or
// filter gradient), built from the operands' shapes, layouts, alignments and type. The first time a
// process meets one, its plan comes from, in order:
//   - this process's choice for it, serialised (another thread's handle builds it again);
//   - the disk cache (kernels.h's directory): the chosen plan as cuDNN serialises it
//     (CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION), which cuDNN builds again without timing;
//   - timing: cuDNN's heuristics (mode A) and its fallback list give candidate engine
//     configurations; up to ATen's cudnn.benchmark_limit of those that build (its default: 10)
//     run three times each on the operands, and the fastest is kept, or, among those within 2% of
//     it, the one with the smallest workspace (a difference in time below the timing's noise, a
//     difference in memory that stays).
// A choice is written to disk once made (where cuDNN can serialise its engine; otherwise the next
// run times it again). A plan is never timed during a CUDA-graph capture (timing waits on the GPU):
// a convolution first met there runs ATen's, counted in counts().to_aten. An engine configuration
// rebuilt from its engine's index and knob choices did not give the timed plan back (unet_tch's
// step took twice as long), so the plan itself is what is kept.
//
// Plans execute on PyTorch's current stream with ATen's cuDNN handle for it, their workspace from the
// caching allocator, so they are captured in CUDA graphs as ATen's convolutions are.
#include "conv_plans.h"

#include "kernels.h"
#include "loader.h"

#include <ATen/Context.h>

#if SK_WITH_CUDNN
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cudnn/Handle.h>
#include <ATen/native/ConvUtils.h>
#include <ATen/ops/empty.h>
#include <c10/core/Event.h>
#include <c10/util/Exception.h>
#include <cudnn_graph.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <vector>
#endif

namespace sk::conv_plans {

#if SK_WITH_CUDNN
namespace {

// ----- the library ---------------------------------------------------------------------------------

struct Api {
  decltype(&::cudnnBackendCreateDescriptor) create;
  decltype(&::cudnnBackendDestroyDescriptor) destroy;
  decltype(&::cudnnBackendSetAttribute) set;
  decltype(&::cudnnBackendGetAttribute) get;
  decltype(&::cudnnBackendFinalize) finalize;
  decltype(&::cudnnBackendExecute) execute;
  decltype(&::cudnnGetErrorString) error_string;
  decltype(&::cudnnGetVersion) version;
};

// The copy libtorch_cuda already loaded (its state shared), else the wheel's, else the loader path's.
const Api& api() {
  return sk::loader::once<Api>([] {
    const auto torch_lib = sk::loader::torch_lib_dir();
    std::vector<std::string> candidates{"libcudnn.so.9"};
    if (!torch_lib.empty())
      candidates.insert(candidates.begin(),
                        (torch_lib.parent_path().parent_path() / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9").string());
    const auto library = sk::loader::Library::open("cuDNN", candidates, /*already_loaded=*/true);
    Api api{};
    library.bind(api.create, "cudnnBackendCreateDescriptor");
    library.bind(api.destroy, "cudnnBackendDestroyDescriptor");
    library.bind(api.set, "cudnnBackendSetAttribute");
    library.bind(api.get, "cudnnBackendGetAttribute");
    library.bind(api.finalize, "cudnnBackendFinalize");
    library.bind(api.execute, "cudnnBackendExecute");
    library.bind(api.error_string, "cudnnGetErrorString");
    library.bind(api.version, "cudnnGetVersion");
    return api;
  });
}

void check(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuDNN: ") + what + " failed: " + api().error_string(status));
}

// One backend descriptor, destroyed with its owner.
class Descriptor {
 public:
  explicit Descriptor(cudnnBackendDescriptorType_t type) { check(api().create(type, &raw_), "creating a descriptor"); }
  ~Descriptor() {
    if (raw_ != nullptr) api().destroy(raw_);
  }
  Descriptor(Descriptor&& other) noexcept : raw_(std::exchange(other.raw_, nullptr)) {}
  Descriptor& operator=(Descriptor&& other) noexcept {
    std::swap(raw_, other.raw_);
    return *this;
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;

  cudnnBackendDescriptor_t get() const { return raw_; }

  Descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const void* values,
                  int64_t count = 1) {
    check(api().set(raw_, name, type, count, values), "setting an attribute");
    return *this;
  }
  Descriptor& descriptor(cudnnBackendAttributeName_t name, const Descriptor& value) {
    const cudnnBackendDescriptor_t raw = value.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw);
  }
  Descriptor& int64(cudnnBackendAttributeName_t name, const int64_t* values, int64_t count = 1) {
    return set(name, CUDNN_TYPE_INT64, values, count);
  }
  Descriptor& finalize(const char* what) {
    check(api().finalize(raw_), what);
    return *this;
  }
  bool try_finalize() { return api().finalize(raw_) == CUDNN_STATUS_SUCCESS; }

  int64_t get_int64(cudnnBackendAttributeName_t name) const {
    int64_t value = 0, count = 0;
    check(api().get(raw_, name, CUDNN_TYPE_INT64, 1, &count, &value), "reading an attribute");
    return value;
  }
  // The descriptors of `type` an attribute holds (heuristics' results, a configuration's knobs).
  std::vector<Descriptor> get_descriptors(cudnnBackendAttributeName_t name, cudnnBackendDescriptorType_t type) const {
    int64_t count = 0;
    check(api().get(raw_, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr), "counting an attribute");
    std::vector<Descriptor> values;
    std::vector<cudnnBackendDescriptor_t> raws;
    for (int64_t i = 0; i < count; ++i) {
      values.emplace_back(type);
      raws.push_back(values.back().get());
    }
    if (count > 0)
      check(api().get(raw_, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count, raws.data()), "reading an attribute");
    values.erase(values.begin() + std::min<int64_t>(count, static_cast<int64_t>(values.size())), values.end());
    return values;
  }

 private:
  cudnnBackendDescriptor_t raw_ = nullptr;
};

// ----- the problem -----------------------------------------------------------------------------------

enum class Pass { forward, data, filter };

// The unique ids of the three operands in every pass: the input (or its gradient), the weight (or
// its gradient), the output (or its gradient).
constexpr std::array<int64_t, 3> kUids = {1, 2, 3};

struct Operand {
  std::array<int64_t, 4> sizes{};
  std::array<int64_t, 4> strides{};
  int64_t alignment = 0;  // bytes: the largest power of two up to 16 dividing its address
};

// `t` as cuDNN is told of it. A dimension of size one gets the stride the memory format gives it,
// as ATen's descriptors do (`fixSizeOneDimStride`): its stride addresses nothing, but cuDNN reads the
// layout from it. A depthwise weight [C, 1, kh, kw] keeps NCHW's strides after a channels-last
// `contiguous`, and described so, cuDNN offers none of its depthwise kernels (convnext_tch's step
// 2.3 times as long).
Operand operand(const at::Tensor& t, at::MemoryFormat format) {
  Operand o;
  for (int d = 0; d < 4; ++d) {
    o.sizes[d] = t.size(d);
    o.strides[d] = t.stride(d);
  }
  const std::array<int, 4> inner_to_outer = format == at::MemoryFormat::ChannelsLast
                                                ? std::array<int, 4>{1, 3, 2, 0}
                                                : std::array<int, 4>{3, 2, 1, 0};
  int64_t dense = 1;
  for (const int d : inner_to_outer) {
    if (o.sizes[d] == 1)
      o.strides[d] = dense;
    else
      dense *= o.sizes[d];
  }
  const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
  o.alignment = 16;
  while (o.alignment > 1 && address % static_cast<uintptr_t>(o.alignment) != 0) o.alignment /= 2;
  return o;
}

// One convolution as cuDNN sees it: everything a plan depends on but the operands' addresses.
struct Problem {
  Pass pass;
  at::ScalarType type;
  std::array<Operand, 3> operands;  // x, w, y (or their gradients), in kUids' order
  std::array<int64_t, 2> stride{}, padding{}, dilation{};
  int device_major = 0, device_minor = 0;

  std::string key() const {
    std::ostringstream text;
    text << (pass == Pass::forward ? "forward" : pass == Pass::data ? "data" : "filter") << ' '
         << c10::toString(type) << " sm_" << device_major << device_minor;
    for (const Operand& o : operands) {
      text << " [";
      for (int d = 0; d < 4; ++d) text << (d ? "," : "") << o.sizes[d];
      text << "](";
      for (int d = 0; d < 4; ++d) text << (d ? "," : "") << o.strides[d];
      text << ")@" << o.alignment;
    }
    text << " stride " << stride[0] << ',' << stride[1] << " padding " << padding[0] << ',' << padding[1]
         << " dilation " << dilation[0] << ',' << dilation[1];
    return text.str();
  }
};

std::array<int64_t, 2> pair(at::IntArrayRef values) { return {values[0], values[values.size() > 1 ? 1 : 0]}; }

Problem problem(Pass pass, const at::Tensor& x, const at::Tensor& w, const at::Tensor& y, const Geometry& g,
                at::MemoryFormat format) {
  const auto& properties = *at::cuda::getCurrentDeviceProperties();
  return Problem{pass,
                 x.scalar_type(),
                 {operand(x, format), operand(w, format), operand(y, format)},
                 pair(g.stride),
                 pair(g.padding),
                 pair(g.dilation),
                 properties.major,
                 properties.minor};
}

// ----- the graph of one convolution -------------------------------------------------------------------

// The descriptors of one convolution's graph, kept alive as long as the plans made from it.
struct Graph {
  std::vector<Descriptor> parts;
  const Descriptor& operation_graph() const { return parts.back(); }
};

Descriptor tensor(const Operand& o, int64_t uid, cudnnDataType_t type) {
  Descriptor t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &type)
      .int64(CUDNN_ATTR_TENSOR_DIMENSIONS, o.sizes.data(), 4)
      .int64(CUDNN_ATTR_TENSOR_STRIDES, o.strides.data(), 4)
      .int64(CUDNN_ATTR_TENSOR_UNIQUE_ID, &uid)
      .int64(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &o.alignment)
      .finalize("describing a convolution's operand");
  return t;
}

// A pass's operation descriptor and the attributes it takes: its operands in kUids' order (x or dx,
// w or dw, y or dy), the convolution, alpha and beta.
struct PassAttributes {
  cudnnBackendDescriptorType_t operation;
  std::array<cudnnBackendAttributeName_t, 3> operands;
  cudnnBackendAttributeName_t convolution, alpha, beta;
};

PassAttributes attributes_of(Pass pass) {
  switch (pass) {
    case Pass::forward:
      return {CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
              {CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
               CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y},
              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA};
    case Pass::data:
      return {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
              {CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
               CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY},
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA};
    case Pass::filter:
      return {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
              {CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
               CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY},
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA};
  }
  throw std::logic_error("a convolution pass without attributes");
}

Graph graph_of(const Problem& p, cudnnHandle_t handle) {
  const cudnnDataType_t type = p.type == at::kHalf ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
  Graph g;
  for (size_t i = 0; i < 3; ++i) g.parts.push_back(tensor(p.operands[i], kUids[i], type));
  const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  const int64_t spatial = 2;
  Descriptor convolution(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  convolution.set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &compute)
      .set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, &mode)
      .int64(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, &spatial)
      .int64(CUDNN_ATTR_CONVOLUTION_DILATIONS, p.dilation.data(), 2)
      .int64(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, p.stride.data(), 2)
      .int64(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, p.padding.data(), 2)
      .int64(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, p.padding.data(), 2)
      .finalize("describing a convolution");
  const PassAttributes attributes = attributes_of(p.pass);
  const float alpha = 1.0f, beta = 0.0f;
  Descriptor op(attributes.operation);
  for (size_t i = 0; i < 3; ++i) op.descriptor(attributes.operands[i], g.parts[i]);
  op.descriptor(attributes.convolution, convolution)
      .set(attributes.alpha, CUDNN_TYPE_FLOAT, &alpha)
      .set(attributes.beta, CUDNN_TYPE_FLOAT, &beta)
      .finalize("describing a convolution's operation");
  Descriptor operation_graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  const cudnnBackendDescriptor_t ops = op.get();
  operation_graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, &ops)
      .set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, &handle)
      .finalize("building a convolution's graph");
  g.parts.push_back(std::move(convolution));
  g.parts.push_back(std::move(op));
  g.parts.push_back(std::move(operation_graph));
  return g;
}

// ----- engine configurations and plans ----------------------------------------------------------------

// A plan and what it refers to.
struct Plan {
  std::vector<Descriptor> parts;  // the configuration, its engine and knobs, the graph
  Descriptor plan;
  int64_t workspace = 0;
};

// The plan of `config` on `handle`, which keeps `config` and `parts` (what the configuration refers
// to) alive; nullopt where cuDNN cannot build it (an engine that does not take this problem, a
// configuration from another cuDNN).
std::optional<Plan> plan_of(Descriptor config, cudnnHandle_t handle, std::vector<Descriptor> parts = {}) {
  Descriptor plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  const cudnnBackendDescriptor_t raw = config.get();
  plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, &handle)
      .set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw);
  if (!plan.try_finalize()) return std::nullopt;
  const int64_t workspace = plan.get_int64(CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE);
  parts.push_back(std::move(config));
  return Plan{std::move(parts), std::move(plan), workspace};
}

// A chosen plan as cuDNN serialises it (its engine, knobs and the problem it was built for), or
// nullopt where this engine cannot be serialised.
std::optional<std::string> serialised(const Plan& plan) {
  int64_t size = 0;
  const auto attribute = CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION;
  if (api().get(plan.plan.get(), attribute, CUDNN_TYPE_CHAR, 0, &size, nullptr) != CUDNN_STATUS_SUCCESS || size <= 0)
    return std::nullopt;
  std::string text(static_cast<size_t>(size), '\0');
  if (api().get(plan.plan.get(), attribute, CUDNN_TYPE_CHAR, size, &size, text.data()) != CUDNN_STATUS_SUCCESS)
    return std::nullopt;
  text.resize(std::min(text.size(), text.find('\0')));
  return text;
}

// The plan `text` serialises, built on `handle`; nullopt where cuDNN cannot build it (a plan of
// another cuDNN or device).
std::optional<Plan> deserialised(const std::string& text, cudnnHandle_t handle) {
  Descriptor plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, &handle);
  if (api().set(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                static_cast<int64_t>(text.size()), text.data()) != CUDNN_STATUS_SUCCESS ||
      !plan.try_finalize())
    return std::nullopt;
  const int64_t workspace = plan.get_int64(CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE);
  return Plan{{}, std::move(plan), workspace};
}

// The workspace a plan takes, from the caching allocator on the current stream.
at::Tensor workspace_for(const Plan& plan, const at::TensorOptions& options) {
  return at::empty({std::max<int64_t>(plan.workspace, 1)}, options.dtype(at::kByte));
}

cudnnStatus_t execute(const Plan& plan, cudnnHandle_t handle, const std::array<void*, 3>& pointers,
                      const at::Tensor& workspace) {
  Descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  void* space = workspace.data_ptr();
  pack.int64(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, kUids.data(), 3)
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, pointers.data(), 3)
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &space)
      .finalize("packing a convolution's operands");
  return api().execute(handle, plan.plan.get(), pack.get());
}

// ----- the record of choices --------------------------------------------------------------------------

struct Counters {
  std::atomic<int64_t> timed{0}, from_disk{0}, to_aten{0};
  std::atomic<int64_t> timing_microseconds{0}, building_microseconds{0};
};

Counters& counters() {
  static Counters* c = new Counters();
  return *c;
}

// Whether plans come only from earlier choices (the process's or the kernel cache's), never timed:
// see set_kept_only().
std::atomic<bool> kept_only_flag{false};

bool kept_only() { return kept_only_flag.load(); }

// This process's chosen plans by problem, serialised, and the plans built from them by handle
// (ATen's handles are per thread; a plan is built for one).
struct Store {
  std::mutex mutex;
  std::map<std::string, std::string> chosen;  // serialised plans
  std::map<std::pair<cudnnHandle_t, std::string>, std::shared_ptr<Plan>> plans;
};

Store& store() {
  static Store* s = new Store();
  return *s;
}

constexpr const char* kHeader = "speedkit cuDNN convolution plan 2";

std::filesystem::path file_for(const std::string& key) {
  const auto dir = kernels::cache_dir();
  if (dir.empty()) return {};
  std::ostringstream name;
  name << "cudnn-conv-" << std::hex << std::hash<std::string>{}(key) << std::dec << "-cudnn" << api().version()
       << ".plan";
  return dir / name.str();
}

// The serialised plan the disk keeps for `key`, if any (a file of another key, or unreadable, is
// none).
std::optional<std::string> read_plan(const std::string& key) {
  const auto path = file_for(key);
  if (path.empty()) return std::nullopt;
  const std::vector<char> bytes = kernels::read_file(path);
  const std::string text(bytes.begin(), bytes.end());
  const std::string expected = std::string(kHeader) + '\n' + key + '\n';
  if (text.size() <= expected.size() || text.compare(0, expected.size(), expected) != 0) return std::nullopt;
  return text.substr(expected.size());
}

void write_plan(const std::string& key, const std::string& plan) {
  const auto path = file_for(key);
  if (path.empty()) return;
  const std::string text = std::string(kHeader) + '\n' + key + '\n' + plan;
  kernels::write_file_atomically(path, std::vector<char>(text.begin(), text.end()));
}

// ----- choosing by timing -------------------------------------------------------------------------------

// The mean milliseconds of three runs of `plan` after one, or nullopt where it does not run (its
// workspace cannot be had, or cuDNN refuses the operands).
std::optional<float> time_plan(const Plan& plan, cudnnHandle_t handle, const std::array<void*, 3>& pointers,
                               const at::TensorOptions& options) {
  at::Tensor workspace;
  try {
    workspace = workspace_for(plan, options);
  } catch (const c10::OutOfMemoryError&) {
    return std::nullopt;
  }
  if (execute(plan, handle, pointers, workspace) != CUDNN_STATUS_SUCCESS) return std::nullopt;
  const auto stream = at::cuda::getCurrentCUDAStream();
  c10::Event start(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  c10::Event end(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  start.record(stream);
  constexpr int kRuns = 3;
  for (int i = 0; i < kRuns; ++i)
    if (execute(plan, handle, pointers, workspace) != CUDNN_STATUS_SUCCESS) return std::nullopt;
  end.record(stream);
  end.synchronize();
  return static_cast<float>(start.elapsedTime(end) / kRuns);
}

// What the filter and the log read of a configuration's engine.
struct Engine {
  int64_t index = -1;
  bool down_converts = false;        // it converts its inputs to a narrower type
  bool compiled_at_run_time = false;  // cuDNN compiles its kernel when a plan is built
};

// Whether `engine`'s notes under `name` (of `type`, at most `count`) hold `note`.
template <typename Note>
bool has_note(const Descriptor& engine, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int count,
              Note note) {
  std::vector<Note> notes(static_cast<size_t>(count));
  int64_t held = 0;
  if (api().get(engine.get(), name, type, count, &held, notes.data()) != CUDNN_STATUS_SUCCESS) return false;
  notes.resize(static_cast<size_t>(std::clamp<int64_t>(held, 0, count)));
  return std::find(notes.begin(), notes.end(), note) != notes.end();
}

Engine engine_of(const Descriptor& config) {
  auto engines = config.get_descriptors(CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  if (engines.empty()) return {};
  const Descriptor& e = engines[0];
  return Engine{e.get_int64(CUDNN_ATTR_ENGINE_GLOBAL_INDEX),
                has_note(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                         CUDNN_NUMERICAL_NOTE_TYPE_COUNT, CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS),
                has_note(e, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE, CUDNN_BEHAVIOR_NOTE_TYPE_COUNT,
                         CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION)};
}

// Whether to print each timing to stderr (SPEEDKIT_CONV_PLANS_LOG set): what was tried and chosen.
bool logging() {
  static const bool on = std::getenv("SPEEDKIT_CONV_PLANS_LOG") != nullptr;
  return on;
}

double milliseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// A candidate timed on the operands.
struct Timed {
  Plan plan;
  float ms;
  Engine engine;
  double build_ms;
  bool fallback;  // from cuDNN's fallback list, not its heuristics
};

void log_choice(const std::string& key, const std::vector<Timed>& timed, size_t best) {
  std::ostringstream text;
  text << "speedkit cuDNN plans: " << key << '\n';
  for (size_t i = 0; i < timed.size(); ++i) {
    const Timed& t = timed[i];
    text << (i == best ? "  * engine " : "    engine ") << t.engine.index << " ("
         << (t.fallback ? "fallback" : "heuristics") << (t.engine.compiled_at_run_time ? ", compiled at run time" : "")
         << ", built in " << t.build_ms << " ms): " << t.ms << " ms, workspace " << t.plan.workspace << " bytes\n";
  }
  std::cerr << text.str();
}

// The candidate chosen among cuDNN's for `graph`, timed on the operands; nullopt where none runs.
std::optional<Timed> choose(const Graph& graph, cudnnHandle_t handle, const std::array<void*, 3>& pointers,
                            const at::TensorOptions& options, const std::string& key) {
  const auto started = std::chrono::steady_clock::now();
  const int limit = at::globalContext().benchmarkLimitCuDNN();
  std::vector<Timed> timed;
  int tried = 0;
  // cuDNN's heuristics' candidates, then its fallback list, as ATen's autotuning takes them.
  for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    Descriptor heuristics(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heuristics.descriptor(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph.operation_graph())
        .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode);
    if (!heuristics.try_finalize()) continue;
    for (Descriptor& config :
         heuristics.get_descriptors(CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)) {
      if (limit > 0 && tried >= limit) break;
      const Engine engine = engine_of(config);
      // ATen's autotuning skips these too: they would not compute in the operands' type.
      if (engine.down_converts) continue;
      const auto building = std::chrono::steady_clock::now();
      auto plan = plan_of(std::move(config), handle);
      if (!plan) continue;
      ++tried;
      const double build_ms = milliseconds_since(building);
      if (auto ms = time_plan(*plan, handle, pointers, options))
        timed.push_back({std::move(*plan), *ms, engine, build_ms, mode == CUDNN_HEUR_MODE_FALLBACK});
    }
  }
  counters().timing_microseconds += static_cast<int64_t>(milliseconds_since(started) * 1000);
  if (timed.empty()) return std::nullopt;
  float fastest = timed[0].ms;
  for (const Timed& t : timed) fastest = std::min(fastest, t.ms);
  size_t best = timed.size();
  for (size_t i = 0; i < timed.size(); ++i)
    if (timed[i].ms <= fastest * 1.02f && (best == timed.size() || timed[i].plan.workspace < timed[best].plan.workspace))
      best = i;
  if (logging()) log_choice(key, timed, best);
  return std::move(timed[best]);
}

// The plan for `p` on the current thread's handle, its operands at `pointers`; nullptr where none
// can be had now.
std::shared_ptr<Plan> plan_for(const Problem& p, const std::array<void*, 3>& pointers,
                               const at::TensorOptions& options) {
  const cudnnHandle_t handle = at::native::getCudnnHandle();
  const std::string key = p.key();
  Store& s = store();
  std::optional<std::string> text;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (auto found = s.plans.find({handle, key}); found != s.plans.end()) return found->second;
    if (auto found = s.chosen.find(key); found != s.chosen.end()) text = found->second;
  }
  std::optional<Plan> plan;
  if (text) plan = deserialised(*text, handle);
  if (!plan) {
    const auto building = std::chrono::steady_clock::now();
    if ((text = read_plan(key)) && (plan = deserialised(*text, handle))) {
      ++counters().from_disk;
      counters().building_microseconds += static_cast<int64_t>(milliseconds_since(building) * 1000);
    }
  }
  if (!plan) {
    // A kept-only step runs ATen's heuristics for what no earlier run kept, uncounted: it runs them
    // so as not to time anything.
    if (kept_only()) return nullptr;
    if (kernels::driver::stream_is_capturing(at::cuda::getCurrentCUDAStream().stream())) {
      ++counters().to_aten;
      return nullptr;
    }
    Graph graph = graph_of(p, handle);
    auto chosen = choose(graph, handle, pointers, options, key);
    if (!chosen) {
      ++counters().to_aten;
      return nullptr;
    }
    ++counters().timed;
    plan = std::move(chosen->plan);
    // The graph's descriptors live as long as the plan made from them.
    for (auto& part : graph.parts) plan->parts.push_back(std::move(part));
    text = serialised(*plan);
    if (text) write_plan(key, *text);
  }
  auto shared = std::make_shared<Plan>(std::move(*plan));
  std::lock_guard<std::mutex> lock(s.mutex);
  if (text) s.chosen.emplace(key, *text);
  return s.plans.emplace(std::make_pair(handle, key), shared).first->second;
}

// Runs `p` on the operands x, w and y (in kUids' order, laid out in `format`) through its plan;
// whether it ran.
bool run(Pass pass, const at::Tensor& x, const at::Tensor& w, const at::Tensor& y, const Geometry& geometry,
         at::MemoryFormat format) {
  const Problem p = problem(pass, x, w, y, geometry, format);
  const std::array<void*, 3> pointers = {x.data_ptr(), w.data_ptr(), y.data_ptr()};
  const auto plan = plan_for(p, pointers, x.options());
  if (plan == nullptr) return false;
  const at::Tensor workspace = workspace_for(*plan, x.options());
  check(execute(*plan, at::native::getCudnnHandle(), pointers, workspace), "running a convolution");
  return true;
}

std::vector<int64_t> output_sizes(const at::Tensor& x, const at::Tensor& w, const Geometry& g) {
  std::vector<int64_t> sizes = {x.size(0), w.size(0)};
  for (int d = 0; d < 2; ++d) {
    const int64_t kernel = g.dilation[d] * (w.size(d + 2) - 1) + 1;
    sizes.push_back((x.size(d + 2) + 2 * g.padding[d] - kernel) / g.stride[d] + 1);
  }
  return sizes;
}

}  // namespace

std::string unsupported(const at::Tensor& x, const at::Tensor& w, const Geometry& g, int64_t groups) {
  if (!x.is_cuda()) return "not on a CUDA device";
  if (x.dim() != 4 || w.dim() != 4) return "not a 2-D convolution";
  if (x.scalar_type() != w.scalar_type() || (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kHalf))
    return "not in bf16 or fp16";
  const std::vector<c10::SymInt> no_padding(2, 0);
  const auto backend = at::native::select_conv_backend(
      x, w, std::nullopt, c10::fromIntArrayRefSlow(g.stride), c10::fromIntArrayRefSlow(g.padding),
      c10::fromIntArrayRefSlow(g.dilation), false, no_padding, groups, std::nullopt);
  if (backend != at::native::ConvBackend::Cudnn) return "ATen runs it on other kernels than cuDNN's";
  auto& context = at::globalContext();
  if (!context.userEnabledCuDNN()) return "cuDNN is off";
  // While kept-only, speedkit itself holds autotuning paused (set_kept_only()); the user's flags are
  // the ones the pause replaced.
  if (!kept_only()) {
    if (!context.benchmarkCuDNN()) return "cudnn.benchmark is off (cuDNN's heuristics choose)";
    if (context.deterministicCuDNN() || context.deterministicAlgorithms()) return "deterministic algorithms asked for";
  }
  try {
    api();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

std::optional<at::Tensor> forward(const at::Tensor& x_in, const at::Tensor& w_in, const Geometry& geometry) {
  const auto format = at::native::cudnn_conv_suggest_memory_format(x_in, w_in);
  const at::Tensor x = x_in.contiguous(format), w = w_in.contiguous(format);
  at::Tensor y = at::empty(output_sizes(x, w, geometry), x.options().memory_format(format));
  if (!run(Pass::forward, x, w, y, geometry, format)) return std::nullopt;
  return y;
}

std::optional<at::Tensor> backward_data(const at::Tensor& dy_in, const at::Tensor& w_in, at::IntArrayRef x_sizes,
                                        const Geometry& geometry, at::MemoryFormat format) {
  const at::Tensor dy = dy_in.contiguous(format), w = w_in.contiguous(format);
  at::Tensor dx = at::empty(x_sizes, dy.options().memory_format(format));
  if (!run(Pass::data, dx, w, dy, geometry, format)) return std::nullopt;
  return dx;
}

std::optional<at::Tensor> backward_filter(const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& w_like,
                                          const Geometry& geometry, at::MemoryFormat format) {
  const at::Tensor dy = dy_in.contiguous(format), x = x_in.contiguous(format);
  at::Tensor dw = at::empty(w_like.sizes(), dy.options().memory_format(format));
  if (!run(Pass::filter, x, dw, dy, geometry, format)) return std::nullopt;
  return dw;
}

bool set_kept_only(bool on) { return kept_only_flag.exchange(on); }
bool is_kept_only() { return kept_only(); }

Counts counts() {
  const Counters& c = counters();
  return Counts{c.timed.load(), static_cast<double>(c.timing_microseconds.load()) / 1e6, c.from_disk.load(),
                static_cast<double>(c.building_microseconds.load()) / 1e6, c.to_aten.load()};
}

#else  // no cuDNN headers: ATen's convolutions only

std::string unsupported(const at::Tensor&, const at::Tensor&, const Geometry&, int64_t) {
  return "speedkit was built without cuDNN's headers";
}
std::optional<at::Tensor> forward(const at::Tensor&, const at::Tensor&, const Geometry&) { return std::nullopt; }
std::optional<at::Tensor> backward_data(const at::Tensor&, const at::Tensor&, at::IntArrayRef, const Geometry&,
                                        at::MemoryFormat) {
  return std::nullopt;
}
std::optional<at::Tensor> backward_filter(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Geometry&,
                                          at::MemoryFormat) {
  return std::nullopt;
}
bool set_kept_only(bool) { return false; }
bool is_kept_only() { return false; }
Counts counts() { return {}; }

#endif

}  // namespace sk::conv_plans

extern "C" {

int sk_conv_plans_kept_only(int on) { return sk::conv_plans::set_kept_only(on != 0) ? 1 : 0; }

int sk_conv_plans_counts(int64_t* timed, double* timing_seconds, int64_t* from_disk, double* building_seconds,
                         int64_t* to_aten) {
  const auto c = sk::conv_plans::counts();
  *timed = c.timed;
  *timing_seconds = c.timing_seconds;
  *from_disk = c.from_disk;
  *building_seconds = c.building_seconds;
  *to_aten = c.to_aten;
  return 0;
}

}  // extern "C"
