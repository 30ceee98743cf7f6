//! The PyTorch peer: the same workloads, timed the same way in PyTorch, in the same run.
//!
//! `--peer pytorch` runs the project's reference (`docs/benchmarks/pytorch_reference.py`, embedded
//! in the runner) with a Python that has torch: `--python PATH`, else `.venv/bin/python` of the
//! current directory or one of its parents, else `python3`. The reference trains each selected
//! workload it has a PyTorch twin of in eager mode with AMP, as one whole-step CUDA graph, and
//! under `torch.compile` (default and `reduce-overhead`), with the runner's warm-up, step count
//! and sync, and reports one JSON line per row. When it cannot run (no Python, no torch, no CUDA
//! device), the reason and its fix are one line, and the runner's own rows stand alone.
//!
//! ```no_run
//! use speedkit::bench::peer::{find_python, run_pytorch};
//! use speedkit::bench::Protocol;
//! let protocol = Protocol { warmup: 10, steps: 50, paranoid_sync: true };
//! match run_pytorch(&find_python(None), &["transformer".into()], "bench", &protocol) {
//!     Ok(run) => println!("{} PyTorch rows", run.rows.len()),
//!     Err(why) => println!("PyTorch peer not run: {why}"),
//! }
//! ```

use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::{DeviceMemory, GpuClocks, Protocol};
use crate::report::table;

/// The reference script, as shipped in `docs/benchmarks/pytorch_reference.py`.
pub const REFERENCE_SCRIPT: &str = include_str!("../../../docs/benchmarks/pytorch_reference.py");

/// The workloads the reference has a PyTorch version of (its `WORKLOADS`).
pub const REFERENCE_WORKLOADS: [&str; 14] = [
    "transformer",
    "linear3",
    "mlp",
    "resnet",
    "mlp_block",
    "transformer_checkpointed",
    "transformer_tch",
    "gpt2",
    "gpt2_tch",
    "llama_tch",
    "unet_tch",
    "llama_large",
    "convnext_tch",
    "vit_tch",
];

/// The reference's modes, in column order, with their column headers.
pub const MODES: [(&str, &str); 4] = [
    ("eager", "eager AMP"),
    ("graph", "graph"),
    ("default", "compile"),
    ("reduce-overhead", "reduce-ovh"),
];

/// Exit status of the reference when it cannot import torch.
const NO_TORCH: i32 = 4;

/// The Python to run the reference with: `explicit`, else the first `.venv/bin/python` found in
/// the current directory or a parent, else `python3` from `PATH`.
pub fn find_python(explicit: Option<&Path>) -> PathBuf {
    if let Some(p) = explicit {
        return p.to_path_buf();
    }
    std::env::current_dir()
        .ok()
        .and_then(|cwd| {
            cwd.ancestors()
                .map(|dir| dir.join(".venv").join("bin").join("python"))
                .find(|p| p.exists())
        })
        .unwrap_or_else(|| PathBuf::from("python3"))
}

/// One speedkit run as the peer tables set it beside PyTorch's.
#[derive(Clone, Debug, Default)]
pub struct RunSummary {
    /// Its workload.
    pub workload: String,
    /// Its config's name.
    pub config: String,
    /// Its device memory.
    pub memory: Option<DeviceMemory>,
    /// Seconds from its start to the end of its first step as timed.
    pub first_step_s: Option<f64>,
    /// Its median step, ms.
    pub median_ms: Option<f64>,
    /// The GPU's clock and power over its timed steps.
    pub clocks: Option<GpuClocks>,
}

/// One PyTorch row: a workload in one mode.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerRow {
    /// Workload name (as the runner's).
    pub workload: String,
    /// `eager`, `graph`, `default` or `reduce-overhead`.
    pub mode: String,
    /// Median step time, ms.
    pub median_ms: Option<f64>,
    /// 10th percentile, ms.
    pub p10_ms: Option<f64>,
    /// 90th percentile, ms.
    pub p90_ms: Option<f64>,
    /// TFLOP/s at the median.
    pub tflops: Option<f64>,
    /// Every timed step, ms.
    #[serde(default)]
    pub times_ms: Vec<f64>,
    /// Memory, measured as speedkit measures its own.
    pub memory: Option<DeviceMemory>,
    /// The GPU's clock and power over the timed steps, read as speedkit reads them.
    #[serde(default)]
    pub clocks: Option<GpuClocks>,
    /// Why this mode failed, if it did.
    pub error: Option<String>,
    /// Seconds from the run's start (before the model is built) to the end of its first step,
    /// compilation included.
    #[serde(default)]
    pub first_step_s: Option<f64>,
}

/// What the reference reported.
#[derive(Clone, Debug, Serialize)]
pub struct PeerRun {
    /// The Python it ran with.
    pub python: PathBuf,
    /// torch, GPU, cuDNN and Python versions, as the reference read them.
    pub environment: serde_json::Value,
    /// Its rows.
    pub rows: Vec<PeerRow>,
}

/// The peer's part of a run report: its rows, or why it did not run.
#[derive(Clone, Debug, Serialize)]
pub struct PeerReport {
    /// `pytorch`.
    pub peer: String,
    /// The run, when it ran.
    pub run: Option<PeerRun>,
    /// Why it did not run, and how to fix that.
    pub not_run: Option<String>,
}

/// Runs the reference for `workloads` at `size` under `protocol`; `Err` is one line saying why
/// it could not run and how to fix that. Rows arrive as they finish and are echoed on stderr.
pub fn run_pytorch(
    python: &Path,
    workloads: &[String],
    size: &str,
    protocol: &Protocol,
) -> Result<PeerRun, String> {
    let mut args: Vec<String> = ["--graph", "--compile", "--size", size, "--only"]
        .map(String::from)
        .into();
    args.push(workloads.join(","));
    args.extend(["--warmup".into(), protocol.warmup.to_string()]);
    args.extend(["--steps".into(), protocol.steps.to_string()]);
    if !protocol.paranoid_sync {
        args.push("--no-paranoid-sync".into());
    }
    let mut rows = Vec::new();
    let environment = run_reference(python, &args, |line| {
        if let Some(Line::Row(row)) = parse_line(line) {
            eprintln!("pytorch {}", describe(&row));
            rows.push(*row);
        }
    })?;
    Ok(PeerRun {
        python: python.to_path_buf(),
        environment,
        rows,
    })
}

/// The largest batch the reference found for one workload in one mode.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerLargestBatch {
    /// Workload name (as the runner's).
    pub workload: String,
    /// `eager`, `default` or `reduce-overhead`.
    pub mode: String,
    /// The largest batch that trained (0: not even the first tried).
    pub largest_batch: i64,
    /// The smallest batch that ran out of memory, if one did.
    pub first_failing: Option<i64>,
    /// Peak allocated at the largest batch, bytes.
    pub peak_allocated_bytes: Option<u64>,
}

/// Finds, in PyTorch, the largest batch each of `workloads` trains at in each of `modes`
/// (`docs/benchmarks/pytorch_reference.py --largest-batch`): the environment and the rows.
pub fn largest_batch_pytorch(
    python: &Path,
    workloads: &[String],
    modes: &[&str],
) -> Result<(serde_json::Value, Vec<PeerLargestBatch>), String> {
    let args = [
        "--only".to_string(),
        workloads.join(","),
        "--largest-batch".into(),
        modes.join(","),
    ];
    let mut rows = Vec::new();
    let environment = run_reference(python, &args, |line| {
        if let Ok(row) = serde_json::from_str::<PeerLargestBatch>(line) {
            eprintln!(
                "pytorch {} {}: largest batch {}",
                row.workload, row.mode, row.largest_batch
            );
            rows.push(row);
        }
    })?;
    Ok((environment, rows))
}

/// Runs the reference script with `args` and `--json-lines`, handing every line of its stdout to
/// `on_line`; the environment it reported, or one line saying why it could not run.
fn run_reference(
    python: &Path,
    args: &[String],
    mut on_line: impl FnMut(&str),
) -> Result<serde_json::Value, String> {
    let fix = "pass --python PATH to a Python with torch (or make .venv, see README)";
    let mut child = Command::new(python)
        .args(["-", "--json-lines"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}; {fix}", python.display()))?;
    // The script goes in on stdin (`python -`), so the runner needs no file of this repository.
    let wrote = child
        .stdin
        .take()
        .map(|mut stdin| stdin.write_all(REFERENCE_SCRIPT.as_bytes()));
    let mut stderr = child.stderr.take();
    let stderr_reader = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(e) = stderr.as_mut() {
            let _ = e.read_to_string(&mut text);
        }
        text
    });
    let mut environment = serde_json::Value::Null;
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            match parse_line(&line) {
                Some(Line::Environment(env)) => environment = env,
                _ => on_line(&line),
            }
        }
    }
    let status = child
        .wait()
        .map_err(|e| format!("{} did not finish: {e}", python.display()))?;
    let errors = stderr_reader.join().unwrap_or_default();
    if status.success() {
        return Ok(environment);
    }
    let last = errors
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no message")
        .trim();
    Err(match (status.code(), wrote) {
        (Some(NO_TORCH), _) => format!("{} cannot import torch ({last}); {fix}", python.display()),
        (_, Some(Err(e))) => format!("{} did not read the script: {e}; {fix}", python.display()),
        (Some(code), _) => format!("{} (exit status {code}): {last}", python.display()),
        (None, _) => format!("{} ({status}): {last}", python.display()),
    })
}

enum Line {
    Environment(serde_json::Value),
    Row(Box<PeerRow>),
}

fn parse_line(line: &str) -> Option<Line> {
    let value: serde_json::Value = serde_json::from_str(line).ok()?;
    if let Some(env) = value.get("environment") {
        return Some(Line::Environment(env.clone()));
    }
    serde_json::from_value(value)
        .ok()
        .map(|r| Line::Row(Box::new(r)))
}

fn describe(row: &PeerRow) -> String {
    match (&row.error, row.median_ms) {
        (Some(e), _) => format!("{} {}: failed: {e}", row.workload, row.mode),
        (None, Some(m)) => format!("{} {}: {m:.3} ms", row.workload, row.mode),
        (None, None) => format!("{} {}: no time", row.workload, row.mode),
    }
}

impl PeerRun {
    /// The median of `workload` in `mode`, when it ran.
    pub fn median_ms(&self, workload: &str, mode: &str) -> Option<f64> {
        self.row(workload, mode).and_then(|r| r.median_ms)
    }

    /// The row of `workload` in `mode`.
    pub fn row(&self, workload: &str, mode: &str) -> Option<&PeerRow> {
        self.rows
            .iter()
            .find(|r| r.workload == workload && r.mode == mode)
    }

    /// The fastest PyTorch median of `workload` over every mode that ran.
    pub fn best_ms(&self, workload: &str) -> Option<f64> {
        self.rows
            .iter()
            .filter(|r| r.workload == workload)
            .filter_map(|r| r.median_ms)
            .min_by(f64::total_cmp)
    }

    /// Side by side, one row per speedkit `(workload, config, median ms)`: PyTorch's median in
    /// each mode and how many times faster speedkit's step is than PyTorch's best.
    pub fn render_times(&self, speedkit: &[(String, String, f64)]) -> String {
        let mut headers = vec!["workload", "config", "speedkit"];
        headers.extend(MODES.iter().map(|(_, h)| *h));
        headers.push("vs best");
        let ms = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |m| format!("{m:.3}"));
        let rows: Vec<Vec<String>> = speedkit
            .iter()
            .filter(|(w, _, _)| self.rows.iter().any(|r| &r.workload == w))
            .map(|(w, c, median)| {
                let mut row = vec![w.clone(), c.clone(), format!("{median:.3}")];
                row.extend(MODES.iter().map(|(mode, _)| ms(self.median_ms(w, mode))));
                row.push(
                    self.best_ms(w)
                        .map_or("-".into(), |best| format!("{:.2}x", best / median)),
                );
                row
            })
            .collect();
        let mut out = String::from(
            "\nPyTorch peer, median ms; vs best: PyTorch's fastest mode / speedkit (above 1: \
             speedkit faster)\n",
        );
        out.push_str(&table(&headers, &rows));
        let failed: Vec<String> = self
            .rows
            .iter()
            .filter(|r| r.error.is_some())
            .map(describe)
            .collect();
        for f in failed {
            let _ = writeln!(out, "  pytorch {f}");
        }
        out
    }

    /// Memory side by side, one row per speedkit run and per PyTorch mode of the same workloads,
    /// in GiB over the whole run, with each run's time to its first step.
    pub fn render_memory(&self, speedkit: &[RunSummary]) -> String {
        let gib = |m: Option<DeviceMemory>, pick: fn(&DeviceMemory) -> u64| {
            m.map_or_else(|| "-".to_string(), |m| format!("{:.2}", m.gib(pick(&m))))
        };
        let cells = |m: Option<DeviceMemory>, first: Option<f64>| {
            vec![
                gib(m, |m| m.peak_allocated_bytes),
                gib(m, |m| m.peak_reserved_bytes),
                gib(m, |m| m.steady_peak_allocated_bytes),
                first.map_or_else(|| "-".to_string(), |s| format!("{s:.1}")),
            ]
        };
        let rows = self.side_by_side(
            speedkit,
            |s| Some(cells(s.memory, s.first_step_s)),
            |r| Some(cells(r.memory, r.first_step_s)),
        );
        let mut out = String::from(
            "\ndevice memory of both sides in GiB. peak alloc, peak resv: over the whole run (warm-up,\n\
             compilation and capture included); steady alloc: peak allocated in the timed steps.\n\
             first s: seconds from the run's start to the end of its first step as timed (speedkit:\n\
             a captured step's first replay; PyTorch: its first step, compilation included)\n",
        );
        out.push_str(&table(
            &[
                "workload",
                "run",
                "peak alloc",
                "peak resv",
                "steady alloc",
                "first s",
            ],
            &rows,
        ));
        out
    }

    /// The GPU's clock and power over each side's timed steps ([`GpuClocks`]), one row per run
    /// that read them; nothing when none did.
    pub fn render_clocks(&self, speedkit: &[RunSummary], legend: &str) -> String {
        let cells = |c: Option<GpuClocks>, ms| c.map(|c| c.cells(ms).to_vec());
        let rows = self.side_by_side(
            speedkit,
            |s| cells(s.clocks, s.median_ms),
            |r| cells(r.clocks, r.median_ms),
        );
        if rows.is_empty() {
            return String::new();
        }
        let mut headings = vec!["workload", "run"];
        headings.extend(GpuClocks::HEADINGS);
        format!("{legend}{}", table(&headings, &rows))
    }

    /// For each workload both sides ran: a row per speedkit run, then one per PyTorch mode that
    /// did not fail, each its workload, its run's name and the cells `speedkit` or `pytorch` give
    /// it (none: no row).
    fn side_by_side(
        &self,
        speedkit: &[RunSummary],
        speedkit_cells: impl Fn(&RunSummary) -> Option<Vec<String>>,
        pytorch_cells: impl Fn(&PeerRow) -> Option<Vec<String>>,
    ) -> Vec<Vec<String>> {
        let mut workloads: Vec<&str> = Vec::new();
        for s in speedkit {
            let w = s.workload.as_str();
            if !workloads.contains(&w) && self.rows.iter().any(|r| r.workload == w) {
                workloads.push(w);
            }
        }
        let line = |w: &str, run: String, cells: Vec<String>| {
            [w.to_string(), run].into_iter().chain(cells).collect()
        };
        let mut rows = Vec::new();
        for w in workloads {
            for s in speedkit.iter().filter(|s| s.workload == w) {
                if let Some(cells) = speedkit_cells(s) {
                    rows.push(line(w, format!("speedkit {}", s.config), cells));
                }
            }
            for (mode, header) in MODES {
                let Some(r) = self.row(w, mode).filter(|r| r.error.is_none()) else {
                    continue;
                };
                if let Some(cells) = pytorch_cells(r) {
                    rows.push(line(w, format!("pytorch {header}"), cells));
                }
            }
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn row(workload: &str, mode: &str, median_ms: f64) -> String {
        format!(
            r#"{{"workload": "{workload}", "mode": "{mode}", "median_ms": {median_ms}, "p10_ms": 1.0,
                "p90_ms": 2.0, "tflops": 3.0, "times_ms": [{median_ms}],
                "memory": {{"peak_allocated_bytes": {GIB}, "peak_reserved_bytes": {GIB},
                            "steady_peak_allocated_bytes": 1024}}}}"#
        )
        .replace('\n', " ")
    }

    fn sample_run() -> PeerRun {
        let mut rows = Vec::new();
        for w in ["transformer", "linear3", "mlp", "resnet"] {
            for (i, (mode, _)) in MODES.iter().enumerate() {
                let Some(Line::Row(r)) = parse_line(&row(w, mode, 40.0 - i as f64)) else {
                    panic!("a row line parses as a row");
                };
                rows.push(*r);
            }
        }
        PeerRun {
            python: PathBuf::from("python3"),
            environment: serde_json::json!({"torch": "2.11.0"}),
            rows,
        }
    }

    #[test]
    fn the_reference_lists_the_workloads_the_runner_names() {
        let quoted: Vec<String> = REFERENCE_WORKLOADS
            .iter()
            .map(|w| format!("{w:?}"))
            .collect();
        let expected = format!("WORKLOADS = ({})", quoted.join(", "));
        assert!(REFERENCE_SCRIPT.contains(&expected), "{expected}");
    }

    #[test]
    fn the_environment_line_and_row_lines_parse() {
        let env = parse_line(r#"{"environment": {"torch": "2.11.0"}}"#);
        assert!(matches!(env, Some(Line::Environment(e)) if e["torch"] == "2.11.0"));
        assert!(parse_line("torch 2.11.0, NVIDIA H100").is_none());
        let failed = parse_line(r#"{"workload": "mlp", "mode": "default", "error": "no triton"}"#);
        assert!(matches!(failed, Some(Line::Row(r)) if r.error.as_deref() == Some("no triton")));
    }

    #[test]
    fn speedkit_is_compared_with_the_fastest_pytorch_mode() {
        let run = sample_run();
        assert_eq!(run.best_ms("mlp"), Some(37.0));
        let text = run.render_times(&[("mlp".into(), "auto".into(), 18.5)]);
        assert!(text.contains("2.00x"), "{text}");
    }

    #[test]
    fn the_peer_tables_fit_100_columns() {
        let run = sample_run();
        let speedkit: Vec<(String, String, f64)> = ["transformer", "linear3", "mlp", "resnet"]
            .iter()
            .flat_map(|w| {
                ["fp32_strict", "auto_eager", "auto"]
                    .map(|c| (w.to_string(), c.to_string(), 12.345))
            })
            .collect();
        let clocks = GpuClocks {
            readings: 100,
            mean_sm_mhz: 1695.0,
            min_sm_mhz: 1665,
            top_sm_mhz: 1710,
            max_sm_mhz: 1980,
            mean_power_w: 693.0,
            power_limit_w: 700.0,
            power_capped: 1.0,
            thermal: 0.0,
        };
        let memory: Vec<_> = speedkit
            .iter()
            .map(|(w, c, _)| RunSummary {
                workload: w.clone(),
                config: c.clone(),
                memory: run.rows[0].memory,
                first_step_s: Some(123.4),
                median_ms: Some(12.345),
                clocks: Some(clocks),
            })
            .collect();
        let text = run.render_times(&speedkit)
            + &run.render_memory(&memory)
            + &run.render_clocks(&memory, "\n");
        for line in text.lines() {
            assert!(line.chars().count() <= 100, "{line}");
        }
        assert!(text.contains("pytorch reduce-ovh"), "{text}");
    }

    #[test]
    fn each_sides_clock_and_power_are_given_where_they_were_read() {
        let mut run = sample_run();
        let clocks = |mhz: f64| GpuClocks {
            readings: 80,
            mean_sm_mhz: mhz,
            min_sm_mhz: 1600,
            top_sm_mhz: 1900,
            max_sm_mhz: 1980,
            mean_power_w: 690.0,
            power_limit_w: 700.0,
            power_capped: 0.5,
            thermal: 0.0,
        };
        run.rows[3].clocks = Some(clocks(1810.0));
        let speedkit = [RunSummary {
            workload: "transformer".into(),
            config: "auto".into(),
            median_ms: Some(20.0),
            clocks: Some(clocks(1695.0)),
            ..RunSummary::default()
        }];
        let text = run.render_clocks(&speedkit, "");
        let rows: Vec<Vec<&str>> = (text.lines().skip(2))
            .map(|l| l.split_whitespace().collect())
            .collect();
        // 690 W over a 20 ms step; PyTorch's at 37 ms (sample_run's reduce-overhead median).
        let speedkit_row = "transformer speedkit auto 1695 1600-1900 86% 690 700 50% 13.80";
        let pytorch_row = "transformer pytorch reduce-ovh 1810 1600-1900 91% 690 700 50% 25.53";
        assert_eq!(
            rows,
            [speedkit_row, pytorch_row].map(|r| r.split(' ').collect::<Vec<_>>())
        );
    }

    #[test]
    fn no_clock_table_is_given_where_no_side_read_its_clock() {
        let speedkit = [RunSummary {
            workload: "transformer".into(),
            ..RunSummary::default()
        }];
        assert_eq!(sample_run().render_clocks(&speedkit, "legend"), "");
    }

    #[test]
    fn each_runs_time_to_its_first_step_is_given_beside_its_memory() {
        let mut run = sample_run();
        run.rows[3].first_step_s = Some(21.25);
        let speedkit = [RunSummary {
            workload: "transformer".into(),
            config: "auto".into(),
            first_step_s: Some(4.04),
            ..RunSummary::default()
        }];
        let text = run.render_memory(&speedkit);
        let line = |prefix: &str| {
            (text.lines())
                .find(|l| l.trim_start().starts_with(prefix))
                .unwrap_or_else(|| panic!("{prefix}: {text}"))
                .to_string()
        };
        assert!(
            line("transformer  speedkit auto").ends_with("4.0"),
            "{text}"
        );
        assert!(
            line("transformer  pytorch reduce-ovh").ends_with("21.2"),
            "{text}"
        );
        assert!(line("transformer  pytorch eager").ends_with("-"), "{text}");
    }
}
