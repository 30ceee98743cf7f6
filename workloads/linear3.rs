//! `linear3`: the seed benchmark.

use speedkit::bench::Bencher;
use speedkit_suite::data;
use speedkit_suite::models::{Linear3, Linear3Config};
use tch::nn::VarStore;

/// `Linear(8192, 8192)` × 3 on a 512 × 8192 batch, MSE against a random target.
#[speedkit::bench(tags = ["seed"])]
fn linear3(b: &mut Bencher) -> anyhow::Result<()> {
    let config = b.size().pick(Linear3Config::tiny(), Linear3Config::bench());
    data::seed();
    let vs = VarStore::new(b.device());
    let model = Linear3::new(&vs.root(), &config);
    let (x, target) = data::regression(config.batch, config.width, b.device())?;
    b.set_flops_per_step(config.flops_per_step());
    b.set_items_per_step(config.batch as f64, "samples");
    super::train_step(b, &vs, || model.loss(&x, &target))
}
