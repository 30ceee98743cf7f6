//! The whole FFI surface of speedkit: the C ABI of the shim (`shim/*.cpp`), and thin safe wrappers
//! that turn its status codes into [`SpeedkitError::Torch`].
//!
//! Nothing outside this module calls into C++. Every shim function catches C++ exceptions, so a
//! failure here is an ordinary `Err`, never an abort.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;

use tch::Tensor;
use torch_sys::C_tensor;

use crate::error::SpeedkitError;

#[repr(C)]
pub(crate) struct RawVersions {
    pub torch_major: c_int,
    pub torch_minor: c_int,
    pub torch_patch: c_int,
    pub built_with_cuda: c_int,
    pub cuda_runtime: i64,
    pub cudnn: i64,
}

#[repr(C)]
pub(crate) struct RawDeviceProps {
    pub name: [c_char; 256],
    pub major: c_int,
    pub minor: c_int,
    pub multiprocessors: c_int,
    pub total_memory: i64,
    pub l2_cache_bytes: i64,
}

extern "C" {
    fn sk_last_error() -> *const c_char;

    fn sk_flag_get_bool(flag: c_int, out: *mut c_int) -> c_int;
    fn sk_flag_set_bool(flag: c_int, value: c_int) -> c_int;
    fn sk_matmul_precision_get(out: *mut c_int) -> c_int;
    fn sk_matmul_precision_set(value: c_int) -> c_int;
    fn sk_flag_restore_bool(flag: c_int, value: c_int) -> c_int;
    fn sk_matmul_precision_restore(value: c_int) -> c_int;
    fn sk_fp32_precision_get(which: c_int, out: *mut c_int) -> c_int;
    fn sk_fp32_precision_set(which: c_int, value: c_int) -> c_int;
    fn sk_test_fail_nth_flag_write(n: c_int);

    fn sk_fp8_linear(
        x: *mut C_tensor,
        weight: *mut C_tensor,
        bias: *mut C_tensor,
        x_history: *mut C_tensor,
        w_history: *mut C_tensor,
        g_history: *mut C_tensor,
        out_dtype: c_int,
        options: c_int,
        out: *mut *mut C_tensor,
        casts_on_kernels: *mut c_int,
    ) -> c_int;
    fn sk_fp8_quantize(
        t: *mut C_tensor,
        format: c_int,
        history: *mut C_tensor,
        rowwise: c_int,
        transpose: c_int,
        use_kernels: c_int,
        data: *mut *mut C_tensor,
        transposed: *mut *mut C_tensor,
        inverse_scale: *mut *mut C_tensor,
        transposed_inverse_scale: *mut *mut C_tensor,
        reason: *mut c_char,
        capacity: c_int,
    ) -> c_int;

    fn sk_autocast_get(device_type: c_int, enabled: *mut c_int, dtype: *mut c_int) -> c_int;
    fn sk_autocast_set(device_type: c_int, enabled: c_int, dtype: c_int) -> c_int;
    fn sk_autocast_increment_nesting(depth: *mut c_int) -> c_int;
    fn sk_autocast_decrement_nesting(depth: *mut c_int) -> c_int;
    fn sk_autocast_clear_cache() -> c_int;

    fn sk_versions_get(out: *mut RawVersions) -> c_int;
    fn sk_cuda_device_count(out: *mut c_int) -> c_int;
    fn sk_cuda_device_props(index: c_int, out: *mut RawDeviceProps) -> c_int;
    fn sk_cuda_memory_stats(
        index: c_int,
        allocated: *mut i64,
        peak: *mut i64,
        reserved: *mut i64,
    ) -> c_int;
    fn sk_cuda_reset_peak_memory(index: c_int) -> c_int;
    fn sk_cuda_peak_reserved_memory(index: c_int, out: *mut i64) -> c_int;
    fn sk_cuda_empty_cache() -> c_int;

    fn sk_cuda_event_new(out: *mut *mut c_void) -> c_int;
    fn sk_cuda_event_record(event: *mut c_void) -> c_int;
    fn sk_cuda_event_elapsed_ms(start: *mut c_void, end: *mut c_void, out: *mut f64) -> c_int;
    fn sk_cuda_event_free(event: *mut c_void);
    fn sk_cuda_synchronize(index: c_int) -> c_int;
    fn sk_cuda_side_stream_enter(index: c_int, out: *mut *mut c_void) -> c_int;
    fn sk_cuda_side_stream_exit(handle: *mut c_void) -> c_int;

    fn sk_cuda_graph_pool_handle(first: *mut u64, second: *mut u64) -> c_int;
    fn sk_cuda_graph_new(out: *mut *mut c_void) -> c_int;
    fn sk_cuda_graph_capture_begin(graph: *mut c_void, pool_first: u64, pool_second: u64) -> c_int;
    fn sk_cuda_graph_capture_end(graph: *mut c_void) -> c_int;
    fn sk_cuda_graph_replay(graph: *mut c_void) -> c_int;
    fn sk_cuda_graph_free(graph: *mut c_void);

    fn sk_amp_unscale_(
        grads: *const *mut C_tensor,
        n: i64,
        found_inf: *mut C_tensor,
        inv_scale: *mut C_tensor,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn sk_fused_adamw_(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        steps: *const *mut C_tensor,
        n: i64,
        lr: *mut C_tensor,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        grad_scale: *mut C_tensor,
        found_inf: *mut C_tensor,
        every_param_on_kernel: c_int,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn sk_foreach_adamw_(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        steps: *const *mut C_tensor,
        n: i64,
        lr: *mut C_tensor,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
    ) -> c_int;
    fn sk_foreach_zero_(tensors: *const *mut C_tensor, n: i64) -> c_int;
    fn sk_clear_grads(tensors: *const *mut C_tensor, n: i64) -> c_int;
    fn sk_set_grads(params: *const *mut C_tensor, grads: *const *mut C_tensor, n: i64) -> c_int;
    fn sk_foreach_norm(
        tensors: *const *mut C_tensor,
        n: i64,
        ord: f64,
        out: *mut *mut C_tensor,
    ) -> c_int;
    fn sk_foreach_mul_scalar_tensor_(
        tensors: *const *mut C_tensor,
        n: i64,
        factor: *mut C_tensor,
    ) -> c_int;
    fn sk_to_channels_last_(tensor: *mut C_tensor) -> c_int;
    fn sk_is_channels_last(tensor: *mut C_tensor, out: *mut c_int) -> c_int;

    fn sk_kernel_source_count(out: *mut c_int) -> c_int;
    fn sk_kernel_source_name(index: c_int, out: *mut *const c_char) -> c_int;
    fn sk_kernel_compile(index: c_int, major: c_int, minor: c_int, cubin_bytes: *mut i64) -> c_int;
    fn sk_nvrtc_version(out: *mut c_int) -> c_int;
    fn sk_kernels_unavailable_reason(index: c_int, reason: *mut c_char, capacity: c_int) -> c_int;

    fn sk_layer_norm_width_supported(index: c_int, width: i64, out: *mut c_int) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn sk_layer_norm(
        x: *mut C_tensor,
        residual: *mut C_tensor,
        weight: *mut C_tensor,
        bias: *mut C_tensor,
        eps: f64,
        out_type: c_int,
        keep_input: c_int,
        y: *mut *mut C_tensor,
        sum: *mut *mut C_tensor,
    ) -> c_int;
    fn sk_cross_entropy(
        logits: *mut C_tensor,
        targets: *mut C_tensor,
        ignore_index: i64,
        loss: *mut *mut C_tensor,
    ) -> c_int;
    fn sk_bias_gelu(h: *mut C_tensor, bias: *mut C_tensor, y: *mut *mut C_tensor) -> c_int;
    fn sk_embedding(
        tokens: *mut C_tensor,
        table: *mut C_tensor,
        positions: *mut C_tensor,
        out: *mut *mut C_tensor,
    ) -> c_int;
    fn sk_linear(
        x: *mut C_tensor,
        weight: *mut C_tensor,
        bias: *mut C_tensor,
        y: *mut *mut C_tensor,
    ) -> c_int;
    fn sk_linear_chunks(
        x: *mut C_tensor,
        weight: *mut C_tensor,
        bias: *mut C_tensor,
        chunks: i64,
        y: *mut *mut C_tensor,
    ) -> c_int;
    fn sk_mlp(
        x: *mut C_tensor,
        w1: *mut C_tensor,
        b1: *mut C_tensor,
        w2: *mut C_tensor,
        b2: *mut C_tensor,
        compute_type: c_int,
        y: *mut *mut C_tensor,
    ) -> c_int;
    fn sk_mlp_take_notes(out: *mut *const c_char) -> c_int;
    fn sk_mlp_set_backward_fusion(mask: c_int, previous: *mut c_int) -> c_int;
}

/// Turns a shim status into a `Result`, fetching the C++ message on failure.
fn check(status: c_int) -> Result<(), SpeedkitError> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: the shim returns a pointer into its thread-local error string, valid until the next
    // failing call on this thread; we copy it out at once.
    let message = unsafe { CStr::from_ptr(sk_last_error()) }
        .to_string_lossy()
        .into_owned();
    Err(SpeedkitError::Torch(message))
}

/// The shim's handles for tensors (`at::Tensor*`), borrowed for the duration of one call. The shim
/// only reads or mutates the tensors in place; it never frees a handle it did not allocate.
fn handles(tensors: &[Tensor]) -> Vec<*mut C_tensor> {
    tensors
        .iter()
        .map(|t| t.as_ptr() as *mut C_tensor)
        .collect()
}

fn handle(tensor: &Tensor) -> *mut C_tensor {
    tensor.as_ptr() as *mut C_tensor
}

// ----- flags -------------------------------------------------------------------------------------

pub(crate) fn flag_get_bool(id: i32) -> Result<bool, SpeedkitError> {
    let mut out = 0;
    // SAFETY: `out` is a valid pointer for the call.
    check(unsafe { sk_flag_get_bool(id, &mut out) })?;
    Ok(out != 0)
}

pub(crate) fn flag_set_bool(id: i32, value: bool) -> Result<(), SpeedkitError> {
    // SAFETY: plain values only.
    check(unsafe { sk_flag_set_bool(id, c_int::from(value)) })
}

/// 0 = highest, 1 = high, 2 = medium.
pub(crate) fn matmul_precision_get() -> Result<i32, SpeedkitError> {
    let mut out = 0;
    // SAFETY: `out` is a valid pointer for the call.
    check(unsafe { sk_matmul_precision_get(&mut out) })?;
    Ok(out)
}

pub(crate) fn matmul_precision_set(value: i32) -> Result<(), SpeedkitError> {
    // SAFETY: plain values only; the shim range-checks.
    check(unsafe { sk_matmul_precision_set(value) })
}

/// Writes only the flag's own field (for restoring a captured state).
pub(crate) fn flag_restore_bool(id: i32, value: bool) -> Result<(), SpeedkitError> {
    // SAFETY: plain values only.
    check(unsafe { sk_flag_restore_bool(id, c_int::from(value)) })
}

/// Writes only the legacy matmul-precision field (for restoring a captured state).
pub(crate) fn matmul_precision_restore(value: i32) -> Result<(), SpeedkitError> {
    // SAFETY: plain values only; the shim range-checks.
    check(unsafe { sk_matmul_precision_restore(value) })
}

/// One entry of the per-backend fp32 precision table: 0 = none, 1 = ieee, 2 = tf32, 3 = bf16.
pub(crate) fn fp32_precision_get(which: i32) -> Result<i32, SpeedkitError> {
    let mut out = 0;
    // SAFETY: `out` is a valid pointer for the call.
    check(unsafe { sk_fp32_precision_get(which, &mut out) })?;
    Ok(out)
}

pub(crate) fn fp32_precision_set(which: i32, value: i32) -> Result<(), SpeedkitError> {
    // SAFETY: plain values only; the shim range-checks.
    check(unsafe { sk_fp32_precision_set(which, value) })
}

/// Makes the `n`-th flag write from now fail once (0 turns the fault off). Test-only.
pub(crate) fn fail_nth_flag_write(n: u32) {
    let n = c_int::try_from(n).unwrap_or(c_int::MAX);
    // SAFETY: plain value; the shim stores it in an atomic.
    unsafe { sk_test_fail_nth_flag_write(n) }
}

// ----- autocast ----------------------------------------------------------------------------------

/// (enabled, ScalarType code) for a c10::DeviceType code.
pub(crate) fn autocast_get(device_type: i32) -> Result<(bool, i32), SpeedkitError> {
    let (mut enabled, mut dtype) = (0, 0);
    // SAFETY: both out-pointers are valid for the call.
    check(unsafe { sk_autocast_get(device_type, &mut enabled, &mut dtype) })?;
    Ok((enabled != 0, dtype))
}

pub(crate) fn autocast_set(
    device_type: i32,
    enabled: bool,
    dtype: i32,
) -> Result<(), SpeedkitError> {
    // SAFETY: plain values only.
    check(unsafe { sk_autocast_set(device_type, c_int::from(enabled), dtype) })
}

pub(crate) fn autocast_increment_nesting() -> Result<i32, SpeedkitError> {
    let mut depth = 0;
    // SAFETY: `depth` is valid for the call.
    check(unsafe { sk_autocast_increment_nesting(&mut depth) })?;
    Ok(depth)
}

pub(crate) fn autocast_decrement_nesting() -> Result<i32, SpeedkitError> {
    let mut depth = 0;
    // SAFETY: `depth` is valid for the call.
    check(unsafe { sk_autocast_decrement_nesting(&mut depth) })?;
    Ok(depth)
}

pub(crate) fn autocast_clear_cache() -> Result<(), SpeedkitError> {
    // SAFETY: no arguments.
    check(unsafe { sk_autocast_clear_cache() })
}

// ----- versions, devices, memory -----------------------------------------------------------------

pub(crate) fn versions() -> Result<RawVersions, SpeedkitError> {
    let mut out = RawVersions {
        torch_major: 0,
        torch_minor: 0,
        torch_patch: 0,
        built_with_cuda: 0,
        cuda_runtime: 0,
        cudnn: 0,
    };
    // SAFETY: `out` is a valid, correctly laid out struct (repr(C), mirrors sk_versions).
    check(unsafe { sk_versions_get(&mut out) })?;
    Ok(out)
}

pub(crate) fn cuda_device_count() -> Result<usize, SpeedkitError> {
    let mut out = 0;
    // SAFETY: `out` is valid for the call.
    check(unsafe { sk_cuda_device_count(&mut out) })?;
    Ok(usize::try_from(out).unwrap_or(0))
}

pub(crate) fn cuda_device_props(index: usize) -> Result<RawDeviceProps, SpeedkitError> {
    let mut out = RawDeviceProps {
        name: [0; 256],
        major: 0,
        minor: 0,
        multiprocessors: 0,
        total_memory: 0,
        l2_cache_bytes: 0,
    };
    let index =
        c_int::try_from(index).map_err(|_| SpeedkitError::Torch("bad device index".into()))?;
    // SAFETY: `out` mirrors sk_device_props; the shim NUL-terminates `name`.
    check(unsafe { sk_cuda_device_props(index, &mut out) })?;
    Ok(out)
}

/// (allocated, peak allocated since reset, reserved) bytes of the caching allocator.
pub(crate) fn cuda_memory_stats(index: usize) -> Result<(u64, u64, u64), SpeedkitError> {
    let (mut allocated, mut peak, mut reserved) = (0i64, 0i64, 0i64);
    // SAFETY: out-pointers valid for the call.
    check(unsafe {
        sk_cuda_memory_stats(index as c_int, &mut allocated, &mut peak, &mut reserved)
    })?;
    Ok((
        allocated.max(0) as u64,
        peak.max(0) as u64,
        reserved.max(0) as u64,
    ))
}

pub(crate) fn cuda_reset_peak_memory(index: usize) -> Result<(), SpeedkitError> {
    // SAFETY: plain value.
    check(unsafe { sk_cuda_reset_peak_memory(index as c_int) })
}

/// Peak bytes reserved by the caching allocator since the last reset.
pub(crate) fn cuda_peak_reserved_memory(index: usize) -> Result<u64, SpeedkitError> {
    let mut peak = 0i64;
    // SAFETY: out-pointer valid for the call.
    check(unsafe { sk_cuda_peak_reserved_memory(index as c_int, &mut peak) })?;
    Ok(peak.max(0) as u64)
}

/// Gives the caching allocator's unused blocks back to the driver.
pub(crate) fn cuda_empty_cache() -> Result<(), SpeedkitError> {
    // SAFETY: no arguments.
    check(unsafe { sk_cuda_empty_cache() })
}

pub(crate) fn cuda_synchronize(index: usize) -> Result<(), SpeedkitError> {
    // SAFETY: plain value.
    check(unsafe { sk_cuda_synchronize(index as c_int) })
}

// ----- owned CUDA objects ------------------------------------------------------------------------

/// A CUDA event with timing enabled, recorded on the current stream.
pub(crate) struct CudaEvent(*mut c_void);

impl CudaEvent {
    pub(crate) fn new() -> Result<Self, SpeedkitError> {
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` receives a heap object we own and free in Drop.
        check(unsafe { sk_cuda_event_new(&mut raw) })?;
        Ok(Self(raw))
    }

    pub(crate) fn record(&self) -> Result<(), SpeedkitError> {
        // SAFETY: self.0 is a live event created by sk_cuda_event_new.
        check(unsafe { sk_cuda_event_record(self.0) })
    }

    /// Milliseconds between `self` and `end` (waits for `end` to complete).
    pub(crate) fn elapsed_ms(&self, end: &CudaEvent) -> Result<f64, SpeedkitError> {
        let mut out = 0.0;
        // SAFETY: both events are live; `out` valid.
        check(unsafe { sk_cuda_event_elapsed_ms(self.0, end.0, &mut out) })?;
        Ok(out)
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: created by sk_cuda_event_new, freed exactly once.
        unsafe { sk_cuda_event_free(self.0) }
    }
}

/// A side stream made current until [`SideStream::exit`] (or drop): ordered after the work already
/// queued, and the previous stream waits for it on exit.
pub(crate) struct SideStream(*mut c_void);

impl SideStream {
    pub(crate) fn enter(device_index: usize) -> Result<Self, SpeedkitError> {
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` receives a heap object freed by sk_cuda_side_stream_exit.
        check(unsafe { sk_cuda_side_stream_enter(device_index as c_int, &mut raw) })?;
        Ok(Self(raw))
    }

    pub(crate) fn exit(mut self) -> Result<(), SpeedkitError> {
        let raw = std::mem::replace(&mut self.0, ptr::null_mut());
        // SAFETY: raw came from sk_cuda_side_stream_enter; exit frees it.
        check(unsafe { sk_cuda_side_stream_exit(raw) })
    }
}

impl Drop for SideStream {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: as in `exit`; on this path (unwinding) the status has no one to go to.
            let _ = unsafe { sk_cuda_side_stream_exit(self.0) };
        }
    }
}

/// Identifies a memory pool of the caching allocator shared by several graphs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GraphPool(u64, u64);

impl GraphPool {
    pub(crate) fn new() -> Result<Self, SpeedkitError> {
        let (mut a, mut b) = (0, 0);
        // SAFETY: out-pointers valid for the call.
        check(unsafe { sk_cuda_graph_pool_handle(&mut a, &mut b) })?;
        Ok(Self(a, b))
    }
}

/// An `at::cuda::CUDAGraph`.
pub(crate) struct CudaGraph(*mut c_void);

impl CudaGraph {
    pub(crate) fn new() -> Result<Self, SpeedkitError> {
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` receives a heap object we own and free in Drop.
        check(unsafe { sk_cuda_graph_new(&mut raw) })?;
        Ok(Self(raw))
    }

    pub(crate) fn capture_begin(&mut self, pool: GraphPool) -> Result<(), SpeedkitError> {
        // SAFETY: live graph.
        check(unsafe { sk_cuda_graph_capture_begin(self.0, pool.0, pool.1) })
    }

    pub(crate) fn capture_end(&mut self) -> Result<(), SpeedkitError> {
        // SAFETY: live graph.
        check(unsafe { sk_cuda_graph_capture_end(self.0) })
    }

    pub(crate) fn replay(&self) -> Result<(), SpeedkitError> {
        // SAFETY: live graph.
        check(unsafe { sk_cuda_graph_replay(self.0) })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: created by sk_cuda_graph_new, freed exactly once.
        unsafe { sk_cuda_graph_free(self.0) }
    }
}

// ----- tensor-list ops ---------------------------------------------------------------------------

pub(crate) fn amp_unscale_(
    grads: &[Tensor],
    found_inf: &Tensor,
    inv_scale: &Tensor,
) -> Result<(), SpeedkitError> {
    let g = handles(grads);
    // SAFETY: every handle is a live tensor borrowed for the call.
    check(unsafe {
        sk_amp_unscale_(
            g.as_ptr(),
            g.len() as i64,
            handle(found_inf),
            handle(inv_scale),
        )
    })
}

/// Borrowed tensor lists of one AdamW bucket (same device and dtype).
pub(crate) struct AdamWLists<'a> {
    pub params: &'a [Tensor],
    pub grads: &'a [Tensor],
    pub exp_avgs: &'a [Tensor],
    pub exp_avg_sqs: &'a [Tensor],
    pub steps: &'a [Tensor],
}

/// Hyper-parameters of one AdamW update.
pub(crate) struct AdamWHyper<'a> {
    pub lr: &'a Tensor,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

fn check_lists(l: &AdamWLists<'_>) -> Result<usize, SpeedkitError> {
    let n = l.params.len();
    if [
        l.grads.len(),
        l.exp_avgs.len(),
        l.exp_avg_sqs.len(),
        l.steps.len(),
    ]
    .iter()
    .any(|&len| len != n)
    {
        return Err(SpeedkitError::Torch(
            "AdamW tensor lists differ in length".into(),
        ));
    }
    Ok(n)
}

/// `_fused_adamw_`; parameters with a kept autocast copy (and, with `every_param_on_kernel`, those
/// without one too) take speedkit's AdamW kernel instead.
pub(crate) fn fused_adamw_(
    lists: &AdamWLists<'_>,
    hyper: &AdamWHyper<'_>,
    grad_scale: Option<&Tensor>,
    found_inf: Option<&Tensor>,
    every_param_on_kernel: bool,
) -> Result<(), SpeedkitError> {
    let n = check_lists(lists)?;
    let (p, g, m, v, s) = (
        handles(lists.params),
        handles(lists.grads),
        handles(lists.exp_avgs),
        handles(lists.exp_avg_sqs),
        handles(lists.steps),
    );
    // SAFETY: all lists have n live handles; optional tensors are null or live.
    check(unsafe {
        sk_fused_adamw_(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            n as i64,
            handle(hyper.lr),
            hyper.beta1,
            hyper.beta2,
            hyper.weight_decay,
            hyper.eps,
            grad_scale.map_or(ptr::null_mut(), handle),
            found_inf.map_or(ptr::null_mut(), handle),
            c_int::from(every_param_on_kernel),
        )
    })
}

pub(crate) fn foreach_adamw_(
    lists: &AdamWLists<'_>,
    hyper: &AdamWHyper<'_>,
) -> Result<(), SpeedkitError> {
    let n = check_lists(lists)?;
    let (p, g, m, v, s) = (
        handles(lists.params),
        handles(lists.grads),
        handles(lists.exp_avgs),
        handles(lists.exp_avg_sqs),
        handles(lists.steps),
    );
    // SAFETY: all lists have n live handles.
    check(unsafe {
        sk_foreach_adamw_(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            n as i64,
            handle(hyper.lr),
            hyper.beta1,
            hyper.beta2,
            hyper.weight_decay,
            hyper.eps,
        )
    })
}

pub(crate) fn foreach_zero_(tensors: &[Tensor]) -> Result<(), SpeedkitError> {
    let t = handles(tensors);
    // SAFETY: live handles for the call.
    check(unsafe { sk_foreach_zero_(t.as_ptr(), t.len() as i64) })
}

/// Sets `grad` of every tensor to undefined (`param.grad = None`).
pub(crate) fn clear_grads(params: &[Tensor]) -> Result<(), SpeedkitError> {
    let t = handles(params);
    // SAFETY: live handles for the call.
    check(unsafe { sk_clear_grads(t.as_ptr(), t.len() as i64) })
}

/// Sets `params[i].grad = grads[i]`.
pub(crate) fn set_grads(params: &[Tensor], grads: &[Tensor]) -> Result<(), SpeedkitError> {
    if params.len() != grads.len() {
        return Err(SpeedkitError::Misuse(format!(
            "{} parameters but {} gradients",
            params.len(),
            grads.len()
        )));
    }
    let (p, g) = (handles(params), handles(grads));
    // SAFETY: live handles of equal length for the call.
    check(unsafe { sk_set_grads(p.as_ptr(), g.as_ptr(), p.len() as i64) })
}

/// The `ord`-norm of all tensors together (as `torch.nn.utils.clip_grad_norm_` computes it).
pub(crate) fn foreach_total_norm(tensors: &[Tensor], ord: f64) -> Result<Tensor, SpeedkitError> {
    let t = handles(tensors);
    let mut out = ptr::null_mut();
    // SAFETY: live handles; `out` receives a new tensor that we wrap and own.
    check(unsafe { sk_foreach_norm(t.as_ptr(), t.len() as i64, ord, &mut out) })?;
    // SAFETY: `out` is a fresh heap `at::Tensor*` from the shim.
    Ok(unsafe { Tensor::from_ptr(out) })
}

pub(crate) fn foreach_mul_(tensors: &[Tensor], factor: &Tensor) -> Result<(), SpeedkitError> {
    let t = handles(tensors);
    // SAFETY: live handles for the call.
    check(unsafe { sk_foreach_mul_scalar_tensor_(t.as_ptr(), t.len() as i64, handle(factor)) })
}

pub(crate) fn to_channels_last_(tensor: &Tensor) -> Result<(), SpeedkitError> {
    // SAFETY: live handle; set_data keeps the same parameter object.
    check(unsafe { sk_to_channels_last_(handle(tensor)) })
}

pub(crate) fn is_channels_last(tensor: &Tensor) -> Result<bool, SpeedkitError> {
    let mut out = 0;
    // SAFETY: live handle, valid out-pointer.
    check(unsafe { sk_is_channels_last(handle(tensor), &mut out) })?;
    Ok(out != 0)
}

// ----- fp8 -----------------------------------------------------------------------------------------

/// How one FP8 GEMM casts its operands (the shim's `options` bits).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Fp8LinearOptions {
    /// Cast on speedkit's kernels where they take the tensor (the caller has checked they run on
    /// the device).
    pub use_kernels: bool,
    /// One scale per row (the histories are then `None`).
    pub rowwise: bool,
    /// The output gradient in e4m3 instead of e5m2.
    pub e4m3_gradients: bool,
}

impl Fp8LinearOptions {
    fn bits(self) -> c_int {
        c_int::from(self.use_kernels)
            | (c_int::from(self.rowwise) << 2)
            | (c_int::from(self.e4m3_gradients) << 3)
    }
}

/// `x Wᵀ + b` through the shim's FP8 autograd function, and whether the forward's casts ran on
/// speedkit's kernels; `histories` (x, W, grad) for the delayed recipe, `None` for dynamic and
/// row-wise scaling. `out_dtype` is a c10 ScalarType code.
pub(crate) fn fp8_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    histories: Option<[&Tensor; 3]>,
    out_dtype: i32,
    options: Fp8LinearOptions,
) -> Result<(Tensor, bool), SpeedkitError> {
    let optional = |t: Option<&Tensor>| t.map_or(ptr::null_mut(), handle);
    let [hx, hw, hg] = histories.map_or([ptr::null_mut(); 3], |h| h.map(handle));
    let (mut out, mut on_kernels) = (ptr::null_mut(), 0);
    // SAFETY: live handles (or null where the shim accepts null); `out` receives a new tensor.
    check(unsafe {
        sk_fp8_linear(
            handle(x),
            handle(weight),
            optional(bias),
            hx,
            hw,
            hg,
            out_dtype,
            options.bits(),
            &mut out,
            &mut on_kernels,
        )
    })?;
    // SAFETY: `out` is a fresh heap `at::Tensor*` from the shim.
    Ok((unsafe { Tensor::from_ptr(out) }, on_kernels != 0))
}

/// The shim's FP8 cast of `t`.
pub(crate) struct Fp8Cast {
    pub data: Tensor,
    pub transpose: Option<Tensor>,
    pub inverse_scale: Tensor,
    pub transpose_inverse_scale: Option<Tensor>,
    /// Why the kernels did not run, or empty.
    pub why_not_kernels: String,
}

/// The shim's FP8 cast. `format` 0 = e4m3, 1 = e5m2; `history` for the delayed recipe (it records
/// t's amax); `rowwise` for one scale per row (and per row of the transpose).
pub(crate) fn fp8_quantize(
    t: &Tensor,
    format: i32,
    history: Option<&Tensor>,
    rowwise: bool,
    transpose: bool,
    use_kernels: bool,
) -> Result<Fp8Cast, SpeedkitError> {
    let (mut data, mut transposed, mut inverse, mut transposed_inverse) = (
        ptr::null_mut(),
        ptr::null_mut(),
        ptr::null_mut(),
        ptr::null_mut(),
    );
    let mut reason = [0 as c_char; 512];
    // SAFETY: live handles (history may be null); the out-pointers receive fresh tensors (the
    // transpose null when not asked for); `reason` is a writable buffer of the capacity passed.
    check(unsafe {
        sk_fp8_quantize(
            handle(t),
            format,
            history.map_or(ptr::null_mut(), handle),
            c_int::from(rowwise),
            c_int::from(transpose),
            c_int::from(use_kernels),
            &mut data,
            &mut transposed,
            &mut inverse,
            &mut transposed_inverse,
            reason.as_mut_ptr(),
            reason.len() as c_int,
        )
    })?;
    // SAFETY: fresh heap `at::Tensor*`s from the shim (null where not asked for); `reason` is
    // NUL-terminated by it.
    unsafe {
        let optional = |t: *mut C_tensor| (!t.is_null()).then(|| Tensor::from_ptr(t));
        Ok(Fp8Cast {
            data: Tensor::from_ptr(data),
            transpose: optional(transposed),
            inverse_scale: Tensor::from_ptr(inverse),
            transpose_inverse_scale: optional(transposed_inverse),
            why_not_kernels: CStr::from_ptr(reason.as_ptr())
                .to_string_lossy()
                .into_owned(),
        })
    }
}

// ----- step profiler, NVTX, autograd graph -------------------------------------------------------

#[repr(C)]
struct RawProfilerEvent {
    name: *const c_char,
    device_type: i32,
    activity_type: i32,
    start_ns: u64,
    duration_ns: u64,
    correlation_id: u64,
    thread_id: u64,
    device_resource_id: i64,
}

extern "C" {
    fn sk_profiler_start(with_cuda: c_int) -> c_int;
    fn sk_profiler_stop(out: *mut *mut c_void) -> c_int;
    fn sk_profiler_event_count(profile: *mut c_void, out: *mut i64) -> c_int;
    fn sk_profiler_event_get(profile: *mut c_void, index: i64, out: *mut RawProfilerEvent)
        -> c_int;
    fn sk_profiler_save(profile: *mut c_void, path: *const c_char) -> c_int;
    fn sk_profiler_free(profile: *mut c_void);
    fn sk_record_range_open(name: *const c_char, out: *mut *mut c_void) -> c_int;
    fn sk_record_range_close(range: *mut c_void) -> c_int;

    fn sk_nvtx_range_push(name: *const c_char);
    fn sk_nvtx_range_pop();

    fn sk_autograd_graph(root: *mut C_tensor, out: *mut *mut c_void) -> c_int;
    fn sk_autograd_graph_sizes(graph: *mut c_void, nodes: *mut i64, leaves: *mut i64) -> c_int;
    fn sk_autograd_graph_node(graph: *mut c_void, index: i64, name: *mut *const c_char) -> c_int;
    fn sk_autograd_graph_leaf(graph: *mut c_void, index: i64, id: *mut u64) -> c_int;
    fn sk_autograd_graph_free(graph: *mut c_void);
    fn sk_tensor_identity(tensor: *mut C_tensor, id: *mut u64) -> c_int;
}

fn c_string(text: &str) -> Result<std::ffi::CString, SpeedkitError> {
    std::ffi::CString::new(text)
        .map_err(|_| SpeedkitError::Misuse(format!("{text:?} contains a NUL byte")))
}

/// One event of a finished profile (times on the host clock, in ns).
#[derive(Clone, Debug)]
pub(crate) struct ProfilerEvent {
    pub name: String,
    /// c10::DeviceType: 0 = CPU, 1 = CUDA.
    pub device_type: i32,
    /// libkineto::ActivityType: 0 = CPU op, 1 = user annotation, 3 = memcpy, 4 = memset,
    /// 5 = kernel, 7 = CUDA runtime call.
    pub activity_type: i32,
    pub start_ns: u64,
    pub duration_ns: u64,
    pub thread_id: u64,
}

/// Starts libtorch's Kineto profiler on this thread (CPU ops; CUDA activity too with `with_cuda`).
pub(crate) fn profiler_start(with_cuda: bool) -> Result<(), SpeedkitError> {
    // SAFETY: plain value.
    check(unsafe { sk_profiler_start(c_int::from(with_cuda)) })
}

/// A finished Kineto profile.
pub(crate) struct ProfilerResult(*mut c_void);

impl ProfilerResult {
    /// Stops the profiler started by [`profiler_start`] and takes its result.
    pub(crate) fn stop() -> Result<Self, SpeedkitError> {
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` receives a heap object we own and free in Drop.
        check(unsafe { sk_profiler_stop(&mut raw) })?;
        Ok(Self(raw))
    }

    pub(crate) fn events(&self) -> Result<Vec<ProfilerEvent>, SpeedkitError> {
        let mut n = 0i64;
        // SAFETY: live profile, valid out-pointer.
        check(unsafe { sk_profiler_event_count(self.0, &mut n) })?;
        (0..n).map(|i| self.event(i)).collect()
    }

    fn event(&self, index: i64) -> Result<ProfilerEvent, SpeedkitError> {
        let mut raw = RawProfilerEvent {
            name: ptr::null(),
            device_type: 0,
            activity_type: 0,
            start_ns: 0,
            duration_ns: 0,
            correlation_id: 0,
            thread_id: 0,
            device_resource_id: 0,
        };
        // SAFETY: live profile; `raw` mirrors sk_profiler_event; the shim range-checks `index`.
        check(unsafe { sk_profiler_event_get(self.0, index, &mut raw) })?;
        // SAFETY: `name` points at a NUL-terminated string owned by the live profile.
        let name = unsafe { CStr::from_ptr(raw.name) }
            .to_string_lossy()
            .into_owned();
        Ok(ProfilerEvent {
            name,
            device_type: raw.device_type,
            activity_type: raw.activity_type,
            start_ns: raw.start_ns,
            duration_ns: raw.duration_ns,
            thread_id: raw.thread_id,
        })
    }

    /// Writes the Chrome trace to `path`.
    pub(crate) fn save(&self, path: &std::path::Path) -> Result<(), SpeedkitError> {
        let path = c_string(&path.to_string_lossy())?;
        // SAFETY: live profile, NUL-terminated path for the call.
        check(unsafe { sk_profiler_save(self.0, path.as_ptr()) })
    }
}

impl Drop for ProfilerResult {
    fn drop(&mut self) {
        // SAFETY: created by sk_profiler_stop, freed exactly once.
        unsafe { sk_profiler_free(self.0) }
    }
}

/// A user-scope range recorded by an active profiler (a no-op without one), closed on drop.
pub(crate) struct RecordRange(*mut c_void);

impl RecordRange {
    pub(crate) fn open(name: &str) -> Result<Self, SpeedkitError> {
        let name = c_string(name)?;
        let mut raw = ptr::null_mut();
        // SAFETY: NUL-terminated name for the call (the shim copies it); `raw` receives the range.
        check(unsafe { sk_record_range_open(name.as_ptr(), &mut raw) })?;
        Ok(Self(raw))
    }

    pub(crate) fn close(mut self) -> Result<(), SpeedkitError> {
        let raw = std::mem::replace(&mut self.0, ptr::null_mut());
        // SAFETY: raw came from sk_record_range_open; close frees it.
        check(unsafe { sk_record_range_close(raw) })
    }
}

impl Drop for RecordRange {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: as in `close`; on this path (unwinding) the status has no one to go to.
            let _ = unsafe { sk_record_range_close(self.0) };
        }
    }
}

/// Opens an NVTX range (a no-op until a tool such as Nsight Systems is attached).
pub(crate) fn nvtx_range_push(name: &CStr) {
    // SAFETY: NUL-terminated name for the call; NVTX copies it.
    unsafe { sk_nvtx_range_push(name.as_ptr()) }
}

/// Closes the innermost NVTX range of this thread.
pub(crate) fn nvtx_range_pop() {
    // SAFETY: no arguments; popping with no open range is a no-op in NVTX.
    unsafe { sk_nvtx_range_pop() }
}

/// The backward graph of a tensor: every node's name (each node once), and the identities of the
/// leaf variables that receive gradients.
pub(crate) fn autograd_graph(root: &Tensor) -> Result<(Vec<String>, Vec<u64>), SpeedkitError> {
    let mut raw = ptr::null_mut();
    // SAFETY: live handle for the call; `raw` receives a heap object freed below.
    check(unsafe { sk_autograd_graph(handle(root), &mut raw) })?;
    let read = || -> Result<(Vec<String>, Vec<u64>), SpeedkitError> {
        let (mut nodes, mut leaves) = (0i64, 0i64);
        // SAFETY: live graph, valid out-pointers.
        check(unsafe { sk_autograd_graph_sizes(raw, &mut nodes, &mut leaves) })?;
        let mut names = Vec::with_capacity(nodes as usize);
        for i in 0..nodes {
            let mut name = ptr::null();
            // SAFETY: live graph, index in range, `name` receives a pointer owned by the graph.
            check(unsafe { sk_autograd_graph_node(raw, i, &mut name) })?;
            // SAFETY: NUL-terminated, alive until the graph is freed below.
            names.push(
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned(),
            );
        }
        let mut ids = Vec::with_capacity(leaves as usize);
        for i in 0..leaves {
            let mut id = 0u64;
            // SAFETY: live graph, index in range, valid out-pointer.
            check(unsafe { sk_autograd_graph_leaf(raw, i, &mut id) })?;
            ids.push(id);
        }
        Ok((names, ids))
    };
    let out = read();
    // SAFETY: created by sk_autograd_graph, freed exactly once.
    unsafe { sk_autograd_graph_free(raw) };
    out
}

/// The identity autograd keys a variable by (comparable with [`autograd_graph`]'s leaves).
pub(crate) fn tensor_identity(tensor: &Tensor) -> Result<u64, SpeedkitError> {
    let mut id = 0u64;
    // SAFETY: live handle, valid out-pointer.
    check(unsafe { sk_tensor_identity(handle(tensor), &mut id) })?;
    Ok(id)
}

// ----- distributed (c10d) ------------------------------------------------------------------------

extern "C" {
    fn sk_dist_init(
        backend: c_int,
        master_addr: *const c_char,
        port: c_int,
        rank: c_int,
        world: c_int,
        local_rank: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
    ) -> c_int;
    fn sk_dist_free(group: *mut c_void);
    fn sk_dist_broadcast_(
        group: *mut c_void,
        tensors: *const *mut C_tensor,
        n: i64,
        root: c_int,
    ) -> c_int;
    fn sk_dist_all_reduce_(group: *mut c_void, tensor: *mut C_tensor, op: c_int) -> c_int;
    fn sk_dist_all_gather(
        group: *mut c_void,
        tensor: *mut C_tensor,
        out: *mut *mut C_tensor,
    ) -> c_int;
    fn sk_dist_barrier(group: *mut c_void) -> c_int;
    fn sk_reducer_new(
        group: *mut c_void,
        params: *const *mut C_tensor,
        n: i64,
        bucket_bytes: i64,
        first_bucket_bytes: i64,
        out: *mut *mut c_void,
    ) -> c_int;
    fn sk_reducer_prepare(reducer: *mut c_void) -> c_int;
    fn sk_reducer_free(reducer: *mut c_void);
}

/// Which c10d backend carries the collectives (the shim's numbering).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RawBackend {
    Gloo = 0,
    Nccl = 1,
}

/// Reduction of [`RawProcessGroup::all_reduce_`] (the shim's numbering).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RawReduceOp {
    Sum = 0,
    Max = 1,
}

/// Where and how to rendezvous (see `sk_dist_init`).
pub(crate) struct Rendezvous<'a> {
    pub backend: RawBackend,
    pub master_addr: &'a str,
    pub port: u16,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub timeout_ms: i64,
}

/// A c10d `ProcessGroup` with its `TCPStore`; shut down and freed on drop.
pub(crate) struct RawProcessGroup(*mut c_void);

impl RawProcessGroup {
    pub(crate) fn init(r: &Rendezvous<'_>) -> Result<Self, SpeedkitError> {
        let addr = std::ffi::CString::new(r.master_addr)
            .map_err(|_| SpeedkitError::Torch("MASTER_ADDR contains a NUL byte".into()))?;
        let mut raw = ptr::null_mut();
        // SAFETY: valid C string and out-pointer for the call; `raw` receives a Group we own.
        check(unsafe {
            sk_dist_init(
                r.backend as c_int,
                addr.as_ptr(),
                c_int::from(r.port),
                r.rank as c_int,
                r.world_size as c_int,
                r.local_rank as c_int,
                r.timeout_ms,
                &mut raw,
            )
        })?;
        Ok(Self(raw))
    }

    pub(crate) fn broadcast_(&self, tensors: &[Tensor], root: usize) -> Result<(), SpeedkitError> {
        let t = handles(tensors);
        // SAFETY: live group and handles for the call.
        check(unsafe { sk_dist_broadcast_(self.0, t.as_ptr(), t.len() as i64, root as c_int) })
    }

    pub(crate) fn all_reduce_(
        &self,
        tensor: &Tensor,
        op: RawReduceOp,
    ) -> Result<(), SpeedkitError> {
        // SAFETY: live group and handle for the call.
        check(unsafe { sk_dist_all_reduce_(self.0, handle(tensor), op as c_int) })
    }

    pub(crate) fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, SpeedkitError> {
        let mut out = ptr::null_mut();
        // SAFETY: live group and handle; `out` receives a fresh tensor that we wrap and own.
        check(unsafe { sk_dist_all_gather(self.0, handle(tensor), &mut out) })?;
        // SAFETY: `out` is a fresh heap `at::Tensor*` from the shim.
        Ok(unsafe { Tensor::from_ptr(out) })
    }

    pub(crate) fn barrier(&self) -> Result<(), SpeedkitError> {
        // SAFETY: live group.
        check(unsafe { sk_dist_barrier(self.0) })
    }
}

impl Drop for RawProcessGroup {
    fn drop(&mut self) {
        // SAFETY: created by sk_dist_init, freed exactly once.
        unsafe { sk_dist_free(self.0) }
    }
}

/// c10d's `Reducer`: bucketed gradient all-reduce from autograd hooks, averaged by the world size.
/// Holds its own reference to the process group, so it may outlive a [`RawProcessGroup`] handle.
pub(crate) struct RawReducer(*mut c_void);

impl RawReducer {
    pub(crate) fn new(
        group: &RawProcessGroup,
        params: &[Tensor],
        bucket_bytes: i64,
        first_bucket_bytes: i64,
    ) -> Result<Self, SpeedkitError> {
        let p = handles(params);
        let mut raw = ptr::null_mut();
        // SAFETY: live group and handles; `raw` receives a Reducer we own.
        check(unsafe {
            sk_reducer_new(
                group.0,
                p.as_ptr(),
                p.len() as i64,
                bucket_bytes,
                first_bucket_bytes,
                &mut raw,
            )
        })?;
        Ok(Self(raw))
    }

    /// Arms the hooks for the next backward pass.
    pub(crate) fn prepare(&self) -> Result<(), SpeedkitError> {
        // SAFETY: live reducer.
        check(unsafe { sk_reducer_prepare(self.0) })
    }
}

impl Drop for RawReducer {
    fn drop(&mut self) {
        // SAFETY: created by sk_reducer_new, freed exactly once.
        unsafe { sk_reducer_free(self.0) }
    }
}

// ----- speedkit's kernels ------------------------------------------------------------------------

/// The file names of the embedded kernel sources, in the shim's order.
pub(crate) fn kernel_source_names() -> Result<Vec<String>, SpeedkitError> {
    let mut count = 0;
    // SAFETY: valid out-pointer.
    check(unsafe { sk_kernel_source_count(&mut count) })?;
    (0..count)
        .map(|index| {
            let mut name: *const c_char = ptr::null();
            // SAFETY: index in range; the shim returns a pointer to a static NUL-terminated string.
            check(unsafe { sk_kernel_source_name(index, &mut name) })?;
            // SAFETY: static string, valid for the life of the process.
            Ok(unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned())
        })
        .collect()
}

/// Compiles kernel source `index` with NVRTC for sm_<major><minor>; the cubin's size in bytes.
pub(crate) fn kernel_compile(index: usize, major: u32, minor: u32) -> Result<usize, SpeedkitError> {
    let to_int = |v: u64| {
        c_int::try_from(v).map_err(|_| SpeedkitError::Misuse(format!("{v} is out of range")))
    };
    let mut bytes = 0i64;
    // SAFETY: plain integers and a valid out-pointer.
    check(unsafe {
        sk_kernel_compile(
            to_int(index as u64)?,
            to_int(u64::from(major))?,
            to_int(u64::from(minor))?,
            &mut bytes,
        )
    })?;
    Ok(usize::try_from(bytes).unwrap_or(0))
}

/// NVRTC's version as major * 1000 + minor * 10.
pub(crate) fn nvrtc_version() -> Result<u32, SpeedkitError> {
    let mut version = 0;
    // SAFETY: valid out-pointer.
    check(unsafe { sk_nvrtc_version(&mut version) })?;
    Ok(u32::try_from(version).unwrap_or(0))
}

/// Why speedkit's kernels cannot run on CUDA device `index`, or `None` when they can.
pub(crate) fn kernels_unavailable_reason(index: usize) -> Result<Option<String>, SpeedkitError> {
    let index =
        c_int::try_from(index).map_err(|_| SpeedkitError::Torch("bad device index".into()))?;
    let mut reason = [0 as c_char; 1024];
    // SAFETY: the buffer's capacity is passed; the shim NUL-terminates within it.
    check(unsafe {
        sk_kernels_unavailable_reason(index, reason.as_mut_ptr(), reason.len() as c_int)
    })?;
    // SAFETY: NUL-terminated by the shim.
    let text = unsafe { CStr::from_ptr(reason.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    Ok((!text.is_empty()).then_some(text))
}

/// c10's ScalarType code of the storage types speedkit's kernels take.
fn scalar_type_code(kind: tch::Kind) -> Result<c_int, SpeedkitError> {
    match kind {
        tch::Kind::Half => Ok(5),
        tch::Kind::Float => Ok(6),
        tch::Kind::BFloat16 => Ok(15),
        other => Err(SpeedkitError::Unsupported(format!(
            "speedkit's kernels do not take {other:?}"
        ))),
    }
}

fn optional_handle(tensor: Option<&Tensor>) -> *mut C_tensor {
    tensor.map_or(ptr::null_mut(), handle)
}

/// Whether the fused LayerNorm backward fits rows of `width` on CUDA device `index`.
pub(crate) fn layer_norm_width_supported(index: usize, width: i64) -> Result<bool, SpeedkitError> {
    let index =
        c_int::try_from(index).map_err(|_| SpeedkitError::Torch("bad device index".into()))?;
    let mut out = 0;
    // SAFETY: plain values and a valid out-pointer.
    check(unsafe { sk_layer_norm_width_supported(index, width, &mut out) })?;
    Ok(out != 0)
}

/// `(LN(x [+ residual]) in out_kind, x + residual)` on speedkit's kernels, differentiable; without a
/// residual the second output is x passed through when `keep_input`, else none.
pub(crate) fn layer_norm(
    x: &Tensor,
    residual: Option<&Tensor>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
    out_kind: tch::Kind,
    keep_input: bool,
) -> Result<(Tensor, Option<Tensor>), SpeedkitError> {
    let out_type = scalar_type_code(out_kind)?;
    let (mut y, mut sum): (*mut C_tensor, *mut C_tensor) = (ptr::null_mut(), ptr::null_mut());
    // SAFETY: live handles (or null) borrowed for the call; on success the shim hands over
    // ownership of `y` (and of `sum` when a residual or `keep_input` was given).
    check(unsafe {
        sk_layer_norm(
            handle(x),
            optional_handle(residual),
            optional_handle(weight),
            optional_handle(bias),
            eps,
            out_type,
            c_int::from(keep_input),
            &mut y,
            &mut sum,
        )
    })?;
    // SAFETY: owned tensors allocated by the shim.
    let y = unsafe { Tensor::from_ptr(y) };
    let sum = (!sum.is_null()).then(|| unsafe { Tensor::from_ptr(sum) });
    Ok((y, sum))
}

/// The mean cross-entropy of `[rows, vocab]` logits on speedkit's fused kernels, differentiable.
pub(crate) fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
) -> Result<Tensor, SpeedkitError> {
    let mut loss: *mut C_tensor = ptr::null_mut();
    // SAFETY: live handles borrowed for the call; on success the shim hands over `loss`.
    check(unsafe { sk_cross_entropy(handle(logits), handle(targets), ignore_index, &mut loss) })?;
    // SAFETY: an owned tensor allocated by the shim.
    Ok(unsafe { Tensor::from_ptr(loss) })
}

/// `table[tokens]` plus `positions[t]` for `[batch, seq]` tokens, on speedkit's kernels,
/// differentiable in the table and the positions.
pub(crate) fn embedding(
    tokens: &Tensor,
    table: &Tensor,
    positions: Option<&Tensor>,
) -> Result<Tensor, SpeedkitError> {
    let mut out: *mut C_tensor = ptr::null_mut();
    // SAFETY: live handles (or null for no positions) borrowed for the call; on success the shim
    // hands over `out`.
    check(unsafe {
        sk_embedding(
            handle(tokens),
            handle(table),
            optional_handle(positions),
            &mut out,
        )
    })?;
    // SAFETY: an owned tensor allocated by the shim.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// `gelu_tanh(h + bias)` on speedkit's kernels, differentiable (the bias gradient from the
/// GELU-backward pass).
pub(crate) fn bias_gelu(h: &Tensor, bias: &Tensor) -> Result<Tensor, SpeedkitError> {
    let mut y: *mut C_tensor = ptr::null_mut();
    // SAFETY: live handles borrowed for the call; on success the shim hands over `y`.
    check(unsafe { sk_bias_gelu(handle(h), handle(bias), &mut y) })?;
    // SAFETY: an owned tensor allocated by the shim.
    Ok(unsafe { Tensor::from_ptr(y) })
}

/// `x Wᵀ + b` in the autocast type (else x's), differentiable, with the weight gradient written in
/// the weight's type by its GEMM and the bias gradient summed on speedkit's kernel.
pub(crate) fn linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor, SpeedkitError> {
    let mut y: *mut C_tensor = ptr::null_mut();
    let bias = bias.map_or(ptr::null_mut(), handle);
    // SAFETY: live handles (or null for no bias) borrowed for the call; on success the shim hands
    // over `y`.
    check(unsafe { sk_linear(handle(x), handle(weight), bias, &mut y) })?;
    // SAFETY: an owned tensor allocated by the shim.
    Ok(unsafe { Tensor::from_ptr(y) })
}

/// As [`linear`], the output returned as `chunks` equal blocks of its last dimension, whose
/// gradients the backward puts side by side in the pass that sums the bias gradient.
pub(crate) fn linear_chunks(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    chunks: usize,
) -> Result<Vec<Tensor>, SpeedkitError> {
    let mut y: Vec<*mut C_tensor> = vec![ptr::null_mut(); chunks];
    let bias = bias.map_or(ptr::null_mut(), handle);
    // SAFETY: live handles (or null for no bias) borrowed for the call; `y` has room for `chunks`
    // handles, which the shim fills and hands over on success.
    check(unsafe {
        sk_linear_chunks(
            handle(x),
            handle(weight),
            bias,
            chunks as i64,
            y.as_mut_ptr(),
        )
    })?;
    // SAFETY: owned tensors allocated by the shim.
    Ok(y.into_iter()
        .map(|t| unsafe { Tensor::from_ptr(t) })
        .collect())
}

/// `fc2(gelu_tanh(fc1(x)))` with its GEMMs in `compute` on cuBLASLt with epilogues, differentiable.
pub(crate) fn mlp(
    x: &Tensor,
    fc1: (&Tensor, &Tensor),
    fc2: (&Tensor, &Tensor),
    compute: tch::Kind,
) -> Result<Tensor, SpeedkitError> {
    let compute_type = scalar_type_code(compute)?;
    let mut y: *mut C_tensor = ptr::null_mut();
    // SAFETY: live handles borrowed for the call; on success the shim hands over `y`.
    check(unsafe {
        sk_mlp(
            handle(x),
            handle(fc1.0),
            handle(fc1.1),
            handle(fc2.0),
            handle(fc2.1),
            compute_type,
            &mut y,
        )
    })?;
    // SAFETY: an owned tensor allocated by the shim.
    Ok(unsafe { Tensor::from_ptr(y) })
}

/// The reasons a GEMM of the MLP ran on ATen since the last call, each once per process.
pub(crate) fn mlp_take_notes() -> Vec<String> {
    let mut text: *const c_char = ptr::null();
    // SAFETY: valid out-pointer; the shim points it at a NUL-terminated per-thread string.
    if unsafe { sk_mlp_take_notes(&mut text) } != 0 || text.is_null() {
        return Vec::new();
    }
    // SAFETY: valid until this thread's next call, and copied out at once.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    text.lines().map(str::to_owned).collect()
}

/// Sets the mask of MLP backward epilogues (shim/cublaslt.cpp's `Fusion` bits); the previous one.
pub(crate) fn mlp_set_backward_fusion(mask: i32) -> Result<i32, SpeedkitError> {
    let mut previous = 0;
    // SAFETY: a plain value and a valid out-pointer.
    check(unsafe { sk_mlp_set_backward_fusion(mask, &mut previous) })?;
    Ok(previous)
}
