// speedkit's C ABI: every function of the shim (speedkit/shim/*.cpp) that Rust calls, declared once.
//
// Every shim file includes this header (through shim.h), so the C++ compiler refuses a definition
// whose signature differs from its declaration here; speedkit's build script generates the Rust
// declarations from this same file (speedkit-build's `abi` module), one Rust module per
// `// @module` section, each mirroring one shim file. The header is plain C in the small shape that
// generator reads: see speedkit-build/src/abi.rs.
//
// The error contract, for every function returning `int`: 0 on success; otherwise non-zero, and
// sk_last_error() holds the message (per thread) until the next failing call. No C++ exception
// crosses into Rust. Tensors cross as tch's handles (sk_tensor, an `at::Tensor*` owned by Rust);
// a tensor handed back through an `sk_tensor*` out-parameter is heap-allocated and owned by the
// caller. A `const char**` out-parameter points at a per-thread string of the shim, valid until the
// calling thread's next call that hands out a string.
#ifndef SPEEDKIT_SHIM_SPEEDKIT_H
#define SPEEDKIT_SHIM_SPEEDKIT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
namespace at {
class Tensor;
}
typedef at::Tensor* sk_tensor;
extern "C" {
#else
typedef struct sk_tensor_opaque* sk_tensor;
#endif

// @module errors: the error contract's message (flags.cpp)

/// The calling thread's last error message.
const char* sk_last_error(void);

// @module scalar_types: c10's ScalarType codes of the tensor types speedkit passes (checked against c10 in flags.cpp)

/// c10::ScalarType's numbering.
enum sk_scalar_type {
  SK_INT64 = 4,
  SK_FLOAT16 = 5,
  SK_FLOAT32 = 6,
  SK_FLOAT64 = 7,
  SK_BOOL = 11,
  SK_BFLOAT16 = 15,
  SK_FLOAT8_E5M2 = 23,
  SK_FLOAT8_E4M3FN = 24
};

// @module flags: PyTorch's global speed flags, read and restored raw (flags.cpp)

/// The boolean flags, by speedkit's id.
enum sk_bool_flag {
  SK_FLAG_CUDA_MATMUL_ALLOW_TF32 = 0,
  SK_FLAG_CUDA_MATMUL_ALLOW_BF16_REDUCED_PRECISION_REDUCTION = 1,
  SK_FLAG_CUDA_MATMUL_ALLOW_FP16_REDUCED_PRECISION_REDUCTION = 2,
  SK_FLAG_CUDNN_ALLOW_TF32 = 3,
  SK_FLAG_CUDNN_BENCHMARK = 4,
  SK_FLAG_CUDNN_DETERMINISTIC = 5,
  SK_FLAG_CUDNN_ENABLED = 6,
  SK_FLAG_SDP_FLASH = 7,
  SK_FLAG_SDP_MEM_EFFICIENT = 8,
  SK_FLAG_SDP_MATH = 9,
  SK_FLAG_SDP_CUDNN = 10,
  SK_FLAG_USE_DETERMINISTIC_ALGORITHMS = 11,
  SK_FLAG_CUDA_EXPANDABLE_SEGMENTS = 12
};

/// The entries of the per-backend fp32 precision table speedkit moves.
enum sk_fp32_precision_entry {
  SK_FP32_CUDA_MATMUL = 0,
  SK_FP32_MKLDNN_MATMUL = 1,
  SK_FP32_CUDNN_CONV = 2,
  SK_FP32_CUDNN_RNN = 3
};

/// Makes the n-th flag write from now fail once (0: never); test-only fault injection.
void sk_test_fail_nth_flag_write(int n);
/// Counts one write of speedkit's own global state that has no setter here (removing an override
/// registered from Rust), failing where sk_test_fail_nth_flag_write says so; changes nothing.
int sk_flag_write(void);
int sk_flag_get_bool(int flag, int* out);
/// Sets a boolean flag through PyTorch's own setter.
int sk_flag_set_bool(int flag, int value);
/// Writes only the flag's own field (restoring a captured state).
int sk_flag_restore_bool(int flag, int value);
/// 0 = highest, 1 = high, 2 = medium.
int sk_matmul_precision_get(int* out);
int sk_matmul_precision_set(int value);
/// Writes only the legacy matmul-precision field.
int sk_matmul_precision_restore(int value);
/// 0 = none, 1 = ieee, 2 = tf32, 3 = bf16.
int sk_fp32_precision_get(int which, int* out);
int sk_fp32_precision_set(int which, int value);

// @module amp: autocast state and the GradScaler's unscale (amp.cpp)

/// Autocast's enabled flag and dtype (a ScalarType code) for a c10::DeviceType code.
int sk_autocast_get(int device_type, int* enabled, int* dtype);
int sk_autocast_set(int device_type, int enabled, int dtype);
int sk_autocast_increment_nesting(int* depth);
int sk_autocast_decrement_nesting(int* depth);
int sk_autocast_clear_cache(void);
/// grads *= inv_scale; found_inf = 1 where any gradient is not finite.
int sk_amp_unscale_(const sk_tensor* grads, int64_t n, sk_tensor found_inf, sk_tensor inv_scale);

// @module device: versions, device properties, the caching allocator, events and streams (device.cpp)

/// libtorch's and CUDA's versions.
typedef struct sk_versions {
  int torch_major;
  int torch_minor;
  int torch_patch;
  int built_with_cuda;
  int64_t cuda_runtime;
  int64_t cudnn;
} sk_versions;

/// One CUDA device's properties.
typedef struct sk_device_props {
  char name[256];
  int major;
  int minor;
  int multiprocessors;
  int64_t total_memory;
  int64_t l2_cache_bytes;
} sk_device_props;

int sk_versions_get(sk_versions* out);
int sk_cuda_device_count(int* out);
int sk_cuda_device_props(int index, sk_device_props* out);
/// Bytes allocated now, peak allocated since the last reset, and reserved, by the caching allocator.
int sk_cuda_memory_stats(int index, int64_t* allocated, int64_t* peak, int64_t* reserved);
int sk_cuda_reset_peak_memory(int index);
/// Peak bytes reserved since the last reset.
int sk_cuda_peak_reserved_memory(int index, int64_t* out);
/// Gives the caching allocator's unused blocks back to the driver.
int sk_cuda_empty_cache(void);
/// Frees the cuBLAS and cuBLASLt workspaces (one per handle and stream, kept for the process once
/// made) of every stream but device `index`'s side stream (`side_stream_too`: of every stream);
/// each is made again at the next GEMM on its stream. Synchronises the current device first.
/// *freed: how many went. Only where no captured CUDA graph replays with a freed one.
int sk_cuda_release_blas_workspaces(int index, int side_stream_too, int64_t* freed);
/// Gives every cuBLAS handle seen on device `index`'s current stream one shared workspace there,
/// allocated now: with `capturing` (the stream is capturing a graph) in the graph's pool, and only
/// where none of them has one there yet; *shared receives how many handles share it (0: nothing
/// done).
int sk_cuda_share_blas_workspace(int index, int capturing, int* shared);
/// The cuBLAS workspaces the process keeps (for every handle, stream and device): *entries
/// receives how many (handle, stream) pairs have one, *distinct how many workspaces they point at
/// (several pairs may share one), *bytes the memory of those.
int sk_cuda_blas_workspaces(int64_t* entries, int64_t* distinct, int64_t* bytes);

/// The caching allocator's counters for one device, in bytes where not a count.
typedef struct sk_memory_totals {
  int64_t allocated;
  int64_t reserved;
  int64_t active;
  int64_t inactive_split;
  int64_t peak_allocated;
  int64_t peak_reserved;
  int64_t alloc_retries;
  int64_t ooms;
  int64_t segments;
} sk_memory_totals;

/// The allocator's segments of one pool on one stream: the default pool is (0, 0), a CUDA graph's
/// private pool any other id.
typedef struct sk_memory_pool {
  uint64_t pool_first;
  uint64_t pool_second;
  uint64_t stream;
  int64_t segments;
  int64_t reserved;
  int64_t allocated;
} sk_memory_pool;

/// Device `index`'s memory now: its totals, and up to `capacity` pool groups written to `pools`
/// (*count receives how many there are, which may exceed `capacity`).
int sk_cuda_memory_snapshot(int index, sk_memory_totals* totals, sk_memory_pool* pools, int64_t capacity,
                            int64_t* count);
/// A CUDA event with timing, freed by sk_cuda_event_free.
int sk_cuda_event_new(void** out);
/// Records the event on the current stream.
int sk_cuda_event_record(void* event);
/// Milliseconds from `start` to `end`, waiting for `end`.
int sk_cuda_event_elapsed_ms(void* start, void* end, double* out);
void sk_cuda_event_free(void* event);
int sk_cuda_synchronize(int index);
/// Makes the device's side stream (one for the process) current, ordered after the work queued so
/// far; sk_cuda_side_stream_exit orders the previous stream after it and frees the handle.
int sk_cuda_side_stream_enter(int index, void** out);
int sk_cuda_side_stream_exit(void* handle);

// @module sensors: the GPU's clock, power and the reasons its clock is held down, through NVML (sensors.cpp)

/// One reading of a CUDA device's sensors: its SM clock now and at most (MHz), its board's power
/// draw (NVML's, averaged over about a second on recent boards) and enforced limit (milliwatts),
/// the energy it took since the driver loaded (millijoules; 0 where the board does not count it),
/// and NVML's clock-event reasons now (a bitmask: 0x4 the power cap, 0x8 a hardware slowdown,
/// 0x20 and 0x40 thermal, 0x80 the power brake).
typedef struct sk_gpu_reading {
  uint32_t sm_clock_mhz;
  uint32_t max_sm_clock_mhz;
  uint32_t power_mw;
  uint32_t power_limit_mw;
  uint64_t energy_mj;
  uint64_t clock_event_reasons;
} sk_gpu_reading;

/// Reads CUDA device `index`'s sensors; fails, naming why, where NVML cannot be loaded or read.
int sk_gpu_sensors_read(int index, sk_gpu_reading* out);

// @module memory_history: the caching allocator's record of every allocation, written as a snapshot file (memory_history.cpp)

/// *out: 1 while the caching allocator records its history (whoever started it), else 0.
int sk_cuda_memory_history_enabled(int* out);
/// Starts (`enabled` non-zero) or stops recording every allocation and free of every device, each
/// with the C++ stack that made it, keeping the latest `max_entries` events. Stopping drops them.
int sk_cuda_memory_history_record(int enabled, int64_t max_entries);
/// Writes the allocator's segments and recorded history to `path`, in the pickle format of
/// PyTorch's `torch.cuda.memory._dump_snapshot`.
int sk_cuda_memory_history_write(const char* path);

// @module weight_casts: fp32 weights' copies in the autocast type, kept across steps (weight_casts.cpp)

/// The bytes and number of the kept copies whose weights are alive, on every device.
int sk_weight_copies_size(int64_t* bytes, int64_t* count);
/// Frees the copies of weights that no longer exist; *freed receives their bytes.
int sk_weight_copies_release_expired(int64_t* freed);
/// Frees every kept copy (the next forward casts again); *freed receives their bytes.
int sk_weight_copies_clear(int64_t* freed);
/// Whether forwards on the calling thread use kept copies (`keep` 1, the default) or cast each
/// weight where it is used (0: inside a checkpointed function); *previous receives the setting
/// replaced.
int sk_weight_copies_keep_on_this_thread(int keep, int* previous);

// @module graphs: CUDA graphs in the caching allocator's graph pools (graphs.cpp)

int sk_cuda_graph_pool_handle(uint64_t* first, uint64_t* second);
int sk_cuda_graph_new(void** out);
/// Begins capture on the current stream (not the default stream).
int sk_cuda_graph_capture_begin(void* graph, uint64_t pool_first, uint64_t pool_second);
int sk_cuda_graph_capture_end(void* graph);
int sk_cuda_graph_replay(void* graph);
void sk_cuda_graph_free(void* graph);

// @module optim: AdamW and the parameter-list helpers (optim.cpp)

/// One AdamW bucket's tensor lists (same device and dtype), n tensors each.
typedef struct sk_adamw_lists {
  const sk_tensor* params;
  const sk_tensor* grads;
  const sk_tensor* exp_avgs;
  const sk_tensor* exp_avg_sqs;
  const sk_tensor* steps;
  int64_t n;
} sk_adamw_lists;

/// One AdamW update's hyper-parameters; lr is a tensor on the device (capturable).
typedef struct sk_adamw_hyper {
  sk_tensor lr;
  double beta1;
  double beta2;
  double weight_decay;
  double eps;
} sk_adamw_hyper;

/// torch._fused_adamw_; speedkit's AdamW kernel takes every parameter it can (writing kept weight
/// copies in the same pass) where the kernel switch allows it. grad_scale, found_inf: NULL without
/// a GradScaler.
int sk_fused_adamw_(const sk_adamw_lists* lists, const sk_adamw_hyper* hyper, sk_tensor grad_scale,
                    sk_tensor found_inf);
/// The multi-tensor (foreach) AdamW, capturable.
int sk_foreach_adamw_(const sk_adamw_lists* lists, const sk_adamw_hyper* hyper);
/// Lays a 4-d parameter out channels-last in place (the same parameter object).
int sk_to_channels_last_(sk_tensor tensor);
int sk_is_channels_last(sk_tensor tensor, int* out);
/// Lays a tensor (a parameter, a gradient) out contiguous (NCHW) again, keeping the same object.
int sk_to_contiguous_(sk_tensor tensor);
/// Starts counting, process-wide, the GroupNorm calls (aten::group_norm, aten::native_group_norm)
/// whose input is a channels-last activation, which ATen copies to NCHW first.
int sk_channels_last_census_start(void);
/// Stops the count; *calls receives it.
int sk_channels_last_census_stop(int64_t* calls);
/// Drops every tensor's gradient (`grad = None`).
int sk_clear_grads(const sk_tensor* tensors, int64_t n);
/// params[i].grad = grads[i].
int sk_set_grads(const sk_tensor* params, const sk_tensor* grads, int64_t n);
int sk_foreach_zero_(const sk_tensor* tensors, int64_t n);
/// The `ord`-norm of all tensors together.
int sk_foreach_norm(const sk_tensor* tensors, int64_t n, double ord, sk_tensor* out);
int sk_foreach_mul_scalar_tensor_(const sk_tensor* tensors, int64_t n, sk_tensor factor);

// @module profiler: the Kineto step profiler, user-scope ranges and the execution trace (profiler.cpp)

/// One profiler event; `name` lives as long as its profile.
typedef struct sk_profiler_event {
  const char* name;
  int32_t device_type;
  int32_t activity_type;
  uint64_t start_ns;
  uint64_t duration_ns;
  uint64_t correlation_id;
  uint64_t thread_id;
  int64_t device_resource_id;
} sk_profiler_event;

/// Starts recording CPU ops on this thread, and CUDA activity with `with_cuda`.
int sk_profiler_start(int with_cuda);
/// Stops the profiler; *out receives the profile (sk_profiler_free).
int sk_profiler_stop(void** out);
int sk_profiler_event_count(void* profile, int64_t* out);
int sk_profiler_event_get(void* profile, int64_t index, sk_profiler_event* out);
/// Writes the Chrome trace.
int sk_profiler_save(void* profile, const char* path);
void sk_profiler_free(void* profile);
/// Opens a user-scope range an active profiler records (closed by sk_record_range_close).
int sk_record_range_open(const char* name, void** out);
int sk_record_range_close(void* range);
/// Records every operator call of the process (PyTorch's execution trace: names, schemas, tensor
/// ids, shapes, strides and types, nesting) into the JSON file `path` until
/// sk_execution_trace_stop; refused while another trace records.
int sk_execution_trace_start(const char* path);
/// Stops the trace started by sk_execution_trace_start and finishes its file.
int sk_execution_trace_stop(void);
/// How many float arguments the last trace kept exactly (the file rounds them to six decimals).
int sk_execution_trace_double_count(int64_t* out);
/// Float argument `index` of the last trace: its call's RecordFunction handle (the file's rf_id),
/// its position among the call's arguments, and its value.
int sk_execution_trace_double(int64_t index, uint64_t* rf_id, int32_t* position, double* value);
/// The id RecordFunction (and so the execution trace, as `tid`) gives the calling thread.
int sk_record_function_thread_id(uint64_t* out);

// @module nvtx: NVTX ranges for timeline tools (nvtx.cpp)

void sk_nvtx_range_push(const char* name);
void sk_nvtx_range_pop(void);

// @module autograd: the backward graph behind a tensor (autograd.cpp)

/// Every node reachable from root's grad_fn and the leaves it writes; *out freed by
/// sk_autograd_graph_free.
int sk_autograd_graph(sk_tensor root, void** out);
int sk_autograd_graph_sizes(void* graph, int64_t* nodes, int64_t* leaves);
/// Node `index`'s name, alive as long as the graph.
int sk_autograd_graph_node(void* graph, int64_t index, const char** name);
int sk_autograd_graph_leaf(void* graph, int64_t index, uint64_t* id);
void sk_autograd_graph_free(void* graph);
/// Whether grad mode is on for the calling thread (torch.is_grad_enabled()).
int sk_grad_mode_enabled(int* enabled);
/// The identity autograd keys a variable by (its TensorImpl).
int sk_tensor_identity(sk_tensor tensor, uint64_t* id);
/// The identity of the node that made `tensor` (its grad_fn), 0 for none: unique while the node
/// lives.
int sk_tensor_grad_fn_identity(sk_tensor tensor, uint64_t* id);
/// Back-propagates from `outputs` with `grad_outputs` as their gradients (torch.autograd.backward),
/// adding to the leaves' gradients.
int sk_autograd_backward(const sk_tensor* outputs, const sk_tensor* grad_outputs, int64_t n);
/// The gradients of `inputs` (m of them, written to `out`; NULL where an input gets none) from
/// `outputs` with `grad_outputs` as their gradients, accumulated into nothing (torch.autograd.grad).
int sk_autograd_grad(const sk_tensor* outputs, const sk_tensor* grad_outputs, int64_t n, const sk_tensor* inputs,
                     int64_t m, sk_tensor* out);

// @module distributed: c10d process groups and DDP's Reducer (distributed.cpp), speedkit's gradient sync (gradient_sync.cpp, its replay watchdog in replay_watchdog.cpp) and optimizer shard (optimizer_shard.cpp)

/// Which c10d backend carries the collectives.
enum sk_dist_backend { SK_DIST_GLOO = 0, SK_DIST_NCCL = 1 };

/// The reductions of sk_dist_all_reduce_.
enum sk_reduce_op { SK_REDUCE_SUM = 0, SK_REDUCE_MAX = 1 };

/// Joins a process group over a TCPStore at master_addr:port; *out freed by sk_dist_free.
int sk_dist_init(int backend, const char* master_addr, int port, int rank, int world, int local_rank,
                 int64_t timeout_ms, void** out);
void sk_dist_free(void* group);
/// Which ranks are lost, in a sentence: those whose heartbeat in the rendezvous store stopped
/// (this call waits three beats, 3 s, to tell), or rank 0 when its store does not answer.
int sk_dist_lost_ranks(void* group, const char** text);
int sk_dist_broadcast_(void* group, const sk_tensor* tensors, int64_t n, int root);
int sk_dist_all_reduce_(void* group, sk_tensor tensor, int op);
int sk_dist_all_gather(void* group, sk_tensor tensor, sk_tensor* out);
int sk_dist_barrier(void* group);
/// c10d's Reducer over `params`: bucketed gradient all-reduce from autograd hooks, averaged.
int sk_reducer_new(void* group, const sk_tensor* params, int64_t n, int64_t bucket_bytes,
                   int64_t first_bucket_bytes, void** out);
/// Arms the hooks for the next backward pass.
int sk_reducer_prepare(void* reducer);
void sk_reducer_free(void* reducer);
/// The gradient all-reduce as ordinary work on the current stream, run after the backward pass (so
/// a CUDA graph can capture it with the step): buckets of at most `bucket_bytes` of `params`'
/// gradients, each copied into one flat buffer in `wire_type` (a ScalarType code, or -1 for the
/// parameters' own type), all-reduced and averaged. With `shard` (ZeRO-1) each bucket is instead
/// padded to a multiple of the world size and reduce-scattered: this rank keeps the average of its
/// contiguous part only, as the gradients of its pieces of the parameters (sk_optimizer_shard_new).
/// With `shard` 2 (ZeRO-3) the parameters are sharded too: each bucket is a unit of parameters
/// (`units[i]`: parameter i's unit; negative: the unit kept gathered through the step), whose
/// parameters become views, in `param_type` (a ScalarType code, -1: their own), of a buffer
/// gathered where a call of the step takes them; this rank keeps its part in fp32, which its
/// pieces are stretches of (parameter_residency.cpp). `units` may be null otherwise (buckets by
/// size). *out freed by sk_grad_sync_free.
int sk_grad_sync_new(void* group, const sk_tensor* params, int64_t n, const int64_t* units, int64_t bucket_bytes,
                     int wire_type, int shard, int param_type, void** out);
/// Before a backward pass: its gradients go into their buckets as autograd produces them, and each
/// bucket's all-reduce starts when it is full, overlapping the rest of the backward pass.
int sk_grad_sync_arm(void* sync);
/// After the backward pass: starts the all-reduces not started and joins them into the current
/// stream; afterwards each parameter's gradient is a view of its bucket, the average across the
/// ranks (a parameter without one gets the average of the others').
int sk_grad_sync_run(void* sync);
/// sk_grad_sync_run in two halves, so that work can go between the joins: starts the all-reduces
/// not started, and joins none.
int sk_grad_sync_start(void* sync);
/// Joins bucket `bucket` (every bucket where negative) into the current stream and finishes its
/// average, as sk_grad_sync_run does; a bucket joined already is left as it is.
int sk_grad_sync_join(void* sync, int64_t bucket);
/// The parameters of bucket `bucket` (buckets start in index order), as indices into the list
/// sk_grad_sync_new was given: at most `capacity` written, *count receives how many there are.
int sk_grad_sync_bucket_members(void* sync, int64_t bucket, int64_t* params, int64_t capacity, int64_t* count);
/// After a replay of a CUDA graph that captured the run: ends the process with a message naming
/// `rank` (and NCCL's communicators aborted) if the replay's work on the current stream is not
/// done within `timeout_ms`, as c10d's watchdog does for the collectives it launches itself.
int sk_grad_sync_watch_replay(void* sync, int64_t timeout_ms, const char* rank);
/// How many buckets (all-reduces) a run makes, and the bytes they send in all.
int sk_grad_sync_shape(void* sync, int64_t* buckets, int64_t* wire_bytes);
/// ZeRO-3: the bytes of parameters this rank holds now (its fp32 parts and the units gathered).
int sk_grad_sync_resident_bytes(void* sync, int64_t* bytes);
/// ZeRO-3: every parameter's whole fp32 value (a collective), in the order sk_grad_sync_new was
/// given them: `out` has room for `capacity`, and receives fresh tensors.
int sk_grad_sync_gather_parameters(void* sync, sk_tensor* out, int64_t capacity);
/// ZeRO-3: every gathered unit let go without its values taken back, so that the next use gathers
/// what this rank's fp32 parts hold now (after a checkpoint was read into them). No collective.
int sk_grad_sync_refresh_parameters(void* sync);
/// ZeRO-3: ends the sharding. With `gather` (a collective) the parameters become whole fp32 tensors
/// of their values again; without, empty tensors, which a later use reports (after a failure).
int sk_grad_sync_unshard(void* sync, int gather);
void sk_grad_sync_free(void* sync);
/// The optimizer's side of a sharded sync: this rank's pieces of the parameters (detached views,
/// whose gradients the sync's run sets) and the all-gather of the updated pieces. It holds its own
/// references, so it may outlive the sync. *out freed by sk_optimizer_shard_free.
int sk_optimizer_shard_new(void* sync, void** out);
/// This rank's pieces (at most `capacity` written, fresh handles) and, for each, the index of its
/// parameter in the list sk_grad_sync_new was given and the place of its first element in that
/// parameter's flattened values; *count receives how many there are.
int sk_optimizer_shard_pieces(void* shard, sk_tensor* pieces, int64_t* params, int64_t* offsets, int64_t capacity,
                              int64_t* count);
/// After the optimizer updated this rank's pieces: every rank's pieces all-gathered, bucket by
/// bucket, into the whole parameters (a collective, on the current stream; capturable).
int sk_optimizer_shard_gather(void* shard);
/// sk_optimizer_shard_gather in parts: starts the all-gather of bucket `bucket` alone (buckets as
/// the sync's, in index order on every rank), to be joined by sk_optimizer_shard_finish_gather.
int sk_optimizer_shard_gather_bucket(void* shard, int64_t bucket);
/// Joins every all-gather sk_optimizer_shard_gather_bucket started into the current stream and
/// refreshes the parameters' kept autocast copies.
int sk_optimizer_shard_finish_gather(void* shard);
/// `tensor` reduced in place across the ranks (SK_REDUCE_SUM or SK_REDUCE_MAX), on the current stream.
int sk_optimizer_shard_all_reduce_(void* shard, sk_tensor tensor, int op);
void sk_optimizer_shard_free(void* shard);

// @module function: autograd functions written in Rust, and activation checkpointing (function.cpp)

/// A Rust function's forward (or, for a checkpoint, its recomputation): the outputs of `inputs`,
/// handed back through sk_function_call_set_results; 0 on success, else non-zero after
/// sk_function_call_fail. `call` is valid for this call only.
typedef int (*sk_function_forward_fn)(void* state, void* call, const sk_tensor* inputs, int64_t n);
/// A Rust function's backward: the inputs' gradients from the outputs' (NULL where an output got
/// none), handed back through sk_function_call_set_results (NULL for no gradient).
typedef int (*sk_function_backward_fn)(void* state, void* call, const sk_tensor* grad_outputs, int64_t n);
/// Frees the Rust state when the node that holds it is destroyed.
typedef void (*sk_function_drop_fn)(void* state);

/// A Rust function's callbacks.
typedef struct sk_function_vtable {
  sk_function_forward_fn forward;
  sk_function_backward_fn backward;
  sk_function_drop_fn drop;
} sk_function_vtable;

/// Applies a Rust function to `inputs` as one node of the autograd graph; its outputs (at most
/// `capacity`) in `outputs`, their count in *n_outputs. `state` belongs to the node from here on,
/// also when this fails. `cast_inputs`: a ScalarType code to cast floating CUDA inputs to under
/// autocast (the forward then runs with autocast off), or -1 to pass them as they are.
/// `once_differentiable`: NULL for a backward autograd may differentiate again, else the function's
/// name, which a second derivative reaching the node fails with.
int sk_function_apply(const sk_function_vtable* vtable, void* state, int cast_inputs, const char* once_differentiable,
                      const sk_tensor* inputs, int64_t n_inputs, sk_tensor* outputs, int64_t capacity,
                      int64_t* n_outputs);
/// Runs `vtable`'s forward on `inputs` without keeping its graph, and again in the backward pass to
/// back-propagate through it (activation checkpointing), the random generators rewound for it
/// unless `capturing` (a CUDA graph capture is recording the step); a backward with create_graph
/// (a second derivative) is an error. As sk_function_apply otherwise.
int sk_checkpoint_apply(const sk_function_vtable* vtable, void* state, int capturing, const sk_tensor* inputs,
                        int64_t n_inputs, sk_tensor* outputs, int64_t capacity, int64_t* n_outputs);
/// y = x · k through a C++ autograd function of the same shape as a one-line Rust Function: the
/// twin a Rust node's host cost is measured against.
int sk_function_reference_scale(sk_tensor x, double k, sk_tensor* y);
/// In a callback: what it hands back (NULL entries: undefined tensors).
int sk_function_call_set_results(void* call, const sk_tensor* results, int64_t n);
/// In a callback: why it failed.
int sk_function_call_fail(void* call, const char* message);
/// In a forward: tensors the backward reads (checked against in-place changes).
int sk_function_call_save_for_backward(void* call, const sk_tensor* tensors, int64_t n);
/// In a forward: outputs that have no gradient.
int sk_function_call_mark_non_differentiable(void* call, const sk_tensor* tensors, int64_t n);
/// In a forward: whether the backward gets zeros (1) or NULL (0) for outputs without a gradient.
int sk_function_call_set_materialize_grads(void* call, int value);
/// In a backward: the saved tensors (at most `capacity`), their count in *count.
int sk_function_call_saved(void* call, sk_tensor* out, int64_t capacity, int64_t* count);
/// In a backward: whether input `index` needs a gradient.
int sk_function_call_needs_input_grad(void* call, int64_t index, int* out);
/// In a backward: whether `tensor`'s memory may take the backward's result: only the caller's
/// handle and the node's saved copy own it, no other tensor shares its storage, and the graph
/// is not kept for another backward.
int sk_function_call_may_overwrite(void* call, sk_tensor tensor, int* out);

// @module deferred: tensors whose memory and values come at their first read (deferred.cpp)

/// Writes a deferred tensor's values, once it has its memory; 0 on success, else non-zero with the
/// reason in `message` (NUL-terminated, at most `capacity` bytes), and the tensor is filled with NaN
/// for the reading operator (with a warning).
typedef int (*sk_deferred_materialize_fn)(void* state, sk_tensor tensor, char* message, int64_t capacity);
/// Frees the state when the deferred tensor has been materialized or has died unread.
typedef void (*sk_deferred_release_fn)(void* state);

/// A deferred tensor's callbacks.
typedef struct sk_deferred_vtable {
  sk_deferred_materialize_fn materialize;
  sk_deferred_release_fn release;
} sk_deferred_vtable;

/// A contiguous tensor of `sizes` (`ndim` of them), type `scalar_type` on `device` (-1: the CPU)
/// that has no memory yet: the first operator that reads it or a view of it (every dispatcher call
/// taking it, except the `exempt_ops`, which must not read its data) first gives it its memory from
/// the device's allocator and has `vtable`'s materialize write its values, on that operator's
/// thread and current stream. `exempt_ops` lists full operator names without overloads
/// ("aten::relu"), separated by commas; "" for none. Operators that only make views (view,
/// permute, narrow, detach, ...) never read it: their results are pending with it. `tag` is the
/// creator's own number for it (see sk_deferred_tag). `state` belongs to the tensor from here on,
/// also when this fails. Operators are observed through a RecordFunction callback that exists only
/// while a deferred tensor is pending. Fails where the thread has RecordFunction off.
int sk_deferred_new(const int64_t* sizes, int64_t ndim, int scalar_type, int device, const char* exempt_ops,
                    uint64_t tag, const sk_deferred_vtable* vtable, void* state, sk_tensor* out);
/// Declares what pending deferred `tensor` is computed from (`count` tensors): an operator that
/// writes one of them in place (an argument of its schema marked written: `add_`'s self, `out=`)
/// first materializes `tensor`, which then gets the values the sources had; a source written where
/// no operator was seen (its version counter moved) leaves `tensor` NaN with a warning naming it,
/// never values computed from the new contents. Once per tensor.
int sk_deferred_computed_from(sk_tensor tensor, const sk_tensor* sources, int64_t count);
/// Whether `tensor` (or the tensor it is a view of) is deferred and pending, and if so its `tag`:
/// how a fused consumer recognises its producer's output.
int sk_deferred_tag(sk_tensor tensor, int* pending, uint64_t* tag);
/// Materializes `tensor` now if it is deferred and pending (before a read that no operator does,
/// such as a kernel's raw pointer); *materialized = whether it was pending.
int sk_deferred_materialize(sk_tensor tensor, int* materialized);
/// Whether `tensor` (or the tensor it is a view of) is deferred and not yet materialized.
int sk_deferred_is_pending(sk_tensor tensor, int* pending);
/// How many deferred tensors are pending in the process, and whether the operator observer is
/// registered (it is exactly while some are).
int sk_deferred_pending(int64_t* count, int* observing);

// @module kernels: speedkit's kernel layer: sources, compilation, the kernel switch and its notes (kernels.cpp)

/// speedkit's fused ops, as the kernel switch and the notes name them; SK_OP_ALL is the switch of
/// every op at once.
enum sk_op {
  SK_OP_ALL = 0,
  SK_OP_LAYER_NORM = 1,
  SK_OP_CROSS_ENTROPY = 2,
  SK_OP_BIAS_GELU = 3,
  SK_OP_EMBEDDING = 4,
  SK_OP_LINEAR = 5,
  SK_OP_MLP = 6,
  SK_OP_ADAMW = 7,
  SK_OP_FP8_CAST = 8,
  SK_OP_BATCH_NORM = 9,
  SK_OP_CONVOLUTION = 10,
  SK_OP_MSE_LOSS = 11,
  SK_OP_COUNT = 12
};

/// What happened to one op so far in the process: it ran on the kernel (`reason` empty) or took
/// ATen's path for `reason`, `count` times. `reason` lives as long as the process.
typedef struct sk_kernel_note {
  int op;
  const char* reason;
  int64_t count;
} sk_kernel_note;

/// Whether the kernels of `op` (SK_OP_ALL: of every op) are switched on.
int sk_kernels_setting_get(int op, int* on);
int sk_kernels_setting_set(int op, int on);
/// Why speedkit's kernels cannot run on CUDA device `index`, or "" when they can.
int sk_kernels_unavailable_reason(int index, const char** reason);
/// How many distinct notes there are; sk_kernel_note_get reads them in order of first occurrence.
int sk_kernel_note_count(int64_t* out);
int sk_kernel_note_get(int64_t index, sk_kernel_note* out);
/// Notes that `op` ran on its kernel (`reason` NULL or empty) or took ATen's path for `reason`
/// (copied): the channel of the shim's own ops, for the overrides built in Rust.
int sk_kernel_note_add(int op, const char* reason);
/// How many kernel sources are registered: speedkit's own (the first *builtin of them), then those
/// registered at run time.
int sk_kernel_source_count(int* out, int* builtin);
/// Source `index`'s name, alive as long as the process.
int sk_kernel_source_name(int index, const char** out);
/// Registers CUDA C++ source `text` under `name` (both copied), compiled on first use with its
/// own cache key; *index receives its index. A name already registered with other text is an error.
int sk_kernel_source_register(const char* name, const char* text, int* index);
/// Compiles source `index` for `sm_<major><minor>`, bypassing the cache: every entry point, or the
/// one named `entry_point` when it is not NULL (an error when the source has none of that name);
/// the cubin's size.
int sk_kernel_compile(int index, const char* entry_point, int major, int minor, int64_t* cubin_bytes);
/// NVRTC's version as major * 1000 + minor * 10.
int sk_nvrtc_version(int* out);
/// Compiles source `index`, one registered at run time, for `sm_<major><minor>` (or reads it from
/// the disk cache) ahead of sk_kernel_load, which then finds its cubin in this process; *compiled
/// receives 1 where NVRTC ran. Safe to call from several threads at once.
int sk_kernel_prepare(int index, int major, int minor, int* compiled);
/// Compiles (or reads from the cache) source `index` for CUDA device `device` and loads kernel
/// `name` of it; *kernel receives a handle (sk_kernel_free). *param_count receives how many
/// parameters the kernel takes and param_sizes (up to `capacity`) their byte sizes, or -1 when the
/// driver cannot tell (before CUDA 12.4).
int sk_kernel_load(int index, const char* name, int device, void** kernel, int64_t* param_sizes, int64_t capacity,
                   int64_t* param_count);
/// Launches a loaded kernel on the current stream of its device with `args` (one pointer to each
/// argument's bytes, as cuLaunchKernel takes them).
int sk_kernel_launch(void* kernel, const uint32_t* grid, const uint32_t* block, int shared_bytes, void** args);
void sk_kernel_free(void* kernel);

// @module layernorm: LayerNorm on speedkit's kernel, else ATen's (layernorm.cpp)

/// y = LN(x [+ residual]) over the last dimension, written in the autocast type where autocast is
/// on for x's device (else x's); with a residual also *sum = x + residual; without one and with
/// `keep_input`, *sum = x passed through (its later gradient joins dx in the kernel); otherwise
/// *sum = NULL. weight, bias: [width] or NULL. Differentiable.
int sk_layer_norm(sk_tensor x, sk_tensor residual, sk_tensor weight, sk_tensor bias, double eps, int keep_input,
                  sk_tensor* y, sk_tensor* sum);
/// Why sk_layer_norm would take ATen's path for these inputs, or "".
int sk_layer_norm_unsupported(sk_tensor x, sk_tensor residual, sk_tensor weight, sk_tensor bias,
                              const char** reason);

// @module classifier: the fused softmax cross-entropy, else ATen's (classifier.cpp)

/// The mean cross-entropy of logits [rows, classes] against int64 targets [rows], rows whose
/// target is ignore_index left out; *loss is an fp32 scalar. Differentiable in the logits.
int sk_cross_entropy(sk_tensor logits, sk_tensor targets, int64_t ignore_index, sk_tensor* loss);
int sk_cross_entropy_unsupported(sk_tensor logits, sk_tensor targets, const char** reason);
/// The cross-entropy of the logits x Wᵀ + b ([rows, vocab]) against int64 targets [rows], computed
/// `block_rows` rows at a time so that the logits are never whole: the mean over the rows whose
/// target is not ignore_index (`mean` 1) or the sum, an fp32 scalar in *loss. x: [rows, in];
/// weight: [vocab, in]; bias: [vocab] or NULL; the GEMMs in `gemm_type` (a ScalarType code), the
/// operands cast to it as autocast casts them. Differentiable once in x, weight and bias.
int sk_chunked_cross_entropy(sk_tensor x, sk_tensor weight, sk_tensor bias, sk_tensor targets, int64_t ignore_index,
                             int mean, int gemm_type, int64_t block_rows, sk_tensor* loss);

// @module overrides: speedkit's kernels as the CUDA implementations of ATen operators (overrides.cpp)

/// The groups of ATen operators speedkit can take over, each registered and removed as one.
enum sk_override { SK_OVERRIDE_LAYER_NORM = 0, SK_OVERRIDE_COUNT = 1 };

/// Whether `which` is registered with PyTorch's dispatcher now.
int sk_override_get(int which, int* on);
/// Registers (`on`) or removes `which`; removing brings back the kernels it replaced.
int sk_override_set(int which, int on);
/// The dispatcher's table of operator `name` (e.g. "aten::native_layer_norm", overload ""): which
/// kernel each dispatch key runs and where it was registered.
int sk_dispatcher_table(const char* name, const char* overload, const char** out);

// @module custom_overrides: a user's Rust kernel as an ATen operator's implementation under one dispatch key (custom_overrides.cpp)

/// The dispatch keys a Rust kernel may be registered under.
enum sk_dispatch_key {
  SK_DISPATCH_CPU = 0,
  SK_DISPATCH_CUDA = 1,
  SK_DISPATCH_AUTOCAST_CPU = 2,
  SK_DISPATCH_AUTOCAST_CUDA = 3
};

/// The kinds of an operator call's argument, as a Rust kernel reads them.
enum sk_value_kind {
  SK_VALUE_NONE = 0,
  SK_VALUE_TENSOR = 1,
  SK_VALUE_INT = 2,
  SK_VALUE_DOUBLE = 3,
  SK_VALUE_BOOL = 4,
  SK_VALUE_INTS = 5,
  SK_VALUE_STRING = 6,
  SK_VALUE_OTHER = 7,
  SK_VALUE_BOOLS = 8
};

/// One argument of an operator call, borrowed for the callback: its schema name, and its value by
/// `kind` (a tensor; an int, also a ScalarType's code; a double; a bool as 0/1; an int list; a
/// string; a bool list, `bools` of 0/1 bytes; for SK_VALUE_OTHER, `text` names the type).
typedef struct sk_override_arg {
  const char* name;
  int kind;
  sk_tensor tensor;
  int64_t int_value;
  double double_value;
  const int64_t* ints;
  int64_t n_ints;
  const char* text;
  const uint8_t* bools;
  int64_t n_bools;
} sk_override_arg;

/// A Rust kernel's call: hands back the operator's results through sk_override_call_set_results,
/// or declines through sk_override_call_decline (the kernel it replaced runs); 0 on success, else
/// non-zero after sk_override_call_fail. `call` is valid for this call only.
typedef int (*sk_override_kernel_fn)(void* state, void* call, const sk_override_arg* args, int64_t n);
/// Frees the Rust state when its registration is removed.
typedef void (*sk_override_drop_fn)(void* state);

/// A Rust kernel's callbacks.
typedef struct sk_override_vtable {
  sk_override_kernel_fn kernel;
  sk_override_drop_fn drop;
} sk_override_vtable;

/// Registers `vtable`'s kernel as operator `name` (e.g. "aten::gelu", overload "") under `key`,
/// recorded by the dispatcher as registered at `file`:`line`; *registration is its handle for
/// sk_custom_override_remove. `state` belongs to the registration from here on, also when this
/// fails. Refused for in-place and out= operators, operators returning anything but tensors, and
/// composite operators under a backend key.
int sk_custom_override_register(const char* name, const char* overload, int key, const char* file, int line,
                                const sk_override_vtable* vtable, void* state, void** registration);
/// Removes a registration, which brings back the kernel it replaced and frees its Rust state.
int sk_custom_override_remove(void* registration);
/// In a kernel: the operator's results, one per return of its schema.
int sk_override_call_set_results(void* call, const sk_tensor* results, int64_t n);
/// In a kernel: runs the kernel this one replaced instead.
int sk_override_call_decline(void* call);
/// In a kernel: why it failed.
int sk_override_call_fail(void* call, const char* message);

// @module bias_gelu: bias + tanh-GELU in one kernel, else ATen's (bias_gelu.cpp)

/// *y = gelu_tanh(h + bias) over the last dimension, in h's type. Differentiable.
int sk_bias_gelu(sk_tensor h, sk_tensor bias, sk_tensor* y);

// @module column_sums: a bias's gradient as speedkit's own operator, speedkit::column_sums (column_sums.cpp)

/// *out = the sum of x over every dimension but the last, [x.size(-1)] of scalar type `dtype` (fp32
/// accumulation), through the dispatcher: speedkit's kernel on CUDA, ATen's sum elsewhere.
int sk_column_sums(sk_tensor x, int dtype, sk_tensor* out);

// @module embedding: token + position embedding in one kernel, else ATen's (embedding.cpp)

/// *out = table[tokens] (+ positions[t] for tokens [batch, seq]), in the table's type.
/// Differentiable in the table and the positions.
int sk_embedding(sk_tensor tokens, sk_tensor table, sk_tensor positions, sk_tensor* out);
int sk_embedding_unsupported(sk_tensor tokens, sk_tensor table, sk_tensor positions, const char** reason);

// @module linear: Linear with speedkit's cheaper backward, else ATen's (linear.cpp)

/// *y = x Wᵀ + b over x's last dimension, in the autocast type where autocast is on for x's
/// device. bias may be NULL. Differentiable once on the kernel path.
int sk_linear(sk_tensor x, sk_tensor weight, sk_tensor bias, sk_tensor* y);
/// As sk_linear, the GEMMs in `gemm_type` (a ScalarType code) whatever autocast says, every operand
/// cast to it as autocast casts them (the weight's and bias's copies kept across steps): what
/// autocast's linear runs, from its override (Override::Linear), where autocast is off.
int sk_linear_in(sk_tensor x, sk_tensor weight, sk_tensor bias, int gemm_type, sk_tensor* y);
/// As sk_linear, the output as `chunks` equal blocks of its last dimension, y[0..chunks).
int sk_linear_chunks(sk_tensor x, sk_tensor weight, sk_tensor bias, int64_t chunks, sk_tensor* y);
/// Forgets the casts of activations this thread's linears remembered to share among the linears
/// that read one unchanged input: after a backward their sources are gone, and the casts would
/// otherwise stay allocated until the thread's next linear.
int sk_linear_forget_input_casts(void);

// @module convolution: convolution under autocast without a kept copy of the weight, else ATen's (convolution.cpp)

/// *y = the convolution of x [N, C, ...] by weight [out, C / groups, ...] (+ bias, which may be
/// NULL) over `spatial_dims` dimensions with `stride`, `padding` and `dilation` (each
/// `spatial_dims` long) and `groups`, in the scalar type `scalar_type`. Its backward casts the weight
/// again instead of keeping the forward's copy.
int sk_convolution(sk_tensor x, sk_tensor weight, sk_tensor bias, const int64_t* stride, const int64_t* padding,
                   const int64_t* dilation, int64_t spatial_dims, int64_t groups, int scalar_type, sk_tensor* y);
/// What the cuDNN plans of speedkit's convolutions (conv_plans.cpp) did in this process: *timed
/// plans chosen by timing cuDNN's candidates (*timing_seconds spent on it), *from_disk built from
/// choices an earlier run kept in the kernel cache (*building_seconds spent on it), *to_aten
/// convolutions left to ATen's because no plan could be had (one first met during a CUDA-graph
/// capture, or no candidate ran).
int sk_conv_plans_counts(int64_t* timed, double* timing_seconds, int64_t* from_disk, double* building_seconds,
                         int64_t* to_aten);
/// Sets whether speedkit's convolutions run only plans chosen earlier (this process's or the kernel
/// cache's), timing nothing and leaving the rest to ATen, whatever cudnn.benchmark says (on != 0),
/// or choose as usual (on == 0). Returns the previous setting (1 or 0).
int sk_conv_plans_kept_only(int on);
/// What speedkit's depthwise kernels (depthwise_conv.cpp) took in this process: of the depthwise
/// convolutions' passes (forward or input gradient, one set of shapes) timed against the plans' or
/// ATen's path, *on_kernels ran faster on speedkit's kernel, *left on the other path; *kernel_runs
/// passes ran on speedkit's kernel, however chosen.
int sk_depthwise_conv_counts(int64_t* on_kernels, int64_t* left, int64_t* kernel_runs);
/// Sets how those passes choose their kernel from now on: 0 timed once per problem (the default),
/// 1 speedkit's kernel, 2 the plans' or ATen's, both untimed. Returns the previous setting, or -1
/// (and changes nothing) for another value.
int sk_depthwise_conv_choose(int choice);

// @module mlp: the transformer MLP on cuBLASLt epilogues, else ATen's (cublaslt.cpp)

/// *y = fc2(gelu_tanh(fc1(x))) with the GEMMs in the autocast type; differentiable.
int sk_mlp(sk_tensor x, sk_tensor w1, sk_tensor b1, sk_tensor w2, sk_tensor b2, sk_tensor* y);
int sk_mlp_unsupported(sk_tensor x, sk_tensor w1, sk_tensor b1, sk_tensor w2, sk_tensor b2, const char** reason);
/// Sets the mask of the backward's epilogues (cublaslt.cpp's Fusion bits); *previous the old one.
int sk_mlp_set_backward_fusion(int mask, int* previous);

// @module fp8: FP8 GEMMs through _scaled_mm and the fused casts (fp8.cpp)

/// The options of sk_fp8_linear.
enum sk_fp8_option { SK_FP8_ROWWISE = 4, SK_FP8_E4M3_GRADIENTS = 8 };

/// The FP8 formats of sk_fp8_quantize.
enum sk_fp8_format { SK_FP8_E4M3 = 0, SK_FP8_E5M2 = 1 };

/// x Wᵀ + b with FP8 GEMMs, the output in `out_dtype` (a ScalarType code). The histories (fp32,
/// 1-d) of x, W and the output gradient for the delayed recipe, else all NULL. Differentiable.
int sk_fp8_linear(sk_tensor x, sk_tensor weight, sk_tensor bias, sk_tensor x_history, sk_tensor w_history,
                  sk_tensor g_history, int out_dtype, int options, sk_tensor* out);
/// The delayed recipe's amax histories (fp32, [3, length]: x, W, the output gradient) of a layer that
/// keeps none of its own (a tch layer), kept per `weight` for as long as it lives: zeros at first,
/// the same tensor at every later call with the same length (a CUDA graph replays into it).
int sk_fp8_weight_histories(sk_tensor weight, int64_t length, sk_tensor* out);
/// Drops the histories of weights that no longer exist (`all`: every history); *freed: how many.
int sk_fp8_weight_histories_release(int all, int64_t* freed);
/// t (2-d) in FP8 `format`, scaled per tensor (from `history` when given) or, with `rowwise`, per
/// row; with `transpose` also tᵀ in FP8 (else *transposed = NULL). On the kernels where the kernel
/// switch allows and they take t, else on ATen's ops (the same bytes).
int sk_fp8_quantize(sk_tensor t, int format, sk_tensor history, int rowwise, int transpose, sk_tensor* data,
                    sk_tensor* transposed, sk_tensor* inverse_scale, sk_tensor* transposed_inverse_scale);

// @module interposer: a step's operator calls below autograd, recorded or replaced by fused kernels (interposer.cpp)

/// Launches fused group `group`'s kernel on `args` (its arguments' tensors, in the order they were
/// added); 0 on success, else non-zero with the reason in `message` (NUL-terminated, at most
/// `capacity` bytes).
typedef int (*sk_interposer_launch_fn)(void* state, int64_t group, const sk_tensor* args, int64_t n, char* message,
                                       int64_t capacity);
/// Frees the state when its program is freed.
typedef void (*sk_interposer_release_fn)(void* state);

/// A program's callbacks.
typedef struct sk_interposer_vtable {
  sk_interposer_launch_fn launch;
  sk_interposer_release_fn release;
} sk_interposer_vtable;

/// An empty program for `device` (-1: the CPU); `state` belongs to it from here on, also when this
/// fails.
int sk_interposer_program_new(int device, const sk_interposer_vtable* vtable, void* state, void** out);
/// Appends the next call: `op` its operator's name ("aten::mul", checked when the call comes);
/// `group` the fused group it belongs to, or -1 (ATen runs it); `computed`: the group's kernel
/// computes its outputs, and ATen's kernel does not run; `launch`: the group's kernel launches
/// once this call returns; `span`: the calls it makes when ATen runs it, itself included.
int sk_interposer_program_add_call(void* program, const char* op, int64_t group, int computed, int launch,
                                   int64_t span);
/// Appends the layout of the next output of computed call `call`: its ScalarType code, sizes and
/// strides (`ndim` of each), as the trace saw them; `unwritten`: no kernel writes or reads its
/// memory (an intermediate of its group), so the call may hand it out without memory.
int sk_interposer_program_add_output(void* program, int64_t call, int scalar_type, const int64_t* sizes,
                                     const int64_t* strides, int64_t ndim, int unwritten);
/// After a recording: makes the kept copies (weight_casts.cpp) of the parameters that its calls
/// `calls` (`n` of them) cast to bf16 or fp16, so that the program that serves those casts finds
/// them current; a call that cast no parameter is passed over.
int sk_interposer_keep_copies(void* session, const int64_t* calls, int64_t n);
/// Serves call `call`, a `_to_copy` left to ATen, from its input's kept copy where it is an fp32
/// parameter cast to bf16 or fp16 in its own layout (weight_casts.cpp): no kernel where the copy is
/// current, and the session fails at its end where the step left such a copy stale.
int sk_interposer_program_keep_copy(void* program, int64_t call);
/// Defers result `output` of computed call `call`: the call returns a tensor with no memory yet
/// (as sk_deferred_new), which group `group`'s kernel writes when it is first read, on the
/// arguments added for that group (its inputs, captured as their calls come and held until then;
/// the tensor itself comes last). How a result only the backward reads is recomputed there
/// instead of saved.
int sk_interposer_program_defer(void* program, int64_t call, int32_t output, int64_t group);
/// Appends an argument of group `group`'s kernel: argument (`output` 0) or result (`output` 1)
/// `index` of call `call`; of an argument that is a list of tensors, its element `element` (-1: the
/// argument is one tensor).
int sk_interposer_program_add_arg(void* program, int64_t group, int64_t call, int output, int32_t index,
                                  int32_t element);
/// Frees a program (no session may be running it).
void sk_interposer_program_free(void* program);

/// Starts a session on this thread (and the threads autograd runs its backward on): with `program`
/// NULL it records every operator call; else it runs the program. One session at a time per
/// process; `*out` receives it.
int sk_interposer_begin(void* program, void** out);
/// Ends the session on the thread it began on: the dispatcher and the thread's keys as before.
int sk_interposer_end(void* session);
/// The calls a recording saw.
int sk_interposer_recorded_count(void* session, int64_t* out);
/// Call `index` of a recording: its operator, the RecordFunction handle of the call (0 where none
/// was seen; the execution trace's `rf_id`), and its span (the calls it made, itself included).
int sk_interposer_recorded_get(void* session, int64_t index, const char** op, uint64_t* rf_id, int64_t* span);
/// Why a program's run left it ("": it did not): the step departed from the program, or a launch
/// failed. From there every call ran ATen's kernel, so the step's results are not to be used.
int sk_interposer_failure(void* session, const char** out);
/// Whether a session is running in this process.
int sk_interposer_active(int* out);
/// Frees a session, ending it first if it still runs.
void sk_interposer_free(void* session);

// @module random: the CUDA generator's Philox state for generated kernels that draw dropout's numbers (random.cpp)

/// A stretch of the current device's default CUDA generator reserved for one dropout: the Philox
/// seed and counter offset (each a device pointer to the value where `captured`, inside a CUDA-graph
/// capture, the offset then plus `intragraph`), and the threads of the grid ATen's dropout kernel
/// runs, whose draws a generated kernel reproduces.
typedef struct sk_philox_draw {
  uint64_t seed;
  uint64_t offset;
  uint64_t intragraph;
  uint32_t threads;
  int32_t captured;
} sk_philox_draw;

/// Reserves what ATen's dropout of `numel` elements reserves of the default CUDA generator.
int sk_dropout_philox_draw(int64_t numel, sk_philox_draw* out);

// @module saved_offload: saved tensors parked in host memory during eager steps (saved_offload.cpp)

/// Starts a session on this thread: the tensors autograd saves for the backward, of storages of at
/// least `min_bytes`, move to host memory (pinned, for CUDA) once nothing but their saved variables
/// holds them, and back when the backward reads them; each pack and unpack is marked in the
/// execution trace. Autograd's default engine is speedkit's until sk_saved_offload_end. Fails while
/// another session runs, or where the default engine is not libtorch's own (a Python process's).
int sk_saved_offload_begin(int64_t min_bytes, void** out);
/// Ends the session and frees its handle; libtorch's engine is the default again. Tensors saved
/// before stay where they are and come back when read. *parked receives how many storages it
/// moved to the host, *parked_bytes their bytes.
int sk_saved_offload_end(void* session, int64_t* parked, int64_t* parked_bytes);
/// Whether autograd's default engine is speedkit's (a session runs).
int sk_saved_offload_active(int* out);
/// Unpins the host memory that sessions parked CUDA tensors in (at once where no parked tensor
/// still holds some, otherwise when the last one is read or freed); nothing where none was pinned.
int sk_saved_offload_release_host_cache(void);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // SPEEDKIT_SHIM_SPEEDKIT_H
