//! `vit_tch`: a ViT-style classifier written with tch's own modules and ops (no `speedkit::nn`):
//! patches by a strided convolution, a class token, learned positions, pre-LN encoder blocks with
//! SDPA and an erf GELU MLP, dropout as ViT trains with it, a normed head on the class token.

use speedkit::bench::Bencher;
use speedkit_suite::data;
use speedkit_suite::models::{VitConfig, VitTch};
use tch::nn::VarStore;

/// 128 random 224×224 RGB images in 16×16 patches (197 tokens each), ViT-S's widths and depth,
/// dropout 0.1, cross-entropy over 1000 classes.
#[speedkit::bench(tags = ["transformer", "attention", "dropout", "tch"])]
fn vit_tch(b: &mut Bencher) -> anyhow::Result<()> {
    let mut config = b.size().pick(VitConfig::tiny(), VitConfig::bench());
    config.batch = b.batch(config.batch);
    data::seed();
    let mut vs = VarStore::new(b.device());
    let model = VitTch::new(&vs.root(), &config)?;
    b.ctx().prepare(&mut vs)?;
    let (images, labels) =
        data::images(config.batch, config.image_size, config.classes, b.device())?;
    b.set_flops_per_step(config.flops_per_step());
    b.set_items_per_step(config.batch as f64, "images");
    super::train_step(b, &vs, || model.loss(&images, &labels))
}
