//! Recording a few steps under the Kineto profiler, each in its own range and timed around.

use std::time::Instant;

use crate::error::Result;
use crate::ffi::{
    self,
    device::CudaEvent,
    profiler::{ProfilerResult, RecordRange},
};
use crate::graph::{self, StepKind};

/// The Kineto profiler while it records; stopped on drop if [`stop`](Self::stop) was not called
/// (a failing or panicking step), so no profiler stays enabled.
pub(super) struct Recording {
    active: bool,
}

impl Recording {
    pub(super) fn start(with_cuda: bool) -> Result<Self> {
        ffi::profiler::start(with_cuda)?;
        Ok(Self { active: true })
    }

    pub(super) fn stop(mut self) -> Result<ProfilerResult> {
        self.active = false;
        ProfilerResult::stop()
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        if self.active {
            // The step's own error is what the caller needs; this result has no one to go to.
            let _ = ProfilerResult::stop();
        }
    }
}

/// The name of step `index`'s range, by which its events are found in the trace.
pub(super) fn range_name(index: usize) -> String {
    format!("speedkit step #{index}")
}

/// What was measured around one step while the profiler recorded.
pub(super) struct StepTiming {
    pub(super) index: usize,
    pub(super) kind: StepKind,
    pub(super) host_ms: f64,
    pub(super) cuda_event_ms: Option<f64>,
    pub(super) peak_memory_bytes: Option<u64>,
}

/// Runs step `index` inside its range, timed on the host and (`cuda`: on that device) by CUDA
/// events, with the device's peak memory reset before it.
pub(super) fn record_step<T>(
    index: usize,
    cuda: Option<usize>,
    step: &mut impl FnMut() -> Result<T>,
) -> Result<StepTiming> {
    if let Some(device) = cuda {
        ffi::device::cuda_synchronize(device)?;
        ffi::device::cuda_reset_peak_memory(device)?;
    }
    let events = match cuda {
        Some(_) => Some((CudaEvent::new()?, CudaEvent::new()?)),
        None => None,
    };
    graph::take_last_step_kind();
    let range = RecordRange::open(&range_name(index))?;
    if let Some((start, _)) = &events {
        start.record()?;
    }
    let t0 = Instant::now();
    step()?;
    let host_ms = t0.elapsed().as_secs_f64() * 1e3;
    if let Some((_, end)) = &events {
        end.record()?;
    }
    if let Some(device) = cuda {
        // Inside the range: every kernel of this step ends before the range does.
        ffi::device::cuda_synchronize(device)?;
    }
    range.close()?;
    let cuda_event_ms = match &events {
        Some((start, end)) => Some(start.elapsed_ms(end)?),
        None => None,
    };
    let peak_memory_bytes = match cuda {
        Some(device) => Some(ffi::device::cuda_memory_stats(device)?.1),
        None => None,
    };
    Ok(StepTiming {
        index,
        kind: graph::take_last_step_kind().unwrap_or(StepKind::Eager),
        host_ms,
        cuda_event_ms,
        peak_memory_bytes,
    })
}
