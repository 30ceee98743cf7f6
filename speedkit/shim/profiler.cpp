// The step profiler: libtorch's Kineto profiler (what torch.profiler drives from Python), its
// events flattened for Rust, its Chrome trace, and user-scope ranges that mark each profiled step;
// and PyTorch's execution trace (the operator graph of a step, which speedkit::trace reads).
#include "shim.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/profiler/standalone/execution_trace_observer.h>
#include <c10/util/Logging.h>

#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

namespace {

namespace kineto_api = torch::autograd::profiler;
namespace profiler_impl = torch::profiler::impl;

// A finished profile: Kineto's result and the event names, kept alive for the pointers handed out.
struct Profile {
  std::unique_ptr<kineto_api::ProfilerResult> result;
  std::vector<std::string> names;
};

// A user-scope range. The profiler reads the name when the range opens; it is kept here anyway,
// because RecordFunction takes a string_view.
struct Range {
  std::string name;
  at::RecordFunction record{at::RecordScope::USER_SCOPE};
};

// c10's log level at ERROR for the life of the object (c10::LOG(WARNING) lines held back), then
// as it was.
class QuietLog {
 public:
  QuietLog() : was_(FLAGS_caffe2_log_level) { FLAGS_caffe2_log_level = 2; }
  ~QuietLog() { FLAGS_caffe2_log_level = was_; }
  QuietLog(const QuietLog&) = delete;
  QuietLog& operator=(const QuietLog&) = delete;

 private:
  int was_;
};

// The execution trace writes each float argument with six decimals (std::to_string): an epsilon
// of 1e-8 as 0, a scale of 1/3 as 0.333333, and a generated kernel would bake those in. While a
// trace records, a callback beside its observer keeps every call's float arguments exactly, under
// the call's RecordFunction handle (the trace's `rf_id`), for speedkit::trace to put in their place.
struct ExactDouble {
  uint64_t rf_id;
  int32_t position;
  double value;
};

std::mutex exact_doubles_mutex;
std::vector<ExactDouble> exact_doubles;
std::optional<at::CallbackHandle> exact_doubles_callback;

std::unique_ptr<at::ObserverContext> keep_exact_doubles(const at::RecordFunction& fn) {
  const auto inputs = fn.inputs();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].isDouble()) continue;
    const std::lock_guard<std::mutex> lock(exact_doubles_mutex);
    exact_doubles.push_back({fn.handle(), static_cast<int32_t>(i), inputs[i].toDouble()});
  }
  return nullptr;
}

void stop_keeping_exact_doubles() {
  if (!exact_doubles_callback) return;
  at::removeCallback(*exact_doubles_callback);
  exact_doubles_callback.reset();
}

}  // namespace

extern "C" {

// Starts recording CPU ops on this thread (and the threads autograd hands work to), plus CUDA
// kernels, copies and runtime calls when `with_cuda` is set.
int sk_profiler_start(int with_cuda) {
  SK_TRY({
    std::set<profiler_impl::ActivityType> activities{profiler_impl::ActivityType::CPU};
    if (with_cuda) activities.insert(profiler_impl::ActivityType::CUDA);
    profiler_impl::ProfilerConfig config(profiler_impl::ProfilerState::KINETO,
                                         /*report_input_shapes=*/false,
                                         /*profile_memory=*/false);
    kineto_api::prepareProfiler(config, activities);
    kineto_api::enableProfiler(config, activities);
  })
}

// Stops recording; `*out` receives the profile (free it with sk_profiler_free).
int sk_profiler_stop(void** out) {
  SK_TRY({
    auto profile = std::make_unique<Profile>();
    profile->result = kineto_api::disableProfiler();
    const auto& events = profile->result->events();
    profile->names.reserve(events.size());
    for (const auto& e : events) profile->names.push_back(e.name());
    *out = profile.release();
  })
}

int sk_profiler_event_count(void* profile, int64_t* out) {
  SK_TRY(*out = static_cast<int64_t>(static_cast<Profile*>(profile)->result->events().size()))
}

int sk_profiler_event_get(void* profile, int64_t index, sk_profiler_event* out) {
  SK_TRY({
    auto* p = static_cast<Profile*>(profile);
    const auto& e = p->result->events().at(static_cast<size_t>(index));
    out->name = p->names.at(static_cast<size_t>(index)).c_str();
    out->device_type = static_cast<int32_t>(e.deviceType());
    out->activity_type = static_cast<int32_t>(e.activityType());
    out->start_ns = e.startNs();
    out->duration_ns = e.durationNs();
    out->correlation_id = e.correlationId();
    out->thread_id = e.startThreadId();
    out->device_resource_id = e.deviceResourceId();
  })
}

// Writes the Chrome trace (JSON; chrome://tracing and ui.perfetto.dev open it).
int sk_profiler_save(void* profile, const char* path) {
  SK_TRY(static_cast<Profile*>(profile)->result->save(path))
}

void sk_profiler_free(void* profile) {
  try {
    delete static_cast<Profile*>(profile);
  } catch (...) {
    // Nothing to report to during teardown.
  }
}

// Opens a user-scope range named `name` (shown in the profile and its trace); `*out` receives the
// range, which sk_record_range_close ends and frees.
int sk_record_range_open(const char* name, void** out) {
  SK_TRY({
    auto range = std::make_unique<Range>();
    range->name = name;
    range->record.before(std::string_view(range->name));
    *out = range.release();
  })
}

int sk_record_range_close(void* range) {
  std::unique_ptr<Range> owned(static_cast<Range*>(range));
  SK_TRY(owned->record.end())
}

// The execution trace observer is one per process (a global RecordFunction callback): it is added
// and enabled here, and disabled and removed at the stop, which also writes the file's end. Its
// log lines ("Enabling Execution Trace Observer") are held back: c10's log level is raised for the
// call and put back before it returns.
int sk_execution_trace_start(const char* path) {
  SK_TRY({
    const QuietLog quiet;
    TORCH_CHECK(profiler_impl::addExecutionTraceObserver(path),
                "an execution trace is already recording (one at a time per process), or ", path,
                " cannot be written");
    profiler_impl::enableExecutionTraceObserver();
    {
      const std::lock_guard<std::mutex> lock(exact_doubles_mutex);
      exact_doubles.clear();
    }
    stop_keeping_exact_doubles();
    exact_doubles_callback = at::addGlobalCallback(
        at::RecordFunctionCallback(&keep_exact_doubles).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  })
}

int sk_execution_trace_stop(void) {
  SK_TRY({
    const QuietLog quiet;
    stop_keeping_exact_doubles();
    profiler_impl::disableExecutionTraceObserver();
    profiler_impl::removeExecutionTraceObserver();
  })
}

int sk_execution_trace_double_count(int64_t* out) {
  SK_TRY({
    const std::lock_guard<std::mutex> lock(exact_doubles_mutex);
    *out = static_cast<int64_t>(exact_doubles.size());
  })
}

int sk_execution_trace_double(int64_t index, uint64_t* rf_id, int32_t* position, double* value) {
  SK_TRY({
    const std::lock_guard<std::mutex> lock(exact_doubles_mutex);
    const ExactDouble& d = exact_doubles.at(static_cast<size_t>(index));
    *rf_id = d.rf_id;
    *position = d.position;
    *value = d.value;
  })
}

int sk_record_function_thread_id(uint64_t* out) { SK_TRY(*out = at::RecordFunction::currentThreadId()) }

}  // extern "C"
