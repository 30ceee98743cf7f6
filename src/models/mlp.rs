//! `Mlp`: a two-layer perceptron classifier.

use speedkit::Result;
use tch::{nn, Tensor};

use super::{cross_entropy, linear};

/// Sizes of [`Mlp`] and of its batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpConfig {
    /// Input features.
    pub input: i64,
    /// Hidden width.
    pub hidden: i64,
    /// Output classes.
    pub classes: i64,
    /// Rows of the input.
    pub batch: i64,
}

impl MlpConfig {
    /// The reference size: 512 → 1024 → 10, batch 256.
    pub const fn bench() -> Self {
        Self {
            input: 512,
            hidden: 1024,
            classes: 10,
            batch: 256,
        }
    }

    /// A CPU-test size: 32 → 64 → 10, batch 16.
    pub const fn tiny() -> Self {
        Self {
            input: 32,
            hidden: 64,
            classes: 10,
            batch: 16,
        }
    }

    /// Matmul FLOPs of one training step: 6·batch·(input·hidden + hidden·classes) (2 per
    /// multiply-add, × 3 for forward + backward) — ≈ 0.82 GFLOP at the bench size.
    pub fn flops_per_step(&self) -> f64 {
        let params = self.input * self.hidden + self.hidden * self.classes;
        6.0 * self.batch as f64 * params as f64
    }
}

/// `Linear(input, hidden)` → ReLU → `Linear(hidden, classes)`.
#[derive(Debug)]
pub struct Mlp {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Mlp {
    /// Builds the two layers under `p` (`fc1`, `fc2`).
    pub fn new(p: &nn::Path, config: &MlpConfig) -> Self {
        Self {
            fc1: nn::linear(p / "fc1", config.input, config.hidden, Default::default()),
            fc2: nn::linear(p / "fc2", config.hidden, config.classes, Default::default()),
        }
    }

    /// Logits, `[batch, classes]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear(&self.fc2, &linear(&self.fc1, x)?.f_relu()?)
    }

    /// Cross-entropy of the logits against class indices `labels`.
    pub fn loss(&self, x: &Tensor, labels: &Tensor) -> Result<Tensor> {
        cross_entropy(&self.forward(x)?, labels)
    }
}
