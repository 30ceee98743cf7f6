//! The benchmark runner as a user drives it: baselines and their verdicts, `--fail-above`, the
//! PyTorch peer when it cannot run, errors for an empty selection, and (on a GPU) memory under
//! graph mode. The workloads are this file's own, so the outcomes are known: `sleepy` is a step
//! whose time a test sets with a sleep.

mod common;

use clap::Parser;
use speedkit::bench::baseline::{self, Baseline};
use speedkit::bench::runner::{self, Args, RunReport};
use speedkit::bench::stats::Verdict;
use speedkit::bench::{testing, Bencher, Workload};
use speedkit_suite::data;
use speedkit_suite::models::resnet::ResNetConfig;
use speedkit_suite::models::{Linear3, Linear3Config};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tch::nn::VarStore;
use tch::{Kind, Tensor};

/// How long one `sleepy` step sleeps, ms.
static SLEEP_MS: AtomicU64 = AtomicU64::new(2);

/// A step that sleeps `SLEEP_MS` and sums a small tensor.
#[speedkit::bench(tags = ["runner-test"])]
fn sleepy(b: &mut Bencher) -> anyhow::Result<()> {
    let x = Tensor::f_ones([4], (Kind::Float, b.device()))?;
    b.run(|| -> anyhow::Result<Tensor> {
        std::thread::sleep(Duration::from_millis(SLEEP_MS.load(Ordering::SeqCst)));
        Ok(x.f_sum(Kind::Float)?)
    })?;
    Ok(())
}

/// `linear3` at the bench size, trained as the reference workloads are (GPU test of memory).
#[speedkit::bench(cuda_only, sizes = ["bench"])]
fn graph_memory_linear3(b: &mut Bencher) -> anyhow::Result<()> {
    let config = Linear3Config::bench();
    data::seed();
    let vs = VarStore::new(b.device());
    let model = Linear3::new(&vs.root(), &config);
    let (x, target) = data::regression(config.batch, config.width, b.device())?;
    let ctx = b.ctx();
    let mut opt = ctx.adamw(&vs, speedkit_suite::REFERENCE_ADAMW)?;
    b.run(|| -> speedkit::Result<Tensor> {
        opt.zero_grad()?;
        let loss = ctx.autocast(|| model.loss(&x, &target))?;
        ctx.backward(&loss)?;
        ctx.step(&mut opt)?;
        Ok(loss)
    })?;
    Ok(())
}

/// The largest batch `batched` trains at: above it, its step fails as a GPU out of memory does.
const BATCH_CAP: i64 = 300;

/// A linear step at `Bencher::batch` (its own: 8) that runs out of memory above `BATCH_CAP`.
#[speedkit::bench(tags = ["runner-test"])]
fn batched(b: &mut Bencher) -> anyhow::Result<()> {
    let batch = b.batch(8);
    if batch > BATCH_CAP {
        anyhow::bail!("CUDA out of memory (this test workload's cap is a batch of {BATCH_CAP})");
    }
    let x = Tensor::f_ones([batch, 4], (Kind::Float, b.device()))?;
    b.run(|| -> anyhow::Result<Tensor> { Ok(x.f_sum(Kind::Float)?) })?;
    Ok(())
}

/// A step tagged `large` (too large for one GPU at bench size, in a real workload): trivial here.
#[speedkit::bench(tags = ["large"])]
fn outsized(b: &mut Bencher) -> anyhow::Result<()> {
    let x = Tensor::f_ones([4], (Kind::Float, b.device()))?;
    b.run(|| -> anyhow::Result<Tensor> { Ok(x.f_sum(Kind::Float)?) })?;
    Ok(())
}

/// A workload whose step fails with a long error of two lines, as a libtorch error with its frames.
#[speedkit::bench(tags = ["runner-test"])]
fn broken(_b: &mut Bencher) -> anyhow::Result<()> {
    anyhow::bail!(
        "{}\nframe #0: where it failed",
        "a long libtorch message ".repeat(8)
    )
}

fn sleepy_only() -> Vec<&'static Workload> {
    vec![Workload::named("sleepy").expect("sleepy is registered")]
}

fn args(extra: &[&str]) -> Args {
    let base = [
        "bench",
        "--config",
        "fp32_strict",
        "--warmup",
        "1",
        "--steps",
        "15",
    ];
    Args::try_parse_from(base.iter().chain(extra)).expect("valid arguments")
}

/// A fresh directory for this test's files.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "speedkit-bench-runner-{}-{test}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn run_sleepy(sleep_ms: u64, extra: &[&str]) -> (RunReport, u8) {
    SLEEP_MS.store(sleep_ms, Ordering::SeqCst);
    let args = args(extra);
    let report = runner::run_with(&args, &sleepy_only()).expect("the run succeeds");
    let status = runner::exit_status(&args, &report);
    (report, status)
}

fn save_baseline(test: &str, sleep_ms: u64) -> String {
    let path = scratch(test).join("baseline.json");
    let path = path.to_str().expect("utf-8 temp path").to_string();
    run_sleepy(sleep_ms, &["--save-baseline", &path]);
    path
}

#[test]
fn a_saved_baseline_keeps_every_step_time_and_a_schema_version() {
    let _lock = common::serial();
    let path = save_baseline("schema", 2);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(json["schema_version"], runner::REPORT_SCHEMA_VERSION);
    assert_eq!(
        json["rows"][0]["measurement"]["times_ms"]
            .as_array()
            .unwrap()
            .len(),
        15
    );
    assert!(json["environment"]["libtorch"].is_string());
    assert_eq!(json["configs"][0]["name"], "fp32_strict");
}

#[test]
fn a_baseline_compared_with_itself_is_no_change() {
    let _lock = common::serial();
    let path = save_baseline("itself", 2);
    let saved = Baseline::load(&path).unwrap();
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let times: Vec<f64> =
        serde_json::from_value(report["rows"][0]["measurement"]["times_ms"].clone()).unwrap();
    let change = speedkit::bench::stats::compare_medians(&saved.rows[0].times_ms, &times).unwrap();
    assert_eq!(change.ratio, 1.0);
    assert_eq!(change.verdict(0.01), Verdict::NoChange);
}

#[test]
fn a_run_against_its_own_baseline_prints_a_verdict_per_row() {
    let _lock = common::serial();
    let path = save_baseline("rerun", 2);
    let (report, _) = run_sleepy(2, &["--baseline", &path]);
    let comparison = report.baseline.as_ref().unwrap();
    assert_eq!(comparison.rows.len(), 1);
    assert!(comparison.rows[0].verdict.is_some());
    assert!(comparison.warnings.is_empty(), "{:?}", comparison.warnings);
    assert!(runner::render_text(&report).contains("against baseline"));
}

#[test]
fn a_slower_step_is_flagged_slower_and_fail_above_exits_non_zero() {
    let _lock = common::serial();
    let path = save_baseline("slower", 2);
    let (report, status) = run_sleepy(40, &["--baseline", &path, "--fail-above", "10"]);
    let row = &report.baseline.as_ref().unwrap().rows[0];
    assert_eq!(row.verdict, Some(Verdict::Slower), "{row:?}");
    assert!(row.change.unwrap().low > 1.1);
    assert_eq!(status, 1);
    assert!(runner::render_text(&report).contains("slower"));
}

#[test]
fn a_slower_step_within_fail_above_exits_zero() {
    let _lock = common::serial();
    let path = save_baseline("within", 2);
    // A bound no ratio reaches: on a GPU the steps are timed by CUDA events, which see almost
    // nothing of a host-side sleep, so the 2 ms baseline can read microseconds and the ratio
    // thousands.
    let (_, status) = run_sleepy(40, &["--baseline", &path, "--fail-above", "1e12"]);
    assert_eq!(status, 0);
}

#[test]
fn a_baseline_from_another_environment_warns_naming_the_difference() {
    let _lock = common::serial();
    let path = save_baseline("environment", 2);
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["environment"]["libtorch"] = "1.0.0-elsewhere".into();
    json["environment"]["gpus"] = serde_json::json!([{ "name": "Some Other GPU" }]);
    std::fs::write(&path, json.to_string()).unwrap();
    let (report, _) = run_sleepy(2, &["--baseline", &path]);
    let warnings = &report.baseline.as_ref().unwrap().warnings;
    assert!(
        warnings
            .iter()
            .any(|w| w.starts_with("libtorch: baseline 1.0.0-elsewhere, now ")),
        "{warnings:?}"
    );
    assert!(
        warnings
            .iter()
            .any(|w| w.starts_with("GPU: baseline Some Other GPU, now ")),
        "{warnings:?}"
    );
    assert!(runner::render_text(&report).contains("warning: measured differently"));
}

#[test]
fn a_missing_baseline_is_an_error_before_anything_runs() {
    let _lock = common::serial();
    let missing = scratch("missing").join("nothing-here.json");
    let args = args(&["--baseline", missing.to_str().unwrap()]);
    let e = runner::run_with(&args, &sleepy_only())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--save-baseline"), "{e}");
    assert_eq!(runner::main_with(&args, &sleepy_only()), 2);
}

#[test]
fn a_baseline_of_another_schema_is_refused() {
    let path = scratch("schema-old").join("old.json");
    std::fs::write(&path, r#"{"environment":{"gpus":[],"libtorch":"2","cuda_runtime":null,"cudnn":null,"driver":null},"protocol":{"warmup":1,"steps":1,"paranoid_sync":true},"rows":[]}"#).unwrap();
    let e = Baseline::load(path.to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("save the baseline again"), "{e}");
}

#[test]
fn a_baseline_name_is_stored_under_target_speedkit_baselines() {
    let path = baseline::path_for("main").unwrap();
    assert!(
        path.ends_with(Path::new("speedkit/baselines/main.json")),
        "{}",
        path.display()
    );
}

#[test]
fn peer_pytorch_without_python_says_how_to_fix_it_and_keeps_speedkit_rows() {
    let _lock = common::serial();
    let (report, status) = run_sleepy(
        2,
        &["--peer", "pytorch", "--python", "/nonexistent/bin/python3"],
    );
    assert_eq!(status, 0);
    assert!(report.rows[0].measurement.is_some());
    let why = report.peer.as_ref().unwrap().not_run.as_deref().unwrap();
    assert!(
        why.contains("cannot start /nonexistent/bin/python3"),
        "{why}"
    );
    assert!(why.contains("--python PATH"), "{why}");
    let text = runner::render_text(&report);
    assert!(
        text.contains("PyTorch peer not run: cannot start"),
        "{text}"
    );
    assert!(text.contains("sleepy"));
}

#[test]
fn peer_pytorch_with_a_python_without_torch_says_how_to_fix_it() {
    let _lock = common::serial();
    let imports_torch = std::process::Command::new("python3")
        .args(["-c", "import torch"])
        .output()
        .map(|o| o.status.success());
    if !matches!(imports_torch, Ok(false)) {
        eprintln!("skipped: needs a python3 on PATH that cannot import torch");
        return;
    }
    let (report, status) = run_sleepy(2, &["--peer", "pytorch", "--python", "python3"]);
    assert_eq!(status, 0);
    let why = report.peer.as_ref().unwrap().not_run.as_deref().unwrap();
    assert!(why.contains("python3 cannot import torch"), "{why}");
    assert!(
        why.contains("pip install -r requirements-torch.txt"),
        "{why}"
    );
    assert!(why.contains("--python PATH"), "{why}");
    assert!(report.rows[0].measurement.is_some());
}

#[test]
fn peer_pytorch_without_cuda_says_the_reference_needs_a_cuda_device() {
    let _lock = common::serial();
    if tch::Cuda::is_available() {
        eprintln!("skipped: a CUDA device is visible, so the reference runs (GPU host)");
        return;
    }
    let python = speedkit::bench::peer::find_python(None);
    let has_torch = std::process::Command::new(&python)
        .args(["-c", "import torch"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_torch {
        eprintln!(
            "skipped: {} cannot import torch (make .venv, see README)",
            python.display()
        );
        return;
    }
    let (report, _) = run_sleepy(2, &["--peer", "pytorch"]);
    let why = report.peer.as_ref().unwrap().not_run.as_deref().unwrap();
    assert!(why.contains("sees no CUDA device"), "{why}");
    assert!(report.rows[0].measurement.is_some());
}

/// Runs the reference's own code on the CPU, with CUDA's timing and memory calls replaced by host
/// stand-ins, and prints the rows it reports (one JSON line each).
const REFERENCE_ON_CPU: &str = r#"
import importlib.util, json, sys, time
import torch
spec = importlib.util.spec_from_file_location("reference", sys.argv[1])
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)

class HostEvent:
    def __init__(self, enable_timing=True):
        self.t = None
    def record(self):
        self.t = time.perf_counter()
    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3

cuda = torch.cuda
cuda.Event, cuda.synchronize, cuda.empty_cache = HostEvent, lambda *a: None, lambda: None
cuda.reset_peak_memory_stats = lambda *a: None
cuda.max_memory_allocated, cuda.max_memory_reserved = (lambda *a: 2048), (lambda *a: 4096)
print(json.dumps(dict(resnet_flops=reference.ResNet18.flops_per_step())))
print(json.dumps(reference.measure("mlp", "eager", torch.device("cpu"), 1, 3)))
"#;

#[test]
fn the_reference_measures_a_row_the_runner_reads() {
    let python = speedkit::bench::peer::find_python(None);
    let Ok(out) = std::process::Command::new(&python)
        .args([
            "-c",
            REFERENCE_ON_CPU,
            "docs/benchmarks/pytorch_reference.py",
        ])
        .output()
    else {
        eprintln!("skipped: no {} to run the reference with", python.display());
        return;
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("No module named 'torch'") {
        eprintln!(
            "skipped: {} cannot import torch (make .venv, see README)",
            python.display()
        );
        return;
    }
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines();
    let flops: serde_json::Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert_eq!(
        flops["resnet_flops"].as_f64(),
        Some(ResNetConfig::bench().flops_per_step())
    );
    let row: speedkit::bench::peer::PeerRow = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert_eq!((row.workload.as_str(), row.mode.as_str()), ("mlp", "eager"));
    assert_eq!(row.times_ms.len(), 3);
    assert!(row.median_ms.is_some_and(|m| m > 0.0));
    let memory = row.memory.unwrap();
    assert_eq!(
        (memory.peak_allocated_bytes, memory.peak_reserved_bytes),
        (2048, 4096)
    );
}

#[test]
fn a_large_workload_runs_at_bench_size_only_where_a_filter_names_it() {
    let outsized = [Workload::named("outsized").expect("outsized is registered")];
    assert_eq!(outsized[0].tags, [speedkit::bench::LARGE_TAG]);
    let by_tag = args(&["--size", "bench", "--filter", "large"]);
    let report = runner::run_with(&by_tag, &outsized).expect("the run succeeds");
    assert!(report.rows.is_empty(), "{:?}", report.rows);
    let named = args(&["--size", "bench", "--filter", "outsized"]);
    let report = runner::run_with(&named, &outsized).expect("the run succeeds");
    assert_eq!(report.rows.len(), 1);
    assert!(report.rows[0].measurement.is_some(), "{:?}", report.rows);
    // The tiny size runs with the others.
    let tiny = args(&["--size", "tiny"]);
    let report = runner::run_with(&tiny, &outsized).expect("the run succeeds");
    assert_eq!(report.rows.len(), 1);
}

#[test]
fn no_registered_workload_is_an_error_naming_bench_main() {
    let args = args(&[]);
    let e = runner::run_with(&args, &[]).unwrap_err().to_string();
    assert!(e.contains("speedkit::bench_main!(your_crate)"), "{e}");
    assert_eq!(runner::main_with(&args, &[]), 2);
}

#[test]
fn a_filter_matching_no_workload_is_an_error_listing_them() {
    let args = args(&["--filter", "no-such-workload"]);
    let e = runner::run_with(&args, &sleepy_only())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--filter no-such-workload matches no workload"),
        "{e}"
    );
    assert!(e.contains("sleepy"), "{e}");
    assert_eq!(runner::main_with(&args, &sleepy_only()), 2);
}

#[test]
fn an_empty_test_harness_is_a_failure_naming_bench_tests() {
    let Err(e) = testing::trials(&[]) else {
        panic!("an empty harness must be an error");
    };
    assert!(e.contains("speedkit::bench_tests!(your_crate)"), "{e}");
}

#[test]
fn largest_batch_searches_the_workloads_that_take_a_batch_and_skips_the_others() {
    let _lock = common::serial();
    let workloads = [
        Workload::named("batched").unwrap(),
        Workload::named("sleepy").unwrap(),
    ];
    let args =
        Args::try_parse_from(["bench", "--config", "fp32_strict", "--largest-batch"]).unwrap();
    let found = runner::largest_batches(
        &args,
        &workloads,
        speedkit::hardware::Hardware::detect().unwrap(),
    )
    .unwrap();
    assert_eq!(
        found.rows.len(),
        1,
        "sleepy takes no batch: {:?}",
        found.rows
    );
    let row = &found.rows[0];
    assert_eq!(
        (row.workload.as_str(), row.default_batch),
        ("batched", Some(8))
    );
    assert!(row.largest_batch <= BATCH_CAP && row.largest_batch >= BATCH_CAP - BATCH_CAP / 8);
    assert!(row.first_failing.is_some_and(|f| f > BATCH_CAP));
    assert!(row
        .tried
        .iter()
        .all(|t| t.trained == (t.batch <= BATCH_CAP)));
    assert!(row.error.is_none());
}

#[test]
fn largest_batch_and_a_fixed_batch_cannot_be_asked_together() {
    let err = Args::try_parse_from(["bench", "--largest-batch", "--batch", "64"]).unwrap_err();
    assert!(err.to_string().contains("cannot be used with"), "{err}");
}

#[test]
fn batch_builds_the_workloads_that_take_one_at_that_batch() {
    let _lock = common::serial();
    let args = args(&["--batch", "301"]);
    let report = runner::run_with(&args, &[Workload::named("batched").unwrap()]).unwrap();
    let error = report.rows[0].error.as_deref().unwrap_or_default();
    assert!(error.contains("out of memory"), "{error}");
}

#[test]
fn the_text_tables_fit_100_columns() {
    let _lock = common::serial();
    let (report, _) = run_sleepy(2, &[]);
    let text = runner::render_text(&report);
    let tables = text.split("\nenvironment").next().unwrap();
    for line in tables.lines() {
        assert!(
            line.chars().count() <= 100,
            "{} columns: {line}",
            line.chars().count()
        );
    }
}

#[test]
fn graph_mode_reports_the_peak_memory_of_the_same_step_as_eager_mode() {
    let _lock = common::serial();
    if common::cuda_or_skip("graph_mode_reports_the_peak_memory_of_the_same_step_as_eager_mode")
        .is_none()
    {
        return;
    }
    let args = Args::try_parse_from([
        "bench",
        "--config",
        "examples/configs/auto_eager.yaml",
        "--config",
        "auto",
        "--warmup",
        "3",
        "--steps",
        "5",
    ])
    .unwrap();
    let workload = Workload::named("graph_memory_linear3").unwrap();
    let report = runner::run_with(&args, &[workload]).unwrap();
    let memory = |config: &str| {
        let row = report.rows.iter().find(|r| r.config == config).unwrap();
        let m = row.measurement.as_ref().unwrap();
        (m.graphed, m.memory.unwrap())
    };
    let ((eager_graphed, eager), (graphed, graph)) = (memory("auto_eager"), memory("auto"));
    eprintln!("eager {eager:?}\ngraph {graph:?}");
    assert!(!eager_graphed && graphed);
    // The capture's allocations count: the graphed run's whole-run peak is the eager step's, give
    // or take the allocator's rounding and a smaller transient on the side stream (-0.4% measured
    // on an H100), never only what stays allocated between replays.
    let ratio = graph.peak_allocated_bytes as f64 / eager.peak_allocated_bytes as f64;
    assert!((0.95..=1.25).contains(&ratio), "graph / eager peak {ratio}");
    assert!(graph.peak_reserved_bytes >= graph.peak_allocated_bytes);
}

#[test]
fn the_memory_breakdown_names_the_optimizer_and_adds_up_to_the_peaks() {
    let _lock = common::serial();
    let test = "the_memory_breakdown_names_the_optimizer_and_adds_up_to_the_peaks";
    if common::cuda_or_skip(test).is_none() {
        return;
    }
    let args = Args::try_parse_from(["bench", "--config", "auto", "--warmup", "3", "--steps", "5"])
        .unwrap();
    let workload = Workload::named("graph_memory_linear3").unwrap();
    let report = runner::run_with(&args, &[workload]).unwrap();
    let memory = report.rows[0].measurement.as_ref().unwrap().memory.unwrap();
    let b = memory.breakdown.expect("a GPU run has a breakdown");
    eprintln!("{b:?}");
    let config = Linear3Config::bench();
    assert_eq!(
        b.parameters,
        3 * 4 * (config.width * config.width + config.width) as u64
    );
    assert_eq!(b.gradients, b.parameters);
    assert!(b.optimizer_state >= 2 * b.parameters);
    assert_eq!(b.held() + b.activations, memory.peak_allocated_bytes);
    assert_eq!(
        b.held() + b.activations + b.cached,
        memory.peak_reserved_bytes
    );
}

#[test]
fn memory_history_without_a_gpu_is_noted_and_writes_nothing() {
    if tch::Cuda::is_available() {
        eprintln!("skipped: a CUDA device is visible (the next test covers that case)");
        return;
    }
    let _lock = common::serial();
    let dir = scratch("history-cpu").join("history");
    let (report, _) = run_sleepy(1, &["--memory-history", dir.to_str().unwrap()]);
    let notes = report.rows[0].notes.join("; ");
    assert!(
        notes.contains("memory history not recorded") && notes.contains("needs a CUDA device"),
        "{notes}"
    );
    assert!(!dir.exists(), "nothing written");
}

#[test]
fn memory_history_writes_one_snapshot_per_run_and_names_it() {
    if common::cuda_or_skip("memory_history_writes_one_snapshot_per_run_and_names_it").is_none() {
        return;
    }
    let _lock = common::serial();
    let dir = scratch("history-gpu").join("history");
    let (report, _) = run_sleepy(1, &["--memory-history", dir.to_str().unwrap()]);
    let file = dir.join("sleepy-fp32_strict.pickle");
    let notes = report.rows[0].notes.join("; ");
    assert!(
        notes.contains(&format!("memory history written to {}", file.display())),
        "{notes}"
    );
    assert!(std::fs::metadata(&file).unwrap().len() > 0);
    assert!(!speedkit::memory::MemoryHistory::is_recording().unwrap());
}

#[test]
fn memory_history_and_largest_batch_cannot_be_asked_together() {
    let err =
        Args::try_parse_from(["bench", "--largest-batch", "--memory-history", "h"]).unwrap_err();
    assert!(err.to_string().contains("cannot be used with"), "{err}");
}

#[test]
fn a_failed_workload_keeps_the_tables_narrow_and_gives_its_whole_error_below_them() {
    let _lock = common::serial();
    let args = args(&[]);
    let broken = Workload::named("broken").expect("broken is registered");
    let report = runner::run_with(&args, &[broken]).expect("the run completes");
    assert_eq!(runner::exit_status(&args, &report), 1);
    let text = runner::render_text(&report);
    let (tables, failures) = text
        .split_once("\nfailures:\n")
        .expect("a failures section");
    for row in tables.lines().filter(|l| l.contains("broken")) {
        assert!(
            row.chars().count() <= 100,
            "a table row {} wide: {row}",
            row.len()
        );
        assert!(row.contains("FAILED"), "{row}");
    }
    assert!(
        failures.starts_with("  broken / fp32_strict:\n"),
        "{failures}"
    );
    assert!(
        failures.contains(&"a long libtorch message ".repeat(8)),
        "{failures}"
    );
    assert!(
        failures.contains("    frame #0: where it failed"),
        "{failures}"
    );
}

#[test]
fn a_run_gives_the_seconds_to_its_first_step_counted_from_before_the_build() {
    let _lock = common::serial();
    // The first step (a warm-up step: eager, no graph) sleeps 30 ms: its end is at least that
    // long after the run began.
    let (report, _) = run_sleepy(30, &[]);
    let first = report.rows[0]
        .measurement
        .as_ref()
        .and_then(|m| m.first_step_s);
    assert!(first.is_some_and(|s| s >= 0.030), "{first:?}");
    let csv = runner::render_csv(&report);
    assert!(
        csv.lines()
            .next()
            .is_some_and(|h| h.contains("first_step_s")),
        "{csv}"
    );
}
