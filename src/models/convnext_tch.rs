//! `ConvnextTch`: a ConvNeXt-style image classifier written with tch's own modules and ops: a
//! patchifying stem, stages of blocks of a 7×7 depthwise convolution, a LayerNorm over channels
//! (the activations permuted to channels-last and back), a pointwise MLP as two `linear` layers
//! around an exact (erf) GELU, a learned per-channel scale and a residual add, stride-2
//! convolutions between stages, and a pooled, normed linear head under cross-entropy.
//!
//! A family none of the other reference models belongs to: a grouped convolution, a LayerNorm
//! over the last dimension of a permuted image, an erf GELU and a broadcast scale parameter, so it
//! measures what speedkit does for a model it was not written for.

use speedkit::{Result, SpeedkitError};
use tch::{nn, Kind, Tensor};

use super::Conv;

/// A ConvNeXt's images, widths, depths and batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvnextConfig {
    /// Images per batch.
    pub batch: i64,
    /// Height and width of the (square) images.
    pub image_size: i64,
    /// Channels of the images.
    pub channels: i64,
    /// Width of the first stage; each later stage has twice the one before.
    pub base: i64,
    /// Blocks in each of the four stages.
    pub depths: [i64; 4],
    /// Classes of the head.
    pub classes: i64,
}

impl ConvnextConfig {
    /// The reference size: 128 images of 3 × 128 × 128, ConvNeXt-T's widths (96 to 768) and
    /// depths (3, 3, 9, 3), 1000 classes.
    pub const fn bench() -> Self {
        Self {
            batch: 128,
            image_size: 128,
            channels: 3,
            base: 96,
            depths: [3, 3, 9, 3],
            classes: 1000,
        }
    }

    /// A CPU-test size: 2 images of 3 × 32 × 32, widths 8 to 64, one block a stage, 10 classes.
    pub const fn tiny() -> Self {
        Self {
            batch: 2,
            image_size: 32,
            channels: 3,
            base: 8,
            depths: [1, 1, 1, 1],
            classes: 10,
        }
    }

    /// Convolution and matmul FLOPs of one training step (forward × 3 for the backward).
    pub fn flops_per_step(&self) -> f64 {
        let b = self.batch as f64;
        let mut side = self.image_size / 4;
        let mut forward = 2.0 * b * (self.channels * self.base * 16 * side * side) as f64;
        for (stage, &depth) in self.depths.iter().enumerate() {
            let c = self.base << stage;
            if stage > 0 {
                side /= 2;
                forward += 2.0 * b * ((c / 2) * c * 4 * side * side) as f64;
            }
            let pixels = b * (side * side) as f64;
            let block = 2.0 * pixels * (49 * c + 8 * c * c) as f64;
            forward += depth as f64 * block;
        }
        forward += 2.0 * b * ((self.base << 3) * self.classes) as f64;
        3.0 * forward
    }

    fn check(&self) -> Result<()> {
        let sizes = [
            self.batch,
            self.image_size,
            self.channels,
            self.base,
            self.classes,
        ];
        if sizes.iter().chain(&self.depths).any(|&v| v <= 0) || self.image_size % 32 != 0 {
            return Err(SpeedkitError::Misuse(format!(
                "a ConvNeXt config needs positive sizes and depths and an image side divisible \
                 by 32 (a stem of 4, three halvings): {self:?}"
            )));
        }
        Ok(())
    }
}

/// LayerNorm over the channels of an NCHW image, as ConvNeXt writes it: channels-last, normed,
/// and back.
fn channels_norm(norm: &nn::LayerNorm, x: &Tensor) -> Result<Tensor> {
    let h = super::layer_norm(norm, &x.f_permute([0, 2, 3, 1])?)?;
    Ok(h.f_permute([0, 3, 1, 2])?)
}

/// `x + γ · fc2(gelu(fc1(norm(dwconv(x)))))`, the MLP over channels-last pixels.
#[derive(Debug)]
struct Block {
    dwconv: Conv,
    norm: nn::LayerNorm,
    fc1: nn::Linear,
    fc2: nn::Linear,
    scale: Tensor,
}

impl Block {
    fn new(p: &nn::Path, c: i64) -> Self {
        Self {
            dwconv: Conv::new(&(p / "dwconv"), (c, c, 7), 1, 3, c),
            norm: nn::layer_norm(p / "norm", vec![c], Default::default()),
            fc1: nn::linear(p / "fc1", c, 4 * c, Default::default()),
            fc2: nn::linear(p / "fc2", 4 * c, c, Default::default()),
            // ConvNeXt's layer scale starts at 1e-6; 0.1 lets a short run see every block learn.
            scale: p.var("scale", &[c], nn::Init::Const(0.1)),
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.dwconv.forward(x)?.f_permute([0, 2, 3, 1])?;
        let h = super::layer_norm(&self.norm, &h)?;
        let h = super::linear(&self.fc1, &h)?.f_gelu("none")?;
        let h = super::linear(&self.fc2, &h)?.f_mul(&self.scale)?;
        Ok(x.f_add(&h.f_permute([0, 3, 1, 2])?)?)
    }
}

/// A channels norm, then a 2×2 stride-2 convolution to twice the width.
#[derive(Debug)]
struct Downsample {
    norm: nn::LayerNorm,
    conv: Conv,
}

/// The ConvNeXt (see the [module docs](self)).
#[derive(Debug)]
pub struct ConvnextTch {
    config: ConvnextConfig,
    stem: Conv,
    stem_norm: nn::LayerNorm,
    downsamples: Vec<Downsample>,
    stages: Vec<Vec<Block>>,
    head_norm: nn::LayerNorm,
    head: nn::Linear,
}

impl ConvnextTch {
    /// Builds the model under `p`; fails on a config whose sizes or depths are not positive or
    /// whose image side does not divide by 32.
    pub fn new(p: &nn::Path, config: &ConvnextConfig) -> Result<Self> {
        config.check()?;
        let norm = |name: String, c: i64| nn::layer_norm(p / name, vec![c], Default::default());
        let width = |stage: usize| config.base << stage;
        let downsamples = (1..4)
            .map(|s| Downsample {
                norm: norm(format!("down{s}_norm"), width(s - 1)),
                conv: Conv::new(
                    &(p / format!("down{s}")),
                    (width(s - 1), width(s), 2),
                    2,
                    0,
                    1,
                ),
            })
            .collect();
        let stages = (0..4)
            .map(|s| {
                (0..config.depths[s])
                    .map(|b| Block::new(&(p / format!("stage{s}") / b), width(s)))
                    .collect()
            })
            .collect();
        Ok(Self {
            config: *config,
            stem: Conv::new(&(p / "stem"), (config.channels, config.base, 4), 4, 0, 1),
            stem_norm: norm("stem_norm".into(), config.base),
            downsamples,
            stages,
            head_norm: norm("head_norm".into(), width(3)),
            head: nn::linear(p / "head", width(3), config.classes, Default::default()),
        })
    }

    /// The config the model was built with.
    pub fn config(&self) -> &ConvnextConfig {
        &self.config
    }

    /// The class logits `[B, classes]` of images `[B, channels, side, side]`.
    pub fn forward(&self, images: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        super::check_images(images, c.channels, c.image_size)?;
        let mut x = channels_norm(&self.stem_norm, &self.stem.forward(images)?)?;
        for (stage, blocks) in self.stages.iter().enumerate() {
            if stage > 0 {
                let down = &self.downsamples[stage - 1];
                x = down.conv.forward(&channels_norm(&down.norm, &x)?)?;
            }
            for block in blocks {
                x = block.forward(&x)?;
            }
        }
        let pooled = x.f_mean_dim([2, 3].as_slice(), false, Kind::Float)?;
        super::linear(&self.head, &super::layer_norm(&self.head_norm, &pooled)?)
    }

    /// Mean cross-entropy of the logits of `images` against class indices `labels` `[B]`.
    pub fn loss(&self, images: &Tensor, labels: &Tensor) -> Result<Tensor> {
        super::cross_entropy(&self.forward(images)?, labels)
    }
}
