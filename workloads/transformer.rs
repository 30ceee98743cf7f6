//! `transformer`: the GPT-style decoder, the main workload.

use speedkit::bench::Bencher;
use speedkit_suite::models::{Transformer, TransformerConfig};

/// 6-layer, d 768 pre-LN decoder on 32 × 512 random tokens, cross-entropy over 8192 classes.
#[speedkit::bench(tags = ["transformer", "attention"])]
fn transformer(b: &mut Bencher) -> anyhow::Result<()> {
    let config = b
        .size()
        .pick(TransformerConfig::tiny(), TransformerConfig::bench());
    let d = super::transformer_data(b, config)?;
    let model = Transformer::new(&d.vs.root(), &d.config)?;
    super::train_step(b, &d.vs, || model.loss(&d.tokens, &d.targets))
}
