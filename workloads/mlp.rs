//! `mlp`: a small classifier, dominated by launch overhead rather than FLOPs on a GPU.

use speedkit::bench::Bencher;
use speedkit_suite::data;
use speedkit_suite::models::{Mlp, MlpConfig};
use tch::nn::VarStore;

/// `Linear(512, 1024)` → ReLU → `Linear(1024, 10)` on a 256 × 512 batch, cross-entropy.
#[speedkit::bench(tags = ["seed", "small"])]
fn mlp(b: &mut Bencher) -> anyhow::Result<()> {
    let config = b.size().pick(MlpConfig::tiny(), MlpConfig::bench());
    data::seed();
    let vs = VarStore::new(b.device());
    let model = Mlp::new(&vs.root(), &config);
    let (x, labels) = data::classification(config.batch, config.input, config.classes, b.device())?;
    b.set_flops_per_step(config.flops_per_step());
    super::train_step(b, &vs, || model.loss(&x, &labels))
}
