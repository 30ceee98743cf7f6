//! `mlp_block`: a GEMM-bound transformer MLP block, where FP8 GEMMs can pay for their casts.

use speedkit::bench::Bencher;
use speedkit_suite::data;
use speedkit_suite::models::{MlpBlock, MlpBlockConfig};
use tch::nn::VarStore;

/// LayerNorm(4096) → Linear(4096, 16384) → GELU → Linear(16384, 4096) → residual on 16384 tokens,
/// MSE against a random target.
#[speedkit::bench(tags = ["gemm", "fp8"])]
fn mlp_block(b: &mut Bencher) -> anyhow::Result<()> {
    let config = b
        .size()
        .pick(MlpBlockConfig::tiny(), MlpBlockConfig::bench());
    data::seed();
    let vs = VarStore::new(b.device());
    let model = MlpBlock::new(&vs.root(), &config);
    let (x, target) = data::regression(config.tokens, config.width, b.device())?;
    b.set_flops_per_step(config.flops_per_step());
    super::train_step(b, &vs, || model.loss(&x, &target))
}
