//! The runner's rendering: the text tables and the environment block, the `--list` table, the
//! files of `--json`, `--csv`, `--svg` and `--save-baseline`, a run's profile, and the progress
//! bars.

use indicatif::{ProgressBar, ProgressStyle};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::cli::Args;
use super::report::{Row, RunReport};
use crate::bench::baseline;
use crate::bench::peer::{PeerReport, RunSummary};
use crate::bench::{format_tflops, DeviceMemory, GpuClocks, Size, Workload};
use crate::dist::Throughput;
use crate::error::{Result, SpeedkitError};
use crate::memory::MemoryHistory;
use crate::profile::Profile;
use crate::report::table;

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.digits$}"))
}

/// The human-readable result: the time table, the memory table, the baseline and peer sections
/// when asked for, the environment block, then each failed row's error. Each table fits 100
/// columns for the reference workloads.
pub fn render_text(report: &RunReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nspeedkit benchmarks — size {}, {} warm-up + {} timed steps, paranoid sync {}; times in ms;\n\
         first s: seconds from the run's start (before the model is built) to the end of its first\n\
         step as timed (a captured step's first replay, after warm-up, trace, compilation, capture)",
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
    if report.peer.as_ref().is_none_or(|p| p.run.is_none()) {
        // Else the peer's table gives them beside PyTorch's.
        out.push_str(&clocks_table(report));
    }
    out.push_str(&breakdown_table(report));
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
    out.push_str(&failures(report));
    out
}

/// A failed row in a table: its error, which may be long and span lines (a libtorch error with
/// its frames), is given whole in [`failures`], not in a column every other row would be padded to.
fn failed_row(r: &Row) -> Vec<String> {
    vec![
        r.workload.clone(),
        r.config.clone(),
        "FAILED (below)".into(),
    ]
}

/// Each failed row's error, whole, under its workload and config; empty where none failed.
fn failures(report: &RunReport) -> String {
    let mut out = String::new();
    for r in report.rows.iter().filter(|r| r.measurement.is_none()) {
        if out.is_empty() {
            out.push_str("\nfailures:\n");
        }
        let _ = writeln!(out, "  {} / {}:", r.workload, r.config);
        for line in r.error.as_deref().unwrap_or("?").lines() {
            let _ = writeln!(out, "    {line}");
        }
    }
    out
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
                m.tflops.map_or_else(|| "-".into(), format_tflops),
                fmt_opt(r.percent_of_peak, 1),
                fmt_opt(m.first_step_s, 1),
            ],
            None => failed_row(r),
        })
        .collect();
    table(
        &[
            "workload", "config", "median", "p10", "p90", "speedup", "TFLOP/s", "% peak", "first s",
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

/// The GPU's clock and power over each run's timed steps ([`GpuClocks`]); nothing when no run
/// read them.
fn clocks_table(report: &RunReport) -> String {
    let rows: Vec<Vec<String>> = (report.rows.iter())
        .filter_map(|r| {
            let m = r.measurement.as_ref()?;
            let mut row = vec![r.workload.clone(), r.config.clone()];
            row.extend(m.clocks?.cells(Some(m.median_ms)));
            Some(row)
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut headings = vec!["workload", "config"];
    headings.extend(GpuClocks::HEADINGS);
    format!("{CLOCKS_LEGEND}{}", table(&headings, &rows))
}

/// What the clock tables' columns mean.
pub(crate) const CLOCKS_LEGEND: &str =
    "\nthe GPU's SM clock and board power while the steps were timed (NVML, every 10 ms): the mean\n\
     clock, its range and its share of the maximum; the mean power and the board's limit; capped:\n\
     the share of readings whose clock the power limit held down; J/step: the mean power times the\n\
     median step\n";

/// Where each run's memory went ([`MemoryBreakdown`](crate::memory::MemoryBreakdown)); nothing
/// when no run measured device memory.
fn breakdown_table(report: &RunReport) -> String {
    let rows: Vec<Vec<String>> = report
        .rows
        .iter()
        .filter_map(|r| {
            let b = r.measurement.as_ref()?.memory?.breakdown?;
            let gib = |bytes: u64| format!("{:.2}", bytes as f64 / (1u64 << 30) as f64);
            Some(vec![
                r.workload.clone(),
                r.config.clone(),
                gib(b.parameters),
                gib(b.gradients),
                gib(b.optimizer_state),
                gib(b.weight_copies),
                gib(b.other_held),
                gib(b.activations),
                gib(b.cached),
                gib(b.graph_pools),
            ])
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "
where the memory went, GiB. held between steps: params, grads, optim (state), copies (weights
         in the autocast type), other; + activ (the step's transient peak) = peak; + cached = resv.
         graph: reserved by CUDA graph pools (allocated or cached)
",
    );
    out.push_str(&table(
        &[
            "workload", "config", "params", "grads", "optim", "copies", "other", "activ", "cached",
            "graph",
        ],
        &rows,
    ));
    out
}

/// Every rank's median and the throughput per GPU and in total, for data-parallel rows.
fn data_parallel_table(report: &RunReport) -> String {
    let rows: Vec<Vec<String>> = report
        .rows
        .iter()
        .filter_map(|r| Some((r, r.data_parallel.as_ref()?)))
        .map(|(r, d)| {
            let per_rank = |values: &[f64]| -> String {
                let shown: Vec<String> = values
                    .iter()
                    .map(|ms| {
                        if ms.is_nan() {
                            "-".into()
                        } else {
                            format!("{ms:.3}")
                        }
                    })
                    .collect();
                shown.join(" ")
            };
            let rate = |pick: fn(&Throughput) -> f64| {
                d.throughput
                    .as_ref()
                    .map_or("-".into(), |t| format!("{:.0} {}/s", pick(t), t.unit))
            };
            vec![
                r.workload.clone(),
                r.config.clone(),
                per_rank(&d.median_ms_per_rank),
                per_rank(&d.collectives_ms_per_rank),
                per_rank(&d.exposed_ms_per_rank),
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
        "\ndata parallel over {world} ranks ({backend}): each rank's median ms, its ms per step in \
         collectives and of those exposed (no other kernel beside them; CUDA only), throughput \
         per GPU and in total\n{}",
        table(
            &[
                "workload",
                "config",
                "median ms per rank",
                "collectives ms",
                "exposed ms",
                "per GPU",
                "total"
            ],
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
    let runs: Vec<RunSummary> = measured
        .map(|(r, m)| RunSummary {
            workload: r.workload.clone(),
            config: r.config.clone(),
            memory: m.memory,
            first_step_s: m.first_step_s,
            median_ms: Some(m.median_ms),
            clocks: m.clocks,
        })
        .collect();
    let mut out = run.render_times(&times);
    out.push_str(&run.render_memory(&runs));
    out.push_str(&run.render_clocks(&runs, CLOCKS_LEGEND));
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

/// Prints the `--list` table of `workloads`.
pub(super) fn print_list(workloads: &[&Workload]) {
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

/// Writes the files `args` asks for: `--json`, `--save-baseline`, `--csv`, `--svg`.
/// `value` as pretty JSON into `path` (`--json` of `--largest-batch`).
pub(super) fn write_json(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    let json = serde_json::to_string_pretty(value)
        .map_err(|e| SpeedkitError::Misuse(format!("the report cannot be written as JSON: {e}")))?;
    std::fs::write(path, json).map_err(|source| SpeedkitError::Io {
        path: path.to_path_buf(),
        source,
    })
}

pub(super) fn write_outputs(args: &Args, report: &RunReport) -> Result<()> {
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
        "workload,config,size,median_ms,p10_ms,p90_ms,speedup,tflops,percent_of_peak,peak_allocated_bytes,peak_reserved_bytes,steady_peak_allocated_bytes,graphed,final_loss,first_step_s,device\n",
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
            "{},{},{},{:.4},{:.4},{:.4},{},{},{},{},{},{},{},{},{},\"{}\"",
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
            fmt_opt(m.first_step_s, 2),
            device
        );
    }
    out
}

/// The bar colours of the SVG chart, one per config, in turn.
const COLORS: [&str; 7] = [
    "#8c8c8c", "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
];

/// A grouped bar chart of the speedup of every config over the first, per workload.
pub fn render_svg(report: &RunReport) -> String {
    let (workloads, configs) = chart_groups(report);
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
                COLORS[ci % COLORS.len()],
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
    svg_legend(&mut s, &configs, width - 140.0, top);
    s.push_str("</svg>\n");
    s
}

/// The workloads and the configs of `report`'s rows, each in order of first appearance.
fn chart_groups(report: &RunReport) -> (Vec<&str>, Vec<&str>) {
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
    (workloads, configs)
}

/// The chart's legend, a colour swatch and name per config, at `x`, from `top` down.
fn svg_legend(s: &mut String, configs: &[&str], x: f64, top: f64) {
    for (ci, c) in configs.iter().enumerate() {
        let y = top + 10.0 + ci as f64 * 18.0;
        let _ = writeln!(
            s,
            r#"<rect x="{x:.0}" y="{:.0}" width="12" height="12" fill="{}"/><text x="{:.0}" y="{:.0}">{c}</text>"#,
            y - 10.0,
            COLORS[ci % COLORS.len()],
            x + 18.0,
            y
        );
    }
}

/// Prints `profile`'s kernel tables for `workload` / `config`, and writes its JSON and Chrome
/// trace to speedkit-profile/.
pub(super) fn write_profile(profile: &Profile, workload: &str, config: &str) -> Result<()> {
    let (title, stem) = (
        format!("{workload} / {config}"),
        format!("{workload}-{config}"),
    );
    let dir = Path::new(crate::profile::DEFAULT_OUTPUT_DIR);
    profile.print_and_write(&title, dir, &stem)
}

/// Writes the history `history` recorded over one run to `dir/WORKLOAD-CONFIG.pickle`; returns
/// the path.
pub(super) fn write_memory_history(
    history: &MemoryHistory,
    dir: &Path,
    workload: &str,
    config: &str,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)
        .map_err(|e| SpeedkitError::Misuse(format!("cannot create {}: {e}", dir.display())))?;
    // Under a launcher every rank records its own device: one file each.
    let rank = match crate::dist::LaunchEnv::from_env() {
        Ok(Some(env)) if env.world_size > 1 => format!(".rank{}", env.rank),
        _ => String::new(),
    };
    let path = dir.join(format!("{workload}-{config}{rank}.pickle"));
    history.write(&path)?;
    Ok(path)
}

/// The progress bar of one workload × config run; hidden on every rank but the one that prints.
pub(super) struct Progress(ProgressBar);

impl Progress {
    /// A bar of `steps` steps headed `prefix`, drawn when `shown`.
    pub(super) fn new(shown: bool, steps: usize, prefix: String) -> Self {
        let bar = if shown {
            ProgressBar::new(steps as u64)
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template("{prefix:>28} [{bar:30}] {pos}/{len} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(prefix);
        Self(bar)
    }

    /// One more step done.
    pub(super) fn tick(&self) {
        self.0.inc(1);
    }

    /// Takes the bar off the terminal.
    pub(super) fn finish(&self) {
        self.0.finish_and_clear();
    }
}
