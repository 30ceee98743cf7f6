//! Benchmark workloads and their measurement.
//!
//! A workload is a function registered with `#[speedkit::bench]`; it builds its model for the
//! [`Size`] it is given, on the device of the [`SpeedContext`] it is given, and hands one training
//! step to [`Bencher::run`], which warms up, times each step (CUDA events on the GPU, a device
//! synchronisation after every step under paranoid sync, as `docs/workloads.md` prescribes), and
//! records the median/p10/p90, TFLOP/s and device memory ([`DeviceMemory`]: the peak of the whole
//! run, warm-up and graph capture included, and the reserved memory).
//!
//! The runner ([`bench_main!`](crate::bench_main)) runs every workload under several configurations
//! side by side; [`bench_tests!`](crate::bench_tests) turns every workload into a `cargo test` case
//! (tiny size, CPU) that checks the step finishes, gives a finite loss, and leaves every flag as found.
//! Both come with speedkit's `runner` feature; registering and measuring workloads needs none.
//!
//! ```
//! use speedkit::bench::Bencher;
//! use tch::nn::{self, Module};
//! use tch::{Kind, Tensor};
//!
//! #[speedkit::bench(tags = ["mlp"])]
//! fn mlp(b: &mut Bencher) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//!     let (batch, width) = b.size().pick((8, 16), (256, 1024));
//!     let ctx = b.ctx();
//!     let vs = nn::VarStore::new(b.device());
//!     let model = nn::linear(vs.root(), width, width, Default::default());
//!     let mut opt = ctx.adamw(&vs, Default::default())?;
//!     let x = Tensor::f_randn([batch, width], (Kind::Float, b.device()))?;
//!     b.set_flops_per_step(6.0 * (batch * width * width) as f64);
//!     b.run(|| -> speedkit::Result<Tensor> {
//!         let loss = ctx.autocast(|| model.forward(&x).square().mean(Kind::Float));
//!         ctx.backward_step(&loss, &mut opt)?;
//!         Ok(loss)
//!     })?;
//!     Ok(())
//! }
//! # assert!(speedkit::bench::Workload::named("mlp").is_some());
//! ```

// The runner (feature `runner`): its command line, run loop and rendering, the saved baselines
// and the PyTorch peer it compares with, and the `cargo test` harness.
#[cfg(feature = "runner")]
pub mod baseline;
mod clocks;
mod memory;
#[cfg(feature = "runner")]
pub mod peer;
#[cfg(feature = "runner")]
pub mod runner;
pub mod stats;
#[cfg(feature = "runner")]
pub mod testing;

pub use clocks::GpuClocks;
#[cfg(feature = "runner")]
#[cfg(feature = "runner")]
pub(crate) use memory::settle_library_workspaces;
pub use memory::DeviceMemory;

use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Instant;
use tch::{Device, Tensor};

use crate::error::SpeedkitError;
use crate::ffi;
use crate::fusion::FusionPlan;
use crate::graph::CompiledStep;
use crate::profile::{Communication, Profile};
use crate::trace::StepTrace;
use crate::SpeedContext;
use clocks::ClockSampler;
use memory::MemoryProbe;

/// Problem size of a workload run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Size {
    /// Runs in well under a second on a CPU (tests, CI).
    Tiny,
    /// The reference size of `docs/workloads.md`.
    Bench,
}

impl Size {
    /// `tiny` or `bench`, whichever this is.
    pub fn pick<T>(self, tiny: T, bench: T) -> T {
        match self {
            Size::Tiny => tiny,
            Size::Bench => bench,
        }
    }

    /// Parses `tiny` / `bench`.
    pub fn parse(s: &str) -> Option<Size> {
        match s {
            "tiny" => Some(Size::Tiny),
            "bench" => Some(Size::Bench),
            _ => None,
        }
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.pick("tiny", "bench"))
    }
}

/// The tag of workloads too large for one GPU at bench size (they train with their parameters
/// sharded over several): a run includes them at that size only where a filter names them.
pub const LARGE_TAG: &str = "large";

/// A registered workload (what `#[speedkit::bench]` submits to `inventory`).
#[derive(Debug)]
pub struct Workload {
    /// Name (the function's by default).
    pub name: &'static str,
    /// Free-form tags, matched by `--filter` too.
    pub tags: &'static [&'static str],
    /// Sizes the workload supports.
    pub sizes: &'static [Size],
    /// Skipped, with a printed reason, without a CUDA device.
    pub cuda_only: bool,
    /// Source file of the registration.
    pub file: &'static str,
    /// Line of the registration.
    pub line: u32,
    /// Runs the workload on a [`Bencher`].
    pub run: fn(&mut Bencher<'_>) -> Result<(), BenchError>,
}

inventory::collect!(Workload);

impl Workload {
    /// Every registered workload, sorted by name.
    pub fn all() -> Vec<&'static Workload> {
        let mut all: Vec<_> = inventory::iter::<Workload>.into_iter().collect();
        all.sort_by_key(|w| w.name);
        all
    }

    /// The registered workload called exactly `name`, if any.
    pub fn named(name: &str) -> Option<&'static Workload> {
        inventory::iter::<Workload>
            .into_iter()
            .find(|w| w.name == name)
    }

    /// Whether `pattern` is a substring of the name or equals a tag.
    pub fn matches(&self, pattern: &str) -> bool {
        self.name.contains(pattern) || self.tags.contains(&pattern)
    }

    /// Whether `pattern` is the whole name (`--exact`): `transformer` and not
    /// `transformer_checkpointed` or the workloads tagged `transformer`.
    ///
    /// ```
    /// # use speedkit::bench::Workload;
    /// # #[speedkit::bench(tags = ["gpt"])]
    /// # fn tiny_gpt(b: &mut speedkit::bench::Bencher) {}
    /// let w = Workload::named("tiny_gpt").unwrap();
    /// assert!(w.matches("gpt") && !w.matches_exactly("gpt") && w.matches_exactly("tiny_gpt"));
    /// ```
    pub fn matches_exactly(&self, pattern: &str) -> bool {
        self.name == pattern
    }
}

/// A workload's failure.
#[derive(Debug)]
pub struct BenchError(Box<dyn std::error::Error + Send + Sync>);

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for BenchError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl BenchError {
    /// Wraps any error.
    pub fn new(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self(e.into())
    }
}

impl From<SpeedkitError> for BenchError {
    fn from(e: SpeedkitError) -> Self {
        Self(Box::new(e))
    }
}

/// What a workload function may return: `()` or `Result<(), E>` for a boxable `E`.
pub trait IntoBenchResult {
    /// Converts.
    fn into_bench_result(self) -> Result<(), BenchError>;
}

impl IntoBenchResult for () {
    fn into_bench_result(self) -> Result<(), BenchError> {
        Ok(())
    }
}

impl<E: Into<Box<dyn std::error::Error + Send + Sync>>> IntoBenchResult for Result<(), E> {
    fn into_bench_result(self) -> Result<(), BenchError> {
        self.map_err(BenchError::new)
    }
}

/// What one timed step may return: a loss tensor (checked finite by tests), nothing, or a `Result`
/// of either.
pub trait IntoStepResult {
    /// Converts.
    fn into_step_result(self) -> Result<Option<Tensor>, BenchError>;
}

impl IntoStepResult for Tensor {
    fn into_step_result(self) -> Result<Option<Tensor>, BenchError> {
        Ok(Some(self))
    }
}

impl IntoStepResult for () {
    fn into_step_result(self) -> Result<Option<Tensor>, BenchError> {
        Ok(None)
    }
}

impl<T: IntoStepResult, E: Into<Box<dyn std::error::Error + Send + Sync>>> IntoStepResult
    for Result<T, E>
{
    fn into_step_result(self) -> Result<Option<Tensor>, BenchError> {
        self.map_err(BenchError::new)?.into_step_result()
    }
}

/// How a [`Bencher`] measures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Protocol {
    /// Untimed steps first (capture and autotuning happen here).
    pub warmup: usize,
    /// Timed steps.
    pub steps: usize,
    /// Synchronise the device after every step.
    pub paranoid_sync: bool,
}

/// One workload × configuration measurement.
#[derive(Clone, Debug, Serialize)]
pub struct Measurement {
    /// Per-step times in milliseconds, in order.
    pub times_ms: Vec<f64>,
    /// Median.
    pub median_ms: f64,
    /// 10th percentile.
    pub p10_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// FLOPs per step, when the workload declared them.
    pub flops_per_step: Option<f64>,
    /// TFLOP/s at the median.
    pub tflops: Option<f64>,
    /// Items per step (e.g. tokens) and their unit, when declared.
    pub items_per_step: Option<(f64, &'static str)>,
    /// Device memory of the run (CUDA only).
    pub memory: Option<DeviceMemory>,
    /// The GPU's clock and power over the timed steps (CUDA only, where NVML can be read).
    pub clocks: Option<GpuClocks>,
    /// Why the GPU's clock and power were not read, on CUDA.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clocks_unread: Option<String>,
    /// The last step's loss, when the step returns one.
    pub final_loss: Option<f64>,
    /// Whether the step ran as a replayed CUDA graph.
    pub graphed: bool,
    /// A data-parallel step's collectives on CUDA, and how much of them the step waited for: the
    /// median step, by exposed time, of [`COMMUNICATION_STEPS`] profiled after the timed ones.
    pub communication: Option<Communication>,
    /// Timing method: `cuda-events` or `host-clock`.
    pub timer: &'static str,
    /// Seconds from the bencher's creation (before the workload built its model) to the end of
    /// its first step run as the timed ones run: the first replay of a captured step, after the
    /// eager warm-up, the trace, the fusion plan, its kernels' compilation and the capture; else
    /// the first step. `None` where no step got that far.
    pub first_step_s: Option<f64>,
}

/// A TFLOP/s figure with about three significant digits, so that small CPU runs do not all read
/// `0.0` and large GPU ones carry no false precision.
///
/// ```
/// use speedkit::bench::format_tflops;
/// assert_eq!(format_tflops(781.83), "782");
/// assert_eq!(format_tflops(12.345), "12.3");
/// assert_eq!(format_tflops(0.00178), "1.78e-3");
/// ```
pub fn format_tflops(t: f64) -> String {
    match t {
        t if t >= 100.0 => format!("{t:.0}"),
        t if t >= 10.0 => format!("{t:.1}"),
        t if t >= 1.0 => format!("{t:.2}"),
        t => format!("{t:.2e}"),
    }
}

/// Percentile (nearest-rank on the sorted samples).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// Steps profiled after a data-parallel run's timed steps on CUDA, for its
/// [`communication`](Measurement::communication).
pub const COMMUNICATION_STEPS: usize = 3;

/// Hands a workload its size, device and context, and measures its step.
pub struct Bencher<'a> {
    size: Size,
    ctx: &'a SpeedContext,
    protocol: Protocol,
    flops_per_step: Option<f64>,
    items_per_step: Option<(f64, &'static str)>,
    measurement: Option<Measurement>,
    on_step: Option<&'a dyn Fn()>,
    profile_steps: Option<usize>,
    profile: Option<Profile>,
    fusion_traced: bool,
    fusion_plan: Option<FusionPlan>,
    batch: Option<i64>,
    default_batch: Option<i64>,
    started: Instant,
}

impl<'a> Bencher<'a> {
    /// A bencher for one run.
    pub fn new(size: Size, ctx: &'a SpeedContext, protocol: Protocol) -> Self {
        Self {
            size,
            ctx,
            protocol,
            flops_per_step: None,
            items_per_step: None,
            measurement: None,
            on_step: None,
            profile_steps: None,
            profile: None,
            fusion_traced: false,
            fusion_plan: None,
            batch: None,
            default_batch: None,
            started: Instant::now(),
        }
    }

    /// Build at batch `batch` instead of the workload's own (`--batch`, `--largest-batch`), for the
    /// workloads that take their batch from [`batch`](Self::batch).
    pub fn with_batch(mut self, batch: Option<i64>) -> Self {
        self.batch = batch;
        self
    }

    /// The batch to build: the one the runner asked for, else `default` (the workload's own at
    /// this size). A workload that calls it can be run at any batch, and searched for its largest.
    ///
    /// ```
    /// use speedkit::bench::{Bencher, Protocol, Size};
    /// use speedkit::{SpeedConfig, SpeedContext};
    /// let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n")?)?;
    /// let protocol = Protocol { warmup: 1, steps: 1, paranoid_sync: true };
    /// let mut b = Bencher::new(Size::Tiny, &ctx, protocol).with_batch(Some(48));
    /// assert_eq!(b.batch(8), 48);
    /// assert_eq!(b.default_batch(), Some(8));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn batch(&mut self, default: i64) -> i64 {
        self.default_batch = Some(default);
        self.batch.unwrap_or(default)
    }

    /// The workload's own batch, once it asked for one with [`batch`](Self::batch).
    pub fn default_batch(&self) -> Option<i64> {
        self.default_batch
    }

    /// After the timed steps, profile `steps` more (see [`SpeedContext::profile`]); `None` turns
    /// profiling off. Taken with [`take_profile`](Self::take_profile).
    pub fn with_profile(mut self, steps: Option<usize>) -> Self {
        self.profile_steps = steps;
        self
    }

    /// Takes the profile recorded by [`run`](Self::run) when [`with_profile`](Self::with_profile)
    /// asked for one.
    pub fn take_profile(&mut self) -> Option<Profile> {
        self.profile.take()
    }

    /// Before the warm-up, run two eager steps, the second with its operators traced, and plan its
    /// fusion groups ([`crate::fusion`]); taken with [`take_fusion_plan`](Self::take_fusion_plan).
    pub fn with_fusion_plan(mut self, on: bool) -> Self {
        self.fusion_traced = on;
        self
    }

    /// Takes the fusion plan of the step traced by [`run`](Self::run) when
    /// [`with_fusion_plan`](Self::with_fusion_plan) asked for one.
    pub fn take_fusion_plan(&mut self) -> Option<FusionPlan> {
        self.fusion_plan.take()
    }

    /// Called after every warm-up and timed step (the runner's progress bar).
    pub fn with_progress(mut self, on_step: &'a dyn Fn()) -> Self {
        self.on_step = Some(on_step);
        self
    }

    /// The problem size to build.
    pub fn size(&self) -> Size {
        self.size
    }

    /// The speed context in force (autocast, optimizer, scaler).
    pub fn ctx(&self) -> &'a SpeedContext {
        self.ctx
    }

    /// The device to build on.
    pub fn device(&self) -> Device {
        self.ctx.device()
    }

    /// FLOPs of one step (for TFLOP/s).
    pub fn set_flops_per_step(&mut self, flops: f64) {
        self.flops_per_step = Some(flops);
    }

    /// Items processed per step, e.g. `(16384.0, "tokens")`, for a throughput column.
    pub fn set_items_per_step(&mut self, items: f64, unit: &'static str) {
        self.items_per_step = Some((items, unit));
    }

    /// The measurement, after [`run`](Self::run).
    pub fn measurement(&self) -> Option<&Measurement> {
        self.measurement.as_ref()
    }

    /// Takes the measurement out.
    pub fn take_measurement(&mut self) -> Option<Measurement> {
        self.measurement.take()
    }

    /// Warms up, then times `step` according to the protocol. When the plan captures graphs, the
    /// step is captured once (after warm-up on a side stream) and replayed; a step that cannot be
    /// captured falls back to eager, noted in the context's audit.
    pub fn run<F, R>(&mut self, mut step: F) -> Result<(), BenchError>
    where
        F: FnMut() -> R,
        R: IntoStepResult,
    {
        let ctx = self.ctx;
        if self.fusion_traced {
            // The second step: the first also makes the optimizer's state, which later steps do not.
            step().into_step_result()?;
            let (result, trace) = StepTrace::record(|| step().into_step_result())?;
            result?;
            self.fusion_plan = Some(FusionPlan::from_trace(&trace));
        }
        let profile_steps = self.profile_steps.or_else(|| {
            let data_parallel = ctx.process_group().is_some() && ctx.plan().cuda_index().is_some();
            data_parallel.then_some(COMMUNICATION_STEPS)
        });
        let (mut measurement, profile) = if ctx.plan().compile_graphs {
            let mut compiled = CompiledStep::new(ctx, || {
                step()
                    .into_step_result()
                    .map_err(|e| SpeedkitError::Graph(e.to_string()))
            });
            let m = self.measure(|| compiled.run().map_err(BenchError::from))?;
            let m = Measurement {
                graphed: compiled.is_graphed(),
                ..m
            };
            let profile = profile_steps
                .map(|steps| ctx.profile(steps, || compiled.run()))
                .transpose()?;
            (m, profile)
        } else {
            let m = self.measure(|| step().into_step_result())?;
            let profile = profile_steps
                .map(|steps| profile_eager(ctx, steps, &mut step))
                .transpose()?;
            (m, profile)
        };
        measurement.communication = profile.as_ref().and_then(median_communication);
        self.measurement = Some(measurement);
        if self.profile_steps.is_some() {
            self.profile = profile;
        }
        Ok(())
    }

    fn measure(
        &self,
        mut step: impl FnMut() -> Result<Option<Tensor>, BenchError>,
    ) -> Result<Measurement, BenchError> {
        let cuda = self.ctx.plan().cuda_index();
        let tick = || {
            if let Some(f) = self.on_step {
                f()
            }
        };
        let probe = cuda.map(MemoryProbe::start).transpose()?;
        let mut first_step_s = None;
        for _ in 0..self.protocol.warmup {
            step()?;
            if first_step_s.is_none() {
                first_step_s = self.first_step_done(cuda)?;
            }
            tick();
        }
        let warmup_peaks = probe.as_ref().map(MemoryProbe::end_warmup).transpose()?;
        let sampler = cuda.map(ClockSampler::start);
        let mut times = Vec::with_capacity(self.protocol.steps);
        let mut last = None;
        match cuda {
            Some(i) => {
                let mut pending = Vec::with_capacity(self.protocol.steps);
                for _ in 0..self.protocol.steps {
                    let (start, end) = (
                        ffi::device::CudaEvent::new()?,
                        ffi::device::CudaEvent::new()?,
                    );
                    start.record()?;
                    last = step()?;
                    end.record()?;
                    if first_step_s.is_none() {
                        first_step_s = self.first_step_done(cuda)?;
                    }
                    if self.protocol.paranoid_sync {
                        ffi::device::cuda_synchronize(i)?;
                        times.push(start.elapsed_ms(&end)?);
                    } else {
                        pending.push((start, end));
                    }
                    tick();
                }
                for (start, end) in pending {
                    times.push(start.elapsed_ms(&end)?);
                }
            }
            None => {
                for _ in 0..self.protocol.steps {
                    let t0 = Instant::now();
                    last = step()?;
                    times.push(t0.elapsed().as_secs_f64() * 1e3);
                    if first_step_s.is_none() {
                        first_step_s = self.first_step_done(cuda)?;
                    }
                    tick();
                }
            }
        }
        let (clocks, clocks_unread) = match sampler {
            Some(Ok(sampler)) => (sampler.finish(), None),
            Some(Err(why)) => (None, Some(why.to_string())),
            None => (None, None),
        };
        let memory = match (&probe, warmup_peaks) {
            (Some(probe), Some(warmup)) => Some(probe.finish(warmup, self.ctx.optimizer_memory())?),
            _ => None,
        };
        let final_loss = match last {
            Some(t) if t.numel() == 1 => Some(t.f_double_value(&[]).map_err(SpeedkitError::from)?),
            _ => None,
        };
        let mut sorted = times.clone();
        sorted.sort_by(f64::total_cmp);
        let median_ms = percentile(&sorted, 50.0);
        Ok(Measurement {
            median_ms,
            p10_ms: percentile(&sorted, 10.0),
            p90_ms: percentile(&sorted, 90.0),
            times_ms: times,
            flops_per_step: self.flops_per_step,
            tflops: self.flops_per_step.map(|f| f / (median_ms * 1e-3) / 1e12),
            items_per_step: self.items_per_step,
            memory,
            clocks,
            clocks_unread,
            final_loss,
            graphed: false,
            communication: None,
            timer: if cuda.is_some() {
                "cuda-events"
            } else {
                "host-clock"
            },
            first_step_s,
        })
    }

    /// After a step: the seconds since the bencher's creation, once the device finished, where
    /// the step ran as the timed ones will (anything but a captured step's eager warm-up).
    fn first_step_done(&self, cuda: Option<usize>) -> Result<Option<f64>, BenchError> {
        if crate::graph::take_last_step_kind() == Some(crate::graph::StepKind::GraphWarmup) {
            return Ok(None);
        }
        if let Some(i) = cuda {
            ffi::device::cuda_synchronize(i)?;
        }
        Ok(Some(self.started.elapsed().as_secs_f64()))
    }
}

/// The profiled step with the median exposed communication, where the steps ran collectives.
fn median_communication(profile: &Profile) -> Option<Communication> {
    let mut steps: Vec<Communication> = profile
        .steps
        .iter()
        .filter_map(|s| s.communication.clone())
        .collect();
    steps.sort_by(|a, b| a.exposed_ms.total_cmp(&b.exposed_ms));
    let middle = steps.len() / 2;
    steps.into_iter().nth(middle)
}

/// Profiles an eager workload step, handing back the step's own error if it fails.
fn profile_eager<R: IntoStepResult>(
    ctx: &SpeedContext,
    steps: usize,
    step: &mut impl FnMut() -> R,
) -> Result<Profile, BenchError> {
    let mut failure = None;
    let profile = ctx.profile(steps, || {
        step().into_step_result().map_err(|e| {
            let message = e.to_string();
            failure = Some(e);
            SpeedkitError::Misuse(message)
        })
    });
    match (profile, failure) {
        (Ok(profile), _) => Ok(profile),
        (Err(_), Some(step_error)) => Err(step_error),
        (Err(e), None) => Err(e.into()),
    }
}

/// Generates `fn main()` for a benchmark runner over the `#[speedkit::bench]` workloads of the
/// crates or modules it names, with the command line described in [`runner`]. It comes with
/// speedkit's `runner` feature (clap, indicatif).
///
/// Name where the workloads are, as a path: a crate (`my_crate`, your library, from a `[[bench]]`
/// target of its package or of another), a module of the target itself (`workloads`, declared
/// with `mod workloads;`), or `crate` for workloads written in the target's own file. Several are
/// separated by commas. Each becomes `use PATH as _;`: a crate that is not named is not linked,
/// and its workloads would silently not be there; a name that does not resolve is a compile error.
///
/// In `benches/workloads.rs`, with `[[bench]] name = "workloads"`, `harness = false` in
/// `Cargo.toml`:
///
/// ```no_run
/// # mod my_crate {}
/// speedkit::bench_main!(my_crate);
/// ```
///
/// Then `cargo bench --bench workloads -- --filter mlp --config fp32_strict --config auto`.
///
/// Without a name it does not compile:
///
/// ```compile_fail
/// speedkit::bench_main!();
/// ```
#[cfg(feature = "runner")]
#[macro_export]
macro_rules! bench_main {
    () => {
        ::core::compile_error!(
            "name the crate (or module) whose workloads to run: \
             `speedkit::bench_main!(my_crate);`"
        );
        // Keeps the error above the only one (no "`main` function not found" after it).
        fn main() -> ::std::process::ExitCode {
            $crate::bench::runner::main()
        }
    };
    ($($($workloads:ident)::+),+ $(,)?) => {
        // Named only to be linked (a crate) or to be checked to exist (a module).
        $(#[allow(unused_imports)] use $($workloads)::+ as _;)+

        fn main() -> ::std::process::ExitCode {
            $crate::bench::runner::main()
        }
    };
}

/// Generates `fn main()` for a `harness = false` test target: one test per `#[speedkit::bench]`
/// workload of the crates or modules it names (tiny size, CPU), each checking a finite loss and
/// that every flag is restored. It comes with speedkit's `runner` feature (libtest-mimic).
///
/// Workloads are named as for [`bench_main!`](crate::bench_main). In `tests/workloads.rs`, with
/// `[[test]] name = "workloads"`, `harness = false` in `Cargo.toml`:
///
/// ```no_run
/// # mod my_crate {}
/// speedkit::bench_tests!(my_crate);
/// ```
///
/// Then `cargo test --test workloads`.
///
/// Without a name it does not compile:
///
/// ```compile_fail
/// speedkit::bench_tests!();
/// ```
#[cfg(feature = "runner")]
#[macro_export]
macro_rules! bench_tests {
    () => {
        ::core::compile_error!(
            "name the crate (or module) whose workloads to test: \
             `speedkit::bench_tests!(my_crate);`"
        );
        // Keeps the error above the only one (no "`main` function not found" after it).
        fn main() -> ::std::process::ExitCode {
            $crate::bench::testing::main()
        }
    };
    ($($($workloads:ident)::+),+ $(,)?) => {
        // Named only to be linked (a crate) or to be checked to exist (a module).
        $(#[allow(unused_imports)] use $($workloads)::+ as _;)+

        fn main() -> ::std::process::ExitCode {
            $crate::bench::testing::main()
        }
    };
}
