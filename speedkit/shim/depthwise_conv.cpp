// Depthwise convolutions on speedkit's kernels where they beat the plans' or ATen's (depthwise_conv.h).
//
// cuDNN's depthwise kernels for channels-last tensors are far from the memory-bound time of the
// pass at some shapes (a ConvNeXt's 7×7 input gradient at 32 × 32: 221 µs, where speedkit's kernel
// takes 84) and well ahead at others (3×3 filters over large images). Rather than a rule over
// shapes, each problem is timed once per process, outside graph captures and outside the steps
// whose convolution plans come only from earlier choices (conv_plans::is_kept_only: ATen's
// heuristics are not what the step will run); the faster path runs from then on. A problem met
// first during a capture runs the other path, undecided.
#include "depthwise_conv.h"

#include "depthwise_conv.cuh"
#include "fused_op.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/core/Event.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace sk::depthwise_conv {
namespace {

namespace kernel = kernels::depthwise_conv;

enum class Pass { forward, input_gradient };

struct Choices {
  std::atomic<int> mode{static_cast<int>(Choice::timed)};
  std::mutex mutex;
  std::unordered_map<std::string, bool> on_kernel;  // by problem: whether speedkit's kernel is faster
  std::atomic<int64_t> on_kernels{0}, left{0}, kernel_runs{0};
};

Choices& choices() {
  static auto* c = new Choices;  // never destroyed: read by threads until the process ends
  return *c;
}

std::string problem_key(Pass pass, const at::Tensor& input, const at::Tensor& w, const conv_plans::Geometry& g) {
  return c10::str(pass == Pass::forward ? "forward " : "input gradient ", input.device(), " ", input.scalar_type(),
                  " ", input.sizes(), " filters ", w.sizes(), " padding ", g.padding);
}

// The mean milliseconds of three runs of `run` after one.
float time_of(const std::function<at::Tensor()>& run) {
  run();
  const auto stream = at::cuda::getCurrentCUDAStream();
  c10::Event start(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  c10::Event end(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  constexpr int kRuns = 3;
  start.record(stream);
  for (int i = 0; i < kRuns; ++i) run();
  end.record(stream);
  end.synchronize();
  return static_cast<float>(start.elapsedTime(end) / kRuns);
}

// Whether speedkit's kernel runs this problem: as the mode says, else the choice made for it,
// else (where timing is possible now) the one made by timing both, else no.
bool kernel_chosen(const std::string& key, const std::function<at::Tensor()>& ours,
                   const std::function<at::Tensor()>& other) {
  Choices& c = choices();
  if (const auto mode = static_cast<Choice>(c.mode.load()); mode != Choice::timed) return mode == Choice::kernel;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (const auto it = c.on_kernel.find(key); it != c.on_kernel.end()) return it->second;
  }
  if (conv_plans::is_kept_only() || kernels::driver::stream_is_capturing(at::cuda::getCurrentCUDAStream().stream()))
    return false;
  const bool faster = time_of(ours) < time_of(other);
  std::lock_guard<std::mutex> lock(c.mutex);
  if (c.on_kernel.emplace(key, faster).second) ++(faster ? c.on_kernels : c.left);
  return faster;
}

at::Tensor run(Pass pass, const at::Tensor& input, const at::Tensor& w, const conv_plans::Geometry& g,
               const std::function<at::Tensor()>& other) {
  const int64_t k = w.size(2);
  const auto ours = [&] {
    ++choices().kernel_runs;
    const at::Tensor filters = w.is_contiguous() ? w : w.contiguous(at::MemoryFormat::ChannelsLast);
    return pass == Pass::forward ? kernel::forward(input, filters, g.padding[0], g.padding[1], false)
                                 : kernel::forward(input, filters, k - 1 - g.padding[0], k - 1 - g.padding[1], true);
  };
  // A gradient that arrives in another layout goes to the other path, undecided.
  if (!input.is_contiguous(at::MemoryFormat::ChannelsLast) || !kernels::aligned_to(8, {&input})) return other();
  return kernel_chosen(problem_key(pass, input, w, g), ours, other) ? ours() : other();
}

}  // namespace

std::string unsupported(const at::Tensor& x, const at::Tensor& w, const conv_plans::Geometry& g, int64_t groups) {
  if (auto why = ops::unusable(SK_OP_CONVOLUTION, x.device()); !why.empty()) return why;
  if (x.dim() != 4 || w.dim() != 4) return "not a 2-D convolution";
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kHalf) return "not in bf16 or fp16";
  if (w.scalar_type() != x.scalar_type()) return "a filter of another type than the input's";
  const int64_t channels = x.size(1), k = w.size(2);
  if (groups != channels || w.size(0) != channels || w.size(1) != 1) return "not depthwise (one filter per channel)";
  if (w.size(3) != k || !kernel::takes_filter_size(k)) return "a filter other than 3×3, 5×5 or 7×7";
  if (channels % 8 != 0 || (channels + kernel::kBlockChannels - 1) / kernel::kBlockChannels > 65535)
    return c10::str(channels, " channels (a multiple of 8 is taken)");
  for (int d = 0; d < 2; ++d) {
    if (g.stride[g.stride.size() > 1 ? d : 0] != 1 || g.dilation[g.dilation.size() > 1 ? d : 0] != 1)
      return "a stride or dilation other than 1";
    const int64_t pad = g.padding[g.padding.size() > 1 ? d : 0];
    if (pad < 0 || pad >= k || x.size(d + 2) + 2 * pad < k) return "a padding of the filter's size or more";
  }
  if (g.padding.size() != 2) return "a padding not given per dimension";
  if (!x.is_contiguous(at::MemoryFormat::ChannelsLast) || !kernels::aligned_to(8, {&x})) return "not channels-last";
  if (!w.is_contiguous() && !w.is_contiguous(at::MemoryFormat::ChannelsLast)) return "filters not dense";
  return {};
}

at::Tensor forward(const at::Tensor& x, const at::Tensor& w, const conv_plans::Geometry& geometry,
                   const std::function<at::Tensor()>& other) {
  return run(Pass::forward, x, w, geometry, other);
}

at::Tensor input_gradient(const at::Tensor& dy, const at::Tensor& w, const conv_plans::Geometry& geometry,
                          const std::function<at::Tensor()>& other) {
  return run(Pass::input_gradient, dy, w, geometry, other);
}

Choice choose(Choice choice) { return static_cast<Choice>(choices().mode.exchange(static_cast<int>(choice))); }

Counts counts() {
  const Choices& c = choices();
  return Counts{c.on_kernels.load(), c.left.load(), c.kernel_runs.load()};
}

}  // namespace sk::depthwise_conv

extern "C" {

int sk_depthwise_conv_counts(int64_t* on_kernels, int64_t* left, int64_t* kernel_runs) {
  SK_TRY({
    const auto c = sk::depthwise_conv::counts();
    *on_kernels = c.on_kernels;
    *left = c.left;
    *kernel_runs = c.kernel_runs;
  })
}

int sk_depthwise_conv_choose(int choice) {
  using sk::depthwise_conv::Choice;
  if (choice < 0 || choice > static_cast<int>(Choice::other)) return -1;
  return static_cast<int>(sk::depthwise_conv::choose(static_cast<Choice>(choice)));
}

}  // extern "C"
