//! `VitTch`: a ViT-style image classifier written with tch's own modules and ops: square patches
//! embedded by a strided convolution, a class token put in front with `cat`, learned position
//! embeddings, pre-LN encoder blocks (bidirectional `scaled_dot_product_attention`, an erf GELU
//! MLP), dropout after the embeddings, after the attention's projection and around the MLP's
//! second layer (as ViT and BERT train), and a normed head on the class token under
//! cross-entropy.
//!
//! A family none of the other reference models belongs to, and the one of them that trains with
//! dropout: random masks inside the captured step, a token count (patches plus the class token)
//! that is no power of two, and a head that reads one token of each image.

use speedkit::{Result, SpeedkitError};
use tch::{nn, Tensor};

use super::{cross_entropy, layer_norm, linear, self_attention, Conv, PreLnBlock};

/// A ViT's images, patches, widths, depth, dropout and batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VitConfig {
    /// Images per batch.
    pub batch: i64,
    /// Height and width of the (square) images.
    pub image_size: i64,
    /// Height and width of a patch.
    pub patch: i64,
    /// Channels of the images.
    pub channels: i64,
    /// Width of a token.
    pub d_model: i64,
    /// Attention heads (each `d_model / heads` wide).
    pub heads: i64,
    /// Encoder blocks.
    pub layers: i64,
    /// Classes of the head.
    pub classes: i64,
    /// The probability each dropout zeroes an element with.
    pub dropout: f64,
}

impl VitConfig {
    /// The reference size: ViT-S/16 (d 384, 6 heads, 12 blocks, MLP 1536) on 128 images of
    /// 3 × 224 × 224 (197 tokens each), 1000 classes, dropout 0.1.
    pub const fn bench() -> Self {
        Self {
            batch: 128,
            image_size: 224,
            patch: 16,
            channels: 3,
            d_model: 384,
            heads: 6,
            layers: 12,
            classes: 1000,
            dropout: 0.1,
        }
    }

    /// A CPU-test size: 2 images of 3 × 32 × 32 in patches of 8 (17 tokens), d 32, 2 heads,
    /// 2 blocks, 10 classes.
    pub const fn tiny() -> Self {
        Self {
            batch: 2,
            image_size: 32,
            patch: 8,
            channels: 3,
            d_model: 32,
            heads: 2,
            layers: 2,
            classes: 10,
            dropout: 0.1,
        }
    }

    /// Tokens per image: its patches and the class token.
    pub fn tokens(&self) -> i64 {
        (self.image_size / self.patch).pow(2) + 1
    }

    /// Convolution and matmul FLOPs of one training step (forward × 3 for the backward): the
    /// patch embedding, each block's 12 d² per token and its attention's two matmuls, the head.
    pub fn flops_per_step(&self) -> f64 {
        let (b, t, d) = (self.batch as f64, self.tokens() as f64, self.d_model as f64);
        let patch_in = (self.channels * self.patch * self.patch) as f64;
        let embed = 2.0 * b * (t - 1.0) * patch_in * d;
        let block = 2.0 * b * t * 12.0 * d * d + 2.0 * 2.0 * b * t * t * d;
        let head = 2.0 * b * d * self.classes as f64;
        3.0 * (embed + self.layers as f64 * block + head)
    }

    fn check(&self) -> Result<()> {
        let sizes = [
            self.batch,
            self.image_size,
            self.patch,
            self.channels,
            self.d_model,
            self.heads,
            self.layers,
            self.classes,
        ];
        let fits =
            self.image_size % self.patch.max(1) == 0 && self.d_model % self.heads.max(1) == 0;
        if sizes.iter().any(|&v| v <= 0) || !fits || !(0.0..1.0).contains(&self.dropout) {
            return Err(SpeedkitError::Misuse(format!(
                "a ViT config needs positive sizes, an image side divisible by the patch, a width \
                 divisible by the heads and a dropout in [0, 1): {self:?}"
            )));
        }
        Ok(())
    }
}

/// One pre-LN encoder block: `x + drop(proj(attn(LN(x))))`, then
/// `x + drop(fc2(drop(gelu(fc1(LN(x))))))`.
fn encoder_block(m: &PreLnBlock, x: &Tensor, heads: i64, dropout: f64) -> Result<Tensor> {
    let qkv = linear(&m.qkv, &layer_norm(&m.ln1, x)?)?;
    let y = self_attention(&qkv, heads, false)?;
    let x = x.f_add(&linear(&m.proj, &y)?.f_dropout(dropout, true)?)?;
    let h = linear(&m.fc1, &layer_norm(&m.ln2, &x)?)?.f_gelu("none")?;
    let h = linear(&m.fc2, &h.f_dropout(dropout, true)?)?;
    Ok(x.f_add(&h.f_dropout(dropout, true)?)?)
}

/// The ViT (see the [module docs](self)), always training: every dropout draws.
#[derive(Debug)]
pub struct VitTch {
    config: VitConfig,
    patches: Conv,
    class_token: Tensor,
    positions: Tensor,
    blocks: Vec<PreLnBlock>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
}

impl VitTch {
    /// Builds the model under `p`; fails on a config whose sizes are not positive, whose image
    /// side the patch does not divide, whose width the heads do not divide, or whose dropout is
    /// outside [0, 1).
    pub fn new(p: &nn::Path, config: &VitConfig) -> Result<Self> {
        config.check()?;
        let (c, d, k) = (config.channels, config.d_model, config.patch);
        // ViT's initialisation of the class token and positions; the rest keeps tch's defaults,
        // which are PyTorch's.
        let init = nn::Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        Ok(Self {
            config: *config,
            patches: Conv::new(&(p / "patches"), (c, d, k), k, 0, 1),
            class_token: p.f_var("class_token", &[1, 1, d], init)?,
            positions: p.f_var("positions", &[1, config.tokens(), d], init)?,
            blocks: (0..config.layers)
                .map(|i| PreLnBlock::new(&(p / format!("block{i}")), d))
                .collect(),
            ln_f: nn::layer_norm(p / "ln_f", vec![d], Default::default()),
            head: nn::linear(p / "head", d, config.classes, Default::default()),
        })
    }

    /// The config the model was built with.
    pub fn config(&self) -> &VitConfig {
        &self.config
    }

    /// The class logits `[B, classes]` of images `[B, channels, side, side]`.
    pub fn forward(&self, images: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        super::check_images(images, c.channels, c.image_size)?;
        let b = images.size()[0];
        // [B, d, side / patch, side / patch] → [B, patches, d], the class token in front.
        let patches = self
            .patches
            .forward(images)?
            .f_flatten(2, 3)?
            .f_transpose(1, 2)?;
        let class_token = self.class_token.f_expand([b, 1, c.d_model], false)?;
        let x = Tensor::f_cat(&[&class_token, &patches], 1)?.f_add(&self.positions)?;
        let mut x = x.f_dropout(c.dropout, true)?;
        for block in &self.blocks {
            x = encoder_block(block, &x, c.heads, c.dropout)?;
        }
        let x = layer_norm(&self.ln_f, &x)?;
        linear(&self.head, &x.f_select(1, 0)?)
    }

    /// Mean cross-entropy of the logits of `images` against class indices `labels` `[B]`.
    pub fn loss(&self, images: &Tensor, labels: &Tensor) -> Result<Tensor> {
        cross_entropy(&self.forward(images)?, labels)
    }
}
