//! `cudnn:`, cuDNN's flags.

use serde::{Deserialize, Serialize};

use super::AutoBool;

/// cuDNN flags (`torch.backends.cudnn.*`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of cuDNN settings"
)]
pub struct CudnnConfig {
    /// `torch.backends.cudnn.enabled` (default `true`).
    pub enabled: bool,
    /// `torch.backends.cudnn.benchmark`: autotune convolution algorithms per input shape.
    pub benchmark: AutoBool,
    /// `torch.backends.cudnn.allow_tf32`: let cuDNN convolutions use TF32.
    pub allow_tf32: AutoBool,
    /// `torch.backends.cudnn.deterministic` (default `false`).
    pub deterministic: bool,
}

impl Default for CudnnConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            benchmark: AutoBool::Auto,
            allow_tf32: AutoBool::Auto,
            deterministic: false,
        }
    }
}
