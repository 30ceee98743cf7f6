//! `sdp_backend:`, the attention backends PyTorch may pick from.

use serde::{Deserialize, Serialize};

/// Scaled-dot-product-attention backends PyTorch may choose from; at least one must stay enabled.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "a mapping of attention backend switches"
)]
pub struct SdpBackendConfig {
    /// FlashAttention kernels.
    pub flash: bool,
    /// Memory-efficient attention kernels.
    pub mem_efficient: bool,
    /// The reference (math) implementation.
    pub math: bool,
    /// cuDNN attention kernels.
    pub cudnn: bool,
}

impl Default for SdpBackendConfig {
    fn default() -> Self {
        Self {
            flash: true,
            mem_efficient: true,
            math: true,
            cudnn: true,
        }
    }
}
