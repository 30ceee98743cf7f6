//! `--largest-batch`: the largest batch each workload trains at under each configuration, found in
//! one process (an out-of-memory run gives everything back, so the next try starts clean), and
//! with `--peer pytorch` the largest PyTorch trains the same workload at in `reduce-overhead`
//! mode, searched the same way.
//!
//! A workload takes part when it builds at [`Bencher::batch`]; each try builds it at that batch
//! and runs 3 warm-up steps (graph capture included) and 2 timed ones.

use std::fmt::Write as _;

use serde::Serialize;

use super::cli::{self, Args, NamedConfig};
use crate::bench::peer::{self, PeerLargestBatch};
use crate::bench::{BenchError, Bencher, Protocol, Size, Workload};
use crate::error::Result;
use crate::hardware::Hardware;
use crate::report::table;
use crate::SpeedContext;

/// How far the doubling goes: 64 times the workload's own batch.
const MAX_FACTOR: i64 = 64;

/// The PyTorch modes searched with `--peer pytorch`.
const PEER_MODES: [&str; 1] = ["reduce-overhead"];

/// One try: the batch, whether it trained, and its peak allocated.
#[derive(Clone, Debug, Serialize)]
pub struct Attempt {
    /// The batch tried.
    pub batch: i64,
    /// It trained; `false`: it ran out of memory.
    pub trained: bool,
    /// Peak bytes allocated when it trained (on a GPU).
    pub peak_allocated_bytes: Option<u64>,
}

/// The largest batch of one workload under one configuration.
#[derive(Clone, Debug, Serialize)]
pub struct LargestBatch {
    /// Workload name.
    pub workload: String,
    /// Config name.
    pub config: String,
    /// The workload's own batch at this size, where the search started.
    pub default_batch: Option<i64>,
    /// The largest batch that trained (0: not even the first).
    pub largest_batch: i64,
    /// The smallest batch that ran out of memory (`None`: the doubling reached its cap).
    pub first_failing: Option<i64>,
    /// Every try, in order.
    pub tried: Vec<Attempt>,
    /// Why the search stopped on something other than running out of memory.
    pub error: Option<String>,
}

/// What `--largest-batch` produces (and writes with `--json`).
#[derive(Clone, Debug, Serialize)]
pub struct LargestBatchReport {
    /// Hardware and software.
    pub environment: Hardware,
    /// Configurations, in order.
    pub configs: Vec<NamedConfig>,
    /// speedkit's results, one per workload × config.
    pub rows: Vec<LargestBatch>,
    /// PyTorch's, with `--peer pytorch`.
    pub peer: Vec<PeerLargestBatch>,
    /// Why the peer did not run, when asked for and it did not.
    pub peer_not_run: Option<String>,
}

/// The largest `batch` for which `fits` holds: doubling from `start` until a batch does not fit
/// (at most `max_factor` × `start`), then halving the interval until the answer is known within an
/// eighth. `(largest fitting or 0, smallest failing)`; an `Err` of `fits` ends the search.
///
/// ```
/// use speedkit::bench::runner::search_largest;
/// let (fits, fails) = search_largest(32, 64, |b| Ok::<_, String>(b <= 300)).unwrap();
/// assert!(fits <= 300 && fits >= 300 - 300 / 8);
/// assert!(fails.is_some_and(|f| f > 300));
/// ```
pub fn search_largest<E>(
    start: i64,
    max_factor: i64,
    mut fits: impl FnMut(i64) -> std::result::Result<bool, E>,
) -> std::result::Result<(i64, Option<i64>), E> {
    let (mut fitting, mut failing) = (0, None);
    let mut batch = start.max(1);
    while failing.is_none() && batch <= max_factor * start.max(1) {
        if fits(batch)? {
            fitting = batch;
            batch *= 2;
        } else {
            failing = Some(batch);
        }
    }
    while let Some(fail) = failing {
        if fitting == 0 || fail - fitting <= (fitting / 8).max(1) {
            break;
        }
        let middle = (fitting + fail) / 2;
        if fits(middle)? {
            fitting = middle;
        } else {
            failing = Some(middle);
        }
    }
    Ok((fitting, failing))
}

/// Runs the search for every one of `selected` that takes a batch, under every configuration of
/// `args`, and the peer when `args` asks for it (what `--largest-batch` prints).
pub fn largest_batches(
    args: &Args,
    selected: &[&Workload],
    hardware: Hardware,
) -> Result<LargestBatchReport> {
    let configs = cli::configs_of(args)?;
    let size = cli::size_of(args, !hardware.gpus.is_empty());
    let mut rows = Vec::new();
    super::run::settle_workspaces(!hardware.gpus.is_empty());
    for w in selected {
        for nc in &configs {
            if let Some(row) = search(w, nc, size) {
                eprintln!(
                    "{} / {}: largest batch {}",
                    row.workload, row.config, row.largest_batch
                );
                rows.push(row);
            }
        }
    }
    let (peer, peer_not_run) = match &args.peer {
        Some(_) => run_peer(args, &rows),
        None => (Vec::new(), None),
    };
    Ok(LargestBatchReport {
        environment: hardware,
        configs,
        rows,
        peer,
        peer_not_run,
    })
}

/// The search for `w` under `nc`; `None` when `w` does not take a batch (said on stderr).
fn search(w: &Workload, nc: &NamedConfig, size: Size) -> Option<LargestBatch> {
    let default_batch = match attempt(w, nc, size, None) {
        Ok((_, _, None)) => {
            eprintln!(
                "skip {}: it builds at a fixed batch (it does not call Bencher::batch)",
                w.name
            );
            return None;
        }
        Ok((_, _, Some(default))) => default,
        Err(e) => {
            return Some(LargestBatch {
                workload: w.name.into(),
                config: nc.name.clone(),
                default_batch: None,
                largest_batch: 0,
                first_failing: None,
                tried: Vec::new(),
                error: Some(e),
            })
        }
    };
    let mut tried = Vec::new();
    let outcome = search_largest(default_batch, MAX_FACTOR, |batch| {
        let (trained, peak, _) = attempt(w, nc, size, Some(batch))?;
        tried.push(Attempt {
            batch,
            trained,
            peak_allocated_bytes: peak,
        });
        Ok::<_, String>(trained)
    });
    let (largest_batch, first_failing, error) = match outcome {
        Ok((fits, fails)) => (fits, fails, None),
        Err(e) => (0, None, Some(e)),
    };
    Some(LargestBatch {
        workload: w.name.into(),
        config: nc.name.clone(),
        default_batch: Some(default_batch),
        largest_batch,
        first_failing,
        tried,
        error,
    })
}

/// What one try found: it trained (`false`: out of memory), the peak allocated (on a GPU), and
/// the workload's own batch (`None`: it takes none).
type Tried = (bool, Option<u64>, Option<i64>);

/// Builds and trains `w` at `batch` (its own with `None`). Failures other than running out of
/// memory are `Err`.
fn attempt(
    w: &Workload,
    nc: &NamedConfig,
    size: Size,
    batch: Option<i64>,
) -> std::result::Result<Tried, String> {
    let ctx = SpeedContext::new(&nc.config).map_err(|e| e.to_string())?;
    let protocol = Protocol {
        warmup: 3,
        steps: 2,
        paranoid_sync: true,
    };
    let mut b = Bencher::new(size, &ctx, protocol).with_batch(batch);
    // A workload may call tch's panicking ops (`Module::forward`), which panic where libtorch runs
    // out of memory: that try is over, not the search (every guard has restored its flags).
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (w.run)(&mut b)))
        .unwrap_or_else(|panic| Err(BenchError::new(panic_message(panic.as_ref()))));
    let default_batch = b.default_batch();
    match outcome {
        Ok(()) => {
            let memory = b.take_measurement().and_then(|m| m.memory);
            Ok((true, memory.map(|m| m.peak_allocated_bytes), default_batch))
        }
        Err(e) if e.to_string().contains("out of memory") => Ok((false, None, default_batch)),
        Err(e) => Err(format!("{} at batch {batch:?}: {e}", w.name)),
    }
}

/// A panic's message, where it carries one.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("a panic without a message");
    format!("panicked: {text}")
}

/// PyTorch's largest batches of the workloads speedkit searched.
fn run_peer(args: &Args, rows: &[LargestBatch]) -> (Vec<PeerLargestBatch>, Option<String>) {
    let mut workloads: Vec<String> = Vec::new();
    for r in rows {
        if !workloads.contains(&r.workload) && peer::REFERENCE_WORKLOADS.contains(&&*r.workload) {
            workloads.push(r.workload.clone());
        }
    }
    if workloads.is_empty() {
        return (
            Vec::new(),
            Some("the reference has none of the searched workloads".into()),
        );
    }
    // The reference runs in a process of its own on the same GPUs: what this process's allocator
    // still caches from the search (tens of GiB near the limit) would be memory it cannot have.
    for gpu in 0..tch::Cuda::device_count() {
        if let Err(e) = crate::memory::release_cached(tch::Device::Cuda(gpu as usize)) {
            eprintln!("warning: cuda:{gpu}'s cached memory was not given back before the reference ran ({e})");
        }
    }
    let python = peer::find_python(args.python.as_deref());
    match peer::largest_batch_pytorch(&python, &workloads, &PEER_MODES) {
        Ok((_, rows)) => (rows, None),
        Err(why) => (Vec::new(), Some(why)),
    }
}

/// The table of both sides, then each speedkit row's batch as a multiple of PyTorch's.
pub(super) fn render(report: &LargestBatchReport) -> String {
    let gib = |b: Option<u64>| {
        b.map_or("-".into(), |b| {
            format!("{:.2}", b as f64 / (1u64 << 30) as f64)
        })
    };
    let failing = |f: Option<i64>| f.map_or("-".into(), |f| f.to_string());
    let mut rows: Vec<Vec<String>> = report
        .rows
        .iter()
        .map(|r| {
            let peak = r.tried.iter().find(|t| t.batch == r.largest_batch);
            vec![
                r.workload.clone(),
                format!("speedkit {}", r.config),
                r.largest_batch.to_string(),
                failing(r.first_failing),
                gib(peak.and_then(|t| t.peak_allocated_bytes)),
                r.error.clone().unwrap_or_default(),
            ]
        })
        .collect();
    rows.extend(report.peer.iter().map(|p| {
        vec![
            p.workload.clone(),
            format!("pytorch {}", p.mode),
            p.largest_batch.to_string(),
            failing(p.first_failing),
            gib(p.peak_allocated_bytes),
            String::new(),
        ]
    }));
    let mut out = String::from(
        "\nlargest batch that trains (within an eighth: the search halves the interval to there);\n\
         peak: allocated at that batch, GiB\n",
    );
    out.push_str(&table(
        &["workload", "run", "largest", "fails at", "peak", "error"],
        &rows,
    ));
    for r in &report.rows {
        for p in report
            .peer
            .iter()
            .filter(|p| p.workload == r.workload && p.largest_batch > 0)
        {
            let _ = writeln!(
                out,
                "{} / {}: {:.2}x the batch of pytorch {}",
                r.workload,
                r.config,
                r.largest_batch as f64 / p.largest_batch as f64,
                p.mode
            );
        }
    }
    if let Some(why) = &report.peer_not_run {
        let _ = writeln!(out, "pytorch did not run: {why}");
    }
    out
}
