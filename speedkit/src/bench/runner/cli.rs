//! The runner's command line: its `main`, [`Args`], and what the arguments resolve to
//! (configurations, size, timing protocol).

use clap::Parser;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::run::main_with;
use crate::bench::{Protocol, Size, Workload};
use crate::config::{AutoBool, Precision, SpeedConfig};
use crate::error::{Result, SpeedkitError};

/// The runner's `main`: every registered workload.
pub fn main() -> ExitCode {
    ExitCode::from(main_with(&Args::parse(), &Workload::all()))
}

/// Command line of the runner.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "speedkit-bench",
    about = "Run speedkit's registered workloads under several configurations"
)]
pub struct Args {
    /// List the registered workloads and exit.
    #[arg(long)]
    pub list: bool,
    /// Only workloads whose name contains PAT or that carry the tag PAT (repeatable).
    #[arg(long = "filter", value_name = "PAT")]
    pub filters: Vec<String>,
    /// A filter matches a whole workload name only (as libtest's --exact).
    #[arg(long)]
    pub exact: bool,
    /// A configuration: preset name (fp32_strict, tf32, auto), bf16, fp16, or a YAML/JSON file (repeatable).
    #[arg(long = "config", value_name = "NAME|FILE")]
    pub configs: Vec<String>,
    /// Problem size [default: bench on a GPU, tiny on a CPU].
    #[arg(long, value_parser = ["tiny", "bench"])]
    pub size: Option<String>,
    /// Timed steps [default: the config's bench.steps].
    #[arg(long)]
    pub steps: Option<usize>,
    /// Warm-up steps [default: the config's bench.warmup].
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Synchronise the device after every timed step (the reference protocol; default on).
    #[arg(long, overrides_with = "no_paranoid_sync")]
    pub paranoid_sync: bool,
    /// Queue timed steps back to back, timing each between CUDA events.
    #[arg(long)]
    pub no_paranoid_sync: bool,
    /// Write all results as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the result table as CSV.
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,
    /// Draw speedups per workload as an SVG bar chart.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Use this device peak (TFLOP/s) for "% of peak" instead of measuring a bf16 matmul.
    #[arg(long, value_name = "TFLOPS")]
    pub peak_tflops: Option<f64>,
    /// Save this run (every step time, environment, configs) as a baseline: a NAME is stored in
    /// target/speedkit/baselines/NAME.json ($CARGO_TARGET_DIR/speedkit/baselines with that set);
    /// a path ending in .json is written as given.
    #[arg(long, value_name = "NAME|FILE")]
    pub save_baseline: Option<String>,
    /// Compare every row with a saved baseline (a NAME, or a report written by --json): ratio of
    /// medians, 95% confidence interval, verdict.
    #[arg(long, value_name = "NAME|FILE")]
    pub baseline: Option<String>,
    /// Changes smaller than this many percent count as "no change".
    #[arg(long, value_name = "PCT", default_value_t = 1.0, requires = "baseline")]
    pub noise_threshold: f64,
    /// Exit with status 1 when a row is slower than the baseline by more than PCT percent with 95%
    /// confidence.
    #[arg(long, value_name = "PCT", requires = "baseline")]
    pub fail_above: Option<f64>,
    /// Time the same workloads in PyTorch (docs/benchmarks/pytorch_reference.py) in this run.
    #[arg(long, value_parser = ["pytorch"])]
    pub peer: Option<String>,
    /// The Python (with torch) for --peer [default: .venv/bin/python here or in a parent
    /// directory, else python3].
    #[arg(long, value_name = "PATH", requires = "peer")]
    pub python: Option<PathBuf>,
    /// After timing, profile STEPS more steps of each run [default: 3]: kernel tables printed,
    /// JSON and Chrome trace written to speedkit-profile/.
    #[arg(long, value_name = "STEPS", num_args = 0..=1, default_missing_value = "3")]
    pub profile: Option<usize>,
    /// Before timing, trace the second eager step of each run and print its fusion plan: which of
    /// its kernels one generated kernel could run together, and which stay ATen's.
    #[arg(long)]
    pub fusion_plan: bool,
    /// Record the CUDA caching allocator's history over each run (model built, warm-up, capture,
    /// timed steps) and write it to DIR/WORKLOAD-CONFIG.pickle, for PyTorch's memory visualiser
    /// (see speedkit::memory::MemoryHistory). Allocation is slower while it records.
    #[arg(long, value_name = "DIR")]
    pub memory_history: Option<PathBuf>,
    /// Build the workloads that take a batch (`Bencher::batch`) at N instead of their own.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(i64).range(1..))]
    pub batch: Option<i64>,
    /// Instead of timing, find the largest batch each workload that takes one trains at, under
    /// each config (and in PyTorch's reduce-overhead mode with --peer pytorch).
    #[arg(long, conflicts_with_all = ["batch", "baseline", "save_baseline", "profile", "memory_history"])]
    pub largest_batch: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    pub bench: bool,
}

/// A named configuration.
#[derive(Clone, Debug, Serialize)]
pub struct NamedConfig {
    /// As given on the command line (file stem for files).
    pub name: String,
    /// The configuration.
    pub config: SpeedConfig,
}

/// Resolves a `--config` argument.
pub fn resolve_config(arg: &str) -> Result<NamedConfig> {
    let path = Path::new(arg);
    let config = if arg == "bf16" || arg == "fp16" {
        let precision = if arg == "bf16" {
            Precision::Bf16
        } else {
            Precision::Fp16
        };
        // Plain bf16/fp16 GEMMs: the baseline FP8 is compared against.
        let mut config = SpeedConfig {
            precision,
            ..SpeedConfig::auto()
        };
        config.fp8.enabled = AutoBool::Off;
        config
    } else if path.extension().is_some_and(|e| e == "json") {
        SpeedConfig::from_json(path)?
    } else if path.exists() || arg.ends_with(".yaml") || arg.ends_with(".yml") {
        SpeedConfig::from_yaml(path)?
    } else {
        // A preset, or the preset lookup's "did you mean" error.
        SpeedConfig::preset(arg)?
    };
    let name = if path.exists() {
        path.file_stem()
            .map_or(arg.to_string(), |s| s.to_string_lossy().into_owned())
    } else {
        arg.to_string()
    };
    Ok(NamedConfig { name, config })
}

/// The `--config` arguments resolved, in order (`fp32_strict` and `auto` without any).
pub(super) fn configs_of(args: &Args) -> Result<Vec<NamedConfig>> {
    let names = if args.configs.is_empty() {
        vec!["fp32_strict".to_string(), "auto".to_string()]
    } else {
        args.configs.clone()
    };
    names
        .iter()
        .map(|n| resolve_config(n))
        .collect::<Result<Vec<_>>>()
}

/// `--size`, else bench on a GPU and tiny on a CPU.
pub(super) fn size_of(args: &Args, on_gpu: bool) -> Size {
    match args.size.as_deref() {
        Some(s) => Size::parse(s).unwrap_or(Size::Tiny),
        None if on_gpu => Size::Bench,
        None => Size::Tiny,
    }
}

/// `--peer` times single-process PyTorch: under a launcher (`world_size` > 1) it is refused.
pub(super) fn check_peer(args: &Args, world_size: usize) -> Result<()> {
    if world_size > 1 && args.peer.is_some() {
        return Err(SpeedkitError::Misuse(
            "--peer pytorch times single-process PyTorch, not a data-parallel run: under a \
             launcher, time the peer with `torchrun --nproc-per-node N \
             docs/benchmarks/pytorch_reference.py --ddp` (or `--fsdp`; \
             docs/benchmarks/multi_gpu.sh runs them all)"
                .into(),
        ));
    }
    Ok(())
}

/// The timing protocol: `--warmup`, `--steps` and the sync flags over the first config's `bench`.
pub(super) fn protocol_of(args: &Args, first: &SpeedConfig) -> Protocol {
    let bench = &first.bench;
    Protocol {
        warmup: args.warmup.unwrap_or(bench.warmup as usize),
        steps: args.steps.unwrap_or(bench.steps as usize).max(1),
        paranoid_sync: if args.no_paranoid_sync {
            false
        } else {
            args.paranoid_sync || bench.paranoid_sync
        },
    }
}
