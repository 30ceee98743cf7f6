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

mod names;

pub use names::{shorten_kernel_name, Category};

use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::path::Path;
use std::time::Instant;

use crate::error::{Result, SpeedkitError};
use crate::ffi::{
    self,
    device::CudaEvent,
    profiler::{ProfilerEvent, ProfilerResult, RecordRange},
};
use crate::graph::{self, StepKind};
use crate::memory::{MemoryBreakdown, MemoryUse};
use crate::report::table;
use crate::SpeedContext;

/// libkineto activity types (`kineto/ActivityType.h`).
const CPU_OP: i32 = 0;
const GPU_MEMCPY: i32 = 3;
const GPU_MEMSET: i32 = 4;
const GPU_KERNEL: i32 = 5;

/// Rows shown per step when printing (the JSON keeps them all).
const SHOWN_ROWS: usize = 25;

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

/// The Kineto profiler while it records; stopped on drop if [`stop`](Self::stop) was not called
/// (a failing or panicking step), so no profiler stays enabled.
struct Recording {
    active: bool,
}

impl Recording {
    fn start(with_cuda: bool) -> Result<Self> {
        ffi::profiler::start(with_cuda)?;
        Ok(Self { active: true })
    }

    fn stop(mut self) -> Result<ProfilerResult> {
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

fn range_name(index: usize) -> String {
    format!("speedkit step #{index}")
}

/// What was measured around one step while the profiler recorded.
struct StepTiming {
    index: usize,
    kind: StepKind,
    host_ms: f64,
    cuda_event_ms: Option<f64>,
    peak_memory_bytes: Option<u64>,
}

fn record_step<T>(
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

fn analyse_step(t: &StepTiming, events: &[ProfilerEvent], cuda: bool) -> Result<StepProfile> {
    let name = range_name(t.index);
    let range = events
        .iter()
        .find(|e| e.device_type == 0 && e.name == name)
        .ok_or_else(|| {
            SpeedkitError::Torch(format!(
                "the profiler recorded no range `{name}` (is another profiler running?)"
            ))
        })?;
    let (from, to) = (range.start_ns, range.start_ns + range.duration_ns);
    let within = |e: &&ProfilerEvent| e.start_ns >= from && e.start_ns <= to;
    let mut step = StepProfile {
        step: t.index,
        kind: t.kind,
        host_ms: t.host_ms,
        cuda_event_ms: t.cuda_event_ms,
        device_busy_ms: None,
        idle_gaps: None,
        peak_memory_bytes: t.peak_memory_bytes,
        rows: Vec::new(),
        categories: Vec::new(),
    };
    let timed: Vec<(String, f64)> = if cuda {
        let device: Vec<&ProfilerEvent> = events
            .iter()
            .filter(within)
            .filter(|e| matches!(e.activity_type, GPU_KERNEL | GPU_MEMCPY | GPU_MEMSET))
            .collect();
        let intervals: Vec<(u64, u64)> = device
            .iter()
            .map(|e| (e.start_ns, e.start_ns + e.duration_ns))
            .collect();
        let (busy_ns, gaps) = busy_and_gaps(intervals);
        step.device_busy_ms = Some(busy_ns as f64 / 1e6);
        step.idle_gaps = Some(gaps);
        device
            .iter()
            .map(|e| (e.name.clone(), e.duration_ns as f64 / 1e6))
            .collect()
    } else {
        let ops: Vec<&ProfilerEvent> = events
            .iter()
            .filter(within)
            .filter(|e| e.device_type == 0 && e.activity_type == CPU_OP && e.name != name)
            .collect();
        let self_ns = self_times(&ops);
        ops.iter()
            .zip(self_ns)
            .map(|(e, ns)| (e.name.clone(), ns as f64 / 1e6))
            .collect()
    };
    step.rows = rows(&timed, cuda, step.step_ms());
    step.categories = categories(&step.rows, step.step_ms());
    Ok(step)
}

/// Groups timed events by (shortened) name, longest total first.
fn rows(timed: &[(String, f64)], cuda: bool, step_ms: f64) -> Vec<OpRow> {
    let mut by_name: BTreeMap<String, OpRow> = BTreeMap::new();
    for (full, ms) in timed {
        let short = if cuda {
            shorten_kernel_name(full)
        } else {
            full.clone()
        };
        let row = by_name.entry(short.clone()).or_insert_with(|| OpRow {
            name: short,
            category: Category::of(full),
            calls: 0,
            total_ms: 0.0,
            mean_us: 0.0,
            share_percent: 0.0,
            full_name: full.clone(),
        });
        row.calls += 1;
        row.total_ms += ms;
    }
    let mut rows: Vec<OpRow> = by_name.into_values().collect();
    for row in &mut rows {
        row.mean_us = row.total_ms * 1e3 / row.calls as f64;
        row.share_percent = percent(row.total_ms, step_ms);
    }
    rows.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
    rows
}

fn categories(rows: &[OpRow], step_ms: f64) -> Vec<CategoryRow> {
    Category::ALL
        .iter()
        .filter_map(|&category| {
            let of: Vec<&OpRow> = rows.iter().filter(|r| r.category == category).collect();
            let total_ms: f64 = of.iter().map(|r| r.total_ms).sum();
            (!of.is_empty()).then(|| CategoryRow {
                category,
                calls: of.iter().map(|r| r.calls).sum(),
                total_ms,
                share_percent: percent(total_ms, step_ms),
            })
        })
        .collect()
}

fn percent(part: f64, whole: f64) -> f64 {
    if whole > 0.0 {
        100.0 * part / whole
    } else {
        0.0
    }
}

/// The time covered by at least one interval, and the gaps between the merged intervals.
fn busy_and_gaps(mut intervals: Vec<(u64, u64)>) -> (u64, IdleGaps) {
    intervals.sort_unstable();
    let mut busy = 0u64;
    let mut gaps = IdleGaps {
        total_ms: 0.0,
        count: 0,
        largest_ms: 0.0,
    };
    let mut current: Option<(u64, u64)> = None;
    for (start, end) in intervals {
        match current {
            Some((s, e)) if start <= e => current = Some((s, e.max(end))),
            Some((s, e)) => {
                busy += e - s;
                let gap_ms = (start - e) as f64 / 1e6;
                gaps.total_ms += gap_ms;
                gaps.count += 1;
                gaps.largest_ms = gaps.largest_ms.max(gap_ms);
                current = Some((start, end));
            }
            None => current = Some((start, end)),
        }
    }
    if let Some((s, e)) = current {
        busy += e - s;
    }
    (busy, gaps)
}

/// Each op's duration minus the durations of the ops directly nested in it (same thread), so that
/// `aten::linear` is not counted again inside its `aten::addmm`.
fn self_times(ops: &[&ProfilerEvent]) -> Vec<u64> {
    let mut self_ns: Vec<u64> = ops.iter().map(|e| e.duration_ns).collect();
    let mut order: Vec<usize> = (0..ops.len()).collect();
    order.sort_by_key(|&i| {
        (
            ops[i].thread_id,
            ops[i].start_ns,
            std::cmp::Reverse(ops[i].duration_ns),
        )
    });
    // Open ops of the current thread, innermost last: (index, end).
    let mut open: Vec<(usize, u64)> = Vec::new();
    let mut thread = None;
    for i in order {
        let e = ops[i];
        if thread != Some(e.thread_id) {
            open.clear();
            thread = Some(e.thread_id);
        }
        while open.last().is_some_and(|&(_, end)| end <= e.start_ns) {
            open.pop();
        }
        if let Some(&(parent, _)) = open.last() {
            self_ns[parent] = self_ns[parent].saturating_sub(e.duration_ns);
        }
        open.push((i, e.start_ns + e.duration_ns));
    }
    self_ns
}

fn format_bytes(bytes: u64) -> String {
    let gib = bytes as f64 / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.2} GiB")
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

impl fmt::Display for StepProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut head = format!(
            "step {} ({}): host {:.3} ms",
            self.step, self.kind, self.host_ms
        );
        if let Some(event_ms) = self.cuda_event_ms {
            let _ = write!(head, ", device {event_ms:.3} ms (CUDA events)");
        }
        if let Some(busy) = self.device_busy_ms {
            let _ = write!(
                head,
                ", kernels busy {busy:.3} ms ({:.1}%)",
                percent(busy, self.step_ms())
            );
        }
        if let Some(g) = &self.idle_gaps {
            let _ = write!(
                head,
                ", idle between kernels {:.3} ms in {} gaps (largest {:.1} µs)",
                g.total_ms,
                g.count,
                g.largest_ms * 1e3
            );
        }
        if let Some(peak) = self.peak_memory_bytes {
            let _ = write!(head, ", peak memory {}", format_bytes(peak));
        }
        writeln!(f, "{head}")?;
        let shown: Vec<Vec<String>> = self
            .rows
            .iter()
            .take(SHOWN_ROWS)
            .map(|r| {
                vec![
                    r.category.to_string(),
                    r.name.clone(),
                    r.calls.to_string(),
                    format!("{:.3}", r.total_ms),
                    format!("{:.1}", r.mean_us),
                    format!("{:.1}", r.share_percent),
                ]
            })
            .collect();
        let what = if self.cuda_event_ms.is_some() {
            "kernel"
        } else {
            "CPU op (self time)"
        };
        f.write_str(&table(
            &[
                "category",
                what,
                "calls",
                "total ms",
                "mean µs",
                "% of step",
            ],
            &shown,
        ))?;
        if self.rows.len() > SHOWN_ROWS {
            let rest = &self.rows[SHOWN_ROWS..];
            let rest_ms: f64 = rest.iter().map(|r| r.total_ms).sum();
            writeln!(
                f,
                "  … {} more ({rest_ms:.3} ms; all in the JSON)",
                rest.len()
            )?;
        }
        let by_category: Vec<Vec<String>> = self
            .categories
            .iter()
            .map(|c| {
                vec![
                    c.category.to_string(),
                    c.calls.to_string(),
                    format!("{:.3}", c.total_ms),
                    format!("{:.1}", c.share_percent),
                ]
            })
            .collect();
        f.write_str(&table(
            &["category", "calls", "total ms", "% of step"],
            &by_category,
        ))
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.rows {
            Rows::CudaKernels => "CUDA kernels",
            Rows::CpuOps => "CPU ops",
        };
        writeln!(f, "{} step(s) on {}, {what}", self.steps.len(), self.device)?;
        if let Some(m) = &self.memory {
            writeln!(
                f,
                "memory: held between steps {} (parameters {}, gradients {}, optimizer state {}, \
                 weight copies {}, other {}); the step's peak adds {}; cached {}; graph pools {}",
                format_bytes(m.held()),
                format_bytes(m.parameters),
                format_bytes(m.gradients),
                format_bytes(m.optimizer_state),
                format_bytes(m.weight_copies),
                format_bytes(m.other_held),
                format_bytes(m.activations),
                format_bytes(m.cached),
                format_bytes(m.graph_pools),
            )?;
        }
        for step in &self.steps {
            writeln!(f)?;
            write!(f, "{step}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(name: &str, thread: u64, start: u64, duration: u64) -> ProfilerEvent {
        ProfilerEvent {
            name: name.into(),
            device_type: 0,
            activity_type: CPU_OP,
            start_ns: start,
            duration_ns: duration,
            thread_id: thread,
        }
    }

    #[test]
    fn self_time_subtracts_only_direct_children() {
        let events = [
            op("aten::linear", 1, 0, 100),
            op("aten::addmm", 1, 10, 60),
            op("aten::copy_", 1, 20, 10),
            op("aten::relu", 1, 80, 15),
            op("aten::mul", 2, 5, 50),
        ];
        let refs: Vec<&ProfilerEvent> = events.iter().collect();
        assert_eq!(self_times(&refs), vec![25, 50, 10, 15, 50]);
    }

    #[test]
    fn busy_time_merges_overlaps_and_gaps_lie_between() {
        let (busy, gaps) = busy_and_gaps(vec![(0, 10), (5, 20), (30, 40), (45, 50)]);
        assert_eq!(busy, 35);
        assert_eq!(gaps.count, 2);
        assert!((gaps.total_ms - 15e-6).abs() < 1e-12);
        assert!((gaps.largest_ms - 10e-6).abs() < 1e-12);
    }

    #[test]
    fn rows_group_by_short_name_longest_first() {
        let timed = vec![
            ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3> >(int)".to_string(), 1.0),
            ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3> >(int)".to_string(), 2.0),
            ("sm90_xmma_gemm_bf16bf16_bf16f32".to_string(), 4.0),
        ];
        let rows = rows(&timed, true, 10.0);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].name, "sm90_xmma_gemm_bf16bf16_bf16f32");
        assert_eq!(rows[0].category, Category::Gemm);
        assert_eq!(
            rows[1].name,
            "vectorized_elementwise_kernel<CUDAFunctor_add>"
        );
        assert_eq!(rows[1].calls, 2);
        assert!((rows[1].share_percent - 30.0).abs() < 1e-9);
        assert!((rows[1].mean_us - 1500.0).abs() < 1e-9);
    }
}
