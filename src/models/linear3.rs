//! `Linear3`: the seed benchmark, three square linear layers and an MSE loss.

use speedkit::Result;
use tch::{nn, Reduction, Tensor};

/// Sizes of [`Linear3`] and of its batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linear3Config {
    /// Input and output width of every layer.
    pub width: i64,
    /// Rows of the input.
    pub batch: i64,
}

impl Linear3Config {
    /// The reference size: width 8192, batch 512.
    pub const fn bench() -> Self {
        Self {
            width: 8192,
            batch: 512,
        }
    }

    /// A CPU-test size: width 64, batch 8.
    pub const fn tiny() -> Self {
        Self {
            width: 64,
            batch: 8,
        }
    }

    /// Matmul FLOPs of one training step: 3 layers × 3 (forward, grad input, grad weight) ×
    /// 2·batch·width² — 618.5 GFLOP at the bench size.
    pub fn flops_per_step(&self) -> f64 {
        let (b, w) = (self.batch as f64, self.width as f64);
        3.0 * 3.0 * 2.0 * b * w * w
    }
}

/// `Linear(w, w)` × 3, with bias, no activation (the seed benchmark of `docs/workloads.md`); its
/// layers are `speedkit::nn::Linear` (FP8 GEMMs where the plan has them).
#[derive(Debug)]
pub struct Linear3 {
    layers: Vec<speedkit::nn::Linear>,
}

impl Linear3 {
    /// Builds the three layers under `p` (`l0`, `l1`, `l2`).
    pub fn new(p: &nn::Path, config: &Linear3Config) -> Self {
        let layers = (0..3)
            .map(|i| {
                speedkit::nn::Linear::new(&(p / format!("l{i}")), config.width, config.width, true)
            })
            .collect();
        Self { layers }
    }

    /// The three layers applied in turn.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.shallow_clone();
        for layer in &self.layers {
            h = layer.forward_t(&h)?;
        }
        Ok(h)
    }

    /// Mean squared error of the output against `target`.
    pub fn loss(&self, x: &Tensor, target: &Tensor) -> Result<Tensor> {
        Ok(self.forward(x)?.f_mse_loss(target, Reduction::Mean)?)
    }
}
