//! Where a device's memory goes, for a user near the limit and for the runner's memory breakdown:
//! the CUDA caching allocator's own counters and segments (allocated, reserved, the CUDA graphs'
//! private pools, cached and fragmented blocks) and what speedkit itself holds (the weight copies of
//! [`crate::nn::Linear`]), and [`release_cached`] to give back what nothing uses.
//!
//! ```no_run
//! use speedkit::memory::MemoryUse;
//! let now = MemoryUse::now(tch::Device::Cuda(0))?;
//! println!("{now}");
//! assert!(now.reserved >= now.allocated);
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};
use tch::Device;

use crate::error::{Result, SpeedkitError};
use crate::ffi;
use crate::optim::OptimizerMemory;

/// One pool's segments, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolUse {
    /// Held from the driver.
    pub reserved: u64,
    /// In allocated blocks.
    pub allocated: u64,
    /// How many segments (device allocations) it holds.
    pub segments: u64,
}

impl PoolUse {
    fn add(&mut self, reserved: u64, allocated: u64, segments: u64) {
        self.reserved += reserved;
        self.allocated += allocated;
        self.segments += segments;
    }
}

/// One device's memory at one moment, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryUse {
    /// In blocks handed out to tensors.
    pub allocated: u64,
    /// Held from the driver by the caching allocator (allocated, cached free blocks, graph pools).
    pub reserved: u64,
    /// The peak of `allocated` since the allocator's peaks were last reset.
    pub peak_allocated: u64,
    /// The peak of `reserved` since then.
    pub peak_reserved: u64,
    /// Free parts of split blocks: memory held but in pieces too small for the next request.
    pub fragmented: u64,
    /// The default pool: eager allocations, parameters, optimizer state.
    pub default_pool: PoolUse,
    /// The private pools of CUDA graphs: what a captured step allocates and replays reuse.
    pub graph_pools: PoolUse,
    /// speedkit's kept copies of fp32 weights in the autocast type (on every device).
    pub weight_copies: u64,
    /// Allocations that failed once and succeeded after the allocator freed its cache.
    pub alloc_retries: u64,
    /// Allocations that failed for good (out-of-memory errors).
    pub ooms: u64,
}

impl MemoryUse {
    /// `device`'s memory now; all zeros on the CPU (there is no caching allocator to read).
    pub fn now(device: Device) -> Result<Self> {
        let Device::Cuda(index) = device else {
            return Ok(Self::default());
        };
        let (totals, pools) = ffi::device::cuda_memory_snapshot(index)?;
        let bytes = |v: i64| v.max(0) as u64;
        let mut use_ = Self {
            allocated: bytes(totals.allocated),
            reserved: bytes(totals.reserved),
            peak_allocated: bytes(totals.peak_allocated),
            peak_reserved: bytes(totals.peak_reserved),
            fragmented: bytes(totals.inactive_split),
            weight_copies: ffi::weight_casts::size()?.0,
            alloc_retries: bytes(totals.alloc_retries),
            ooms: bytes(totals.ooms),
            ..Self::default()
        };
        for pool in pools {
            let in_graph_pool = (pool.pool_first, pool.pool_second) != (0, 0);
            let target = if in_graph_pool {
                &mut use_.graph_pools
            } else {
                &mut use_.default_pool
            };
            target.add(
                bytes(pool.reserved),
                bytes(pool.allocated),
                bytes(pool.segments),
            );
        }
        Ok(use_)
    }

    /// Reserved but not allocated: cached blocks the allocator keeps for reuse.
    pub fn cached(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }
}

impl fmt::Display for MemoryUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "allocated {} (peak {}), reserved {} (peak {}); default pool {} of {} reserved, \
             graph pools {} of {} reserved; fragmented {}; weight copies {}",
            gib(self.allocated),
            gib(self.peak_allocated),
            gib(self.reserved),
            gib(self.peak_reserved),
            gib(self.default_pool.allocated),
            gib(self.default_pool.reserved),
            gib(self.graph_pools.allocated),
            gib(self.graph_pools.reserved),
            gib(self.fragmented),
            gib(self.weight_copies),
        )
    }
}

/// Where a run's device memory went, in bytes (the runner's breakdown table, a profile's memory
/// line).
///
/// `parameters` + `gradients` + `optimizer_state` + `weight_copies` + `other_held` is what stays
/// allocated after the last step; adding `activations` gives the whole-run peak allocated; adding
/// `cached` gives the peak reserved. `graph_pools` and `fragmented` are parts of the reserved
/// memory seen from another side (a graph pool's blocks are allocated or cached).
///
/// ```
/// use speedkit::memory::{MemoryBreakdown, MemoryUse};
/// use speedkit::optim::OptimizerMemory;
/// let after_last_step = MemoryUse { allocated: 1000, reserved: 1600, ..Default::default() };
/// let optimizer = OptimizerMemory { parameters: 200, gradients: 200, state: 400 };
/// let b = MemoryBreakdown::of(after_last_step, optimizer, (1500, 1800));
/// assert_eq!((b.other_held, b.activations, b.cached), (200, 500, 300));
/// assert_eq!(b.held() + b.activations, 1500);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    /// The parameters of the optimizers the context made.
    pub parameters: u64,
    /// Their allocated gradients.
    pub gradients: u64,
    /// Those optimizers' state (AdamW's moments).
    pub optimizer_state: u64,
    /// speedkit's kept copies of weights in the autocast type.
    pub weight_copies: u64,
    /// Everything else allocated between steps: inputs, data, buffers, the loss, parameters no
    /// optimizer of the context holds.
    pub other_held: u64,
    /// The step's transient peak above what is held between steps: activations and temporaries
    /// (for a graphed step, of the captured step and its warm-up).
    pub activations: u64,
    /// Reserved at the peak but not allocated: cached free blocks, fragmentation included.
    pub cached: u64,
    /// Reserved by CUDA graphs' private pools after the last step.
    pub graph_pools: u64,
    /// Free parts of split blocks after the last step (a part of what is cached).
    pub fragmented: u64,
}

impl MemoryBreakdown {
    /// The breakdown from the allocator's state after the last step, the context's optimizers, and
    /// the whole run's `(peak allocated, peak reserved)`.
    pub fn of(after: MemoryUse, optimizer: OptimizerMemory, peaks: (u64, u64)) -> Self {
        let named =
            optimizer.parameters + optimizer.gradients + optimizer.state + after.weight_copies;
        Self {
            parameters: optimizer.parameters,
            gradients: optimizer.gradients,
            optimizer_state: optimizer.state,
            weight_copies: after.weight_copies,
            other_held: after.allocated.saturating_sub(named),
            activations: peaks.0.saturating_sub(after.allocated),
            cached: peaks.1.saturating_sub(peaks.0),
            graph_pools: after.graph_pools.reserved,
            fragmented: after.fragmented,
        }
    }

    /// Allocated between steps: the sum of the first five parts.
    pub fn held(&self) -> u64 {
        self.parameters
            + self.gradients
            + self.optimizer_state
            + self.weight_copies
            + self.other_held
    }
}

/// `bytes` as GiB with two decimals, e.g. `"1.50 GiB"`.
///
/// ```
/// assert_eq!(speedkit::memory::gib(3 << 29), "1.50 GiB");
/// ```
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// What speedkit holds on the device: the bytes and number of kept weight copies whose weights are
/// alive.
///
/// ```
/// let (bytes, copies) = speedkit::memory::weight_copies()?;
/// assert!(copies > 0 || bytes == 0);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn weight_copies() -> Result<(u64, u64)> {
    ffi::weight_casts::size()
}

/// The cuBLAS workspaces the process keeps, on every device: cuBLAS gives each (handle, stream)
/// pair that has run a GEMM a workspace (32 MiB on Hopper) for the life of the process, and each
/// thread has its own handle, so a step's forward and its backward (autograd's thread) would hold
/// one each on the same stream. speedkit's graph warm-ups and captures give them one to share.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlasWorkspaces {
    /// (handle, stream) pairs with a workspace.
    pub entries: u64,
    /// The workspaces they point at: fewer than `entries` where pairs share one.
    pub workspaces: u64,
    /// The memory of those workspaces.
    pub bytes: u64,
}

/// The cuBLAS workspaces the process keeps now ([`BlasWorkspaces`]).
///
/// ```no_run
/// let w = speedkit::memory::blas_workspaces()?;
/// println!("{} cuBLAS workspaces for {} pairs, {}", w.workspaces, w.entries, speedkit::memory::gib(w.bytes));
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn blas_workspaces() -> Result<BlasWorkspaces> {
    let (entries, workspaces, bytes) = ffi::device::blas_workspaces()?;
    Ok(BlasWorkspaces {
        entries,
        workspaces,
        bytes,
    })
}

/// Gives back what nothing uses: the weight copies of weights that no longer exist, then every
/// cached block of `device` (what `torch.cuda.empty_cache()` does). Returns the bytes of reserved
/// memory given back. On the CPU only the copies are dropped.
///
/// ```no_run
/// let freed = speedkit::memory::release_cached(tch::Device::Cuda(0))?;
/// println!("gave back {}", speedkit::memory::gib(freed));
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn release_cached(device: Device) -> Result<u64> {
    ffi::weight_casts::release_expired()?;
    let Device::Cuda(index) = device else {
        return Ok(0);
    };
    let before = MemoryUse::now(device)?.reserved;
    ffi::device::cuda_synchronize(index)?;
    ffi::device::cuda_empty_cache()?;
    Ok(before.saturating_sub(MemoryUse::now(device)?.reserved))
}

/// Resets `device`'s peak counters ([`MemoryUse::peak_allocated`], [`MemoryUse::peak_reserved`]),
/// so that the next reading's peaks are of what ran since. Nothing to do on the CPU.
///
/// ```no_run
/// speedkit::memory::reset_peaks(tch::Device::Cuda(0))?;
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn reset_peaks(device: Device) -> Result<()> {
    match device {
        Device::Cuda(index) => ffi::device::cuda_reset_peak_memory(index),
        _ => Ok(()),
    }
}

/// Drops every kept weight copy, so that the next forward casts the weights again: what a caller
/// near the limit does before a phase that needs the memory more than the copies save time
/// (evaluation of another model, say). Returns their bytes.
///
/// ```
/// let freed = speedkit::memory::drop_weight_copies()?;
/// assert_eq!(speedkit::memory::weight_copies()?.0, 0);
/// # let _ = freed;
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn drop_weight_copies() -> Result<u64> {
    ffi::weight_casts::clear()
}

/// The events a [`MemoryHistory`] keeps unless told otherwise: the latest 1,000,000 allocations
/// and frees, tens of steps of a large model.
pub const DEFAULT_HISTORY_EVENTS: usize = 1_000_000;

/// Records every allocation and free of the CUDA caching allocator, each with the C++ stack that
/// made it, from [`record`](Self::record) until dropped, for a snapshot file
/// ([`write`](Self::write)) in the format of PyTorch's `torch.cuda.memory._dump_snapshot`: PyTorch's
/// memory visualiser (`python -m torch.cuda._memory_viz trace_plot FILE -o FILE.html`, or the
/// pytorch.org/memory_viz page) draws it as a timeline of every tensor, which shows what is alive
/// at the peak and which operator allocated it.
///
/// The recording is the allocator's, for the whole process: it slows allocation (a stack is
/// unwound for each), and the guard stops it when dropped, panics included. Where something else
/// already records (a second guard, or a library of the user's), the guard neither changes nor
/// stops that recording.
///
/// ```no_run
/// use speedkit::memory::{MemoryHistory, DEFAULT_HISTORY_EVENTS};
/// let history = MemoryHistory::record(DEFAULT_HISTORY_EVENTS)?;
/// let x = tch::Tensor::ones([1024, 1024], (tch::Kind::Float, tch::Device::Cuda(0)));
/// let _y = x.matmul(&x);
/// history.write(std::path::Path::new("matmul.pickle"))?;
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
#[derive(Debug)]
pub struct MemoryHistory {
    /// Whether this guard started the recording, and so stops it.
    started: bool,
}

impl MemoryHistory {
    /// Starts recording, keeping the latest `max_events` allocations and frees (older ones are
    /// dropped from the record). Fails without a CUDA device, changing nothing.
    pub fn record(max_events: usize) -> Result<Self> {
        if max_events == 0 {
            return Err(SpeedkitError::Misuse(
                "a memory history keeps at least one event: pass max_events >= 1 \
                 (speedkit::memory::DEFAULT_HISTORY_EVENTS keeps a million)"
                    .into(),
            ));
        }
        if ffi::device::cuda_device_count()? == 0 {
            return Err(SpeedkitError::Unsupported(
                "recording the allocator's memory history needs a CUDA device, and none is \
                 visible"
                    .into(),
            ));
        }
        if ffi::memory_history::enabled()? {
            return Ok(MemoryHistory { started: false });
        }
        ffi::memory_history::start(max_events)?;
        Ok(MemoryHistory { started: true })
    }

    /// Whether the caching allocator records its history now, whoever started it. `false` where
    /// no CUDA device is visible.
    ///
    /// ```no_run
    /// use speedkit::memory::MemoryHistory;
    /// {
    ///     let _history = MemoryHistory::record(1000)?;
    ///     assert!(MemoryHistory::is_recording()?);
    /// }
    /// assert!(!MemoryHistory::is_recording()?);
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn is_recording() -> Result<bool> {
        if ffi::device::cuda_device_count()? == 0 {
            return Ok(false);
        }
        ffi::memory_history::enabled()
    }

    /// Writes the allocator's segments and the history recorded so far to `path` (a pickle; by
    /// convention `.pickle`). The recording goes on.
    pub fn write(&self, path: &std::path::Path) -> Result<()> {
        ffi::memory_history::write(path)
    }
}

impl Drop for MemoryHistory {
    fn drop(&mut self) {
        if self.started {
            // Drop cannot report: a failed stop leaves the record on, which only slows allocation.
            let _ = ffi::memory_history::stop();
        }
    }
}

/// `cause`, an out-of-memory error during `phase` on `device`, as [`SpeedkitError::OutOfMemory`]:
/// the phase, libtorch's message, the device's memory once what nothing uses is given back
/// ([`release_cached`]), and `advice`.
pub(crate) fn out_of_memory(
    device: Device,
    phase: &str,
    cause: &SpeedkitError,
    advice: &str,
) -> SpeedkitError {
    // Giving back is best effort: the error to report is the out-of-memory one.
    let _ = release_cached(device);
    let now = match MemoryUse::now(device) {
        Ok(m) => format!(
            "after it, {} stay allocated and {} reserved (peak {} allocated); ",
            gib(m.allocated),
            gib(m.reserved),
            gib(m.peak_allocated)
        ),
        Err(_) => String::new(),
    };
    let cause = cause.to_string();
    let cause = cause.strip_prefix("libtorch: ").unwrap_or(&cause);
    SpeedkitError::OutOfMemory(format!(
        "during the {phase} on {device:?} ({cause}); {now}try {advice}"
    ))
}

/// An out-of-memory error of libtorch's, by its message (`c10::OutOfMemoryError`'s text).
pub(crate) fn is_out_of_memory(error: &SpeedkitError) -> bool {
    let text = error.to_string();
    text.contains("out of memory") || text.contains("OutOfMemoryError")
}
