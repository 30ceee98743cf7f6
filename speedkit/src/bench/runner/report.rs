//! What a run produces: a [`Row`] per workload × config, and the [`RunReport`] that `--json` and
//! `--save-baseline` write.

use serde::Serialize;

use super::cli::NamedConfig;
use crate::bench::baseline::Comparison;
use crate::bench::peer::PeerReport;
use crate::bench::{Measurement, Protocol, Size};
use crate::dist::{ProcessGroup, Throughput};
use crate::error::Result;
use crate::hardware::Hardware;

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

impl Row {
    /// The row of `workload` under `config` before it runs: nothing measured, no error.
    pub(super) fn pending(workload: &str, config: &str, size: Size) -> Self {
        Row {
            workload: workload.to_string(),
            config: config.to_string(),
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
        }
    }
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
    /// Each rank's time in collectives per step, ms (NaN where it has no figure: on the CPU).
    pub collectives_ms_per_rank: Vec<f64>,
    /// Of that, each rank's time no other kernel ran beside the collectives, ms: the
    /// communication its step waited for ([`Communication`](crate::profile::Communication)).
    pub exposed_ms_per_rank: Vec<f64>,
}

impl DataParallelRow {
    /// Gathers every rank's median (a collective: every rank calls it, also when its own run
    /// failed, with `None`).
    pub(super) fn gather(group: &ProcessGroup, mine: Option<&Measurement>) -> Result<Self> {
        let median_ms_per_rank = group.all_gather_f64(mine.map_or(f64::NAN, |m| m.median_ms))?;
        let throughput = mine.and_then(|m| m.items_per_step).map(|(items, unit)| {
            let rates = median_ms_per_rank
                .iter()
                .map(|ms| items / (ms * 1e-3))
                .collect();
            Throughput::from_rates(unit, rates)
        });
        let communication = mine.and_then(|m| m.communication.as_ref());
        let collectives_ms_per_rank =
            group.all_gather_f64(communication.map_or(f64::NAN, |c| c.busy_ms))?;
        let exposed_ms_per_rank =
            group.all_gather_f64(communication.map_or(f64::NAN, |c| c.exposed_ms))?;
        Ok(Self {
            world_size: group.world_size(),
            backend: group.backend().to_string(),
            median_ms_per_rank,
            throughput,
            collectives_ms_per_rank,
            exposed_ms_per_rank,
        })
    }
}

/// Version of the layout of [`RunReport`]'s JSON; bumped whenever a field changes meaning or
/// moves. 2: memory as [`DeviceMemory`](crate::bench::DeviceMemory), baselines and peers (later
/// additions: `world_size`, rows' `data_parallel` with, later, its `collectives_ms_per_rank` and
/// `exposed_ms_per_rank`, and the measurement's `communication`).
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

impl RunReport {
    /// The report of `--list`: the environment, nothing run.
    pub(super) fn empty(environment: Hardware) -> Self {
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
