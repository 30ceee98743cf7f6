//! The reference models of `docs/workloads.md`.
//!
//! Each model is built under a [`tch::nn::Path`] from a config struct with a `bench()` size (the
//! reference numbers) and a `tiny()` size (well under a second per step on a CPU), and each config
//! knows the matmul FLOPs of one training step (`flops_per_step`, forward + backward = 3 × forward),
//! computed from the dimensions alone, so bench-size numbers can be checked without allocating a
//! bench-size model.

pub mod convnext_tch;
mod linear3;
pub mod llama_tch;
mod mlp;
mod mlp_block;
pub mod resnet;
pub mod tch_transformer;
mod transformer;
pub mod unet_tch;
pub mod vit_tch;

pub use convnext_tch::{ConvnextConfig, ConvnextTch};
pub use linear3::{Linear3, Linear3Config};
pub use llama_tch::{LlamaConfig, LlamaTch};
pub use mlp::{Mlp, MlpConfig};
pub use mlp_block::{MlpBlock, MlpBlockConfig};
pub use resnet::{ResNet, ResNetConfig};
pub use tch_transformer::{gpt2_small, TchTransformer};
pub use transformer::{Transformer, TransformerConfig};
pub use unet_tch::{UnetConfig, UnetTch};
pub use vit_tch::{VitConfig, VitTch};

use speedkit::{Result, SpeedkitError};
use tch::{nn, Tensor};

/// `x · Wᵀ + b` through the fallible op, so a shape error is a value, not a panic.
pub(crate) fn linear(layer: &nn::Linear, x: &Tensor) -> Result<Tensor> {
    Ok(x.f_linear(&layer.ws, layer.bs.as_ref())?)
}

/// LayerNorm with PyTorch's default epsilon (tch keeps its own config private).
pub(crate) fn layer_norm(norm: &nn::LayerNorm, x: &Tensor) -> Result<Tensor> {
    Ok(x.f_layer_norm(
        &norm.normalized_shape,
        norm.ws.as_ref(),
        norm.bs.as_ref(),
        1e-5,
        true,
    )?)
}

/// The modules of a pre-LN transformer block, named as tch users name them: `ln1` → `qkv` (q, k
/// and v in one linear) → attention → `proj`; `ln2` → `fc1` (to 4d) → activation → `fc2`. Each
/// model applies them its own way (causal or not, its activation, dropout or none).
#[derive(Debug)]
pub(crate) struct PreLnBlock {
    pub(crate) ln1: nn::LayerNorm,
    pub(crate) qkv: nn::Linear,
    pub(crate) proj: nn::Linear,
    pub(crate) ln2: nn::LayerNorm,
    pub(crate) fc1: nn::Linear,
    pub(crate) fc2: nn::Linear,
}

impl PreLnBlock {
    /// The block's modules of width `d` under `p`, with tch's (PyTorch's) initialisation.
    pub(crate) fn new(p: &nn::Path, d: i64) -> Self {
        let ln = |name: &str| nn::layer_norm(p / name, vec![d], Default::default());
        let lin = |name: &str, i: i64, o: i64| nn::linear(p / name, i, o, Default::default());
        Self {
            ln1: ln("ln1"),
            qkv: lin("qkv", d, 3 * d),
            proj: lin("proj", d, d),
            ln2: ln("ln2"),
            fc1: lin("fc1", d, 4 * d),
            fc2: lin("fc2", 4 * d, d),
        }
    }
}

/// Multi-head self-attention over `qkv` (`[B, T, 3d]`: q, k and v side by side, as one linear
/// makes them), each split into `heads` heads (`[B, heads, T, d / heads]`, the layout
/// `scaled_dot_product_attention` takes), attended (`causal` or not) and put back as `[B, T, d]`.
pub(crate) fn self_attention(qkv: &Tensor, heads: i64, causal: bool) -> Result<Tensor> {
    let (b, t, three_d) = qkv.size3()?;
    let d = three_d / 3;
    let parts = qkv.f_split(d, -1)?;
    let split = |part: &Tensor| -> Result<Tensor> {
        Ok(part.f_view([b, t, heads, d / heads])?.f_transpose(1, 2)?)
    };
    let (q, k, v) = (split(&parts[0])?, split(&parts[1])?, split(&parts[2])?);
    let y = Tensor::f_scaled_dot_product_attention::<Tensor>(
        &q, &k, &v, None, 0.0, causal, None, false,
    )?;
    Ok(y.f_transpose(1, 2)?.f_reshape([b, t, d])?)
}

/// Mean cross-entropy of `logits` (`[N, C]`) against class indices (`[N]`).
pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    Ok(logits.f_cross_entropy_loss::<Tensor>(targets, None, tch::Reduction::Mean, -100, 0.0)?)
}

/// A 2-D convolution with its stride, padding and groups, applied through the fallible op.
#[derive(Debug)]
pub(crate) struct Conv {
    conv: nn::Conv2D,
    stride: i64,
    padding: i64,
    groups: i64,
}

impl Conv {
    /// A `k`×`k` convolution from `cin` to `cout` channels under `p`.
    pub(crate) fn new(
        p: &nn::Path,
        (cin, cout, k): (i64, i64, i64),
        stride: i64,
        padding: i64,
        groups: i64,
    ) -> Self {
        let config = nn::ConvConfig {
            stride,
            padding,
            groups,
            ..Default::default()
        };
        Self {
            conv: nn::conv2d(p, cin, cout, k, config),
            stride,
            padding,
            groups,
        }
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_conv2d(
            &self.conv.ws,
            self.conv.bs.as_ref(),
            [self.stride; 2],
            [self.padding; 2],
            [1, 1],
            self.groups,
        )?)
    }
}

/// `images` as an image model takes them, `[batch, channels, side, side]`, else a misuse error
/// naming that shape.
pub(crate) fn check_images(images: &Tensor, channels: i64, side: i64) -> Result<()> {
    if images.dim() == 4 && images.size()[1..] == [channels, side, side] {
        return Ok(());
    }
    Err(SpeedkitError::Misuse(format!(
        "images must be [batch, {channels}, {side}, {side}], not {:?}",
        images.size()
    )))
}
