//! `gpt2_tch`: GPT-2 small written with tch's own modules and ops (no `speedkit::nn`), the model
//! a tch user brings to speedkit.

use speedkit::bench::Bencher;
use speedkit_suite::models::{gpt2_small, TchTransformer, TransformerConfig};

/// GPT-2 small (12 layers, d 768, 12 heads) on 8 × 1024 random tokens, cross-entropy over 50304
/// classes. The tiny size is `transformer`'s, since any GPT-2 vocabulary is too slow for a CPU test.
#[speedkit::bench(tags = ["transformer", "attention", "tch"])]
fn gpt2_tch(b: &mut Bencher) -> anyhow::Result<()> {
    let config = b.size().pick(TransformerConfig::tiny(), gpt2_small());
    let d = super::transformer_data(b, config)?;
    let model = TchTransformer::new(&d.vs.root(), &d.config)?;
    super::train_step(b, &d.vs, || model.loss(&d.tokens, &d.targets))
}
