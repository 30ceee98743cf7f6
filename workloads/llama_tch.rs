//! `llama_tch`: a Llama-style decoder written with tch's own modules and ops (no `speedkit::nn`):
//! RMSNorm, rotary embeddings, SwiGLU, no biases.

use speedkit::bench::Bencher;
use speedkit_suite::models::{LlamaConfig, LlamaTch};
use tch::nn::VarStore;

/// d 1024, 16 heads, 8 blocks, SwiGLU width 2816, vocabulary 32000, on 8 × 1024 random tokens.
#[speedkit::bench(tags = ["transformer", "attention", "tch"])]
fn llama_tch(b: &mut Bencher) -> anyhow::Result<()> {
    let mut config = b.size().pick(LlamaConfig::tiny(), LlamaConfig::bench());
    config.batch = b.batch(config.batch);
    speedkit_suite::data::seed();
    let vs = VarStore::new(b.device());
    let model = LlamaTch::new(&vs.root(), &config)?;
    let (tokens, targets) =
        speedkit_suite::data::tokens(config.batch, config.seq_len, config.vocab, b.device())?;
    b.set_flops_per_step(config.flops_per_step());
    b.set_items_per_step(config.tokens_per_step() as f64, "tokens");
    super::train_step(b, &vs, || model.loss(&tokens, &targets))
}
