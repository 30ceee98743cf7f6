//! Saved runs and the verdict of a new run against one.
//!
//! `--save-baseline NAME` writes the whole run report (every per-step time, the environment, the
//! configurations, the protocol) to `target/speedkit/baselines/NAME.json` (under
//! `$CARGO_TARGET_DIR` when that is set); `--baseline NAME` reads it back (a path to any report
//! written by `--json` works too) and compares each workload × config row: the ratio of the
//! medians, its 95% bootstrap interval and a verdict ([`stats`](super::stats)). A baseline from
//! another GPU, driver or library version is compared with a warning that names the difference,
//! and so is a row whose GPU ran at another SM clock than the baseline's (a power cap reached in
//! one run and not the other moves every kernel's time: [`GpuClocks`](super::GpuClocks)).
//!
//! ```no_run
//! use speedkit::bench::baseline::{self, Baseline};
//! let path = baseline::path_for("main")?;
//! let saved = Baseline::load("main")?;
//! println!("{} rows saved in {}", saved.rows.len(), path.display());
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::PathBuf;

use super::runner::{Row, REPORT_SCHEMA_VERSION};
use super::stats::{compare_medians, MedianRatio, Verdict};
use super::{GpuClocks, Protocol};
use crate::error::{Result, SpeedkitError};
use crate::hardware::Hardware;
use crate::report::table;

/// Where named baselines live: `$CARGO_TARGET_DIR/speedkit/baselines`, or
/// `target/speedkit/baselines` under the current directory.
pub fn baseline_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| PathBuf::from("target"), PathBuf::from)
        .join("speedkit")
        .join("baselines")
}

/// The file of a baseline: `NAME` (letters, digits, `-`, `_`, `.`) in [`baseline_dir`], or, for
/// anything that names a file (ends in `.json` or contains a path separator), that file.
///
/// ```
/// use speedkit::bench::baseline::path_for;
/// assert!(path_for("main").unwrap().ends_with("speedkit/baselines/main.json"));
/// assert_eq!(path_for("runs/old.json").unwrap(), std::path::Path::new("runs/old.json"));
/// assert!(path_for("no good").is_err());
/// ```
pub fn path_for(name_or_path: &str) -> Result<PathBuf> {
    if name_or_path.ends_with(".json") || name_or_path.contains(std::path::MAIN_SEPARATOR) {
        return Ok(PathBuf::from(name_or_path));
    }
    let valid = !name_or_path.is_empty()
        && !name_or_path.starts_with('.')
        && name_or_path
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !valid {
        return Err(SpeedkitError::Misuse(format!(
            "baseline name {name_or_path:?}: use letters, digits, '-', '_' and '.', \
             or give a path ending in .json"
        )));
    }
    Ok(baseline_dir().join(format!("{name_or_path}.json")))
}

/// Writes a run report's JSON as the baseline `name_or_path` ([`path_for`]), creating the
/// directory; returns the file written.
pub fn save(name_or_path: &str, report_json: &str) -> Result<PathBuf> {
    let path = path_for(name_or_path)?;
    let io = |source| SpeedkitError::Io {
        path: path.clone(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    std::fs::write(&path, report_json).map_err(io)?;
    Ok(path)
}

/// The parts of a GPU a comparison depends on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedGpu {
    /// Marketing name.
    pub name: String,
}

/// The environment a baseline was measured in (the fields of [`Hardware`] that change timings).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedEnvironment {
    /// Visible GPUs.
    pub gpus: Vec<SavedGpu>,
    /// libtorch version.
    pub libtorch: String,
    /// CUDA runtime version.
    pub cuda_runtime: Option<String>,
    /// cuDNN version.
    pub cudnn: Option<String>,
    /// NVIDIA driver version.
    pub driver: Option<String>,
}

impl SavedEnvironment {
    /// The same fields of the running machine.
    pub fn of(hardware: &Hardware) -> Self {
        Self {
            gpus: hardware
                .gpus
                .iter()
                .map(|g| SavedGpu {
                    name: g.name.clone(),
                })
                .collect(),
            libtorch: hardware.libtorch.clone(),
            cuda_runtime: hardware.cuda_runtime.clone(),
            cudnn: hardware.cudnn.clone(),
            driver: hardware.driver.clone(),
        }
    }

    /// Each field that differs from `now`, as `what: baseline X, now Y`.
    pub fn differences(&self, now: &SavedEnvironment) -> Vec<String> {
        let gpu = |e: &SavedEnvironment| {
            e.gpus
                .first()
                .map_or_else(|| "no GPU".to_string(), |g| g.name.clone())
        };
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "none".into());
        [
            ("GPU", gpu(self), gpu(now)),
            ("driver", opt(&self.driver), opt(&now.driver)),
            ("libtorch", self.libtorch.clone(), now.libtorch.clone()),
            ("CUDA", opt(&self.cuda_runtime), opt(&now.cuda_runtime)),
            ("cuDNN", opt(&self.cudnn), opt(&now.cudnn)),
        ]
        .into_iter()
        .filter(|(_, then, now)| then != now)
        .map(|(what, then, now)| format!("{what}: baseline {then}, now {now}"))
        .collect()
    }
}

/// One saved workload × config row.
#[derive(Clone, Debug, Deserialize)]
pub struct BaselineRow {
    /// Workload name.
    pub workload: String,
    /// Config name.
    pub config: String,
    /// Size it ran at (`tiny`/`bench`).
    pub size: String,
    /// Per-step times, ms (empty when the row failed).
    pub times_ms: Vec<f64>,
    /// The GPU's clock and power over its timed steps, where they were read.
    pub clocks: Option<GpuClocks>,
}

/// A saved run, read back.
#[derive(Clone, Debug)]
pub struct Baseline {
    /// The file it was read from.
    pub path: PathBuf,
    /// Where it was measured.
    pub environment: SavedEnvironment,
    /// How it was measured.
    pub protocol: Protocol,
    /// Its rows.
    pub rows: Vec<BaselineRow>,
}

#[derive(Deserialize)]
struct SavedReport {
    schema_version: Option<u32>,
    environment: SavedEnvironment,
    protocol: Protocol,
    rows: Vec<SavedRow>,
}

#[derive(Deserialize)]
struct SavedRow {
    workload: String,
    config: String,
    size: String,
    measurement: Option<SavedMeasurement>,
}

#[derive(Deserialize)]
struct SavedMeasurement {
    times_ms: Vec<f64>,
    #[serde(default)]
    clocks: Option<GpuClocks>,
}

impl Baseline {
    /// Reads the baseline `name_or_path` ([`path_for`]).
    pub fn load(name_or_path: &str) -> Result<Baseline> {
        let path = path_for(name_or_path)?;
        let text = std::fs::read_to_string(&path).map_err(|source| {
            let hint = if source.kind() == std::io::ErrorKind::NotFound {
                format!(" (no such baseline: save one first with --save-baseline {name_or_path})")
            } else {
                String::new()
            };
            SpeedkitError::Io {
                path: path.clone(),
                source: std::io::Error::new(source.kind(), format!("{source}{hint}")),
            }
        })?;
        Self::parse(&text, path)
    }

    /// Parses a run report's JSON (`path` is kept for messages).
    pub fn parse(json: &str, path: PathBuf) -> Result<Baseline> {
        let bad =
            |what: String| SpeedkitError::Misuse(format!("baseline {}: {what}", path.display()));
        let saved: SavedReport = serde_json::from_str(json)
            .map_err(|e| bad(format!("not a speedkit run report ({e})")))?;
        match saved.schema_version {
            Some(REPORT_SCHEMA_VERSION) => {}
            other => {
                return Err(bad(format!(
                    "written with report schema {}, this runner reads schema \
                     {REPORT_SCHEMA_VERSION}: save the baseline again with this runner",
                    other.map_or("1 (unversioned)".to_string(), |v| v.to_string())
                )))
            }
        }
        let rows = saved
            .rows
            .into_iter()
            .map(|r| {
                let (times_ms, clocks) = r
                    .measurement
                    .map_or((Vec::new(), None), |m| (m.times_ms, m.clocks));
                BaselineRow {
                    workload: r.workload,
                    config: r.config,
                    size: r.size,
                    times_ms,
                    clocks,
                }
            })
            .collect();
        Ok(Baseline {
            path,
            environment: saved.environment,
            protocol: saved.protocol,
            rows,
        })
    }

    /// The row of `workload` × `config` at `size`, if saved.
    pub fn row(&self, workload: &str, config: &str, size: &str) -> Option<&BaselineRow> {
        self.rows
            .iter()
            .find(|r| r.workload == workload && r.config == config && r.size == size)
    }
}

/// One row of the current run against its baseline row.
#[derive(Clone, Debug, Serialize)]
pub struct ComparedRow {
    /// Workload name.
    pub workload: String,
    /// Config name.
    pub config: String,
    /// The baseline's median, ms (`None`: not in the baseline).
    pub baseline_median_ms: Option<f64>,
    /// This run's median, ms.
    pub median_ms: f64,
    /// `median / baseline median` with its 95% interval.
    pub change: Option<MedianRatio>,
    /// Faster, slower, or no change within noise.
    pub verdict: Option<Verdict>,
}

/// The current run against a baseline, as written into the run's JSON.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    /// The baseline file.
    pub path: PathBuf,
    /// Every difference of environment or protocol between the two runs.
    pub warnings: Vec<String>,
    /// Changes within ± this fraction count as no change.
    pub noise_threshold: f64,
    /// The rows.
    pub rows: Vec<ComparedRow>,
}

/// Compares the measured `rows` of a run on `hardware` under `protocol` with `baseline`.
pub fn compare(
    baseline: &Baseline,
    rows: &[Row],
    hardware: &Hardware,
    protocol: &Protocol,
    noise_threshold: f64,
) -> Comparison {
    let mut warnings = baseline
        .environment
        .differences(&SavedEnvironment::of(hardware));
    if baseline.protocol != *protocol {
        warnings.push(format!(
            "protocol: baseline {}, now {}",
            describe(&baseline.protocol),
            describe(protocol)
        ));
    }
    let compared = rows
        .iter()
        .filter_map(|r| {
            let m = r.measurement.as_ref()?;
            let saved = baseline
                .row(&r.workload, &r.config, &r.size.to_string())
                .filter(|b| !b.times_ms.is_empty());
            let clocks = saved.and_then(|b| Some((b.clocks?, m.clocks?)));
            if let Some((then, now)) = clocks {
                let row = format!("{} {}", r.workload, r.config);
                warnings.extend(clock_difference(&row, &then, &now, noise_threshold));
            }
            let change = saved.and_then(|b| compare_medians(&b.times_ms, &m.times_ms));
            Some(ComparedRow {
                workload: r.workload.clone(),
                config: r.config.clone(),
                baseline_median_ms: saved.map(|b| super::stats::median(&b.times_ms)),
                median_ms: m.median_ms,
                change,
                verdict: change.map(|c| c.verdict(noise_threshold)),
            })
        })
        .collect();
    Comparison {
        path: baseline.path.clone(),
        warnings,
        noise_threshold,
        rows: compared,
    }
}

/// A warning where `row`'s GPU ran at a mean SM clock more than `threshold` (a fraction) away from
/// its baseline's: every kernel's time moves with it.
fn clock_difference(
    row: &str,
    then: &GpuClocks,
    now: &GpuClocks,
    threshold: f64,
) -> Option<String> {
    let change = now.mean_sm_mhz / then.mean_sm_mhz - 1.0;
    (change.abs() > threshold).then(|| {
        format!(
            "{row}: the GPU's SM clock averaged {:.0} MHz, the baseline's {:.0} ({:+.1}%; held \
             down by the power cap in {:.0}% of readings, the baseline's in {:.0}%)",
            now.mean_sm_mhz,
            then.mean_sm_mhz,
            100.0 * change,
            100.0 * now.power_capped,
            100.0 * then.power_capped
        )
    })
}

fn describe(p: &Protocol) -> String {
    format!(
        "{} warm-up + {} timed steps, paranoid sync {}",
        p.warmup,
        p.steps,
        if p.paranoid_sync { "on" } else { "off" }
    )
}

impl Comparison {
    /// The rows slower than the baseline by more than `percent` with 95% confidence, each with
    /// its change.
    pub fn slower_beyond(&self, percent: f64) -> Vec<(&ComparedRow, MedianRatio)> {
        self.rows
            .iter()
            .filter_map(|r| Some((r, r.change?)))
            .filter(|(_, c)| c.slower_beyond(percent / 100.0))
            .collect()
    }

    /// The comparison as text: warnings first, then one row per workload × config.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\nagainst baseline {}\nratio: time now / baseline, 95% CI; within ±{:.1}% is no change",
            self.path.display(),
            100.0 * self.noise_threshold
        );
        for w in &self.warnings {
            let _ = writeln!(
                out,
                "  warning: measured differently, ratios include the difference: {w}"
            );
        }
        let rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| {
                let (ratio, interval, verdict) = match (r.change, r.verdict) {
                    (Some(c), Some(v)) => (
                        format!("{:.3}", c.ratio),
                        format!("{:.3}-{:.3}", c.low, c.high),
                        v.to_string(),
                    ),
                    _ => ("-".into(), "-".into(), "not in baseline".into()),
                };
                vec![
                    r.workload.clone(),
                    r.config.clone(),
                    r.baseline_median_ms
                        .map_or("-".into(), |b| format!("{b:.3}")),
                    format!("{:.3}", r.median_ms),
                    ratio,
                    interval,
                    verdict,
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                "workload",
                "config",
                "baseline ms",
                "now ms",
                "ratio",
                "95% CI",
                "verdict",
            ],
            &rows,
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clocks(mean_sm_mhz: f64, power_capped: f64) -> GpuClocks {
        GpuClocks {
            readings: 60,
            mean_sm_mhz,
            min_sm_mhz: 1600,
            top_sm_mhz: 1980,
            max_sm_mhz: 1980,
            mean_power_w: 690.0,
            power_limit_w: 700.0,
            power_capped,
            thermal: 0.0,
        }
    }

    #[test]
    fn a_row_whose_gpu_ran_at_another_clock_than_its_baseline_is_named() {
        let warning = clock_difference(
            "llama_tch auto",
            &clocks(1980.0, 0.0),
            &clocks(1782.0, 1.0),
            0.02,
        );
        assert_eq!(
            warning.as_deref(),
            Some(
                "llama_tch auto: the GPU's SM clock averaged 1782 MHz, the baseline's 1980 \
                 (-10.0%; held down by the power cap in 100% of readings, the baseline's in 0%)"
            )
        );
    }

    #[test]
    fn a_clock_within_the_noise_threshold_of_its_baselines_is_no_warning() {
        let warning =
            clock_difference("mlp auto", &clocks(1850.0, 1.0), &clocks(1830.0, 1.0), 0.02);
        assert_eq!(warning, None);
    }
}
