//! The step profiler: where a training step's time goes, from Rust.
//!
//! [`SpeedContext::profile`] records a few steps with libtorch's Kineto profiler (the engine behind
//! `torch.profiler`) and returns a [`Profile`]: per step, a table of every CUDA kernel (its name
//! shortened, calls, total and mean time, share of the step, [`Category`]), the host time against
//! the device time, the idle gaps between kernels and the peak memory. On the CPU the table lists
//! the CPU ops instead (self time, so nested ops are not counted twice). A profile prints as
//! tables, serialises to JSON, and writes the Chrome/Perfetto trace (open it at ui.perfetto.dev).
//!
//! Each step runs inside a user range `speedkit step #N` (visible in the trace), bracketed by CUDA
//! events and followed by a device synchronisation, so every kernel of a step is attributed to it.
//! A step run through [`graphed`](SpeedContext::graphed) says how it ran ([`StepKind`]): an eager
//! warm-up, the capture, or a replay of the captured graph.
//!
//! ```
//! use speedkit::{apply_speedups, SpeedConfig};
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//! let mut vs = nn::VarStore::new(Device::Cpu);
//! let model = nn::linear(vs.root(), 16, 4, Default::default());
//! let ctx = apply_speedups(&mut vs, &SpeedConfig::from_yaml_str("device: cpu\n")?)?;
//! let x = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
//! let profile = ctx.profile(2, || Ok(model.forward(&x).sum(None).backward()))?;
//! assert!(profile.steps[0].rows.iter().any(|r| r.name == "aten::addmm"));
//! println!("{profile}");
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

mod analysis;
mod display;
mod names;
mod recording;

pub use names::{shorten_kernel_name, Category};

use serde::Serialize;
use std::fmt;
use std::path::Path;

use crate::error::{Result, SpeedkitError};
use crate::ffi::profiler::ProfilerResult;
use crate::graph::StepKind;
use crate::memory::{MemoryBreakdown, MemoryUse};
use crate::SpeedContext;
use analysis::analyse_step;
use recording::{record_step, Recording, StepTiming};

/// What a profile's tables list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rows {
    /// CUDA kernels, copies and fills, by device time.
    CudaKernels,
    /// CPU ops (ATen ops, autograd nodes), by self time on the host.
    CpuOps,
}

/// One kernel (or CPU op) of a step: all calls of the same shortened name.
#[derive(Clone, Debug, Serialize)]
pub struct OpRow {
    /// Shortened kernel name (see [`shorten_kernel_name`]), or the CPU op's name.
    pub name: String,
    /// What it does.
    pub category: Category,
    /// How many times it ran in the step.
    pub calls: usize,
    /// Time over all calls, ms (device time for kernels, self time for CPU ops).
    pub total_ms: f64,
    /// Mean time per call, µs.
    pub mean_us: f64,
    /// Share of the step, percent: of the CUDA-event time for kernels, of the host time for CPU ops.
    pub share_percent: f64,
    /// One full (demangled) name behind the short one.
    pub full_name: String,
}

/// One category's sum within a step.
#[derive(Clone, Debug, Serialize)]
pub struct CategoryRow {
    /// The category.
    pub category: Category,
    /// Calls of its kernels or ops.
    pub calls: usize,
    /// Time, ms.
    pub total_ms: f64,
    /// Share of the step, percent (as [`OpRow::share_percent`]).
    pub share_percent: f64,
}

/// Time the device sat idle between the kernels of a step.
#[derive(Clone, Debug, Serialize)]
pub struct IdleGaps {
    /// Sum of all gaps, ms.
    pub total_ms: f64,
    /// Number of gaps.
    pub count: usize,
    /// The longest gap, ms.
    pub largest_ms: f64,
}

/// The collectives of a step between ranks (NCCL kernels) and how much of their time the step
/// waited for: what data parallelism costs beyond the single-GPU step.
///
/// ```no_run
/// # fn f(profile: &speedkit::profile::Profile) {
/// for step in &profile.steps {
///     if let Some(c) = &step.communication {
///         println!("collectives {:.3} ms, {:.3} ms exposed", c.busy_ms, c.exposed_ms);
///     }
/// }
/// # }
/// ```
#[derive(Clone, Debug, Serialize)]
pub struct Communication {
    /// Kernels of the collectives in the step.
    pub calls: usize,
    /// Time at least one collective ran, ms.
    pub busy_ms: f64,
    /// Of that, the time no other kernel, copy or fill ran beside it, ms: communication not hidden
    /// under compute, including the wait for a slower rank (a collective's kernel runs until every
    /// rank joins).
    pub exposed_ms: f64,
}

/// One profiled step.
#[derive(Clone, Debug, Serialize)]
pub struct StepProfile {
    /// 1-based index within the profile.
    pub step: usize,
    /// How the step ran (eager, graph warm-up, capture or replay).
    pub kind: StepKind,
    /// Host time inside the step closure, ms (queueing work; the device may still be busy).
    pub host_ms: f64,
    /// Device time between CUDA events recorded around the step, ms (CUDA only).
    pub cuda_event_ms: Option<f64>,
    /// Time at least one kernel, copy or fill ran, ms (CUDA only).
    pub device_busy_ms: Option<f64>,
    /// Idle time between the step's first and last kernel (CUDA only).
    pub idle_gaps: Option<IdleGaps>,
    /// The collectives between ranks, where the step ran any (CUDA only).
    pub communication: Option<Communication>,
    /// Peak memory allocated by the caching allocator during the step, bytes (CUDA only).
    pub peak_memory_bytes: Option<u64>,
    /// Kernels (or CPU ops), longest total first.
    pub rows: Vec<OpRow>,
    /// The rows summed by category, in [`Category::ALL`] order, empty categories left out.
    pub categories: Vec<CategoryRow>,
}

impl StepProfile {
    /// The time the shares are taken of: the CUDA-event time on a GPU, the host time on a CPU.
    pub fn step_ms(&self) -> f64 {
        self.cuda_event_ms.unwrap_or(self.host_ms)
    }

    /// Sum of the rows' time, ms.
    pub fn rows_total_ms(&self) -> f64 {
        self.rows.iter().map(|r| r.total_ms).sum()
    }
}

/// A profile of a few steps: see the [module docs](self).
#[derive(Serialize)]
pub struct Profile {
    /// The device profiled (`cpu`, `cuda:0`).
    pub device: String,
    /// What the tables list.
    pub rows: Rows,
    /// One entry per step, in order.
    pub steps: Vec<StepProfile>,
    /// Where the device memory went over the profiled steps (CUDA only).
    pub memory: Option<MemoryBreakdown>,
    #[serde(skip)]
    trace: ProfilerResult,
}

impl fmt::Debug for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Profile")
            .field("device", &self.device)
            .field("rows", &self.rows)
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

impl Profile {
    /// Pretty JSON of the tables (not the trace; see [`save_trace`](Self::save_trace)).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// Writes [`to_json`](Self::to_json) to `path`.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_json()).map_err(|source| SpeedkitError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Writes the Chrome trace of every profiled step (JSON; open it in chrome://tracing or at
    /// ui.perfetto.dev).
    pub fn save_trace(&self, path: &Path) -> Result<()> {
        self.trace.save(path)
    }

    /// Prints the tables under `title`, then writes `<dir>/<stem>.json` and the trace
    /// `<dir>/<stem>.trace.json` (creating `dir`), naming both files: what `--profile` does in
    /// the runner and the examples.
    pub fn print_and_write(&self, title: &str, dir: &Path, stem: &str) -> Result<()> {
        println!("== profile: {title}\n{self}");
        std::fs::create_dir_all(dir).map_err(|source| SpeedkitError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let stem: String = stem
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let json = dir.join(format!("{stem}.json"));
        let trace = dir.join(format!("{stem}.trace.json"));
        self.write_json(&json)?;
        self.save_trace(&trace)?;
        println!("  wrote {} and {}", json.display(), trace.display());
        Ok(())
    }
}

/// Where `--profile` writes its files, relative to the working directory.
pub const DEFAULT_OUTPUT_DIR: &str = "speedkit-profile";

impl SpeedContext {
    /// Profiles `steps` calls of `step` (see the [module docs](crate::profile)). On a GPU the tables
    /// list CUDA kernels; on the CPU, CPU ops. Only one profile can record at a time in a process.
    pub fn profile<T>(&self, steps: usize, mut step: impl FnMut() -> Result<T>) -> Result<Profile> {
        if steps == 0 {
            return Err(SpeedkitError::Misuse(
                "profile needs at least one step".into(),
            ));
        }
        let cuda = self.plan().cuda_index();
        let recording = Recording::start(cuda.is_some())?;
        let mut timings = Vec::with_capacity(steps);
        for index in 1..=steps {
            timings.push(record_step(index, cuda, &mut step)?);
        }
        let trace = recording.stop()?;
        let events = trace.events()?;
        let steps = timings
            .iter()
            .map(|t| analyse_step(t, &events, cuda.is_some()))
            .collect::<Result<Vec<_>>>()?;
        let memory = match cuda {
            Some(device) => Some(self.memory_over(device, &timings)?),
            None => None,
        };
        Ok(Profile {
            device: crate::plan::device_name(self.device()),
            rows: if cuda.is_some() {
                Rows::CudaKernels
            } else {
                Rows::CpuOps
            },
            steps,
            memory,
            trace,
        })
    }

    /// The breakdown after the profiled steps; the peaks are the steps' (each step resets them).
    fn memory_over(&self, device: usize, timings: &[StepTiming]) -> Result<MemoryBreakdown> {
        let after = MemoryUse::now(tch::Device::Cuda(device))?;
        let peak_allocated = timings.iter().filter_map(|t| t.peak_memory_bytes).max();
        let peaks = (
            peak_allocated.unwrap_or(after.allocated),
            after.peak_reserved,
        );
        Ok(MemoryBreakdown::of(after, self.optimizer_memory(), peaks))
    }
}
