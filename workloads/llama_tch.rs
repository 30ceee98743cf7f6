//! `llama_tch`: a Llama-style decoder written with tch's own modules and ops (no `speedkit::nn`):
//! RMSNorm, rotary embeddings, SwiGLU, no biases; `llama_large`: the same at 6.74 B parameters.

use speedkit::bench::Bencher;
use speedkit_suite::models::{LlamaConfig, LlamaTch};
use tch::nn::VarStore;

/// d 1024, 16 heads, 8 blocks, SwiGLU width 2816, vocabulary 32000, on 8 × 1024 random tokens.
#[speedkit::bench(tags = ["transformer", "attention", "tch"])]
fn llama_tch(b: &mut Bencher) -> anyhow::Result<()> {
    let config = b.size().pick(LlamaConfig::tiny(), LlamaConfig::bench());
    llama_step(b, config)
}

/// The same decoder at Llama 2 7B's shape (6.74 B parameters; `LlamaConfig::large`), on 2 × 512
/// tokens per GPU. Its weights, gradients and AdamW state (16 bytes a parameter) do not fit one
/// 80 GB GPU: at bench size it trains with its parameters sharded over several, under `speedkit
/// launch` with `examples/configs/dp_zero3.yaml`, and runs only where a filter names it (the
/// `large` tag); its tiny size runs with the others.
#[speedkit::bench(tags = ["transformer", "tch", "large"])]
fn llama_large(b: &mut Bencher) -> anyhow::Result<()> {
    let config = b.size().pick(LlamaConfig::tiny(), LlamaConfig::large());
    llama_step(b, config)
}

/// A training step of [`LlamaTch`] at `config`, with the runner's batch.
fn llama_step(b: &mut Bencher, mut config: LlamaConfig) -> anyhow::Result<()> {
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
