//! `unet_tch`: a diffusion-style U-Net written with tch's own modules and ops (no `speedkit::nn`):
//! GroupNorm, SiLU, stride-2 convolutions down, nearest upsampling up, skip concatenation.

use speedkit::bench::Bencher;
use speedkit_suite::models::{UnetConfig, UnetTch};
use tch::nn::VarStore;
use tch::{Kind, Tensor};

/// 64 images of 3 × 64 × 64, widths 64/128/256, GroupNorm(32), MSE against random noise.
#[speedkit::bench(tags = ["conv", "tch"])]
fn unet_tch(b: &mut Bencher) -> anyhow::Result<()> {
    let mut config = b.size().pick(UnetConfig::tiny(), UnetConfig::bench());
    config.batch = b.batch(config.batch);
    speedkit_suite::data::seed();
    let mut vs = VarStore::new(b.device());
    let model = UnetTch::new(&vs.root(), &config)?;
    // What `apply_speedups` does to a user's model: conv weights channels-last where the plan says
    // so. The images stay as a user's data loader gives them (NCHW).
    b.ctx().prepare(&mut vs)?;
    let shape = [
        config.batch,
        config.channels,
        config.image_size,
        config.image_size,
    ];
    let images = Tensor::f_randn(shape, (Kind::Float, b.device()))?;
    let noise = Tensor::f_randn(shape, (Kind::Float, b.device()))?;
    b.set_flops_per_step(config.flops_per_step());
    b.set_items_per_step(config.batch as f64, "images");
    super::train_step(b, &vs, || model.loss(&images, &noise))
}
