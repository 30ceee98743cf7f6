//! `gpt2`: GPT-2 small written on `speedkit::nn`'s modules, as a user who rewrites for speedkit
//! writes it.

use speedkit::bench::Bencher;
use speedkit_suite::models::{gpt2_small, Transformer, TransformerConfig};

/// `transformer`'s model at GPT-2 small's size (12 layers, d 768, 12 heads) on 8 × 1024 random
/// tokens, cross-entropy over 50304 classes: `gpt2_tch`'s model, written on `speedkit::nn`. The tiny
/// size is `transformer`'s.
#[speedkit::bench(tags = ["transformer", "attention"])]
fn gpt2(b: &mut Bencher) -> anyhow::Result<()> {
    let config = b.size().pick(TransformerConfig::tiny(), gpt2_small());
    let d = super::transformer_data(b, config)?;
    let model = Transformer::new(&d.vs.root(), &d.config)?;
    super::train_step(b, &d.vs, || model.loss(&d.tokens, &d.targets))
}
