//! `UnetTch`: a diffusion-style U-Net written with tch's own modules and ops: residual blocks of
//! GroupNorm, SiLU and 3×3 convolutions, stride-2 convolutions down, nearest-neighbour upsampling
//! up, and the encoder's activations concatenated into the decoder (skip connections), trained to
//! predict a noise image under a mean-squared error.
//!
//! Like [`TchTransformer`](super::TchTransformer) it measures what speedkit does for a model it
//! did not write, of a family whose norm (GroupNorm) and activation (SiLU) none of speedkit's
//! hand-written overrides covers.

use speedkit::{Result, SpeedkitError};
use tch::{nn, Tensor};

use super::Conv;

/// A U-Net's images, widths and batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnetConfig {
    /// Images per batch.
    pub batch: i64,
    /// Height and width of the (square) images.
    pub image_size: i64,
    /// Channels of the images.
    pub channels: i64,
    /// Width of the first level; the second has twice it, the middle four times.
    pub base: i64,
    /// GroupNorm's groups (every width must be a multiple of it).
    pub groups: i64,
}

impl UnetConfig {
    /// The reference size: 64 images of 3 × 64 × 64, widths 64/128/256, GroupNorm(32).
    pub const fn bench() -> Self {
        Self {
            batch: 64,
            image_size: 64,
            channels: 3,
            base: 64,
            groups: 32,
        }
    }

    /// A CPU-test size: 2 images of 3 × 16 × 16, widths 8/16/32, GroupNorm(4).
    pub const fn tiny() -> Self {
        Self {
            batch: 2,
            image_size: 16,
            channels: 3,
            base: 8,
            groups: 4,
        }
    }

    /// Convolution FLOPs of one training step (forward × 3 for the backward), from the layers of
    /// [`UnetTch`].
    pub fn flops_per_step(&self) -> f64 {
        let b = self.batch as f64;
        let conv = |cin: i64, cout: i64, k: i64, side: i64| {
            2.0 * b * (cin * cout * k * k * side * side) as f64
        };
        let res = |cin: i64, cout: i64, side: i64| {
            let skip = if cin == cout {
                0.0
            } else {
                conv(cin, cout, 1, side)
            };
            conv(cin, cout, 3, side) + conv(cout, cout, 3, side) + skip
        };
        let (c, s) = (self.base, self.image_size);
        let forward = conv(self.channels, c, 3, s)
            + res(c, c, s)
            + conv(c, c, 3, s / 2)
            + res(c, 2 * c, s / 2)
            + conv(2 * c, 2 * c, 3, s / 4)
            + res(2 * c, 4 * c, s / 4)
            + res(4 * c, 4 * c, s / 4)
            + conv(4 * c, 4 * c, 3, s / 2)
            + res(6 * c, 2 * c, s / 2)
            + conv(2 * c, 2 * c, 3, s)
            + res(3 * c, c, s)
            + conv(c, self.channels, 3, s);
        3.0 * forward
    }

    fn check(&self) -> Result<()> {
        let widths = [
            self.base,
            2 * self.base,
            3 * self.base,
            4 * self.base,
            6 * self.base,
        ];
        if [
            self.batch,
            self.image_size,
            self.channels,
            self.base,
            self.groups,
        ]
        .iter()
        .any(|&v| v <= 0)
            || self.image_size % 4 != 0
            || widths.iter().any(|w| w % self.groups != 0)
        {
            return Err(SpeedkitError::Misuse(format!(
                "a U-Net config needs positive sizes, an image side divisible by 4 (two \
                 halvings) and widths (base × 1, 2, 3, 4, 6) divisible by the groups: {self:?}"
            )));
        }
        Ok(())
    }
}

/// A `k`×`k` convolution of `stride`, padded by `k / 2`.
fn conv(p: &nn::Path, cin: i64, cout: i64, k: i64, stride: i64) -> Conv {
    Conv::new(p, (cin, cout, k), stride, k / 2, 1)
}

/// `silu(group_norm(x))`, the pre-activation of every convolution but the first.
fn norm_silu(norm: &nn::GroupNorm, x: &Tensor) -> Result<Tensor> {
    Ok(x.f_group_norm(
        norm.num_groups,
        norm.ws.as_ref(),
        norm.bs.as_ref(),
        1e-5,
        true,
    )?
    .f_silu()?)
}

/// `conv2(silu(gn2(conv1(silu(gn1(x)))))) + skip(x)`, the skip a 1×1 convolution where the width
/// changes.
#[derive(Debug)]
struct ResBlock {
    norm1: nn::GroupNorm,
    conv1: Conv,
    norm2: nn::GroupNorm,
    conv2: Conv,
    skip: Option<Conv>,
}

impl ResBlock {
    fn new(p: &nn::Path, cin: i64, cout: i64, groups: i64) -> Self {
        let gn = |name: &str, c: i64| nn::group_norm(p / name, groups, c, Default::default());
        Self {
            norm1: gn("norm1", cin),
            conv1: conv(&(p / "conv1"), cin, cout, 3, 1),
            norm2: gn("norm2", cout),
            conv2: conv(&(p / "conv2"), cout, cout, 3, 1),
            skip: (cin != cout).then(|| conv(&(p / "skip"), cin, cout, 1, 1)),
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.conv1.forward(&norm_silu(&self.norm1, x)?)?;
        let h = self.conv2.forward(&norm_silu(&self.norm2, &h)?)?;
        let skip = match &self.skip {
            Some(conv) => conv.forward(x)?,
            None => x.shallow_clone(),
        };
        Ok(h.f_add(&skip)?)
    }
}

/// Nearest-neighbour upsampling by 2, then a 3×3 convolution.
#[derive(Debug)]
struct Up {
    conv: Conv,
}

impl Up {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let size = x.size();
        let up = x.f_upsample_nearest2d([size[2] * 2, size[3] * 2], None, None)?;
        self.conv.forward(&up)
    }
}

/// The U-Net (see the [module docs](self)): two levels down, a middle of two blocks, two up.
#[derive(Debug)]
pub struct UnetTch {
    config: UnetConfig,
    conv_in: Conv,
    down1: ResBlock,
    downsample1: Conv,
    down2: ResBlock,
    downsample2: Conv,
    mid1: ResBlock,
    mid2: ResBlock,
    up2: Up,
    dec2: ResBlock,
    up1: Up,
    dec1: ResBlock,
    norm_out: nn::GroupNorm,
    conv_out: Conv,
}

impl UnetTch {
    /// Builds the model under `p`; fails on a config [`UnetConfig::flops_per_step`] cannot lay
    /// out (see its fields).
    pub fn new(p: &nn::Path, config: &UnetConfig) -> Result<Self> {
        config.check()?;
        let (c, g, ch) = (config.base, config.groups, config.channels);
        let conv3 =
            |name: &str, cin: i64, cout: i64, stride: i64| conv(&(p / name), cin, cout, 3, stride);
        let res = |name: &str, cin: i64, cout: i64| ResBlock::new(&(p / name), cin, cout, g);
        Ok(Self {
            config: *config,
            conv_in: conv3("conv_in", ch, c, 1),
            down1: res("down1", c, c),
            downsample1: conv3("downsample1", c, c, 2),
            down2: res("down2", c, 2 * c),
            downsample2: conv3("downsample2", 2 * c, 2 * c, 2),
            mid1: res("mid1", 2 * c, 4 * c),
            mid2: res("mid2", 4 * c, 4 * c),
            up2: Up {
                conv: conv3("up2", 4 * c, 4 * c, 1),
            },
            dec2: res("dec2", 6 * c, 2 * c),
            up1: Up {
                conv: conv3("up1", 2 * c, 2 * c, 1),
            },
            dec1: res("dec1", 3 * c, c),
            norm_out: nn::group_norm(p / "norm_out", g, c, Default::default()),
            conv_out: conv3("conv_out", c, ch, 1),
        })
    }

    /// The config the model was built with.
    pub fn config(&self) -> &UnetConfig {
        &self.config
    }

    /// The predicted noise, shaped as the images `[B, channels, side, side]`.
    pub fn forward(&self, images: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        super::check_images(images, c.channels, c.image_size)?;
        let skip1 = self.down1.forward(&self.conv_in.forward(images)?)?;
        let skip2 = self.down2.forward(&self.downsample1.forward(&skip1)?)?;
        let mid = self.downsample2.forward(&skip2)?;
        let mid = self.mid2.forward(&self.mid1.forward(&mid)?)?;
        let x = Tensor::f_cat(&[&self.up2.forward(&mid)?, &skip2], 1)?;
        let x = self.dec2.forward(&x)?;
        let x = Tensor::f_cat(&[&self.up1.forward(&x)?, &skip1], 1)?;
        let x = self.dec1.forward(&x)?;
        self.conv_out.forward(&norm_silu(&self.norm_out, &x)?)
    }

    /// Mean squared error of the prediction for `images` against `noise`.
    pub fn loss(&self, images: &Tensor, noise: &Tensor) -> Result<Tensor> {
        Ok(self
            .forward(images)?
            .f_mse_loss(noise, tch::Reduction::Mean)?)
    }
}
