//! `bench:`, the benchmark runner's settings.

use serde::{Deserialize, Serialize};

/// Settings of the benchmark runner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of benchmark settings"
)]
pub struct BenchConfig {
    /// Untimed steps before measuring.
    pub warmup: u32,
    /// Timed steps; at least 1.
    pub steps: u32,
    /// Synchronise the device around every timed step (slower, but timings cannot lie).
    pub paranoid_sync: bool,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            warmup: 10,
            steps: 50,
            paranoid_sync: true,
        }
    }
}
