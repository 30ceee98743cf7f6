//! `gpt2_tch`: GPT-2 small written with tch's own modules and ops (no `speedkit::nn`), the model
//! a tch user brings to speedkit.

use speedkit::bench::Bencher;
use speedkit_suite::data;
use speedkit_suite::models::{gpt2_small, TchTransformer, TransformerConfig};
use tch::nn::VarStore;

/// GPT-2 small (12 layers, d 768, 12 heads) on 8 × 1024 random tokens, cross-entropy over 50304
/// classes. The tiny size is `transformer`'s, since any GPT-2 vocabulary is too slow for a CPU test.
#[speedkit::bench(tags = ["transformer", "attention", "tch"])]
fn gpt2_tch(b: &mut Bencher) -> anyhow::Result<()> {
    let mut config = b.size().pick(TransformerConfig::tiny(), gpt2_small());
    config.batch = b.batch(config.batch);
    data::seed();
    let vs = VarStore::new(b.device());
    let model = TchTransformer::new(&vs.root(), &config)?;
    let (tokens, targets) = data::tokens(config.batch, config.seq_len, config.vocab, b.device())?;
    b.set_flops_per_step(config.flops_per_step());
    b.set_items_per_step(config.tokens_per_step() as f64, "tokens");
    super::train_step(b, &vs, || model.loss(&tokens, &targets))
}
