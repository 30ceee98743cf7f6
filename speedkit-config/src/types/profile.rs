//! `profile:`, profiling aids.

use serde::{Deserialize, Serialize};

/// Profiling aids (`profile:`).
///
/// ```
/// use speedkit_config::SpeedConfig;
///
/// let cfg = SpeedConfig::from_yaml_str("profile:\n  nvtx: true\n")?;
/// assert!(cfg.profile.nvtx);
/// assert!(!SpeedConfig::default().profile.nvtx);
/// # Ok::<(), speedkit_config::ConfigError>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of profiling settings"
)]
pub struct ProfileConfig {
    /// Mark forward, backward, optimizer step, GradScaler and graph replay as NVTX ranges, so an
    /// `nsys` timeline reads like the training loop (default `false`; costs nothing when off).
    pub nvtx: bool,
}
