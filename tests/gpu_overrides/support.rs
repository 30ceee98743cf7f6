//! Helpers the override tests share: holding the LayerNorm override, channels-last strides.

use crate::common;
use speedkit::overrides::Override;
use tch::Tensor;

/// Holds speedkit's LayerNorm override registered (`on`) or removed while the guard lives.
pub fn hold(on: bool) -> speedkit::flags::FlagGuard {
    common::hold_override(Override::LayerNorm, on)
}

/// `t` [N, C, ...] with channels-last strides (the channel dimension moved last in memory).
pub fn channels_last(t: &Tensor) -> Tensor {
    let mut order: Vec<i64> = (0..t.dim() as i64).filter(|&d| d != 1).collect();
    order.push(1);
    let mut inverse = vec![0i64; order.len()];
    for (position, &dim) in order.iter().enumerate() {
        inverse[dim as usize] = position as i64;
    }
    t.permute(&order).contiguous().permute(&inverse)
}
