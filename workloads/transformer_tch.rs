//! `transformer_tch`: the `transformer` workload's model written with tch's own modules and ops
//! (no `speedkit::nn`), what speedkit gives code it did not write.

use speedkit::bench::Bencher;
use speedkit_suite::models::{TchTransformer, TransformerConfig};

/// `transformer` as a plain tch user writes it: 6-layer, d 768 pre-LN decoder on 32 × 512 random
/// tokens, cross-entropy over 8192 classes.
#[speedkit::bench(tags = ["transformer", "attention", "tch"])]
fn transformer_tch(b: &mut Bencher) -> anyhow::Result<()> {
    let config = b
        .size()
        .pick(TransformerConfig::tiny(), TransformerConfig::bench());
    let d = super::transformer_data(b, config)?;
    let model = TchTransformer::new(&d.vs.root(), &d.config)?;
    super::train_step(b, &d.vs, || model.loss(&d.tokens, &d.targets))
}
