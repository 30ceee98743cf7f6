//! `convnext_tch`: a ConvNeXt-style classifier written with tch's own modules and ops (no
//! `speedkit::nn`): 7×7 depthwise convolutions, LayerNorm over permuted channels, an erf GELU MLP,
//! layer scale, stride-2 downsampling, a pooled head under cross-entropy.

use speedkit::bench::Bencher;
use speedkit_suite::data;
use speedkit_suite::models::{ConvnextConfig, ConvnextTch};
use tch::nn::VarStore;

/// 128 random 128×128 RGB images, ConvNeXt-T's widths and depths, cross-entropy over 1000 classes.
#[speedkit::bench(tags = ["conv", "tch"])]
fn convnext_tch(b: &mut Bencher) -> anyhow::Result<()> {
    let mut config = b
        .size()
        .pick(ConvnextConfig::tiny(), ConvnextConfig::bench());
    config.batch = b.batch(config.batch);
    data::seed();
    let mut vs = VarStore::new(b.device());
    let model = ConvnextTch::new(&vs.root(), &config)?;
    // What `apply_speedups` does to a user's model: conv weights channels-last where the plan says
    // so. The images stay as a user's data loader gives them (NCHW).
    b.ctx().prepare(&mut vs)?;
    let (images, labels) =
        data::images(config.batch, config.image_size, config.classes, b.device())?;
    b.set_flops_per_step(config.flops_per_step());
    b.set_items_per_step(config.batch as f64, "images");
    super::train_step(b, &vs, || model.loss(&images, &labels))
}
