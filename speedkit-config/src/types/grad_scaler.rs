//! `grad_scaler:`, dynamic loss scaling.

use serde::{Deserialize, Serialize};

use super::AutoBool;

/// Dynamic loss scaling (`torch.amp.GradScaler`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of grad scaler settings"
)]
pub struct GradScalerConfig {
    /// `auto`: on exactly when the precision resolves to fp16.
    pub enabled: AutoBool,
    /// Initial loss scale; finite and > 0 (default 2^16).
    pub init_scale: f64,
    /// Factor the scale grows by after `growth_interval` clean steps; finite and > 1.
    pub growth_factor: f64,
    /// Factor the scale shrinks by after an inf/NaN step; strictly between 0 and 1.
    pub backoff_factor: f64,
    /// Clean steps between growths; at least 1.
    pub growth_interval: u32,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        Self {
            enabled: AutoBool::Auto,
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}
