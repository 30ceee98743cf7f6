//! `transformer_checkpointed`: the main workload with every block checkpointed, the memory a user
//! near the limit trades for one more forward of each block.

use speedkit::bench::Bencher;
use speedkit_suite::data;
use speedkit_suite::models::{Transformer, TransformerConfig};
use speedkit_suite::REFERENCE_ADAMW;
use tch::nn::VarStore;
use tch::Tensor;

/// `transformer`, each block's activations recomputed in the backward
/// ([`speedkit::checkpoint`]): one block's activations alive at a time.
#[speedkit::bench(tags = ["transformer", "checkpoint", "memory"])]
fn transformer_checkpointed(b: &mut Bencher) -> anyhow::Result<()> {
    let mut config = b
        .size()
        .pick(TransformerConfig::tiny(), TransformerConfig::bench());
    config.batch = b.batch(config.batch);
    data::seed();
    let vs = VarStore::new(b.device());
    let model = Transformer::new(&vs.root(), &config)?;
    let (tokens, targets) = data::tokens(config.batch, config.seq_len, config.vocab, b.device())?;
    // The model's FLOPs, as `transformer` counts them: the recomputation is not useful work (the
    // TFLOP/s column reads as model FLOP utilisation, comparable between the two).
    b.set_flops_per_step(config.flops_per_step());
    b.set_items_per_step(config.tokens_per_step() as f64, "tokens");
    let ctx = b.ctx();
    ctx.data_parallel(&vs)?;
    let mut opt = ctx.adamw(&vs, REFERENCE_ADAMW)?;
    b.run(|| -> speedkit::Result<Tensor> {
        // The scope holds the whole step: the backward runs the checkpointed blocks again.
        ctx.checkpointed(|ck| {
            opt.zero_grad()?;
            let loss = ctx.autocast(|| model.loss_checkpointed(ck, &tokens, &targets))?;
            ctx.backward(&loss)?;
            ctx.step(&mut opt)?;
            Ok(loss)
        })
    })?;
    Ok(())
}
