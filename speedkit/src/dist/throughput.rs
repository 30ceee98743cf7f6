//! [`Throughput`]: a data-parallel run's rate, from every rank's own measurement. Ranks step in
//! lockstep (every backward pass waits for the gradient all-reduce), so the run processes the sum
//! of the ranks' rates; per GPU is that sum over the number of ranks.

use serde::Serialize;

use super::ProcessGroup;
use crate::error::Result;

/// Items per second (tokens, images, samples) of every rank, their total and the mean per GPU.
///
/// ```
/// use speedkit::dist::Throughput;
/// let t = Throughput::from_rates("tokens", vec![30_000.0, 34_000.0]);
/// assert_eq!((t.world_size, t.total, t.per_gpu), (2, 64_000.0, 32_000.0));
/// assert_eq!(t.to_string(), "64000 tokens/s in total over 2 ranks, 32000 tokens/s per GPU");
/// ```
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Throughput {
    /// What is counted, e.g. `tokens`.
    pub unit: String,
    /// Number of ranks measured.
    pub world_size: usize,
    /// Each rank's own rate, items/s, in rank order.
    pub per_rank: Vec<f64>,
    /// The run's rate: the sum over ranks, items/s.
    pub total: f64,
    /// `total / world_size`, items/s.
    pub per_gpu: f64,
}

impl Throughput {
    /// The throughput of ranks that measured `per_rank` items/s each (rank order).
    pub fn from_rates(unit: &str, per_rank: Vec<f64>) -> Self {
        let total: f64 = per_rank.iter().sum();
        let world_size = per_rank.len();
        Self {
            unit: unit.to_string(),
            world_size,
            per_rank,
            total,
            per_gpu: total / world_size.max(1) as f64,
        }
    }

    /// Every rank's `rate` (items/s, this rank's own measurement), gathered through `group`; with
    /// no group (a single process), this process's alone. A collective: every rank of the group
    /// must call it.
    ///
    /// ```no_run
    /// use speedkit::{dist::Throughput, SpeedConfig, SpeedContext};
    /// let ctx = SpeedContext::new(&SpeedConfig::auto())?;
    /// let mine = 16384.0 / 0.020;   // tokens per step / seconds per step
    /// let t = Throughput::gather(ctx.process_group(), mine, "tokens")?;
    /// ctx.print_main(&t);
    /// # Ok::<(), speedkit::SpeedkitError>(())
    /// ```
    pub fn gather(group: Option<&ProcessGroup>, rate: f64, unit: &str) -> Result<Self> {
        let per_rank = match group {
            Some(g) => g.all_gather_f64(rate)?,
            None => vec![rate],
        };
        Ok(Self::from_rates(unit, per_rank))
    }
}

impl std::fmt::Display for Throughput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let unit = &self.unit;
        write!(
            f,
            "{:.0} {unit}/s in total over {} rank{}, {:.0} {unit}/s per GPU",
            self.total,
            self.world_size,
            if self.world_size == 1 { "" } else { "s" },
            self.per_gpu
        )
    }
}
