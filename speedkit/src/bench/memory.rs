//! Device memory of a measured run, read from the CUDA caching allocator.
//!
//! A whole-step CUDA graph allocates every activation of the step into its private pool while it
//! is captured, during warm-up; its replays then allocate nothing. A peak taken over the timed
//! steps alone therefore shows only what stays allocated between steps, and under graph mode
//! leaves out most of the step's memory. [`DeviceMemory`] keeps the peak of the whole run (warm-up
//! and capture included) as the figure to compare, next to the reserved memory and, separately
//! named, that steady-state peak. PyTorch's reference (`docs/benchmarks/pytorch_reference.py`)
//! measures the same three the same way.
//!
//! [`crate::memory::MemoryBreakdown`] says where that memory went: what stays allocated between steps (parameters,
//! gradients and optimizer state, from the optimizers the context made; speedkit's weight copies;
//! the rest), the step's own transient peak (activations), and what the allocator reserves beyond
//! (the CUDA graphs' pools, cached and fragmented blocks).

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::ffi;
use crate::memory::{MemoryBreakdown, MemoryUse};
use crate::optim::OptimizerMemory;

/// Device memory of one run, in bytes.
///
/// ```
/// use speedkit::bench::DeviceMemory;
/// let m = DeviceMemory {
///     peak_allocated_bytes: 3 << 30,
///     peak_reserved_bytes: 4 << 30,
///     steady_peak_allocated_bytes: 1 << 30,
///     breakdown: None,
/// };
/// assert_eq!(m.gib(m.peak_allocated_bytes), 3.0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemory {
    /// Peak bytes allocated over the whole run: warm-up (graph capture, autotuning, first-step
    /// allocations of the optimizer state) and timed steps; what was already allocated when the
    /// run began (parameters, data) counts at its size then. The figure to compare.
    pub peak_allocated_bytes: u64,
    /// Peak bytes the caching allocator held from the driver over the whole run (allocated blocks,
    /// cached free blocks and graph pools): the device memory the process occupied.
    pub peak_reserved_bytes: u64,
    /// Peak bytes allocated during the timed steps only. Under graph replay the step's activations
    /// sit in the graph's pool, allocated at capture, so this is far below the whole-run peak.
    pub steady_peak_allocated_bytes: u64,
    /// Where it went (absent from figures recorded before breakdowns were).
    pub breakdown: Option<MemoryBreakdown>,
}

impl DeviceMemory {
    /// `bytes` in GiB.
    pub fn gib(&self, bytes: u64) -> f64 {
        bytes as f64 / (1u64 << 30) as f64
    }
}

/// Makes cuBLAS's and cuBLASLt's workspaces of `device` now, before any workload: for the calling
/// thread's handles and the autograd engine's (the backward's GEMMs run on its thread), on the
/// default stream and on the side stream graph warm-ups and captures run on.
///
/// cuBLAS keeps a workspace per handle and stream for the life of the process, allocated through
/// the caching allocator where the first GEMM of that pair happens. Made in the middle of a
/// workload, it lands in a large segment that workload freed, and then pins that whole segment:
/// every later workload counted it as its own reserved memory (1.5 GiB after `gpt2_tch`, measured
/// on an H100). Made first, each sits in a small segment of its own. Each run then frees them
/// ([`MemoryProbe::start`]), which also teaches the first graph warm-up which handles share the
/// side stream's workspace.
#[cfg(feature = "runner")]
pub(crate) fn settle_library_workspaces(device: usize) -> Result<()> {
    let gemms = || -> Result<()> {
        let options = (tch::Kind::BFloat16, tch::Device::Cuda(device));
        let a = tch::Tensor::f_ones([64, 64], options)?.set_requires_grad(true);
        // A matmul takes cuBLAS; a linear with a bias, cuBLASLt's epilogue; their backward, the
        // same on the autograd engine's thread.
        let y = a.f_matmul(&a)?.f_linear(&a, Some(&a.f_select(0, 0)?))?;
        y.f_sum(tch::Kind::Float)?.f_backward()?;
        Ok(())
    };
    gemms()?;
    let side = ffi::device::SideStream::enter(device)?;
    let on_side = gemms();
    side.exit()?;
    on_side?;
    ffi::device::cuda_synchronize(device)
}

/// Reads the allocator's peaks of one device across a run's two phases.
pub(crate) struct MemoryProbe {
    device: usize,
}

impl MemoryProbe {
    /// Starts a run: waits for the device, gives back what nothing uses (the weight copies of
    /// earlier workloads' models, the cuBLAS workspaces of earlier work where no graph replays
    /// with them, cached blocks), so that the run's figures are its own whether it runs first or
    /// after others, and resets the peaks.
    pub(crate) fn start(device: usize) -> Result<Self> {
        // A workspace made by earlier work (the up-front ones, an eager workload's) would count
        // in this run's peak; one this run makes is its own, and goes before the next run.
        ffi::device::release_blas_workspaces(device, ffi::graphs::CudaGraph::live() == 0)?;
        crate::memory::release_cached(tch::Device::Cuda(device))?;
        ffi::device::cuda_reset_peak_memory(device)?;
        Ok(Self { device })
    }

    /// Ends the warm-up: the peaks so far (allocated, reserved), then resets them for the timed
    /// steps.
    pub(crate) fn end_warmup(&self) -> Result<(u64, u64)> {
        let peaks = self.peaks()?;
        ffi::device::cuda_reset_peak_memory(self.device)?;
        Ok(peaks)
    }

    /// Ends the run, combining the warm-up's peaks with the timed steps', and says where the
    /// memory went (`optimizer`: what the context's optimizers hold now).
    pub(crate) fn finish(
        &self,
        warmup: (u64, u64),
        optimizer: OptimizerMemory,
    ) -> Result<DeviceMemory> {
        let (steady_allocated, steady_reserved) = self.peaks()?;
        let peaks = (
            warmup.0.max(steady_allocated),
            warmup.1.max(steady_reserved),
        );
        let after = MemoryUse::now(tch::Device::Cuda(self.device))?;
        Ok(DeviceMemory {
            peak_allocated_bytes: peaks.0,
            peak_reserved_bytes: peaks.1,
            steady_peak_allocated_bytes: steady_allocated,
            breakdown: Some(MemoryBreakdown::of(after, optimizer, peaks)),
        })
    }

    fn peaks(&self) -> Result<(u64, u64)> {
        ffi::device::cuda_synchronize(self.device)?;
        let (_, allocated, _) = ffi::device::cuda_memory_stats(self.device)?;
        Ok((
            allocated,
            ffi::device::cuda_peak_reserved_memory(self.device)?,
        ))
    }
}
