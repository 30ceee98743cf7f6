//! `resnet`: a CIFAR ResNet-18, the convolution workload (cuDNN autotuning, channels-last).

use speedkit::bench::Bencher;
use speedkit_suite::data;
use speedkit_suite::models::resnet::{channels_last, ResNet, ResNetConfig};
use tch::nn::VarStore;

/// ResNet-18 on 256 random 32×32 RGB images, cross-entropy over 10 classes.
#[speedkit::bench(tags = ["conv"])]
fn resnet(b: &mut Bencher) -> anyhow::Result<()> {
    let config = b.size().pick(ResNetConfig::tiny(), ResNetConfig::bench());
    let ctx = b.ctx();
    data::seed();
    let mut vs = VarStore::new(b.device());
    let model = ResNet::new(&vs.root(), &config);
    // Conv weights channels-last when the plan says so (before the optimizer copies their layout).
    ctx.prepare(&mut vs)?;
    let (images, labels) =
        data::images(config.batch, config.image_size, config.classes, b.device())?;
    // The NCHW batch is dropped once copied: only the layout the model reads stays alive for the
    // run (3 MiB at the bench size), as in PyTorch's reference.
    let images = {
        let nchw = images;
        if ctx.plan().channels_last {
            channels_last(&nchw)?
        } else {
            nchw
        }
    };
    b.set_flops_per_step(config.flops_per_step());
    b.set_items_per_step(config.batch as f64, "images");
    super::train_step(b, &vs, || model.loss(&images, &labels))
}
