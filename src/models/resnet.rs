//! `ResNet`: a CIFAR-style residual network (ResNet-18 layout at the bench size) with BatchNorm.

use speedkit::{Result, SpeedkitError};
use tch::{nn, Tensor};

use super::{cross_entropy, linear};

/// Dimensions of [`ResNet`] and of its batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResNetConfig {
    /// Channels of the four stages (the stem outputs `widths[0]`).
    pub widths: [i64; 4],
    /// Basic blocks per stage.
    pub blocks: [usize; 4],
    /// Height and width of the (square, RGB) input images.
    pub image_size: i64,
    /// Output classes.
    pub classes: i64,
    /// Images per batch.
    pub batch: i64,
}

impl ResNetConfig {
    /// ResNet-18 for CIFAR-10: 3×3 stem, stages of 64/128/256/512 channels with 2 basic blocks
    /// each, 32×32 inputs, batch 256.
    pub const fn bench() -> Self {
        Self {
            widths: [64, 128, 256, 512],
            blocks: [2, 2, 2, 2],
            image_size: 32,
            classes: 10,
            batch: 256,
        }
    }

    /// A CPU-test size: 8/16/32/64 channels, one block per stage, 8×8 inputs, batch 4.
    pub const fn tiny() -> Self {
        Self {
            widths: [8, 16, 32, 64],
            blocks: [1, 1, 1, 1],
            image_size: 8,
            classes: 10,
            batch: 4,
        }
    }

    /// Convolution and linear FLOPs of one training step: 2·(multiply-adds of the forward pass) × 3
    /// for forward + backward, summed over the stem, every 3×3 convolution, the 1×1 projection
    /// shortcuts and the classifier. BatchNorm, ReLU, pooling and additions are not counted.
    pub fn flops_per_step(&self) -> f64 {
        let b = self.batch as f64;
        let conv = |cin: i64, cout: i64, k: i64, out_hw: i64| {
            2.0 * b * (cin * cout * k * k * out_hw * out_hw) as f64
        };
        let mut hw = self.image_size;
        let mut forward = conv(3, self.widths[0], 3, hw);
        let mut cin = self.widths[0];
        for (stage, (&width, &blocks)) in self.widths.iter().zip(&self.blocks).enumerate() {
            for block in 0..blocks {
                let stride = if stage > 0 && block == 0 { 2 } else { 1 };
                // 3×3, padding 1: the output side is ⌈side / stride⌉.
                hw = (hw + stride - 1) / stride;
                forward += conv(cin, width, 3, hw) + conv(width, width, 3, hw);
                if stride != 1 || cin != width {
                    forward += conv(cin, width, 1, hw);
                }
                cin = width;
            }
        }
        forward += 2.0 * b * (cin * self.classes) as f64;
        3.0 * forward
    }
}

/// A bias-free convolution followed by BatchNorm.
#[derive(Debug)]
struct ConvBn {
    conv: nn::Conv2D,
    bn: nn::BatchNorm,
    stride: i64,
    padding: i64,
}

impl ConvBn {
    fn new(p: &nn::Path, cin: i64, cout: i64, k: i64, stride: i64) -> Self {
        let config = nn::ConvConfig {
            stride,
            padding: k / 2,
            bias: false,
            ..Default::default()
        };
        // BatchNorm starts as the identity, as in PyTorch (tch draws the scale from U(0, 1)).
        let bn_config = nn::BatchNormConfig {
            ws_init: nn::Init::Const(1.0),
            ..Default::default()
        };
        Self {
            conv: nn::conv2d(p / "conv", cin, cout, k, config),
            bn: nn::batch_norm2d(p / "bn", cout, bn_config),
            stride,
            padding: k / 2,
        }
    }

    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let y = x.f_conv2d(
            &self.conv.ws,
            self.conv.bs.as_ref(),
            [self.stride; 2],
            [self.padding; 2],
            [1, 1],
            1,
        )?;
        let bn = &self.bn;
        Ok(y.f_batch_norm(
            bn.ws.as_ref(),
            bn.bs.as_ref(),
            Some(&bn.running_mean),
            Some(&bn.running_var),
            train,
            0.1,
            1e-5,
            true,
        )?)
    }
}

/// `relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))`, the shortcut a 1×1 projection when the
/// shape changes.
#[derive(Debug)]
struct BasicBlock {
    c1: ConvBn,
    c2: ConvBn,
    shortcut: Option<ConvBn>,
}

impl BasicBlock {
    fn new(p: &nn::Path, cin: i64, cout: i64, stride: i64) -> Self {
        let shortcut = (stride != 1 || cin != cout)
            .then(|| ConvBn::new(&(p / "shortcut"), cin, cout, 1, stride));
        Self {
            c1: ConvBn::new(&(p / "c1"), cin, cout, 3, stride),
            c2: ConvBn::new(&(p / "c2"), cout, cout, 3, 1),
            shortcut,
        }
    }

    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let y = self
            .c2
            .forward(&self.c1.forward(x, train)?.f_relu()?, train)?;
        let skip = match &self.shortcut {
            Some(s) => s.forward(x, train)?,
            None => x.shallow_clone(),
        };
        Ok(y.f_add(&skip)?.f_relu()?)
    }
}

/// A CIFAR ResNet: 3×3 stem (no max-pool), four stages of basic blocks (stride 2 from the second
/// stage on), global average pooling and a linear classifier. Convolution weights are 4-d, so
/// [`speedkit::SpeedContext::prepare`] lays them out channels-last when the plan says so; feed
/// inputs through [`channels_last`] then too.
#[derive(Debug)]
pub struct ResNet {
    stem: ConvBn,
    blocks: Vec<BasicBlock>,
    fc: nn::Linear,
}

impl ResNet {
    /// Builds the network under `p`.
    pub fn new(p: &nn::Path, config: &ResNetConfig) -> Self {
        let stem = ConvBn::new(&(p / "stem"), 3, config.widths[0], 3, 1);
        let mut blocks = Vec::new();
        let mut cin = config.widths[0];
        for (stage, (&width, &count)) in config.widths.iter().zip(&config.blocks).enumerate() {
            for i in 0..count {
                let stride = if stage > 0 && i == 0 { 2 } else { 1 };
                blocks.push(BasicBlock::new(
                    &(p / format!("stage{stage}") / format!("block{i}")),
                    cin,
                    width,
                    stride,
                ));
                cin = width;
            }
        }
        let fc = nn::linear(p / "fc", cin, config.classes, Default::default());
        Self { stem, blocks, fc }
    }

    /// Logits `[B, classes]` for images `[B, 3, H, W]`; `train` selects batch statistics (and
    /// updates the running ones) or the running statistics.
    pub fn forward(&self, images: &Tensor, train: bool) -> Result<Tensor> {
        let mut x = self.stem.forward(images, train)?.f_relu()?;
        for block in &self.blocks {
            x = block.forward(&x, train)?;
        }
        let pooled = x.f_adaptive_avg_pool2d([1, 1])?.f_flatten(1, -1)?;
        linear(&self.fc, &pooled)
    }

    /// Training-mode cross-entropy of the logits against class indices `labels`.
    pub fn loss(&self, images: &Tensor, labels: &Tensor) -> Result<Tensor> {
        cross_entropy(&self.forward(images, true)?, labels)
    }
}

/// `images` (`[B, C, H, W]`) with the same shape but channels-last (NHWC) memory, which is what
/// cuDNN's Tensor Core convolutions want when the weights are channels-last too.
pub fn channels_last(images: &Tensor) -> Result<Tensor> {
    if images.dim() != 4 {
        return Err(SpeedkitError::Misuse(format!(
            "channels-last needs a 4-d tensor, got {:?}",
            images.size()
        )));
    }
    // NCHW → NHWC copy → a permuted view that reads as NCHW but has NHWC strides.
    Ok(images
        .f_permute([0, 2, 3, 1])?
        .f_contiguous()?
        .f_permute([0, 3, 1, 2])?)
}
