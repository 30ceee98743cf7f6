//! The benchmark runner behind [`bench_main!`](crate::bench_main).
//!
//! ```text
//! cargo bench --bench workloads -- [--list] [--filter PAT]... [--config NAME|FILE]... [--size tiny|bench]
//!     [--steps N] [--warmup N] [--paranoid-sync|--no-paranoid-sync] [--json FILE] [--csv FILE] [--svg FILE]
//!     [--save-baseline NAME] [--baseline NAME|FILE [--noise-threshold PCT] [--fail-above PCT]]
//!     [--peer pytorch [--python PATH]] [--profile [STEPS]]
//! ```
//! Configurations run side by side in one process (comparisons are only valid within one run); the
//! first is the one the speedup column divides by. `--config` takes a preset (`fp32_strict`,
//! `tf32`, `auto`), `bf16`/`fp16` (auto with that precision), or a YAML/JSON file.
//!
//! `--save-baseline`/`--baseline` keep a run and judge a later one against it
//! ([`baseline`]); `--peer pytorch` times the same workloads in PyTorch in the
//! same run ([`peer`]). Exit status: 0, 1 when a workload failed or a row is slower
//! than the baseline beyond `--fail-above`, 2 for bad input (including no workload to run).
//!
//! Under `speedkit launch --nproc-per-node N -- <runner>` (or torchrun) every rank runs every
//! workload data-parallel, and rank 0 alone prints and writes files: each row then carries every
//! rank's median ([`DataParallelRow`]) and the throughput per GPU and in total.

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tch::{Device, Kind, Tensor};

use super::baseline::{self, Baseline, Comparison};
use super::peer::{self, PeerReport};
use super::{Bencher, DeviceMemory, Measurement, Protocol, Size, Workload};
use crate::config::{AutoBool, Precision, SpeedConfig};
use crate::dist::{LaunchEnv, ProcessGroup, Throughput};
use crate::error::{Result, SpeedkitError};
use crate::ffi;
use crate::hardware::Hardware;
use crate::report::table;
use crate::SpeedContext;

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

/// One workload × config result.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Workload name.
    pub workload: String,
    /// Config name.
    pub config: String,
    /// Size run.
    pub size: Size,
    /// The measurement, or `None` if it failed.
    pub measurement: Option<Measurement>,
    /// Median speedup over the first config of the same workload.
    pub speedup: Option<f64>,
    /// TFLOP/s as a percentage of the measured device peak.
    pub percent_of_peak: Option<f64>,
    /// Precision the plan resolved to.
    pub precision: String,
    /// Flags changed by the config (name = value).
    pub flags: Vec<String>,
    /// Notes from the context (graph capture, fall-backs).
    pub notes: Vec<String>,
    /// The ops that ran on speedkit's own kernels ([`crate::kernels`]); empty when none did.
    pub kernels: Vec<String>,
    /// Error message if the run failed.
    pub error: Option<String>,
    /// Every rank's figures, when the row ran data-parallel under a launcher.
    pub data_parallel: Option<DataParallelRow>,
}

/// A row measured by every rank of a data-parallel run. The row's own figures are rank 0's.
#[derive(Clone, Debug, Serialize)]
pub struct DataParallelRow {
    /// Ranks that trained together.
    pub world_size: usize,
    /// Their transport, `gloo` or `nccl`.
    pub backend: String,
    /// Each rank's median step time, ms, in rank order (NaN for a rank whose run failed).
    pub median_ms_per_rank: Vec<f64>,
    /// Items/s per rank, per GPU and in total, when the workload declares its items per step.
    pub throughput: Option<Throughput>,
}

impl DataParallelRow {
    /// Gathers every rank's median (a collective: every rank calls it, also when its own run
    /// failed, with `None`).
    fn gather(group: &ProcessGroup, mine: Option<&Measurement>) -> Result<Self> {
        let median_ms_per_rank = group.all_gather_f64(mine.map_or(f64::NAN, |m| m.median_ms))?;
        let throughput = mine.and_then(|m| m.items_per_step).map(|(items, unit)| {
            let rates = median_ms_per_rank
                .iter()
                .map(|ms| items / (ms * 1e-3))
                .collect();
            Throughput::from_rates(unit, rates)
        });
        Ok(Self {
            world_size: group.world_size(),
            backend: group.backend().to_string(),
            median_ms_per_rank,
            throughput,
        })
    }
}

/// Version of the layout of [`RunReport`]'s JSON; bumped whenever a field changes meaning or
/// moves. 2: memory as [`DeviceMemory`], baselines and peers (later
/// additions: `world_size`, rows' `data_parallel`).
pub const REPORT_SCHEMA_VERSION: u32 = 2;

/// The whole run, as written by `--json` and `--save-baseline`.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// [`REPORT_SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Hardware and software.
    pub environment: Hardware,
    /// Processes of the run: 1, or the launcher's `WORLD_SIZE` (the table's figures are rank 0's;
    /// each row's `data_parallel` has every rank's).
    pub world_size: usize,
    /// The device peak used for "% of peak", TFLOP/s.
    pub peak_tflops: Option<f64>,
    /// How the peak was obtained.
    pub peak_source: String,
    /// Timing protocol.
    pub protocol: Protocol,
    /// Configurations, in order.
    pub configs: Vec<NamedConfig>,
    /// Results.
    pub rows: Vec<Row>,
    /// The comparison with `--baseline`.
    pub baseline: Option<Comparison>,
    /// The `--peer` run.
    pub peer: Option<PeerReport>,
}

/// Measures the dense bf16 matmul rate of `device` (8192³, median of 20 after 5 warm-ups).
pub fn measure_matmul_peak(device: Device) -> Result<f64> {
    let Device::Cuda(index) = device else {
        return Err(SpeedkitError::Unsupported(
            "peak measurement needs a CUDA device".into(),
        ));
    };
    let n = 8192i64;
    let a = Tensor::f_randn([n, n], (Kind::BFloat16, device))?;
    let b = Tensor::f_randn([n, n], (Kind::BFloat16, device))?;
    let mut times = Vec::new();
    for i in 0..25 {
        let (start, end) = (
            ffi::device::CudaEvent::new()?,
            ffi::device::CudaEvent::new()?,
        );
        start.record()?;
        let _c = a.f_matmul(&b)?;
        end.record()?;
        ffi::device::cuda_synchronize(index)?;
        if i >= 5 {
            times.push(start.elapsed_ms(&end)?);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * (n as f64).powi(3) / (super::percentile(&times, 50.0) * 1e-3) / 1e12)
}

/// The runner's `main`: every registered workload.
pub fn main() -> ExitCode {
    ExitCode::from(main_with(&Args::parse(), &Workload::all()))
}

/// Runs `workloads` as `args` say, printing errors; returns the exit status (see the module docs).
pub fn main_with(args: &Args, workloads: &[&Workload]) -> u8 {
    match run_with(args, workloads) {
        Ok(report) => exit_status(args, &report),
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
    }
}

/// 1 when a row failed or is slower than the baseline beyond `--fail-above` (each said on
/// stderr), 0 otherwise.
pub fn exit_status(args: &Args, report: &RunReport) -> u8 {
    let mut status = 0;
    if report.rows.iter().any(|r| r.error.is_some()) {
        status = 1;
    }
    if let (Some(pct), Some(comparison)) = (args.fail_above, &report.baseline) {
        for (r, c) in comparison.slower_beyond(pct) {
            eprintln!(
                "regression: {} / {} takes {:.3}x the baseline's time (95% CI {:.3}-{:.3}), \
                 slower beyond --fail-above {pct}%",
                r.workload, r.config, c.ratio, c.low, c.high
            );
            status = 1;
        }
    }
    status
}

/// Runs every registered workload `args` selects and prints/writes the results.
pub fn run(args: &Args) -> Result<RunReport> {
    run_with(args, &Workload::all())
}

/// Runs those of `workloads` that `args` selects and prints/writes the results.
pub fn run_with(args: &Args, workloads: &[&Workload]) -> Result<RunReport> {
    let selected = select(workloads, &args.filters)?;
    let hardware = Hardware::detect()?;
    let launch = LaunchEnv::from_env()?;
    let main = launch.as_ref().is_none_or(LaunchEnv::is_main);
    if args.list {
        if main {
            print_list(&selected);
        }
        return Ok(RunReport::empty(hardware));
    }
    let world_size = launch.as_ref().map_or(1, |e| e.world_size);
    if world_size > 1 && args.peer.is_some() {
        return Err(SpeedkitError::Misuse(
            "--peer pytorch times single-process PyTorch, not a data-parallel run: under a \
             launcher, time the peer with `torchrun --nproc-per-node N \
             docs/benchmarks/pytorch_reference.py --ddp` (docs/benchmarks/multi_gpu.sh runs both)"
                .into(),
        ));
    }
    let names = if args.configs.is_empty() {
        vec!["fp32_strict".to_string(), "auto".to_string()]
    } else {
        args.configs.clone()
    };
    let configs = names
        .iter()
        .map(|n| resolve_config(n))
        .collect::<Result<Vec<_>>>()?;
    // Bad baseline arguments fail before anything is measured.
    let baseline = args.baseline.as_deref().map(Baseline::load).transpose()?;
    if let Some(name) = &args.save_baseline {
        baseline::path_for(name)?;
    }
    let on_gpu = !hardware.gpus.is_empty();
    let size = match args.size.as_deref() {
        Some(s) => Size::parse(s).unwrap_or(Size::Tiny),
        None if on_gpu => Size::Bench,
        None => Size::Tiny,
    };
    let protocol = protocol_of(args, &configs[0].config);
    let (peak_tflops, peak_source) = device_peak(args, on_gpu, launch.as_ref())?;
    let rows = measure_all(
        &selected,
        &configs,
        size,
        &protocol,
        peak_tflops,
        on_gpu,
        args.profile,
    );
    let peer = args
        .peer
        .as_ref()
        .map(|name| run_peer(name, args, &rows, size, &protocol));
    let comparison = baseline.map(|b| {
        baseline::compare(
            &b,
            &rows,
            &hardware,
            &protocol,
            args.noise_threshold / 100.0,
        )
    });
    let report = RunReport {
        schema_version: REPORT_SCHEMA_VERSION,
        environment: hardware,
        world_size,
        peak_tflops,
        peak_source,
        protocol,
        configs,
        rows,
        baseline: comparison,
        peer,
    };
    // Every rank has the same rows; one copy of the tables and files is enough.
    if main {
        println!("{}", render_text(&report));
        write_outputs(args, &report)?;
    }
    Ok(report)
}

/// The workloads matching any of `filters` (all when there is none); no workload at all, or none
/// matching, is an error that says how to fix it.
pub fn select<'w>(workloads: &[&'w Workload], filters: &[String]) -> Result<Vec<&'w Workload>> {
    if workloads.is_empty() {
        return Err(SpeedkitError::Misuse(
            "no workloads are registered in this benchmark runner: it runs the \
             `#[speedkit::bench]` functions of the crate it names, so write \
             `speedkit::bench_main!(your_crate);` with the crate that defines them (a dependency \
             of this bench target)"
                .into(),
        ));
    }
    let selected: Vec<&Workload> = workloads
        .iter()
        .copied()
        .filter(|w| filters.is_empty() || filters.iter().any(|f| w.matches(f)))
        .collect();
    if selected.is_empty() {
        let names: Vec<&str> = workloads.iter().map(|w| w.name).collect();
        return Err(SpeedkitError::Misuse(format!(
            "--filter {} matches no workload: a filter is part of a name or a whole tag; the \
             workloads are {} (see --list)",
            filters.join(" --filter "),
            names.join(", ")
        )));
    }
    Ok(selected)
}

fn print_list(workloads: &[&Workload]) {
    let rows: Vec<Vec<String>> = workloads
        .iter()
        .map(|w| {
            vec![
                w.name.to_string(),
                w.tags.join(","),
                w.sizes
                    .iter()
                    .map(Size::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
                if w.cuda_only { "cuda" } else { "any" }.to_string(),
                format!("{}:{}", w.file, w.line),
            ]
        })
        .collect();
    print!(
        "{}",
        table(
            &["workload", "tags", "sizes", "device", "defined at"],
            &rows
        )
    );
}

impl RunReport {
    fn empty(environment: Hardware) -> Self {
        RunReport {
            schema_version: REPORT_SCHEMA_VERSION,
            environment,
            world_size: 1,
            peak_tflops: None,
            peak_source: String::new(),
            protocol: Protocol {
                warmup: 0,
                steps: 0,
                paranoid_sync: true,
            },
            configs: vec![],
            rows: vec![],
            baseline: None,
            peer: None,
        }
    }
}

fn protocol_of(args: &Args, first: &SpeedConfig) -> Protocol {
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

/// The peak for "% of peak". Under a launcher only rank 0 (which prints) measures it, on its own
/// device: the other ranks' devices are busy with nothing else yet, but they print no table.
fn device_peak(
    args: &Args,
    on_gpu: bool,
    launch: Option<&LaunchEnv>,
) -> Result<(Option<f64>, String)> {
    Ok(match (args.peak_tflops, on_gpu, launch) {
        (Some(p), _, _) => (Some(p), "given with --peak-tflops".to_string()),
        (None, true, Some(env)) if !env.is_main() => (None, "measured by rank 0".to_string()),
        (None, true, _) => (
            Some(measure_matmul_peak(Device::Cuda(
                launch.map_or(0, |env| env.local_rank),
            ))?),
            "measured: 8192^3 bf16 matmul, median of 20".to_string(),
        ),
        (None, false, _) => (None, "no GPU: no peak".to_string()),
    })
}

fn measure_all(
    workloads: &[&Workload],
    configs: &[NamedConfig],
    size: Size,
    protocol: &Protocol,
    peak_tflops: Option<f64>,
    on_gpu: bool,
    profile: Option<usize>,
) -> Vec<Row> {
    let mut rows = Vec::new();
    let main = crate::dist::is_main_process();
    for w in workloads {
        let skip = if w.cuda_only && !on_gpu {
            Some("needs a CUDA device".to_string())
        } else if !w.sizes.contains(&size) {
            Some(format!("no {size} size"))
        } else {
            None
        };
        if let Some(why) = skip {
            if main {
                eprintln!("skip {}: {why}", w.name);
            }
            continue;
        }
        let mut first_median: Option<f64> = None;
        for nc in configs {
            let row = run_one(w, nc, size, protocol, peak_tflops, profile);
            if let Some(m) = &row.measurement {
                let base = *first_median.get_or_insert(m.median_ms);
                rows.push(Row {
                    speedup: Some(base / m.median_ms),
                    ..row
                });
            } else {
                eprintln!(
                    "error: {} under {}: {}",
                    w.name,
                    nc.name,
                    row.error.as_deref().unwrap_or("?")
                );
                rows.push(row);
            }
        }
    }
    rows
}

/// Runs the peer on the workloads that produced rows; when it cannot run, says why in one line.
fn run_peer(name: &str, args: &Args, rows: &[Row], size: Size, protocol: &Protocol) -> PeerReport {
    let mut workloads: Vec<String> = Vec::new();
    for r in rows.iter().filter(|r| r.measurement.is_some()) {
        if !workloads.contains(&r.workload) {
            workloads.push(r.workload.clone());
        }
    }
    if workloads.is_empty() {
        return PeerReport {
            peer: name.to_string(),
            run: None,
            not_run: Some("no speedkit row was measured, so there is nothing to compare".into()),
        };
    }
    let python = peer::find_python(args.python.as_deref());
    eprintln!(
        "running the PyTorch peer with {} on {} ...",
        python.display(),
        workloads.join(", ")
    );
    match peer::run_pytorch(&python, &workloads, &size.to_string(), protocol) {
        Ok(run) if run.rows.is_empty() => PeerReport {
            peer: name.to_string(),
            run: None,
            not_run: Some(format!(
                "the reference has no PyTorch version of {} (it has {})",
                workloads.join(", "),
                peer::REFERENCE_WORKLOADS.join(", ")
            )),
        },
        Ok(run) => PeerReport {
            peer: name.to_string(),
            run: Some(run),
            not_run: None,
        },
        Err(why) => PeerReport {
            peer: name.to_string(),
            run: None,
            not_run: Some(why),
        },
    }
}

fn run_one(
    w: &Workload,
    nc: &NamedConfig,
    size: Size,
    protocol: &Protocol,
    peak: Option<f64>,
    profile: Option<usize>,
) -> Row {
    let mut row = Row {
        workload: w.name.to_string(),
        config: nc.name.clone(),
        size,
        measurement: None,
        speedup: None,
        percent_of_peak: None,
        precision: String::new(),
        flags: Vec::new(),
        notes: Vec::new(),
        kernels: Vec::new(),
        error: None,
        data_parallel: None,
    };
    let ctx = match SpeedContext::new(&nc.config) {
        Ok(c) => c,
        Err(e) => {
            row.error = Some(e.to_string());
            return row;
        }
    };
    row.precision = ctx.plan().precision.to_string();
    let bar = if ctx.is_main() {
        ProgressBar::new((protocol.warmup + protocol.steps) as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{prefix:>28} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(format!("{} / {}", w.name, nc.name));
    let tick = || bar.inc(1);
    let mut b = Bencher::new(size, &ctx, protocol.clone())
        .with_progress(&tick)
        .with_profile(profile);
    let _ = crate::kernels::take_ops_run();
    let outcome = (w.run)(&mut b);
    row.kernels = crate::kernels::take_ops_run()
        .into_iter()
        .map(String::from)
        .collect();
    bar.finish_and_clear();
    let profile = b.take_profile();
    let measurement = b.take_measurement();
    if let Some(group) = ctx.process_group() {
        match DataParallelRow::gather(group, measurement.as_ref()) {
            Ok(d) => row.data_parallel = Some(d),
            Err(e) => row.error = Some(e.to_string()),
        }
    }
    let audit = ctx.audit();
    row.flags = audit
        .flag_changes
        .iter()
        .filter(|c| c.changed())
        .map(|c| format!("{} = {}", c.name, c.after))
        .collect();
    row.notes = audit.notes;
    if let Some(p) = profile {
        let (title, stem) = (
            format!("{} / {}", w.name, nc.name),
            format!("{}-{}", w.name, nc.name),
        );
        let dir = Path::new(crate::profile::DEFAULT_OUTPUT_DIR);
        if let Err(e) = p.print_and_write(&title, dir, &stem) {
            row.notes.push(format!("profile not written: {e}"));
        }
    }
    match (outcome, measurement) {
        (Err(e), _) => row.error = Some(e.to_string()),
        (Ok(()), None) => row.error = Some("the workload never called Bencher::run".into()),
        // The gather across ranks failed (already in `row.error`).
        (Ok(()), Some(_)) if row.error.is_some() => {}
        (Ok(()), Some(m)) => {
            row.percent_of_peak = match (m.tflops, peak) {
                (Some(t), Some(p)) => Some(100.0 * t / p),
                _ => None,
            };
            row.measurement = Some(m);
        }
    }
    row
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.digits$}"))
}

/// The human-readable result: the time table, the memory table, the baseline and peer sections
/// when asked for, then the environment block. Each table fits 100 columns for the reference
/// workloads.
pub fn render_text(report: &RunReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nspeedkit benchmarks — size {}, {} warm-up + {} timed steps, paranoid sync {}; times in ms",
        report
            .rows
            .first()
            .map_or("-".to_string(), |r| r.size.to_string()),
        report.protocol.warmup,
        report.protocol.steps,
        if report.protocol.paranoid_sync {
            "on"
        } else {
            "off"
        }
    );
    out.push_str(&time_table(report));
    out.push_str(
        "\ndevice memory in GiB, and output. kernels: speedkit's own kernels ran. peak: allocated over the\n\
         whole run (warm-up and graph capture included); resv: reserved over the whole run; steady:\n\
         allocated in timed steps\n",
    );
    out.push_str(&memory_table(report));
    if report.rows.iter().any(|r| r.data_parallel.is_some()) {
        out.push_str(&data_parallel_table(report));
    }
    if let Some(c) = &report.baseline {
        out.push_str(&c.render());
    }
    if let Some(p) = &report.peer {
        out.push_str(&render_peer(report, p));
    }
    out.push_str(&environment_block(report));
    out
}

fn failed_row(r: &Row) -> Vec<String> {
    vec![
        r.workload.clone(),
        r.config.clone(),
        format!("FAILED: {}", r.error.as_deref().unwrap_or("?")),
    ]
}

fn time_table(report: &RunReport) -> String {
    let rows: Vec<Vec<String>> = report
        .rows
        .iter()
        .map(|r| match &r.measurement {
            Some(m) => vec![
                r.workload.clone(),
                r.config.clone(),
                format!("{:.3}", m.median_ms),
                format!("{:.3}", m.p10_ms),
                format!("{:.3}", m.p90_ms),
                r.speedup.map_or("-".into(), |s| format!("{s:.2}x")),
                m.tflops.map_or_else(|| "-".into(), super::format_tflops),
                fmt_opt(r.percent_of_peak, 1),
            ],
            None => failed_row(r),
        })
        .collect();
    table(
        &[
            "workload", "config", "median", "p10", "p90", "speedup", "TFLOP/s", "% peak",
        ],
        &rows,
    )
}

fn memory_table(report: &RunReport) -> String {
    let rows: Vec<Vec<String>> = report
        .rows
        .iter()
        .map(|r| match &r.measurement {
            Some(m) => {
                let gib = |pick: fn(&DeviceMemory) -> u64| {
                    m.memory
                        .map_or("-".into(), |mem| format!("{:.2}", mem.gib(pick(&mem))))
                };
                vec![
                    r.workload.clone(),
                    r.config.clone(),
                    if m.graphed { "yes" } else { "no" }.to_string(),
                    if r.kernels.is_empty() { "no" } else { "yes" }.to_string(),
                    gib(|mem| mem.peak_allocated_bytes),
                    gib(|mem| mem.peak_reserved_bytes),
                    gib(|mem| mem.steady_peak_allocated_bytes),
                    m.items_per_step.map_or("-".into(), |(n, unit)| {
                        format!("{:.0} {unit}/s", n / (m.median_ms * 1e-3))
                    }),
                    fmt_opt(m.final_loss, 4),
                ]
            }
            None => failed_row(r),
        })
        .collect();
    table(
        &[
            "workload",
            "config",
            "graph",
            "kernels",
            "peak",
            "resv",
            "steady",
            "throughput",
            "loss",
        ],
        &rows,
    )
}

/// Every rank's median and the throughput per GPU and in total, for data-parallel rows.
fn data_parallel_table(report: &RunReport) -> String {
    let rows: Vec<Vec<String>> = report
        .rows
        .iter()
        .filter_map(|r| Some((r, r.data_parallel.as_ref()?)))
        .map(|(r, d)| {
            let medians: Vec<String> = d
                .median_ms_per_rank
                .iter()
                .map(|ms| format!("{ms:.3}"))
                .collect();
            let rate = |pick: fn(&Throughput) -> f64| {
                d.throughput
                    .as_ref()
                    .map_or("-".into(), |t| format!("{:.0} {}/s", pick(t), t.unit))
            };
            vec![
                r.workload.clone(),
                r.config.clone(),
                medians.join(" "),
                rate(|t| t.per_gpu),
                rate(|t| t.total),
            ]
        })
        .collect();
    let (world, backend) = report
        .rows
        .iter()
        .find_map(|r| r.data_parallel.as_ref())
        .map_or((report.world_size, "-".to_string()), |d| {
            (d.world_size, d.backend.clone())
        });
    format!(
        "\ndata parallel over {world} ranks ({backend}): median ms of each rank, throughput per \
         GPU and in total\n{}",
        table(
            &["workload", "config", "median per rank", "per GPU", "total"],
            &rows
        )
    )
}

fn render_peer(report: &RunReport, peer: &PeerReport) -> String {
    let Some(run) = &peer.run else {
        return format!(
            "\nPyTorch peer not run: {}\n",
            peer.not_run.as_deref().unwrap_or("no reason given")
        );
    };
    let measured = report
        .rows
        .iter()
        .filter_map(|r| Some((r, r.measurement.as_ref()?)));
    let times: Vec<(String, String, f64)> = measured
        .clone()
        .map(|(r, m)| (r.workload.clone(), r.config.clone(), m.median_ms))
        .collect();
    let memory: Vec<(String, String, Option<DeviceMemory>)> = measured
        .map(|(r, m)| (r.workload.clone(), r.config.clone(), m.memory))
        .collect();
    let mut out = run.render_times(&times);
    out.push_str(&run.render_memory(&memory));
    out
}

fn environment_block(report: &RunReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\nenvironment");
    for line in report.environment.to_string().lines() {
        let _ = writeln!(out, "  {line}");
    }
    let _ = writeln!(
        out,
        "  peak        {} ({})",
        fmt_opt(report.peak_tflops, 1),
        report.peak_source
    );
    if report.world_size > 1 {
        let _ = writeln!(
            out,
            "  ranks       {} processes (the tables give rank 0's figures, \"data parallel\" \
             every rank's)",
            report.world_size
        );
    }
    if let Some(run) = report.peer.as_ref().and_then(|p| p.run.as_ref()) {
        let _ = writeln!(
            out,
            "  pytorch     {} ({})",
            run.environment,
            run.python.display()
        );
    }
    let mut seen = Vec::new();
    for r in &report.rows {
        if seen.contains(&&r.config) {
            continue;
        }
        seen.push(&r.config);
        let flags = if r.flags.is_empty() {
            "no flag changed".to_string()
        } else {
            r.flags.join(", ")
        };
        let _ = writeln!(
            out,
            "  config {:<12} precision {}; {}",
            r.config, r.precision, flags
        );
    }
    let mut notes: Vec<&String> = report.rows.iter().flat_map(|r| &r.notes).collect();
    notes.dedup();
    for n in notes {
        let _ = writeln!(out, "  note: {n}");
    }
    out
}

fn write_outputs(args: &Args, report: &RunReport) -> Result<()> {
    let write = |path: &Path, text: String| {
        std::fs::write(path, text).map_err(|source| SpeedkitError::Io {
            path: path.to_path_buf(),
            source,
        })
    };
    let json = serde_json::to_string_pretty(report).map_err(|e| {
        SpeedkitError::Misuse(format!("the run report cannot be written as JSON: {e}"))
    })?;
    if let Some(p) = &args.json {
        write(p, json.clone())?;
    }
    if let Some(name) = &args.save_baseline {
        let path = baseline::save(name, &json)?;
        eprintln!("saved the baseline in {}", path.display());
    }
    if let Some(p) = &args.csv {
        write(p, render_csv(report))?;
    }
    if let Some(p) = &args.svg {
        write(p, render_svg(report))?;
    }
    Ok(())
}

/// The result rows as CSV.
pub fn render_csv(report: &RunReport) -> String {
    let mut out = String::from(
        "workload,config,size,median_ms,p10_ms,p90_ms,speedup,tflops,percent_of_peak,peak_allocated_bytes,peak_reserved_bytes,steady_peak_allocated_bytes,graphed,final_loss,device\n",
    );
    let device = report
        .environment
        .primary_gpu()
        .map_or("cpu".to_string(), |g| g.name.clone());
    for r in &report.rows {
        let Some(m) = &r.measurement else { continue };
        let memory = |pick: fn(&DeviceMemory) -> u64| {
            m.memory.map_or(String::new(), |mem| pick(&mem).to_string())
        };
        let _ = writeln!(
            out,
            "{},{},{},{:.4},{:.4},{:.4},{},{},{},{},{},{},{},{},\"{}\"",
            r.workload,
            r.config,
            r.size,
            m.median_ms,
            m.p10_ms,
            m.p90_ms,
            fmt_opt(r.speedup, 3),
            fmt_opt(m.tflops, 2),
            fmt_opt(r.percent_of_peak, 1),
            memory(|mem| mem.peak_allocated_bytes),
            memory(|mem| mem.peak_reserved_bytes),
            memory(|mem| mem.steady_peak_allocated_bytes),
            m.graphed,
            fmt_opt(m.final_loss, 5),
            device
        );
    }
    out
}

/// A grouped bar chart of the speedup of every config over the first, per workload.
pub fn render_svg(report: &RunReport) -> String {
    let mut workloads: Vec<&str> = Vec::new();
    let mut configs: Vec<&str> = Vec::new();
    for r in &report.rows {
        if !workloads.contains(&r.workload.as_str()) {
            workloads.push(&r.workload);
        }
        if !configs.contains(&r.config.as_str()) {
            configs.push(&r.config);
        }
    }
    let speedup = |w: &str, c: &str| {
        report
            .rows
            .iter()
            .find(|r| r.workload == w && r.config == c)
            .and_then(|r| r.speedup)
            .unwrap_or(0.0)
    };
    let max = report
        .rows
        .iter()
        .filter_map(|r| r.speedup)
        .fold(1.0f64, f64::max);
    let (bar_w, gap, left, top, height) = (22.0, 26.0, 60.0, 40.0, 260.0);
    let group_w = configs.len() as f64 * bar_w + gap;
    let width = left + workloads.len() as f64 * group_w + 160.0;
    let colors = [
        "#8c8c8c", "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
    ];
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{:.0}" font-family="sans-serif" font-size="12">"#,
        top + height + 60.0
    );
    let gpu = report
        .environment
        .primary_gpu()
        .map_or("CPU".to_string(), |g| g.name.clone());
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="20" font-size="14">speedup over {} per workload — {gpu}</text>"#,
        configs.first().unwrap_or(&"-")
    );
    let y_of = |v: f64| top + height - v / max * height;
    for tick in 0..=(max.ceil() as usize) {
        let y = y_of(tick as f64);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{:.0}" y1="{y:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.0}" y="{:.1}" text-anchor="end">{tick}x</text>"##,
            width - 150.0,
            left - 6.0,
            y + 4.0
        );
    }
    for (wi, w) in workloads.iter().enumerate() {
        let x0 = left + wi as f64 * group_w + gap / 2.0;
        for (ci, c) in configs.iter().enumerate() {
            let v = speedup(w, c);
            let (x, y) = (x0 + ci as f64 * bar_w, y_of(v));
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{w} {c}: {v:.2}x</title></rect><text x="{:.1}" y="{:.1}" font-size="9" text-anchor="middle">{v:.1}</text>"#,
                bar_w - 2.0,
                top + height - y,
                colors[ci % colors.len()],
                x + bar_w / 2.0 - 1.0,
                y - 3.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{w}</text>"#,
            x0 + configs.len() as f64 * bar_w / 2.0,
            top + height + 18.0
        );
    }
    for (ci, c) in configs.iter().enumerate() {
        let y = top + 10.0 + ci as f64 * 18.0;
        let x = width - 140.0;
        let _ = writeln!(
            s,
            r#"<rect x="{x:.0}" y="{:.0}" width="12" height="12" fill="{}"/><text x="{:.0}" y="{:.0}">{c}</text>"#,
            y - 10.0,
            colors[ci % colors.len()],
            x + 18.0,
            y
        );
    }
    s.push_str("</svg>\n");
    s
}
