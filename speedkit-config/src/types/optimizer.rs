//! `optimizer:`, which optimizer and how it runs.

use serde::{Deserialize, Serialize};

use super::AutoBool;

/// Optimizer choice and implementation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of optimizer settings"
)]
pub struct OptimizerConfig {
    /// The optimizer; only [`OptimizerName::AdamW`] exists today.
    pub name: OptimizerName,
    /// Use the fused (single-kernel) implementation.
    pub fused: AutoBool,
}

/// The optimizer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OptimizerName {
    /// AdamW (decoupled weight decay), spelled `adamw`.
    #[default]
    AdamW,
}

spelled_enum!(OptimizerName, "optimizer.name", [AdamW => "adamw"]);
