//! `transformer_tch`: the `transformer` workload's model written with tch's own modules and ops
//! (no `speedkit::nn`), what speedkit gives code it did not write.

use speedkit::bench::Bencher;
use speedkit_suite::data;
use speedkit_suite::models::{TchTransformer, TransformerConfig};
use tch::nn::VarStore;

/// `transformer` as a plain tch user writes it: 6-layer, d 768 pre-LN decoder on 32 × 512 random
/// tokens, cross-entropy over 8192 classes.
#[speedkit::bench(tags = ["transformer", "attention", "tch"])]
fn transformer_tch(b: &mut Bencher) -> anyhow::Result<()> {
    let mut config = b
        .size()
        .pick(TransformerConfig::tiny(), TransformerConfig::bench());
    config.batch = b.batch(config.batch);
    data::seed();
    let vs = VarStore::new(b.device());
    let model = TchTransformer::new(&vs.root(), &config)?;
    let (tokens, targets) = data::tokens(config.batch, config.seq_len, config.vocab, b.device())?;
    b.set_flops_per_step(config.flops_per_step());
    b.set_items_per_step(config.tokens_per_step() as f64, "tokens");
    super::train_step(b, &vs, || model.loss(&tokens, &targets))
}
