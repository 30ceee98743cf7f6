//! Mixed precision: [`autocast`](autocast::AutocastGuard) scopes and the [`GradScaler`].

pub mod autocast;
pub mod scaler;

pub use autocast::{autocast, is_autocast_enabled, AutocastGuard, AutocastState};
pub use scaler::{GradScaler, GradScalerState, ScaledOptimizer};
