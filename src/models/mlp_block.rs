//! `MlpBlock`: a transformer MLP block at a width where the GEMMs dominate the step.

use speedkit::Result;
use tch::{nn, Tensor};

use super::layer_norm;

/// Sizes of [`MlpBlock`] and of its batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpBlockConfig {
    /// Model width (LayerNorm and the block's input and output).
    pub width: i64,
    /// Hidden width of the two Linears.
    pub hidden: i64,
    /// Tokens in the batch (rows of the input).
    pub tokens: i64,
}

impl MlpBlockConfig {
    /// The reference size: 4096 → 16384 → 4096 on 16384 tokens (8 × 2048).
    pub const fn bench() -> Self {
        Self {
            width: 4096,
            hidden: 16384,
            tokens: 16384,
        }
    }

    /// A CPU-test size: 64 → 256 → 64 on 32 tokens.
    pub const fn tiny() -> Self {
        Self {
            width: 64,
            hidden: 256,
            tokens: 32,
        }
    }

    /// Matmul FLOPs of one training step: 3 (forward + backward) · 2 Linears · 2 · tokens · width ·
    /// hidden — ≈ 13.2 TFLOP at the bench size.
    pub fn flops_per_step(&self) -> f64 {
        12.0 * self.tokens as f64 * self.width as f64 * self.hidden as f64
    }
}

/// LayerNorm(width) → Linear(width, hidden) → GELU (tanh) → Linear(hidden, width) → residual, its
/// Linears `speedkit::nn::Linear` (FP8 GEMMs where the plan has them).
#[derive(Debug)]
pub struct MlpBlock {
    norm: nn::LayerNorm,
    fc1: speedkit::nn::Linear,
    fc2: speedkit::nn::Linear,
}

impl MlpBlock {
    /// Builds the block under `p` (`norm`, `fc1`, `fc2`).
    pub fn new(p: &nn::Path, config: &MlpBlockConfig) -> Self {
        Self {
            norm: nn::layer_norm(p / "norm", vec![config.width], Default::default()),
            fc1: speedkit::nn::Linear::new(&(p / "fc1"), config.width, config.hidden, true),
            fc2: speedkit::nn::Linear::new(&(p / "fc2"), config.hidden, config.width, true),
        }
    }

    /// The block's output, `[tokens, width]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc1.forward_t(&layer_norm(&self.norm, x)?)?;
        let y = self.fc2.forward_t(&h.f_gelu("tanh")?)?;
        Ok(x.f_add(&y)?)
    }

    /// Mean squared error of the output against `target`.
    pub fn loss(&self, x: &Tensor, target: &Tensor) -> Result<Tensor> {
        Ok(self.forward(x)?.f_mse_loss(target, tch::Reduction::Mean)?)
    }
}
